"""The learner over several nodes (``echo2 learner --nnodes``), tested on this machine as 2 nodes x 1 process:
two separate torchrun launches (``--nnodes 2``, ``--node-rank`` 0 and 1) meeting at a rendezvous on
127.0.0.1, gloo over loopback. One GRPO step equals the one-process step; ``echo2 learner`` on node 1 resolves
nothing, follows node 0's run with the config rank 0 sends, and exits 0 when that run ends; a node whose
peers never come fails in one line within its rendezvous timeout; infra/skypilot/learner.yaml starts the
same command on every node of a cluster."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO
from safetensors.torch import load_file

from echo2.learner.torchrun import Rendezvous, torchrun_command

STEP = str(REPO / "tests" / "support" / "distributed_step.py")
MULTINODE_STEP = str(REPO / "tests" / "support" / "multinode_step.py")
ATOL = 1e-5
"""Weights after one AdamW step (lr 1e-3) agree to this: the ranks sum the same gradient in another order."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Every process's exit code, or every one killed (their sessions) and an AssertionError at the deadline."""
    from helpers import reap_session

    deadline = time.monotonic() + timeout
    try:
        return [proc.wait(timeout=max(0.1, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the nodes did not all exit within {timeout:.0f} s") from None
    finally:
        for proc in procs:
            reap_session(proc)


@pytest.mark.e2e
def test_a_step_over_two_nodes_updates_the_weights_as_one_process_does(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    proc = subprocess.run([sys.executable, STEP, str(tiny_model), str(tmp_path / "one.safetensors")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    endpoint, layout = f"127.0.0.1:{free_port()}", tmp_path / "layout"
    layout.mkdir()
    procs, logs = [], []
    for node in (1, 0):  # node 1 first: it waits at the rendezvous until node 0 opens it
        command = torchrun_command(1, Rendezvous(2, node, endpoint, timeout_s=240),
                                   [MULTINODE_STEP, str(tiny_model), str(tmp_path / "two.safetensors"), str(layout)])
        out, err = open(tmp_path / f"node{node}.out", "w"), open(tmp_path / f"node{node}.err", "w")
        procs.append(subprocess.Popen(command, cwd=REPO, stdout=out, stderr=err, start_new_session=True))
        logs.append((out, err))
    codes = wait_all(procs, timeout=300)
    for out, err in logs:
        out.close(), err.close()
    assert codes == [0, 0], (codes, *((tmp_path / f"node{n}.err").read_text()[-3000:] for n in (0, 1)))
    # global rank 0 is node 0's first process; node 1's process is rank 1 of a world of 2
    ranks = {p.name: json.loads(p.read_text()) for p in layout.iterdir()}
    assert ranks == {"rank-0.json": {"RANK": 0, "GROUP_RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 2},
                     "rank-1.json": {"RANK": 1, "GROUP_RANK": 1, "LOCAL_RANK": 0, "WORLD_SIZE": 2}}, ranks
    two = ast.literal_eval((tmp_path / "node0.out").read_text().strip().splitlines()[-1])
    assert one["world"] == 1 and two["world"] == 2
    assert abs(one["loss"] - two["loss"]) < 1e-6 and abs(one["grad_norm"] - two["grad_norm"]) < 1e-5, (one, two)
    assert one["rollouts"] == two["rollouts"] and one["groups_with_signal"] == two["groups_with_signal"] > 0
    a, b = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert a.keys() == b.keys()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    moved = max((a[k] - initial[k]).abs().max().item() for k in a)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"largest difference of a weight, 2 nodes x 1 process vs 1 process: {worst:.2e} (moved up to {moved:.2e})")
    assert moved > 1e-4 and worst < ATOL, (moved, worst)


@pytest.mark.e2e
def test_a_node_whose_peers_never_come_fails_in_one_line_within_its_rendezvous_timeout(tiny_model, tmp_path):
    from e2e_runs import QUICKSTART, echo2, sets

    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    proc = echo2("learner", QUICKSTART, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint,
                 "--rdzv-timeout", "3", *sets(f"model.name={tiny_model}"), check=False, timeout=120)
    assert proc.returncode == 1 and time.monotonic() - started < 60, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: node 1 of 2 could not reach the rendezvous at {endpoint} "
                                                   "within 3 s"), proc.stderr
    # node 0 alone: its run is resolved and torchrun waits for node 1 at the rendezvous, then gives up
    proc = echo2("learner", QUICKSTART, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint,
                 "--rdzv-timeout", "5", *sets(f"model.name={tiny_model}", f"store.url={tmp_path}"), check=False,
                 timeout=180)
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert proc.returncode == 1 and last.startswith("error: the learner's 1 other node(s) did not all join the "
                                                    f"rendezvous at {endpoint} within 5 s"), proc.stderr[-3000:]


@pytest.mark.e2e
def test_bad_node_options_are_refused_in_one_line(tiny_model, tmp_path):
    from e2e_runs import QUICKSTART, echo2, sets

    for args, message in [
        (("run", QUICKSTART, *sets("learner.nnodes=2")), "learner.nnodes is 2: start the learner with `echo2 learner"),
        (("learner", QUICKSTART, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "nohost"),
         "--rdzv-endpoint must be HOST:PORT on node 0"),
        (("learner", QUICKSTART, "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"),
         "--node-rank must be in 0..1"),
        (("learner", QUICKSTART, "--nnodes", "2", *sets("train.lora_rank=8")), "shards full fine-tuning only"),
    ]:
        proc = echo2(*args, *sets(f"model.name={tiny_model}", f"store.url={tmp_path}"), check=False, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (args, proc.stderr)
    assert not (tmp_path / "runs").exists()


def test_the_learner_task_starts_echo2_learner_on_every_node_with_node_0_as_the_rendezvous(tmp_path):
    """SkyPilot's own parser reads the task (num_nodes: 1 by default, `sky launch --num-nodes N` for more); its
    run section, executed with the variables SkyPilot sets on each node, starts `echo2 learner` with that
    node's rank, every node meeting at the first address of SKYPILOT_NODE_IPS (the head node, rank 0)."""
    from conftest import sky_task  # SkyPilot's environment (.venv-sky); skipped without

    from echo2.fleet.backends.skypilot_task import DEFAULT_TASK_FILE, load_task_config

    task = sky_task({"config": load_task_config(DEFAULT_TASK_FILE.parent / "learner.yaml")})["yaml"]
    assert task["num_nodes"] == 1
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "echo2").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (venv / "bin" / "echo2").chmod(0o755)
    for rank in (0, 1):
        env = {"PATH": os.environ["PATH"], **task["envs"], "ECHO2_VENV": str(venv), "SKYPILOT_NUM_NODES": "2",
               "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "10.0.0.4\n10.0.0.5",
               "SKYPILOT_NUM_GPUS_PER_NODE": "8"}
        proc = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split("\n")[:-1] == [
            "learner", task["envs"]["ECHO2_CONFIG"], "--nproc", "8", "--nnodes", "2", "--node-rank", str(rank),
            "--rdzv-endpoint", "10.0.0.4:29500", "--set", "learner.dist_backend=nccl"], proc.stdout


@pytest.mark.e2e
def test_echo2_learner_on_two_nodes_node_1_follows_node_0s_run_through_sigterm_and_resume(tiny_model, tmp_path):
    """`echo2 learner --nnodes 2` end to end. Node 1's launcher is given a store it could not reach and a run id
    of its own: it never opens the store nor resolves a run; its process takes node 0's config from rank 0 and
    does its share of every step. SIGTERM to node 0's launcher ends the run on both nodes, as with several
    processes on one node (rank 0 checkpoints with node 1's follower, which ignores the signal, then releases
    it: node 0 exits 143 as a one-process learner does, node 1 exits 0); `--resume` on node 0,
    node 1 started as before, continues from the last checkpoint with the resumed run's config and finishes
    it, and node 1 exits 0 when the run ends."""
    import signal

    from e2e_runs import QUICKSTART, TINY, sets
    from helpers import ledger_audit, reap_tagged, wait_until

    from echo2.data.store import open_store

    run = tmp_path / "runs" / "stop"
    node1 = sets(f"model.name={tiny_model}", "store.url=s3://no-such-bucket/echo2", "run.id=not-this-one",
                 "store.options={endpoint_url: 'http://127.0.0.1:9'}")

    def start_nodes(node0: list[str], tag: str) -> list[subprocess.Popen]:
        endpoint = f"127.0.0.1:{free_port()}"
        procs = []
        for rank, args in ((0, node0), (1, node1)):
            with open(tmp_path / f"{tag}-node{rank}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "echo2.cli", "learner", QUICKSTART, "--nnodes", "2", "--nproc", "1",
                     "--rdzv-endpoint", endpoint, "--rdzv-timeout", "300", "--node-rank", str(rank), *args],
                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "ECHO2_TEST_TAG": str(tmp_path)}))
        return procs

    def logs(tag: str) -> str:
        return "\n".join((tmp_path / f"{tag}-node{rank}.log").read_text()[-2500:] for rank in (0, 1))

    try:
        procs = start_nodes(sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=stop", *TINY,
                                 "train.max_steps=500", "eval.before=false"), "first")
        wait_until(lambda: (run / "checkpoints" / "step-000002" / "manifest.json").exists()
                   or any(p.poll() is not None for p in procs), 300, "the first checkpoint")
        procs[0].send_signal(signal.SIGTERM)
        codes = wait_all(procs, timeout=120)  # both nodes end; none waits on for its collective timeout
        assert codes == [143, 0] and (run / "checkpoints" / "step-000002" / "manifest.json").exists(), logs("first")
        procs = start_nodes(["--resume", *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=stop",
                                                "train.max_steps=4", "eval.after=false")], "resumed")
        codes = wait_all(procs, timeout=600)
    finally:
        reap_tagged(str(tmp_path))
    assert codes == [0, 0], (codes, logs("resumed"))
    summary = json.loads((run / "reports" / "summary.json").read_text())
    assert summary["steps"] == 4, summary
    problems, counts = ledger_audit(open_store(str(run)))
    assert not problems and counts["used"] >= 4, (problems, counts)
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["learner"]["nnodes"] == 2 and record["config"]["learner"]["nproc"] == 1
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["stop"]  # node 1 made no run of its own
    assert "Traceback" not in (tmp_path / "resumed-node1.log").read_text(), logs("resumed")
