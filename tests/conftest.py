"""Shared fixtures: a tiny randomly initialised causal LM with its own tokenizer, Prefect offline (one API server per
pytest worker for the end-to-end runs)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from echo2.bench.tiny_model import make_tiny_model  # tests import it from here too

# Prefect runs offline: the end-to-end runs share the worker's API server (prefect_api), the rest start Prefect's
# ephemeral one; the home is per session (see pytest_configure).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
# per-session state lives under .pytest_cache, one folder per pytest-xdist worker ("main" without xdist)
_STATE = REPO / ".pytest_cache" / os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ.setdefault("ECHO2_SECRETS", str(_STATE / "secrets"))

# SkyPilot downloads its catalogs at first use (nothing here can reach them) and keeps its state under
# $SKY_RUNTIME_DIR, read when `sky` is imported: point it at a per-session folder seeded with the
# fixture catalog (tests/fixtures/skypilot-catalog) before any test imports SkyPilot.
_SKY_RUNTIME = _STATE / "sky-runtime"
shutil.rmtree(_SKY_RUNTIME, ignore_errors=True)
shutil.copytree(REPO / "tests" / "fixtures" / "skypilot-catalog" / "v8", _SKY_RUNTIME / ".sky" / "catalogs" / "v8")
os.environ["SKY_RUNTIME_DIR"] = str(_SKY_RUNTIME)
os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")


def sky_python_or_skip() -> str:
    """SkyPilot's Python (its own environment: `make setup` builds .venv-sky); the test is skipped without one."""
    from echo2.fleet.backends.skypilot_api import SkyPilotUnavailable, sky_python

    try:
        return sky_python()
    except SkyPilotUnavailable as exc:
        pytest.skip(str(exc))


def sky_task(task: dict) -> dict:
    """``task`` (as echo2 sends it to sky_bridge.py) built by SkyPilot into its ``sky.Task``, in SkyPilot's own
    environment, and described back (``sky_bridge.describe_task``); the test is skipped without that environment."""
    sky_python_or_skip()
    from echo2.fleet.backends.skypilot_api import bridge

    return bridge("task", task)


def pytest_configure(config):
    home = _STATE / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))


@pytest.fixture(autouse=True)
def _environment_left_as_found():
    """Put pytest's own environment back after each test: `echo2 run` in-process (CliRunner) sets Prefect's
    defaults there, PREFECT_LOGGING_LEVEL=WARNING among them, and every later test on the worker that starts a
    server or a flow run inherits them (the UI test's deployed flow run then logged no line at all)."""
    environ = dict(os.environ)
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="session")
def prefect_api() -> str:
    """The URL of this worker's Prefect API: the server Prefect would start for a flow (``prefect_server.start``'s
    ephemeral form), started once, in the worker's own ``PREFECT_HOME``."""
    import prefect_server

    proc, env = prefect_server.start(_STATE / "prefect-api-home", ephemeral=True)
    yield env["PREFECT_API_URL"]
    prefect_server.stop(proc)


@pytest.fixture(autouse=True)
def _end_to_end_runs_share_a_prefect_api(request, _environment_left_as_found):
    """An end-to-end test's runs (``echo2 run``, a chaos scenario, a bench) talk to the worker's one Prefect API
    instead of each starting Prefect's temporary server: the same server and services, without a server start
    (its imports and start-up) per run. A test marked ``prefect_ephemeral`` keeps the user's default path, where
    the run starts its own; a test that set ``PREFECT_API_URL`` keeps its own server."""
    node = request.node
    if (node.get_closest_marker("e2e") and not node.get_closest_marker("prefect_ephemeral")
            and "PREFECT_API_URL" not in os.environ):
        os.environ["PREFECT_API_URL"] = request.getfixturevalue("prefect_api")
    yield


@pytest.fixture(autouse=True)
def _logging_left_as_found():
    """Take out the root handlers a test installed (``echo2 run`` in-process under typer's CliRunner sets one up on
    the runner's stderr, closed when the invoke returns) and put the levels back: a later test on the same
    worker logging into a closed stream fails with "I/O operation on closed file". pytest's own capture
    handlers come and go per phase; they are left to pytest."""
    import logging

    root, ours = logging.getLogger(), logging.getLogger("echo2")
    before, levels = set(root.handlers), (root.level, ours.level)
    yield
    for handler in list(root.handlers):
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    root.setLevel(levels[0])
    ours.setLevel(levels[1])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def moto_credentials(monkeypatch):
    """The made-up AWS credentials and region moto's server takes (it checks no signature)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def s3_store(s3_server, moto_credentials):
    import uuid

    import boto3

    bucket = f"echo2-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    from echo2.data.store import open_store

    return open_store(f"s3://{bucket}/root", {"endpoint_url": s3_server})


@pytest.fixture
def clock(monkeypatch):
    """Ledger events and entries get the timestamps the test chooses (``ledger.time.time()``), from ``helpers.T0``:
    set ``clock[0]``."""
    import types

    from helpers import T0

    from echo2.data import ledger

    now = [T0]
    monkeypatch.setattr(ledger, "time", types.SimpleNamespace(time=lambda: now[0]))
    return now


@pytest.fixture(params=["file", "memory", "s3"])
def each_store(request, tmp_path):
    """The same test on every ObjectStore backend: local files, memory:// and S3 (moto's server on loopback)."""
    import uuid

    from echo2.data.store import open_store

    if request.param == "file":
        return open_store(str(tmp_path / "store"))
    if request.param == "memory":
        return open_store(f"memory://echo2-test-{uuid.uuid4().hex}")
    return request.getfixturevalue("s3_store")


@pytest.fixture
def one_rank_group():
    """A test that builds a sharded learner in this process (FSDP2 over a one-rank group, as one GPU does): the
    group is taken down afterwards, so no later test on this worker runs inside it."""
    yield
    from echo2.learner.process_group import leave

    leave()
