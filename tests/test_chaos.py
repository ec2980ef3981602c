"""The chaos suite's scenarios in their smaller forms (``make chaos`` runs them all at full size with
``echo2 chaos``; echo2/chaos/). The other scenarios' small forms live beside the code they test:
reclaims (test_e2e), hostile peers and truncated shards (test_relay_hostile, test_broadcast), forged
manifests and tokens (test_untrusted_actor), bad input (test_e2e, test_config), dishonest actors
(test_behavior_audit), the relay's TLS (test_relay_tls), the listing under load (test_collector).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import REPO
from echo2.chaos import fuzz
from echo2.chaos.runner import failed
from echo2.chaos.faults import learner_kills
from echo2.data.store import open_store
from helpers import ledger_audit


def test_sigkill_during_checkpoints_publishes_and_steps_always_resumes(tiny_model, tmp_path):
    """The learner SIGKILLed mid-checkpoint, mid-publish and mid-step (failpoints at random passes), resumed
    each time: it finishes, LATEST never names an uncommitted version, every rollout file is in the ledger once."""
    (tmp_path / "tiny-model").symlink_to(tiny_model)
    row = learner_kills(tmp_path, kills=3)
    print("chaos:", json.dumps(row))
    assert not failed(row), row
    run = open_store(str(tmp_path / "runs" / "kill"))
    max_steps = 6 * 3 + 4
    summary = run.get_json("reports/summary.json")
    assert summary["steps"] == max_steps and run.get_json("policy/LATEST") == {"version": max_steps}
    assert run.exists(f"checkpoints/step-{max_steps:06d}/manifest.json")
    problems, counts = ledger_audit(run)
    assert not problems and counts["used"] >= max_steps, problems
    assert 0 <= summary["max_lag_used"] <= 2


@pytest.fixture(scope="module")
def fuzz_context(tiny_model, tmp_path_factory):
    """A run's worth of honest rows and a collector that validates as the learner does (tiny model)."""
    from transformers import AutoTokenizer

    from echo2.config import load_config
    from echo2.tasks import make_task

    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = make_task(load_config(None, ["task.eval_size=10"]).task)
    rows = fuzz.honest(task.sample_train(random.Random(1), 2), tok, group_size=4, salt=0)
    return tok, task, rows


def _collect(tmp_path, tok, task, cases, used):
    from echo2.data.rollouts import RolloutLimits, content_hash, decode_rollouts
    from echo2.learner.collector import RolloutCollector
    from echo2.learner.verify import TaskVerifier

    store = open_store(str(tmp_path))
    store.put("rollouts/v000003/a9-used-000000.arrow", used)
    for c in cases:
        store.put(f"rollouts/v{c.version:06d}/{c.actor}-000000.arrow", c.data, if_absent=False)
    limits = RolloutLimits(vocab_size=len(tok), group_size=4, max_completion_tokens=6, max_prompt_tokens=4096,
                           reward_range=task.reward_range)
    col = RolloutCollector(store, run_id="fuzz", staleness=2, groups_per_step=2, limits=limits,
                           verifier=TaskVerifier(task, tok, max_new_tokens=6), max_file_bytes=1 << 20)
    col.used_hashes.add(content_hash(decode_rollouts(used)))  # a step already used it
    col.settled.add("rollouts/v000003/a9-used-000000.arrow")
    store.put("rollouts/v000003/zz-honest-000000.arrow", fuzz._encode(fuzz.honest(
        task.sample_train(random.Random(9), 2), tok, group_size=4, salt=1), "fuzz", "zz-honest", 3))
    return col.collect(step=4, learner_version=3, timeout_s=20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(fuzz.KINDS), min_size=3, max_size=12), seed=st.integers(0, 2**31))
def test_every_hostile_rollout_file_is_quarantined_with_its_reason(fuzz_context, tmp_path_factory, kinds, seed):
    tok, task, rows = fuzz_context
    tmp = tmp_path_factory.mktemp("fuzz")
    used = fuzz._encode(rows, "fuzz", "a9-used", 3)
    rng = random.Random(seed)
    cases = [fuzz.case(kind, i, rng, rows=rows, run_id="fuzz", version=3, vocab=len(tok), max_file_bytes=1 << 20,
                       used_data=used) for i, kind in enumerate(kinds)]
    sel = _collect(tmp, tok, task, cases, used)
    reasons = {q["key"]: q["reason"] for q in sel.quarantined}
    dropped = {d["key"]: d["reason"] for d in sel.dropped}
    for c in cases:
        key = f"rollouts/v{c.version:06d}/{c.actor}-000000.arrow"
        if c.expect == "duplicate":
            assert dropped.get(key, "").startswith("duplicate"), (c.kind, reasons.get(key), dropped.get(key))
        else:
            assert key in reasons, (c.kind, dropped.get(key))
            assert c.expect.lower() in reasons[key].lower(), (c.kind, reasons[key])
    assert [u["key"] for u in sel.used] == ["rollouts/v000003/zz-honest-000000.arrow"]  # training goes on


def test_store_operations_ride_out_a_faulty_store_and_an_outage(s3_server):
    """10% of S3 requests failing (503 SlowDown, 500, dropped connections) and a 5 s outage: every put, get
    and list still succeeds, and the objects are what was written."""
    import boto3

    from echo2.chaos.s3_proxy import FaultyS3Proxy

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="echo2-faults")
    proxy = FaultyS3Proxy(s3_server, fail_rate=0.1, seed=1)
    url = proxy.start()
    try:
        store = open_store("s3://echo2-faults/x", {"endpoint_url": url, "key": "testing", "secret": "testing"},
                           retry_s=60)
        started = time.time()
        for i in range(30):
            store.put(f"k/{i:03d}", bytes([i]) * 100)
            if i == 10:
                proxy.outage(5)
        assert [store.get(f"k/{i:03d}") for i in range(30)] == [bytes([i]) * 100 for i in range(30)]
        assert len(store.list("k/")) == 30 and store.list_folders("") == ["k"]
        assert proxy.failed >= 5 and time.time() - started >= 5  # the faults and the outage did happen
    finally:
        proxy.stop()


def test_echo2_chaos_prints_one_json_object_per_scenario_and_exits_by_the_result(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "chaos", "--scenario", "bad-input", "--json",
                           "--keep", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["scenario"] for r in rows] == ["bad-input"]
    assert set(rows[0]) >= {"scenario", "injected", "detected", "lost", "bad_loaded", "finished"}
    assert rows[0]["injected"] == rows[0]["detected"] >= 9 and rows[0]["finished"]
    bad = subprocess.run([sys.executable, "-m", "echo2.cli", "chaos", "--scenario", "nope"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown scenario nope" in bad.stderr
