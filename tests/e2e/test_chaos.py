"""The chaos suite's scenarios in their smaller forms (``make chaos`` runs them all at full size with
``echo2 chaos``; echo2/chaos/): learner kills, fuzzed rollout files (local and S3), store faults,
``hostile-store``, ``bad-peers`` and ``hostile-code`` here. The other scenarios' small forms live beside the
code they test: reclaims (test_e2e), hostile peers and truncated shards (also test_relay_hostile,
test_broadcast), forged manifests and tokens (test_untrusted_actor), bad input (test_e2e, test_config),
dishonest actors (test_spot_check), the relay's TLS (test_relay_tls), the listing under load
(test_collector).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
from conftest import REPO
from helpers import ledger_audit
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from echo2.chaos import fuzz
from echo2.chaos.runner import failed
from echo2.chaos.scenarios.learner_kill import learner_kills
from echo2.data.store import open_store


@pytest.mark.e2e
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


def _collect(store, plant, tok, task, cases, used):
    """The cases planted (``plant(case, key)``) beside a used file and an honest one; one collection."""
    from echo2.data.rollouts import RolloutLimits, content_hash, decode_rollouts
    from echo2.learner.collector import RolloutCollector
    from echo2.learner.verify import TaskVerifier

    store.put("rollouts/v000003/a9-used-000000.arrow", used)
    for c in cases:
        plant(c, f"rollouts/v{c.version:06d}/{c.actor}-000000.arrow")
    limits = RolloutLimits(vocab_size=len(tok), group_size=4, max_completion_tokens=6, max_prompt_tokens=4096,
                           reward_range=task.reward_range)
    col = RolloutCollector(store, run_id="fuzz", staleness=2, groups_per_step=2, limits=limits,
                           verifier=TaskVerifier(task, tok, max_new_tokens=6), max_file_bytes=1 << 20)
    col.used_hashes.add(content_hash(decode_rollouts(used)))  # a step already used it
    col.settled.add("rollouts/v000003/a9-used-000000.arrow")
    store.put("rollouts/v000003/zz-honest-000000.arrow", fuzz._encode(fuzz.honest(
        task.sample_train(random.Random(9), 2), tok, group_size=4, salt=1), "fuzz", "zz-honest", 3))
    return col.collect(step=4, learner_version=3, timeout_s=20)


def _judged_as_expected(sel, cases):
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


def _cases(kinds, seed, rows, tok, used):
    rng = random.Random(seed)
    return [fuzz.case(kind, i, rng, rows=rows, run_id="fuzz", version=3, vocab=len(tok), max_file_bytes=1 << 20,
                      used_data=used) for i, kind in enumerate(kinds)]


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(fuzz.LOCAL_KINDS), min_size=3, max_size=12), seed=st.integers(0, 2**31))
@example(kinds=["huge_sparse", "garbage", "duplicate"], seed=0)
def test_every_hostile_rollout_file_is_quarantined_with_its_reason(fuzz_context, tmp_path_factory, kinds, seed):
    """On a local store; a ``huge_sparse`` file (3 GiB, sparse) is set aside without being read: the
    process's peak memory does not grow by its size."""
    tok, task, rows = fuzz_context
    tmp = tmp_path_factory.mktemp("fuzz")
    used = fuzz._encode(rows, "fuzz", "a9-used", 3)
    cases = _cases(kinds, seed, rows, tok, used)
    peak = _peak_rss_bytes()
    sel = _collect(open_store(str(tmp)), lambda c, key: fuzz.plant_local(c, tmp / key), tok, task, cases, used)
    _judged_as_expected(sel, cases)
    if "huge_sparse" in kinds:
        assert _peak_rss_bytes() - peak < fuzz.SPARSE_BYTES // 3, "a multi-GB file was read into memory"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(fuzz.KINDS), min_size=3, max_size=8).map(lambda k: ["unreadable", *k]),
       seed=st.integers(0, 2**31))
@pytest.mark.e2e
def test_every_hostile_object_on_s3_is_quarantined_with_its_reason(fuzz_context, s3_server, kinds, seed):
    """On S3 (moto's server): the same kinds and ``unreadable``, a valid file stored as GLACIER (HEAD works,
    GET and copy are refused), which the collection must set aside instead of failing on it."""
    import uuid

    import boto3

    tok, task, rows = fuzz_context
    bucket = f"fuzz-{uuid.uuid4().hex[:10]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket=bucket)
    store = open_store(f"s3://{bucket}/run", {"endpoint_url": s3_server, "key": "testing", "secret": "testing"})
    used = fuzz._encode(rows, "fuzz", "a9-used", 3)
    cases = _cases(kinds, seed, rows, tok, used)
    sel = _collect(store, lambda c, key: fuzz.plant_s3(c, client, bucket, f"run/{key}"), tok, task, cases, used)
    _judged_as_expected(sel, cases)


@pytest.mark.e2e
def test_store_operations_ride_out_a_faulty_store_and_an_outage(s3_server):
    """10% of S3 requests failing (503 SlowDown, 500, dropped connections) and a 5 s outage: every put, get
    and list still succeeds, the objects are what was written, and the proxy counts each failed request as
    detected only because the same request came again (what ``store-faults`` reports as detected)."""
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
        # every failed request was sent again by the store layer: the proxy saw each fault detected
        assert proxy.retried(grace_s=0) == (proxy.failed, proxy.failed, 0)
        # a client that gives up after a failure is not counted as having detected it
        import urllib.error
        import urllib.request

        proxy.outage(60)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"{url}/echo2-faults/given-up", timeout=10)
        assert proxy.retried(grace_s=0) == (proxy.failed, proxy.failed - 1, 0)
        assert proxy.retried(grace_s=3600) == (proxy.failed - 1, proxy.failed - 1, 1)  # too late to judge
    finally:
        proxy.stop()


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_hostile_store_actor_is_caught_and_nothing_it_planted_is_loaded(tiny_model, tmp_path):
    """``hostile-store`` at its small size: one actor with its own scoped credentials on moto's S3 (IAM
    enforced) writes GLACIER rollout and peer objects, a huge object and peer record, replies that hang the
    grader, files far beyond LATEST+1, a junk flood and a planted checkpoint; checkpoints with a forged manifest
    and with a pickle payload in their DCP metadata are planted before the resume. On a local store, a learner
    killed past its checkpoint is resumed over a thousand empty future-folder files, and meets a real batch
    padded with byte-for-byte copies and malformed files of the lost timeline. The runs and their resumes finish,
    every honest actor's files are still used, the attackers are banned (the S3 one revoked), nothing planted is
    loaded or run, the first collection after the local resume returns within a minute, and every kind is
    detected by its own evidence (a quarantine reason naming it, a ban, a log line)."""
    from echo2.chaos.scenarios.hostile_store import KINDS, hostile_store

    (tmp_path / "tiny-model").symlink_to(tiny_model)
    row = hostile_store(tmp_path, quick=True)
    print("chaos:", json.dumps({k: v for k, v in row.items() if k != "audit"}, indent=1))
    assert set(row["kinds"]) == set(KINDS) and row["injected"] == len(KINDS)
    missed = {k: v["evidence"] for k, v in row["kinds"].items() if not v["detected"]}
    assert not missed, missed
    assert not row["broken"], row["broken"]
    assert row["finished"] and row["lost"] == 0 and row["bad_loaded"] == 0 and not row["leaks"], row["detail"]
    assert not failed(row)


@pytest.mark.e2e
def test_bad_peers_hostile_peer_with_a_launched_actors_credentials_is_left_and_nothing_bad_is_loaded(tiny_model,
                                                                                                   tmp_path):
    """``bad-peers`` at its small size: an attacker holding one launched actor's credentials registers that
    actor's peer record with its own relay, which serves corrupted chunks and chunks of another version.
    The plans send the other actor to it (the relay plans only actors the fleet launched: a peer under a
    made-up name is never asked, and the row would measure nothing); the actor leaves it at the first bad
    chunk for the store, never loads a bad version, and the run finishes. A hostile peer that served no
    chunk makes the row broken."""
    from echo2.chaos.scenarios.bad_peers import bad_peers

    (tmp_path / "tiny-model").symlink_to(tiny_model)
    row = bad_peers(tmp_path, quick=True)
    print("chaos:", json.dumps({k: v for k, v in row.items() if k != "audit"}, indent=1))
    assert row["injected"] >= 2, row["detail"]  # at least one bad chunk served, and the truncated shard
    assert row["detected"] == row["injected"] and not row["broken"], row["detail"]
    assert row["finished"] and row["lost"] == 0 and row["bad_loaded"] == 0 and not row["leaks"], row["detail"]
    assert not failed(row)


def test_the_pickle_hostile_store_plants_would_run_a_command_if_anything_loaded_it(tmp_path):
    """What makes the scenario's "the marker never appears" mean something: plain ``pickle.loads`` of the payload it
    plants as a checkpoint's ``dcp-metadata`` runs its command (in a process of its own here)."""
    from echo2.chaos.store_junk import pickle_payload

    marker = tmp_path / "ran"
    payload = pickle_payload(f"touch {marker}")
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                   input=payload, check=True, timeout=120)
    assert marker.exists()


@pytest.mark.e2e
def test_hostile_code_programs_are_held_on_the_actor_and_the_learner_and_leave_nothing(tiny_model, tmp_path):
    """``hostile-code`` at its small size: a real run of the code task in which one actor's policy writes the hostile
    programs (fork bomb, busy loop, 10 GB, writes and reads outside, a loopback connection, 1 GB of output, setsid,
    killing its parent). Each is held every time it runs on the actor, the learner runs its files' programs again and
    agrees, the run finishes, and nothing is left: no process, no file outside, no connection, no secret."""
    from echo2.chaos.hostile_programs import NAMES
    from echo2.chaos.scenarios.hostile_code import hostile_code

    (tmp_path / "tiny-model").symlink_to(tiny_model)
    row = hostile_code(tmp_path, quick=True)
    print("chaos:", json.dumps({k: v for k, v in row.items() if k != "audit"}, indent=1))
    assert row["injected"] == len(NAMES) and row["detected"] == row["injected"], row["detail"]
    assert not row["broken"], row["broken"]
    assert row["finished"] and row["lost"] == 0 and not row["leaks"], row["detail"]
    assert row["overhead_ms"] > 0 and "sandbox overhead" in row["detail"]
    assert not failed(row)
