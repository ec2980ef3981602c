"""One learner incarnation writes a run at a time: the run's lease, taken by a conditional write, and a fence.

Several things may start a second learner on one run while the first still lives: a SkyPilot managed job's recovery
(the old machine only looked gone), a Prefect retry, an operator's ``--resume``. Two learners writing one run would
interleave versions, ledger entries and checkpoints of two timelines. So every learner incarnation takes the run's
lease before it writes anything of its own, and checks it before every commit:

    lease/incarnation-NNNNNN.json   the incarnation's record (number, host, boot id, pid), created with the store's
                                    create-if-absent: of two learners taking number N at once, one gets AlreadyExists
    lease/incarnation-NNNNNN.beat   its heartbeat, rewritten by that incarnation only: a count that moves at every
                                    renewal (each step, each poll while it collects, each checkpoint), and
                                    ``released`` once it leaves (finished, stopped, left on a notice)

Taking: the newest incarnation N holds the run unless it released it, or it is this very process (a new run object
in one process supersedes the old one), or it ran on this machine's boot under a pid that is gone. Otherwise the
taker watches N's heartbeat for ``LEASE_S`` (by its own clock, so no two machines' clocks are compared): a beat that
moves is a live learner, and the taker refuses (``LeaseHeld``, one line); a beat that stays still is a dead one, and
the taker creates N + 1.

Fencing: ``FencedStore`` checks, before every write that commits something (a manifest, ``policy/LATEST``, a ledger
entry or event, the run's summary), that no newer incarnation exists; an incarnation that finds one stops
(``LeaseLost``) without writing, so the new one's run is never written by the old one again. The check is one listing
of ``lease/``. The
incarnation number also goes into every manifest the learner publishes, and an actor ignores a version of an older
incarnation than the newest it has seen (``rollout/actor.py``), so even a write that slipped in between a check and
its commit is never loaded. Actors cannot write ``lease/`` (their store policy, ``fleet/credentials.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from echo2.data import layout
from echo2.data.store import AlreadyExists, NotFound, ObjectStore
from echo2.errors import Echo2InputError

log = logging.getLogger("echo2.lease")

LEASE = "lease/"
LEASE_S = float(os.environ.get("ECHO2_LEASE_S", "300"))
"""How long a taker watches a holder's heartbeat before it calls the holder dead (``ECHO2_LEASE_S``)."""
_RECORD_RE = re.compile(r"^lease/incarnation-(\d{6,})\.json$")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class LeaseHeld(Echo2InputError):
    """Another learner incarnation holds the run and is alive."""


class LeaseLost(Echo2InputError):
    """A newer learner incarnation took the run: this one must stop without writing."""


def record_key(n: int) -> str:
    return f"{LEASE}incarnation-{n:06d}.json"


def beat_key(n: int) -> str:
    return f"{LEASE}incarnation-{n:06d}.beat"


def _boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has ended: its parent just has not reaped it
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X")
    except OSError:
        return True


def newest_incarnation(store: ObjectStore) -> int:
    """The newest incarnation that took the run (0: none yet)."""
    numbers = [int(m.group(1)) for k in store.list(LEASE) if (m := _RECORD_RE.match(k))]
    return max(numbers, default=0)


def _read_json(store: ObjectStore, key: str) -> dict:
    try:
        value = json.loads(store.get(key))
    except (NotFound, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class Lease:
    """This incarnation's hold on a run (``take``): renew it, check it, release it."""

    def __init__(self, store: ObjectStore, incarnation: int):
        self.store = store
        self.incarnation = incarnation
        self.count = 0
        self.released = False

    def _beat(self, released: bool = False) -> None:
        self.count += 1
        self.store.put(beat_key(self.incarnation), json.dumps({"count": self.count, "released": released}).encode(),
                       if_absent=False)

    def renew(self) -> None:
        """Show that this incarnation lives (each step, each poll while collecting, each checkpoint); a store error
        is logged, not raised: a beat missed is at worst a takeover, which the fence then stops this one for."""
        if self.released:
            return
        try:
            self._beat()
        except Exception as exc:
            log.warning("could not renew the run's lease: %s", exc)

    def check(self) -> None:
        """``LeaseLost`` if a newer incarnation took the run (before every commit: ``FencedStore``)."""
        newest = newest_incarnation(self.store)
        if newest > self.incarnation:
            record = _read_json(self.store, record_key(newest))
            raise LeaseLost(f"learner incarnation {newest} (host {record.get('host')}, pid {record.get('pid')}) took "
                            f"this run: incarnation {self.incarnation} stops without writing")

    def release(self) -> None:
        """This incarnation leaves (finished, stopped, left on a notice): the next one takes the run at once."""
        if self.released:
            return
        try:
            self.check()
            self._beat(released=True)
            self.released = True
        except LeaseLost:
            self.released = True
        except Exception as exc:
            log.warning("could not release the run's lease: %s", exc)

    def fenced(self, store: ObjectStore) -> "FencedStore":
        return FencedStore(store, self)


def _holder_gone(record: dict, beat: dict) -> str | None:
    """Why the holder of ``record`` needs no waiting for (None: watch its heartbeat)."""
    if beat.get("released") is True:
        return "it released the run"
    host, boot, pid = record.get("host"), record.get("boot_id"), record.get("pid")
    if not isinstance(pid, int) or host != socket.gethostname() or boot is None or boot != _boot_id():
        return None
    if pid == os.getpid():
        return "it is this process"
    if not _pid_alive(pid):
        return f"its process {pid} on this machine is gone"
    return None


def take(store: ObjectStore, *, wait_s: float | None = None, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> Lease:
    """Take the run in ``store`` for a new incarnation (see the module docstring); ``LeaseHeld`` if a live learner
    holds it or another took it at the same moment."""
    wait_s = LEASE_S if wait_s is None else wait_s
    held = newest_incarnation(store)
    if held:
        record, beat = _read_json(store, record_key(held)), _read_json(store, beat_key(held))
        why = _holder_gone(record, beat)
        if why is None:
            log.warning("learner incarnation %d (host %s, pid %s) may still hold this run: watching its heartbeat for "
                        "%.0f s", held, record.get("host"), record.get("pid"), wait_s)
            start, now = clock(), beat
            while clock() - start < wait_s:
                sleep(min(5.0, wait_s / 10))
                now = _read_json(store, beat_key(held))
                if now.get("released") is True:
                    break
                if now != beat:
                    raise LeaseHeld(f"learner incarnation {held} (host {record.get('host')}, pid {record.get('pid')}) "
                                    "still holds this run (its heartbeat moves): stop it before starting another")
            why = "its heartbeat stood still" if now.get("released") is not True else "it released the run"
        log.info("taking the run from learner incarnation %d: %s", held, why)
    lease = Lease(store, held + 1)
    mine = {"incarnation": lease.incarnation, "host": socket.gethostname(), "boot_id": _boot_id(),
            "pid": os.getpid(), "taken_at": time.time()}
    try:
        store.put(record_key(lease.incarnation), json.dumps(mine).encode(), if_absent=True)
    except AlreadyExists:
        raise LeaseHeld(f"another learner took this run as incarnation {lease.incarnation} at the same "
                        "moment") from None
    lease.renew()
    return lease


def _commits(key: str) -> bool:
    """Whether writing ``key`` (relative to the run root) commits something the run's readers act on."""
    return (key.endswith("/" + layout.MANIFEST) or key in (layout.LATEST, layout.SUMMARY)
            or (key.startswith("ledger/") and key != layout.COLLECTING))


def _plain(store: ObjectStore) -> ObjectStore:
    return store


class FencedStore(ObjectStore):
    """The run's store as one incarnation writes it: every write that commits (``_commits``) checks the lease first.
    Reads and other writes (shards, which only a manifest commits) go straight through. Pickled (a torchrun learner's
    announcement of a checkpoint), it is the plain store: followers write shards only."""

    def __init__(self, inner: ObjectStore, lease: Lease, prefix: str = ""):
        self._inner, self._lease, self._prefix = inner, lease, prefix
        self.url = inner.url

    def __reduce__(self):
        return _plain, (self._inner,)

    def __getattr__(self, name: str) -> Any:  # the inner store's own attributes (retry_s, fs ...)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def _fence(self, key: str) -> None:
        if _commits(self._prefix + key):
            self._lease.check()

    # -- writes ---------------------------------------------------------------------------
    def put(self, key: str, data: bytes, *, if_absent: bool = True) -> None:
        self._fence(key)
        self._inner.put(key, data, if_absent=if_absent)

    def put_pointer(self, key: str, data: bytes) -> None:
        self._fence(key)
        self._inner.put_pointer(key, data)

    def copy(self, src: str, dst: str) -> None:
        self._fence(dst)
        self._inner.copy(src, dst)

    def move(self, src: str, dst: str) -> None:
        self._fence(dst)
        self._inner.move(src, dst)

    def delete(self, key: str) -> None:
        self._inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self._inner.delete_prefix(prefix)

    def child(self, prefix: str) -> "FencedStore":
        return FencedStore(self._inner.child(prefix), self._lease, f"{self._prefix}{prefix.strip('/')}/")

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._inner.get_range(key, start, end)

    @property
    def can_stream(self) -> bool:
        return self._inner.can_stream

    def stream_range(self, key: str, start: int, sizes: list[int]) -> Iterator[bytes]:
        return self._inner.stream_range(key, start, sizes)

    def size(self, key: str) -> int:
        return self._inner.size(key)

    def modified(self, key: str) -> float:
        return self._inner.modified(key)

    def exists(self, key: str) -> bool:
        return self._inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self._inner.list(prefix)

    def list_folders(self, prefix: str) -> list[str]:
        return self._inner.list_folders(prefix)


@dataclass(frozen=True)
class Incarnation:
    """What an actor knows of the learner incarnations it has seen (``rollout/actor.py``)."""

    newest: int = 0

    def admits(self, manifest: dict) -> bool:
        """Whether a version's manifest is of the newest incarnation seen or a newer one (a manifest of a learner
        before incarnations were numbered counts as 0)."""
        n = manifest.get("incarnation", 0)
        return isinstance(n, int) and not isinstance(n, bool) and n >= self.newest

    def seen(self, manifest: dict) -> "Incarnation":
        n = manifest.get("incarnation", 0)
        ok = isinstance(n, int) and not isinstance(n, bool)
        return Incarnation(max(self.newest, n)) if ok else self
