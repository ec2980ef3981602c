"""A tiny-model run with sparse delta versions, end to end: the real learner publishing bf16 keyframes
and deltas, real actor processes relaying them to each other (one joins late), and every weight an
actor's engine loaded compared byte for byte with what the learner published."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from helpers import teach_sums, wait_until
from relay_run import both_hold, delta_relay_run, engine_loads, hashes, published_versions

from echo2.data import layout
from echo2.data.weights import unique_state_dict

pytestmark = pytest.mark.e2e

STEPS = 8


@pytest.fixture(scope="module")
def answering_model(tiny_model, tmp_path_factory):
    """The tiny model taught to answer a sum about a quarter of the time, on every problem the run draws
    (``teach_sums``'s ``every_problem``): its rollout groups carry a reward signal, so the learner's steps
    really change weights. Taught on a sample of the problems, the others were never answered and their
    groups carried none: a step without a signal was common, and once every delta step of a run lacked one."""
    return teach_sums(tiny_model, tmp_path_factory.mktemp("answering-model"), steps=250, every_problem=True)


def test_actors_run_exactly_the_published_bf16_weights(answering_model, tmp_path, monkeypatch):
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv("ECHO2_TEST_RECORDS", str(records))
    # a small learning rate, as in RL: some elements change each step, most keep their bf16 bits
    run, fleet = delta_relay_run(tmp_path, answering_model, run_id="delta", steps=STEPS, actors=1, groups_per_batch=1,
                                 lr=2e-5, keyframe_every=3)

    fleet.start()
    try:
        while run.step < STEPS:
            run.update(run.collect(should_abort=fleet.reconcile))
            if run.step == 4:
                fleet.resize(2, "a second actor joins late: it starts from the newest keyframe")
                wait_until(lambda: len(list(records.glob("*.jsonl"))) == 2, 120, "the late actor's first version")
            elif run.step > 4:
                # once both are in the plan, the next version waits until both hold this one (both_hold)
                wait_until(lambda: both_hold(run, run.step), 120, f"both actors on v{run.step}")
    finally:
        fleet.stop()
    run.finish()

    store = run.store
    manifests, published = published_versions(store, STEPS)  # all kept (keep_versions)
    kinds = {v: m["weights"] for v, m in manifests.items()}
    assert [v for v, k in kinds.items() if k == "full"] == [0, 3, 6] and list(kinds.values()).count("delta") == 6, kinds

    loads = engine_loads(run, records, published)
    assert len(loads) == 2
    for actor, (swapped, _) in loads.items():
        assert len(swapped) >= 2, (actor, swapped)
        assert any(kinds[v] == "delta" for v in swapped), (actor, swapped)
    logs = {actor: log for actor, (_, log) in loads.items()}
    everything = "\n".join(logs.values())
    assert "delta on v" in everything  # the common case: a delta applied to the version held
    late = logs[sorted(logs)[-1]]  # actor1 joined while LATEST was v4, a delta: keyframe v3, then v4
    assert re.search(r"now generating with policy v4 \(loaded in [0-9.]+s, from keyframe v3 \(\+1 deltas", late), late
    received = re.findall(r"v\d+ received and verified \(.*", everything)
    # through a peer, deltas are relayed as files
    assert any(re.search(r"from actor\S+ at http://127.0.0.1", line) for line in received), received

    # every step's publish is on record: metrics.json, TensorBoard
    history = json.loads(store.get(layout.report_key("metrics.json")))
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    deltas = [m for m in history if m.get("publish_keyframe") == 0]
    assert len(deltas) == 6 and all(0 < m["publish_bytes"] < m["publish_full_bytes"] for m in deltas)
    # a step whose groups all carry no signal changes nothing: an empty delta, still published and checked
    assert all(0 <= m["publish_changed_fraction"] < 1 and m["publish_apply_seconds"] > 0 for m in deltas)
    # which steps carry a signal is up to sampling (with every problem taught, six delta steps without one are
    # all but impossible): every one that did must change weights
    with_signal = [m for m in deltas if m["groups_with_signal"] > 0]
    assert with_signal and all(m["publish_changed_fraction"] > 0 for m in with_signal), \
        [(m["groups_with_signal"], m["publish_changed_fraction"]) for m in deltas]
    summary = store.get_json(layout.SUMMARY)  # keyframes at steps 3 and 6, deltas of ~15% between them
    assert 0 < summary["published_sent_bytes"] < 0.6 * summary["published_full_bytes"], summary
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.local_dir / "tensorboard"))
    events.Reload()
    assert {"publish/bytes", "publish/full_bytes", "publish/changed_fraction", "publish/encode_seconds",
            "publish/apply_seconds"} <= set(events.Tags()["scalars"])

    # `echo2 export` of the last version (a delta) rebuilds it through its chain
    dest = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "echo2.cli", "export", store.url, str(dest)], check=True, cwd=REPO,
                   capture_output=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dest)
    assert hashes(unique_state_dict(model, torch.bfloat16)) == published[STEPS]
