"""A learner run publishing bf16 sparse deltas to recording actors that relay versions to each other, driven
step by step in the test's own process (test_delta_e2e.py, test_moe.py), and what both check of it: the store
rebuilds every version the learner signed, and every engine load is byte for byte a published version."""

from __future__ import annotations

import json
import re
import sys

from conftest import REPO

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.delta import tensor_table
from echo2.data.delta_chain import read_version
from echo2.data.store import open_store
from echo2.data.weights import read_manifest
from echo2.fleet.make import make_fleet
from echo2.learner.run import LearnerRun


def hashes(tensors) -> dict[str, str]:
    return {name: e["sha256"] for name, e in tensor_table(tensors).items()}


def delta_relay_run(tmp_path, model, *, run_id: str, steps: int, actors: int, groups_per_batch: int, lr: float,
                    keyframe_every: int):
    """The run (every version kept) and its fleet of ``actors`` recording actors (``tests/support/recording_actor.py``;
    each engine load goes to $ECHO2_TEST_RECORDS), neither started."""
    config = config_from_dict({
        "run": {"id": run_id}, "store": {"url": str(tmp_path)}, "model": {"name": str(model)},
        "task": {"eval_size": 10},
        "rollout": {"group_size": 8, "groups_per_batch": groups_per_batch, "max_new_tokens": 4,
                    "max_pending_batches": 1},
        "train": {"max_steps": steps, "groups_per_step": 2, "staleness": 2, "lr": lr, "checkpoint_every": 100},
        "publish": {"dtype": "bfloat16", "delta": True, "keyframe_every": keyframe_every, "keep_versions": 20},
        "learner": {"num_threads": 1},
        "eval": {"before": False, "after": False},
        "fleet": {"actors": actors, "max_restarts": 0},
        "broadcast": {"mode": "relay", "chunk_mb": 0.01},
    })
    run = LearnerRun(config, open_store(str(tmp_path)).child(layout.RUNS), resume=False)
    fleet = make_fleet(config.fleet, run.store, store_options={}, log_dir=run.log_dir, run_key=run.key,
                       actor_command=[sys.executable, str(REPO / "tests" / "support" / "recording_actor.py")])
    return run, fleet


def both_hold(run: LearnerRun, version: int) -> bool:
    """Both actors generate with ``version``: the learner waits for this before the next version, so that each
    is relayed to the second actor rather than superseded at its parent before it asks (a learner publishing
    faster than its actors poll LATEST makes the child rightly take the version from the store)."""
    logs = [p.read_text() for p in run.log_dir.glob("*.log")]
    return len(logs) == 2 and all(f"now generating with policy v{version} " in log for log in logs)


def published_versions(store, steps: int) -> tuple[dict[int, dict], dict[int, dict[str, str]]]:
    """Every version's manifest and its tensors' signed hashes; checks the store rebuilds each exactly."""
    manifests = {v: read_manifest(store, layout.policy_dir(v)) for v in range(steps + 1)}
    published = {v: {n: e["sha256"] for n, e in m["tensors"].items()} for v, m in manifests.items()}
    for v in manifests:  # what the store rebuilds is what the learner signed
        assert hashes(read_version(store, v)[0]) == published[v]
    return manifests, published


def engine_loads(run: LearnerRun, records, published: dict[int, dict[str, str]]) -> dict[str, tuple[list[int], str]]:
    """Per actor, the versions it swapped in (from its log) and its log; checks every engine load, byte for
    byte, is the version the learner published, one load per swap."""
    out = {}
    for path in run.log_dir.glob("*.log"):
        actor, log = path.stem, path.read_text()
        loaded = [json.loads(line) for line in (records / f"{actor}.jsonl").read_text().splitlines()]
        swapped = [int(v) for v in re.findall(r"now generating with policy v(\d+)", log)]
        assert len(loaded) == len(swapped), (actor, swapped)
        for version, table in zip(swapped, loaded):
            assert table == published[version], (actor, version)
        out[actor] = (swapped, log)
    return out
