"""A spot learner's local actors that the relaunched learner does not adopt are stopped, not left running unmanaged
(``fleet/backends/local.py``, ``LocalBackend.release_leftovers``). The "actors" are real processes whose command
lines are an actor's (``--run URL --actor-id ID``), in sessions of their own as a spot learner starts them."""

from __future__ import annotations

import signal
import subprocess
import sys

from echo2.config import LocalFleetConfig
from echo2.fleet.backends.local import LocalBackend

SLEEP = [sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_DFL)\ntime.sleep(600)"]


def _actor(actor_id: str, url: str) -> subprocess.Popen:
    return subprocess.Popen([*SLEEP, "actor", "--run", url, "--actor-id", actor_id], start_new_session=True)


def test_leftover_local_actors_are_stopped_and_no_other_process(tmp_path):
    url = str(tmp_path / "store" / "runs" / "r1")
    leftover, other = _actor("actor3-a1b2c3", url), _actor("actor4-d4e5f6", url)
    try:
        LocalBackend(LocalFleetConfig(actors=1), tmp_path / "logs").release_leftovers(["actor3-a1b2c3"])
        assert leftover.wait(timeout=30) == -signal.SIGTERM  # stopped by the release (a bound, not a measure)
        assert other.poll() is None  # an actor it was not asked to stop runs on
    finally:
        for proc in (leftover, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
