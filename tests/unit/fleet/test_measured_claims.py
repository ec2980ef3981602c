"""What actors claim about their own speed cannot steer buying (``fleet/sizing/measured.py``, ``fit.py``): a median per
actor, then across actors; each claimed time cut to the store's own clock (the time between the actor's commits);
nothing of an actor the run banned. The runs are ``test_prices._synthetic_run``'s: used files whose ledger entries
record their figures as the learner does, each committed 10 s after the one before."""

from __future__ import annotations

import os

import pytest
from prices_shared import START, _synthetic_run

from echo2.config import load_config
from echo2.data import layout
from echo2.data.ledger import write_consumed, write_event
from echo2.data.store import open_store
from echo2.fleet.sizing.fit import fit_run
from echo2.fleet.sizing.measured import measure_run

L4 = {"gpu": "L4", "gpu_count": 1, "model_params_b": 4.0}


def _events(*actors: str) -> list[dict]:
    return [{"kind": "requested", "actor_id": a, **L4} for a in actors]


def test_one_actor_claiming_3e38_seconds_does_not_zero_its_gpu_s_speed(tmp_path):
    """Two honest actors at 1000 tokens/s and one that claims each batch took 3e38 s: the L4's speed stays the
    honest actors' (the liar's claims are cut to the 10 s between its commits, and it is one actor of three)."""
    store = _synthetic_run(tmp_path / "run", [
        ("a0", 1, 250, 1.0), ("a1", 1, 250, 1.0), ("liar", 1, 250, 3e38),
        ("a0", 2, 250, 1.0), ("a1", 2, 250, 1.0), ("liar", 2, 250, 3e38),
    ], _events("a0", "a1", "liar"))
    [m] = measure_run(store)
    assert m.tokens_per_second == pytest.approx(1000.0)


def test_an_actor_banned_later_is_not_measured(tmp_path):
    """An actor that claims its batches took a microsecond, then is expelled: the GPU's speed is the honest one's."""
    store = _synthetic_run(tmp_path / "run", [
        ("a0", 1, 250, 1.0), ("cheat", 1, 250, 1e-6), ("a0", 2, 250, 1.0), ("cheat", 2, 250, 1e-6),
    ], [*_events("a0", "cheat"), {"kind": "expelled", "actor_id": "cheat", "ts": START + 100}])
    [m] = measure_run(store)
    assert m.tokens_per_second == pytest.approx(1000.0) and m.files == 2


def test_the_fit_takes_no_claimed_turn_longer_than_the_store_saw(tmp_path):
    """The capacity fit: an actor claiming each whole turn took 3e38 s gets at most the time the store saw between
    its commits (10 s; 70 s for a1's one file, from when its actor was asked for), and a figure is the median of the
    actors' medians: a0's six files weigh as much as a1's one."""
    store = open_store(str(tmp_path / "run"))
    store.put_json(layout.RUN_JSON, {"config": load_config(None, ["fleet.actors=2"]).model_dump(mode="json")})
    for actor in ("a0", "a1"):
        write_event(store, "requested", actor, ts=START, **L4)
    files = [("a0", v) for v in range(1, 7)] + [("a1", 1)]
    for step, (actor, version) in enumerate(files, start=1):
        key = layout.rollout_key(version, actor, step)
        store.put(key, b"committed")
        os.utime(tmp_path / "run" / key, (START + 10 * step,) * 2)
        claims = {"generation_seconds": 1.0, "previous_batch_seconds": 3e38, "put_seconds": 0.1,
                  "fetch_seconds": 9.0 if actor == "a0" else 1.0, "tokens": 1000}
        write_consumed(store, step, {"used": [{"key": key, "policy_version": version, "measured": claims}],
                                     "written_at": START + 10 * step + 1})
    history = [{"time": START + 10 * s, "seconds": 3.0, "wait_seconds": 1.0} for s in range(1, 8)]
    fit = fit_run(store, skip_steps=1, history=history)
    assert sorted(fit.batch_seconds) == pytest.approx([9.9, 69.9]), fit.batch_seconds
    assert fit.workload.dissemination_seconds == pytest.approx(5.0)  # median of a0's 9 s and a1's 1 s
