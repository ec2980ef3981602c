"""A real Prefect server (SQLite, loopback, no UI): for tests that need more than the ephemeral API (events sent over
its websocket, blocks saved and loaded), started once per module that asks; and, in the ephemeral server's own form,
the one API every end-to-end run of a pytest worker talks to (conftest.py). Stopped by its process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PREFECT = str(Path(sys.executable).parent / "prefect")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(home: Path, *, ephemeral: bool = False) -> tuple[subprocess.Popen, dict[str, str]]:
    """The server's process and the environment a client of it runs with (its own ``PREFECT_HOME``).

    ``ephemeral``: the server Prefect starts for a flow when no ``PREFECT_API_URL`` is set (its own uvicorn command
    and environment, ``SubprocessASGIServer._run_uvicorn_command``: the ephemeral set of services, no UI), so that
    runs sharing it see the API a user's ``echo2 run`` sees."""
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_SERVER_UI_ENABLED="false")
    home.mkdir(parents=True, exist_ok=True)
    log = open(home.parent / f"{home.name}-server.log", "wb")  # noqa: SIM115 -- closed with the server
    if ephemeral:
        import importlib.util

        site = Path(importlib.util.find_spec("prefect").origin).parent.parent  # Prefect's --app-dir, unimported
        command = [sys.executable, "-m", "uvicorn", "--app-dir", str(site), "--factory",
                   "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "error", "--lifespan", "on"]
        server_env = dict(env, PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
        server_env.pop("PREFECT_API_URL")
    else:
        command = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
        server_env = env
    proc = subprocess.Popen(command, env=server_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{env['PREFECT_API_URL']}/health", timeout=2).status_code == 200:
                return proc, env
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"the Prefect server did not start: {Path(log.name).read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    """Its whole process group (the server runs its services beside the web server): SIGTERM, then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    proc.log.close()


def read_events(env: dict[str, str], prefix: str, want: int, timeout_s: float = 60) -> list[dict]:
    """The server's events whose names start with ``prefix``, once at least ``want`` have arrived (the server persists
    what its websocket receives in batches, a few seconds later)."""
    from prefect.events.filters import EventFilter, EventNameFilter

    deadline = time.monotonic() + timeout_s
    events: list[dict] = []
    while time.monotonic() < deadline:
        query = EventFilter(event=EventNameFilter(prefix=[prefix])).model_dump(mode="json")
        reply = httpx.post(f"{env['PREFECT_API_URL']}/events/filter", timeout=10, json={"filter": query, "limit": 50})
        assert reply.status_code == 200, reply.text[:2000]
        events = reply.json()["events"]
        if len(events) >= want:
            return events
        time.sleep(1)
    return events
