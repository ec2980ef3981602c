"""Start Prefect's temporary API server early, so that it comes up while the learner imports.

Without ``PREFECT_API_URL``, Prefect starts a temporary API server (a uvicorn subprocess; ~10 s on a
2-core machine) when the flow is first called, that is after ``echo2.flows.train`` has imported torch and
transformers (another ~10 s). Started first, in a thread that only spawns the subprocess and polls its
health, the two overlap. Prefect keeps one such server per process (``SubprocessASGIServer()`` is a
singleton), so the flow finds this one running and uses it; it is stopped at exit as Prefect stops its own.

Rank 0 of a learner under torchrun starts it in a session of its own (``own_session``; Prefect's command, with
``start_new_session``): torchrun stops a rank with ``killpg``, which would stop the server too while rank 0
still reports its interruption to it (Prefect's client then retried for minutes). Elsewhere it stays in the
learner's session, which is what a supervisor kills after a SIGKILLed learner (``echo2 chaos``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("echo2.flows")


def start_prefect_api(own_session: bool = False) -> Callable[[], None]:
    """Start the temporary API server in the background where the flow would start one; the returned
    function waits until it answers (call it before the flow). A server that did not come up is left to
    Prefect, which starts it again when the flow is called and says why if it cannot."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # a server of the user's (make ui, a deployment's worker): nothing to start
        return lambda: None
    # imported here, in the calling thread: imports racing in two threads can deadlock on module locks
    from prefect.server.api.server import SubprocessASGIServer

    server = _own_session_server() if own_session else SubprocessASGIServer()

    def start() -> None:
        try:
            server.start()
        except Exception as exc:  # noqa: BLE001 - Prefect retries and reports it when the flow starts
            log.debug("early start of Prefect's temporary API server failed: %s", exc)

    thread = threading.Thread(target=start, name="prefect-api-start", daemon=True)
    thread.start()
    return thread.join


def _own_session_server():
    """Prefect's one-per-process ``SubprocessASGIServer`` (the flow's ``SubprocessASGIServer()`` returns this
    instance: subclasses share its registry) whose uvicorn process starts in a session of its own; the command
    is Prefect 3's own."""
    import os
    import subprocess
    import sys

    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class OwnSessionServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
            return subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                 "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "error", "--lifespan", "on"],
                env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
                start_new_session=True)

    return OwnSessionServer()


EXIT_DRAIN_S = 30.0
"""How long an interrupted run waits for Prefect to ship the log lines and events it still holds."""


def leave_prefect(exit_code: int, timeout_s: float = EXIT_DRAIN_S) -> None:
    """After an interruption: let Prefect ship what it still holds (its log and event services) within
    ``timeout_s``, then return; if one has not finished by then, stop the temporary server and end the process now
    with ``exit_code``.

    Prefect drains those services at interpreter exit without a time limit. A Ctrl-C raises KeyboardInterrupt
    wherever the main thread is, Prefect's own code included, and an interrupted run has then waited on that drain
    for good after it had checkpointed, stopped its actors and said so (the Ctrl-C test, under load). The run is
    safe by then; only log lines still in flight are lost. ``prefect._internal``: the services' registry and their
    drain, the calls Prefect's own exit hook makes (Prefect is pinned)."""
    import concurrent.futures
    import os
    import sys

    from prefect._internal.concurrency.services import _active_services

    pending = [service._drain(at_exit=True) for service in list(_active_services)]
    _, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
    if not not_done:
        return
    log.warning("Prefect had not shipped its last log lines and events %.0f s after the interruption: leaving "
                "without them", timeout_s)
    from prefect.server.api.server import SubprocessASGIServer

    for server in list(SubprocessASGIServer._instances.values()):  # the temporary server, as Prefect's atexit does
        server.stop()
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
