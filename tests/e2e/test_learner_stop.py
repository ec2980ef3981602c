"""Stopping a learner of several processes (torchrun, 2 gloo ranks on CPU): SIGTERM and Ctrl-C checkpoint and exit
143 and 130 as the one-process learner does, and ``--resume`` continues from that checkpoint; a rank 0 that dies
(SIGKILL) still lets its followers exit, on the broken group, not after torchrun's shutdown grace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

# rank 0 starts Prefect's temporary server in a session of its own (echo2/flows/api_server.py), which torchrun's
# killpg must not stop while rank 0 reports its interruption: these runs keep that server
pytestmark = pytest.mark.prefect_ephemeral

SHORT = ["train.checkpoint_every=1000", "eval.before=false", "eval.after=false"]
"""No scheduled checkpoint: the one the test finds is the interruption's own."""


def _events(run, kind: str) -> list[dict]:
    return [e for e in (json.loads(p.read_text()) for p in (run / "ledger" / "events").glob("*.json"))
            if e["kind"] == kind]


def test_a_signal_inside_an_announced_op_is_acted_on_when_the_op_ends():
    """Rank 0 must not leave its followers inside an op's collectives: SIGTERM and SIGINT wait for the block's
    end, then reach the handlers in place, each once; outside the block they act at once again."""
    from echo2.learner.distributed import stop_signals_deferred

    seen: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: seen.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with stop_signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            assert seen == []
        assert sorted(seen) == sorted([signal.SIGTERM, signal.SIGINT])
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen.count(signal.SIGTERM) == 2
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _tracebacks(log: str) -> str:
    """Every rank's traceback in the log, whole (the end of the log alone showed only rank 0's, which followed the
    other's: seen once under make test, a follower's inside the interruption's checkpoint)."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback" in line]
    return "\n...\n".join("\n".join(lines[max(0, i - 5):i + 60]) for i in starts)[-20000:]


def _stop_mid_run(tiny_model, tmp_path, stop, expected_code: int) -> tuple:
    """`echo2 learner --nproc 2` stopped by ``stop(launcher)`` once step 2 is done: it exits ``expected_code``
    within seconds, nothing of the run left running, no traceback, and a checkpoint of the step it reached
    (checkpoint_every is 1000: the interruption's own). Returns (run folder, that step)."""
    from e2e_runs import QUICKSTART, TINY, sets
    from helpers import reap_session, reap_tagged, wait_until

    from echo2.chaos.runner import kill_by_environment

    args = sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=stop", *TINY, *SHORT,
                "train.max_steps=500")
    run = tmp_path / "runs" / "stop"
    # PYTHONFAULTHANDLER: a run that has not exited 120 s after the signal is sent SIGABRT below, launcher,
    # torchrun and ranks alike, and each prints every thread's stack into the log (seen once under make test:
    # rank 0 said "interrupted" and nothing exited; the cause is not found yet)
    with open(tmp_path / "learner.log", "w") as out:
        learner = subprocess.Popen([sys.executable, "-m", "echo2.cli", "learner", QUICKSTART, "--nproc", "2", *args],
                                   cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "ECHO2_TEST_TAG": str(tmp_path), "PYTHONFAULTHANDLER": "1"})
    try:
        # step 3's batch is recorded once step 2 has moved the version. Step 2's own record is written before its
        # update, and a signal then lands at a safe point before the optimizer step: the learner rightly checkpoints
        # step 1 (seen once in CI), and a test waiting on that record could not tell the two apart
        wait_until(lambda: (run / "ledger" / "consumed" / "step-000003.json").exists() or learner.poll() is not None,
                   300, "step 2's end")
        stop(learner)
        signalled = time.monotonic()
        try:
            code = learner.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_by_environment("ECHO2_TEST_TAG", str(tmp_path), signal.SIGABRT)
            learner.wait(timeout=30)
            raise AssertionError("the run did not exit within 120 s of the signal; the stacks of what was left:\n"
                                 + (tmp_path / "learner.log").read_text()[-12000:]) from None
        took = time.monotonic() - signalled
    finally:
        reap_session(learner)
        left = reap_tagged(str(tmp_path))
    log = (tmp_path / "learner.log").read_text()
    assert code == expected_code, log[-4000:]
    assert left == 0, f"{left} processes of the run outlived it"
    assert took < 30, f"{took:.0f} s from the signal to the exit"  # torchrun's SIGKILL would come after STOP_GRACE_S
    assert "Traceback" not in log, _tracebacks(log)
    [stopped] = _events(run, "interrupted")
    reached = stopped["step"]
    assert reached >= 2 and (run / "checkpoints" / f"step-{reached:06d}" / "manifest.json").exists(), log[-3000:]
    return run, reached


@pytest.mark.e2e
def test_sigterm_stops_a_two_process_learner_with_a_checkpoint_that_resume_continues(tiny_model, tmp_path):
    """SIGTERM to `echo2 learner --nproc 2` mid-run: rank 0 checkpoints the step it reached (every rank writes its
    shards: the followers ignore the signal torchrun passed them and wait for rank 0), releases them, and the
    launcher exits 143; `--resume` continues from that checkpoint. (Before: the followers died at once, rank 0's
    checkpoint hung until torchrun's SIGKILL 30 s later, exit 1, no checkpoint.)"""
    from e2e_runs import QUICKSTART, echo2, sets
    from helpers import reap_tagged

    run, reached = _stop_mid_run(tiny_model, tmp_path, lambda launcher: launcher.send_signal(signal.SIGTERM), 143)
    try:
        echo2("learner", QUICKSTART, "--nproc", "2", "--resume",
              *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=stop", *SHORT,
                    f"train.max_steps={reached + 1}"), timeout=300, env={**os.environ, "ECHO2_TEST_TAG": str(tmp_path)})
    finally:
        reap_tagged(str(tmp_path))
    assert [e["step"] for e in _events(run, "resume")] == [reached]
    assert json.loads((run / "reports" / "summary.json").read_text())["steps"] == reached + 1


@pytest.mark.e2e
def test_ctrl_c_stops_a_two_process_learner_with_a_checkpoint(tiny_model, tmp_path):
    """Ctrl-C in a terminal: SIGINT to the launcher's process group (the launcher and torchrun; torchrun starts
    each rank in a session of its own and passes the signal on). Exit 130, with the checkpoint."""
    _stop_mid_run(tiny_model, tmp_path, lambda launcher: os.killpg(launcher.pid, signal.SIGINT), 130)


@pytest.mark.e2e
def test_the_followers_of_a_rank_0_killed_mid_run_exit_on_the_broken_group(tiny_model, tmp_path):
    """The followers ignore SIGTERM, so torchrun cannot end them before its shutdown grace: they must end by
    themselves when rank 0 is gone. Rank 0 is SIGKILLed at step 3's collection (a failpoint) with a grace of
    600 s; the learner has exited long before it."""
    from e2e_runs import QUICKSTART, TINY, sets
    from helpers import reap_session, reap_tagged

    args = sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=killed", *TINY, *SHORT)
    with open(tmp_path / "learner.log", "w") as out:
        learner = subprocess.Popen([sys.executable, "-m", "echo2.cli", "learner", QUICKSTART, "--nproc", "2", *args],
                                   cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "ECHO2_FAILPOINTS": "step:6", "ECHO2_TEST_TAG": str(tmp_path),
                                        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600"})
    try:
        code = learner.wait(timeout=300)
    finally:
        reap_session(learner)
        reap_tagged(str(tmp_path))  # rank 0's Prefect server: its own session, and rank 0 died without stopping it
    log = (tmp_path / "learner.log").read_text()
    assert code not in (0, 143), log[-3000:]
    assert "forcefully exiting" not in log, log[-3000:]  # torchrun's SIGKILL after the grace: never reached
