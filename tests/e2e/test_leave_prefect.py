"""An interrupted run leaves within a bounded time even when one of Prefect's services (its log and event shipping)
never finishes draining: Prefect's own exit hook waits for them without a limit."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

STUCK = """
import sys
from prefect._internal.concurrency.services import QueueService

class Stuck(QueueService[int]):
    async def _handle(self, item):
        pass

service = Stuck.instance()
service.send(1)
service._stopped = True  # stopped, its end-of-queue item never sent: what an interruption inside _stop leaves
if sys.argv[1] == "leave":
    from echo2.flows.api_server import leave_prefect

    leave_prefect(130, timeout_s=1)
print("exiting the usual way")
"""


@pytest.mark.e2e
def test_an_interrupted_run_leaves_though_a_prefect_service_never_drains():
    with pytest.raises(subprocess.TimeoutExpired):  # Prefect's exit hook alone waits on it for good
        subprocess.run([sys.executable, "-c", STUCK, "plain"], cwd=REPO, capture_output=True, timeout=8)
    proc = subprocess.run([sys.executable, "-c", STUCK, "leave"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "exiting the usual way" not in proc.stdout
    assert "leaving without them" in proc.stderr
