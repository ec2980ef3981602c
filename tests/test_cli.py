"""The CLI's own handling of what the flow raises (in process, with the flow replaced)."""

import os
import signal

import flows.train
import pytest
from typer.testing import CliRunner

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
    yield
    os.environ.clear()
    os.environ.update(environ)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _no_prefect_api(monkeypatch):
    """The flow is replaced here, so nothing talks to Prefect: `echo2 run` does not start its API server."""
    import flows.api_server

    monkeypatch.setattr(flows.api_server, "start_prefect_api", lambda: lambda: None)


def test_ctrl_c_exits_130_even_when_prefect_turns_the_interrupt_into_another_error(tiny_model, tmp_path, monkeypatch):
    # Prefect can swallow a KeyboardInterrupt that lands while it creates a task run and raise
    # ValueError("Task run is not set") in its place (seen in CI); the user still pressed Ctrl-C
    def train_interrupted_inside_prefect(**_):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            raise ValueError("Task run is not set") from None
        raise AssertionError("SIGINT did not interrupt")

    monkeypatch.setattr(flows.train, "train", train_interrupted_inside_prefect)
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

    monkeypatch.setattr(flows.train, "train", train_fails)
    previous = signal.getsignal(signal.SIGINT)
    try:
        result = CliRunner().invoke(app, ["run", QUICKSTART, "--set", f"model.name={tiny_model}",
                                          "--set", f"store.url={tmp_path}", "--set", "run.id=bug"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert isinstance(result.exception, ValueError) and result.exit_code == 1
