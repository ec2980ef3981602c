"""The CLI's own handling of what the flow raises (in process, with the flow replaced)."""

import os
import signal

import pytest
from typer.testing import CliRunner

import echo2.flows.train
from echo2.cli import app

QUICKSTART = "configs/quickstart.yaml"


@pytest.fixture(autouse=True)
def _restore_process_state():
    """`echo2 run` sets Prefect's environment defaults (PREFECT_LOGGING_LEVEL=WARNING among them)
    and the logging config for its own process; here that process is pytest's, whose environment
    later tests' servers and flow runs inherit (the UI test's flow run lost every log line)."""
    import logging

    environ = dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # `echo2 run` takes both
    yield
    os.environ.clear()
    os.environ.update(environ)
    root.handlers[:] = handlers
    root.setLevel(level)
    for sig, handler in signals.items():
        signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _no_prefect_api(monkeypatch):
    """The flow is replaced here, so nothing talks to Prefect: `echo2 run` does not start its API server."""
    import echo2.flows.api_server

    monkeypatch.setattr(echo2.flows.api_server, "start_prefect_api", lambda own_session=False: lambda: None)


def test_ctrl_c_exits_130_even_when_prefect_turns_the_interrupt_into_another_error(tiny_model, tmp_path, monkeypatch):
    # Prefect can swallow a KeyboardInterrupt that lands while it creates a task run and raise
    # ValueError("Task run is not set") in its place (seen in CI); the user still pressed Ctrl-C
    def train_interrupted_inside_prefect(**_):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            raise ValueError("Task run is not set") from None
        raise AssertionError("SIGINT did not interrupt")

    monkeypatch.setattr(echo2.flows.train, "train", train_interrupted_inside_prefect)
    previous = signal.getsignal(signal.SIGINT)
    try:
        result = CliRunner().invoke(app, ["run", QUICKSTART, "--set", f"model.name={tiny_model}",
                                          "--set", f"store.url={tmp_path}", "--set", "run.id=cut"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.exit_code == 130, (result.output, result.exception)
    assert "--resume" in result.output


def test_an_error_without_ctrl_c_is_not_reported_as_an_interrupt(tiny_model, tmp_path, monkeypatch):
    def train_fails(**_):
        raise ValueError("a real bug")

    monkeypatch.setattr(echo2.flows.train, "train", train_fails)
    previous = signal.getsignal(signal.SIGINT)
    try:
        result = CliRunner().invoke(app, ["run", QUICKSTART, "--set", f"model.name={tiny_model}",
                                          "--set", f"store.url={tmp_path}", "--set", "run.id=bug"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert isinstance(result.exception, ValueError) and result.exit_code == 1


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment holds ``ECHO2_TEST_TAG=tag`` (zombies excluded)."""
    from pathlib import Path

    marker, out = f"ECHO2_TEST_TAG={tag}".encode(), []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0")
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


@pytest.mark.e2e
def test_sigterm_to_echo2_chaos_stops_every_process_of_its_scenarios(tmp_path):
    """`kill` (or a CI job's timeout) on `echo2 chaos` stops what its scenarios started as Ctrl-C does: their
    runs live in sessions of their own, so the default action of SIGTERM used to leave each scenario's
    learner, actors and Prefect server running."""
    import secrets
    import subprocess
    import sys

    from conftest import REPO
    from helpers import reap_tagged, wait_until

    tag = f"chaos-{secrets.token_hex(4)}"
    env = dict(os.environ, ECHO2_TEST_TAG=tag)
    with open(tmp_path / "chaos.log", "w") as log:
        chaos = subprocess.Popen([sys.executable, "-m", "echo2.cli", "chaos", "--scenario", "reclaims", "--quick",
                                  "--keep", str(tmp_path / "kept")], cwd=REPO, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    run = tmp_path / "kept" / "reclaims" / "runs" / "notice1"
    steps = run / "ledger" / "consumed"
    try:
        wait_until(lambda: (steps / "step-000001.json").exists(), 300, "the scenario's run to train")
        assert len(tagged_pids(tag)) >= 3  # the suite, its learner, actors (and Prefect's server)
        chaos.send_signal(signal.SIGTERM)
        chaos.wait(timeout=120)
        wait_until(lambda: not tagged_pids(tag), 30, "every process of the scenario to exit")
    finally:
        chaos.kill()
        chaos.wait()
        reap_tagged(tag)
    output = (tmp_path / "chaos.log").read_text()
    assert chaos.returncode == 143 and "interrupted" in output, output[-3000:]
    # stopped, not left to run on: a learner the suite had left behind would have finished its 8 steps
    assert not (run / "reports" / "summary.json").exists()


def test_version_prints_the_package_version():
    import subprocess
    import sys

    from conftest import REPO

    import echo2

    proc = subprocess.run([sys.executable, "-m", "echo2", "--version"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"echo2 {echo2.__version__}\n", proc.stdout + proc.stderr


def test_python_dash_m_echo2_is_the_echo2_command():
    """``python -m echo2`` (echo2/__main__.py) runs the same app as the ``echo2`` script: its commands listed."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "echo2", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert proc.returncode == 0, proc.stderr
    assert "python -m echo2" in proc.stdout
    for command in ("run", "learner", "actor", "export", "eval", "report", "audit", "chaos", "plan", "prices",
                    "bench", "fleet"):
        assert f" {command} " in proc.stdout, (command, proc.stdout)


SUMMARY = {"run_id": "two", "steps": 4, "wall_seconds": 312.4, "eval_before": 0.2, "eval_after": 0.45,
           "eval_metric": "accuracy", "cost_usd": 0.0, "cost_priced": False, "rollouts_used": 9,
           "eval_metrics": {"before": {"accuracy": 0.2, "pass_at_1_ci95_low": 0.08, "pass_at_1_ci95_high": 0.42},
                            "after": {"accuracy": 0.45, "pass_at_1_ci95_low": 0.28, "pass_at_1_ci95_high": 0.63}}}


@pytest.mark.parametrize("json_flag", [False, True])
def test_a_finished_run_ends_with_two_lines_or_its_json(tiny_model, tmp_path, monkeypatch, json_flag):
    """The run ends with the held-out metric before -> after with its intervals, steps, wall time, cost and where
    the reports are, in two lines; the whole summary is reports/summary.json, or stdout with --json."""
    import json

    monkeypatch.setattr(echo2.flows.train, "train", lambda **_: dict(SUMMARY))
    result = CliRunner().invoke(app, ["run", QUICKSTART, "--set", f"model.name={tiny_model}", "--set",
                                      f"store.url={tmp_path}", "--set", "run.id=two", *(["--json"] * json_flag)])
    assert result.exit_code == 0, (result.output, result.exception)
    lines = [line for line in result.stdout.splitlines() if not line.startswith("step ")]
    if json_flag:
        assert json.loads("\n".join(lines)) == SUMMARY
        return
    assert lines == ["held-out greedy accuracy: 0.200 [95% 0.080, 0.420] -> 0.450 [95% 0.280, 0.630] (+0.250); "
                     "4 steps, 5m12s, no priced resources",
                     f"run two: reports in {tmp_path}/runs/two/reports/ (summary.json, curves.png, cost.md)"]


def test_the_two_lines_without_evaluations_and_with_a_priced_run():
    from echo2.cli.run import summary_lines

    resumed = {**SUMMARY, "eval_before": None, "cost_usd": 1.5, "cost_priced": True, "wall_seconds": 7300}
    assert summary_lines(resumed, "r/")[0] == ("held-out accuracy after training: 0.450 [95% 0.280, 0.630]; "
                                               "4 steps, 2h01m, $1.5000")
    off = {**SUMMARY, "eval_before": None, "eval_after": None, "cost_usd": None, "wall_seconds": 42}
    assert summary_lines(off, "r/")[0] == "no held-out evaluation before and after; 4 steps, 42s, cost unknown"
