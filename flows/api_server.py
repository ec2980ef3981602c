"""Start Prefect's temporary API server early, so that it comes up while the learner imports.

Without ``PREFECT_API_URL``, Prefect starts a temporary API server (a uvicorn subprocess; ~10 s on a
2-core machine) when the flow is first called, that is after ``flows.train`` has imported torch and
transformers (another ~10 s). Started first, in a thread that only spawns the subprocess and polls its
health, the two overlap. Prefect keeps one such server per process (``SubprocessASGIServer()`` is a
singleton), so the flow finds this one running and uses it; it is stopped at exit as Prefect stops its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("echo2.flows")


def start_prefect_api() -> Callable[[], None]:
    """Start the temporary API server in the background where the flow would start one; the returned
    function waits until it answers (call it before the flow). A server that did not come up is left to
    Prefect, which starts it again when the flow is called and says why if it cannot."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # a server of the user's (make ui, a deployment's worker): nothing to start
        return lambda: None
    # imported here, in the calling thread: imports racing in two threads can deadlock on module locks
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()

    def start() -> None:
        try:
            server.start()
        except Exception as exc:  # noqa: BLE001 - Prefect retries and reports it when the flow starts
            log.debug("early start of Prefect's temporary API server failed: %s", exc)

    thread = threading.Thread(target=start, name="prefect-api-start", daemon=True)
    thread.start()
    return thread.join
