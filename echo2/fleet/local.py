"""Local fleet: each actor is an OS process (``echo2 actor``) on this machine.

Children get PR_SET_PDEATHSIG on Linux, so an actor dies with a learner killed by SIGKILL, and
they also watch their parent pid. Every launch, exit and stop is written to the ledger.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.config import FleetConfig
from echo2.data.ledger import write_event
from echo2.data.run_key import KEY_ENV, RELAY_SECRET_ENV, relay_secret
from echo2.data.store import ObjectStore
from echo2.fleet.backend import FleetBackend
from echo2.fleet.costs import fleet_usd

log = logging.getLogger("echo2.fleet")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the actor's own parent-pid watch still applies


@dataclass
class _Slot:
    index: int
    actor_id: str
    proc: subprocess.Popen
    log_path: Path
    restarts: int = 0


class LocalFleet(FleetBackend):
    def __init__(self, config: FleetConfig, store: ObjectStore, *, store_options: dict, log_dir: Path,
                 run_key: Ed25519PrivateKey, actor_command: list[str] | None = None):
        """``actor_command`` replaces ``python -m echo2.cli actor`` (the overlap benchmark's actors);
        ``--run``, ``--actor-id`` and ``--parent-pid`` are appended to it."""
        self.config = config
        self.actor_command = actor_command or [sys.executable, "-m", "echo2.cli", "actor"]
        self.run_key = run_key
        self.store = store
        self.store_options = store_options
        self.log_dir = log_dir
        self.slots: list[_Slot] = []
        self.desired = config.actors if isinstance(config.actors, int) else config.min_actors
        """Actors wanted now: ``fleet.actors``, or with ``auto`` what the capacity model last asked for."""
        self._log_offsets: dict[Path, int] = {}
        self._stopped = False
        atexit.register(self.stop)

    def _launch(self, index: int, restarts: int = 0) -> _Slot:
        actor_id = f"actor{index}-{secrets.token_hex(3)}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{actor_id}.log"
        # secrets travel in the environment, never on the command line or through the store; an actor
        # gets the relay secret, never the learner's signing key (not even one inherited from our env)
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
        env.update(ECHO2_STORE_OPTIONS=json.dumps(self.store_options), **{RELAY_SECRET_ENV: relay_secret(self.run_key)})
        cmd = [*self.actor_command, "--run", self.store.url, "--actor-id", actor_id, "--parent-pid", str(os.getpid())]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        write_event(self.store, "launch", actor_id, backend="local", pid=proc.pid, price_usd_per_hour=0.0,
                    restarts=restarts)
        log.info("launched %s (pid %d), log %s", actor_id, proc.pid, log_path)
        return _Slot(index, actor_id, proc, log_path, restarts)

    def start(self) -> None:
        self.slots = [self._launch(i) for i in range(self.desired)]

    def resize(self, n: int, reason: str) -> None:
        """Grow to ``n`` actors, or retire the newest ones (SIGTERM: a commit under way finishes)."""
        if n == len(self.slots):
            return
        log.info("fleet: %d -> %d actors (%s)", len(self.slots), n, reason)
        write_event(self.store, "resize", "fleet", actors_from=len(self.slots), actors_to=n, reason=reason)
        while len(self.slots) < n:
            self.slots.append(self._launch(max((s.index for s in self.slots), default=-1) + 1))
        while len(self.slots) > n:
            self._terminate(self.slots.pop(), grace_s=10.0)
        self.desired = n

    def reconcile(self) -> dict:
        alive = 0
        for n, slot in enumerate(self.slots):
            code = slot.proc.poll()
            if code is None:
                alive += 1
                continue
            write_event(self.store, "exited", slot.actor_id, code=code)
            if slot.restarts >= self.config.max_restarts:
                raise RuntimeError(
                    f"actor {slot.actor_id} exited with code {code} and was restarted {slot.restarts} times; "
                    f"see {slot.log_path}"
                )
            log.warning("actor %s exited with code %s; restarting", slot.actor_id, code)
            self.slots[n] = self._launch(slot.index, slot.restarts + 1)
            alive += 1
        return {"actors_alive": alive, "actors_desired": self.desired}

    def stop(self, grace_s: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        for slot in self.slots:
            if slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + grace_s
        for slot in self.slots:
            self._terminate(slot, grace_s=max(0.1, deadline - time.time()))
        atexit.unregister(self.stop)

    def _terminate(self, slot: _Slot, grace_s: float) -> None:
        if slot.proc.poll() is None:
            slot.proc.send_signal(signal.SIGTERM)
        try:
            slot.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            slot.proc.kill()
            slot.proc.wait()
        try:
            write_event(self.store, "terminated", slot.actor_id, code=slot.proc.returncode)
        except Exception as exc:  # the store may be the reason we are stopping
            log.warning("could not record the stop of %s: %s", slot.actor_id, exc)

    def cost_so_far(self) -> float:
        """Dollars the fleet has spent in this run so far (local processes are free, but counted)."""
        return fleet_usd(self.store)  # fleet/costs.py owns every cost figure

    def new_log_lines(self) -> list[str]:
        """Lines the actors logged since the last call, prefixed with the actor id (for the flow's log)."""
        lines = []
        for slot in self.slots:
            offset = self._log_offsets.get(slot.log_path, 0)
            try:
                with open(slot.log_path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next call
            self._log_offsets[slot.log_path] = offset + len(complete)
            lines += [f"[{slot.actor_id}] {line}" for line in complete.decode(errors="replace").splitlines() if line]
        return lines
