"""Issue 18, item 10: ``fleet.actors: auto`` sizes the fleet from what validated, used files say of
their making (recorded in the ledger by the learner), never from an actor's raw file; and a failure of
the sizing keeps the fleet as it is, logged, instead of ending the run."""

from __future__ import annotations

import logging

import pyarrow as pa
from helpers import make_rollouts

from echo2.config import load_config
from echo2.data import layout
from echo2.data.rollouts import RolloutLimits, decode_rollouts, encode_rollouts
from echo2.data.store import open_store
from echo2.fleet.sizing.autosize import auto_fleet_size
from echo2.learner.collector import RolloutCollector

YEAR_146000_US = 4_545_000_000_000_000_000
"""A created_at in the year 146000, in microseconds since the epoch (fits int64; no datetime holds it)."""
LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0))
TIMINGS = {"put_seconds": 0.1, "previous_batch_seconds": 2.1, "fetch_seconds": 0.3, "swap_seconds": 0.2,
           "dissemination_seconds": 0.5}


def _file(version: int, actor: str, seq: int, *, created_at_us: int | None = None) -> bytes:
    data = encode_rollouts(make_rollouts(salt=f"-{actor}-{version}-{seq}"), run_id="run", actor_id=actor,
                           policy_version=version, task="arithmetic", measured=TIMINGS)
    if created_at_us is None:
        return data
    table = decode_rollouts(data)
    stamps = pa.array([created_at_us] * table.num_rows, pa.int64()).cast(table.schema.field("created_at").type)
    table = table.set_column(table.schema.get_field_index("created_at"), "created_at", stamps)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _run(tmp_path, *, far_future_used: bool):
    """A run of 6 steps as the learner records it: each step's file chosen by the real collector (so the
    ledger holds its figures), the learner's per-step metrics, and a file in the year 146000: left unused
    in rollouts/, or (``far_future_used``) a well-formed one the collector used, as validation allows."""
    store = open_store(str(tmp_path / "run"))
    config = load_config(None, ["fleet.actors=auto", "fleet.min_actors=1", "fleet.max_actors=4",
                                "train.groups_per_step=2", "rollout.groups_per_batch=2", "train.staleness=1"])
    store.put_json(layout.RUN_JSON, {"config": config.model_dump(mode="json")})
    collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=2, limits=LIMITS)
    history = []
    for step in range(1, 7):
        version = step - 1
        hostile = far_future_used and step == 3
        store.put(layout.rollout_key(version, "a0", step),
                  _file(version, "a0", step, created_at_us=YEAR_146000_US if hostile else None))
        collector.settle(collector.collect(step=step, learner_version=version, timeout_s=5))
        history.append({"time": 100.0 + 3 * step, "seconds": 3.0, "wait_seconds": 1.0})
    if not far_future_used:
        store.put(layout.rollout_key(5, "a9", 0), _file(5, "a9", 0, created_at_us=YEAR_146000_US))
    return config, store, history


def test_a_file_from_the_year_146000_left_unused_is_never_read_by_the_fit(tmp_path):
    config, store, history = _run(tmp_path, far_future_used=False)
    sized = auto_fleet_size(config, store, history)
    assert sized is not None, "the honest files measure the fleet"
    n, reason = sized
    assert 1 <= n <= 4 and "capacity model" in reason


def test_a_used_file_claiming_the_year_146000_does_not_crash_the_fit(tmp_path):
    config, store, history = _run(tmp_path, far_future_used=True)
    used = store.get_json(layout.consumed_key(3))["used"][0]
    assert used["measured"]["created_at"] > 1e12  # recorded as a number, never as a calendar date
    assert used["measured"]["put_seconds"] == TIMINGS["put_seconds"]
    assert auto_fleet_size(config, store, history) is not None


def test_a_failure_of_the_sizing_keeps_the_fleet_and_is_logged_once(tmp_path, caplog):
    config, store, history = _run(tmp_path, far_future_used=False)
    store.put(layout.consumed_key(7), b"{not json", if_absent=False)  # a damaged ledger entry
    with caplog.at_level(logging.INFO, logger="echo2.fleet"):
        assert auto_fleet_size(config, store, history) is None
        assert auto_fleet_size(config, store, history) is None  # tried again at the next step
    failures = [r for r in caplog.records if "fleet sizing failed" in r.getMessage()]
    assert [r.levelname for r in failures] == ["ERROR", "WARNING"]
    assert failures[0].exc_info is not None and failures[1].exc_info is None  # the traceback once
