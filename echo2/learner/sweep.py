"""The collector's look beyond a poll's window, spread over collections, and the janitor of banned actors' files.

A poll lists only the version folders a step can use and the next one, by name (``collector.py``). Whatever an
actor commits elsewhere (late into an old folder, or into folders far in the future, which no honest actor
writes) is found by the sweep: a cycle lists every folder's name once, then, collection after collection,
lists at most ``folders_per_collection`` of them; a cycle starts on the first collection of every process and
then every ``every`` collections after the last one ended, ``every`` growing with the number of folders (so a
step's share of the sweep stays flat however long the run). A million folders cost a million listings, but
never inside one collection.

Once an actor is banned its files are not judged, moved or recorded one by one: its ban record in the ledger
(``ledger.write_ban``) stands for all of them, and the ``Janitor`` deletes them in a thread of its own, off the
collection's path (a file it has not reached when the run finishes is listed in the final entry instead). The
files that made the ban were quarantined, so the evidence is kept.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter

from echo2.data import layout
from echo2.data.store import NotFound, ObjectStore

log = logging.getLogger("echo2.learner")

FULL_SWEEP_EVERY = 16
"""Collections between two sweep cycles at least (late files into old folders are found within this many)."""
SWEEP_FOLDERS = 64
"""Folders a sweep lists in one collection at most."""
LOG_EVERY = 1000
"""The janitor says what it deleted when its queue runs dry, and at least every this many files."""


class Sweep:
    """Which folders outside the poll's window the next collection lists (see the module docstring)."""

    def __init__(self, store: ObjectStore, *, every: int = FULL_SWEEP_EVERY,
                 folders_per_collection: int = SWEEP_FOLDERS):
        self.store = store
        self.every = every
        self.folders_per_collection = folders_per_collection
        self._names: list[str] | None = None  # the cycle's folders (None: no cycle under way)
        self._next = 0  # the first of them still to list
        self._since: int | None = None  # collections since the last cycle ended (None: none yet)

    @property
    def due(self) -> bool:
        return self._names is not None or self._since is None or self._since >= self.every

    def chunk(self, window: range) -> list[tuple[int, str]]:
        """The committed rollout files of the cycle's next folders, as (version, key); folders of ``window``
        (the poll lists them anyway) are passed over. Ends the cycle when its last folder is listed."""
        if self._names is None:
            self._names, self._next = sorted(self.store.list_folders(layout.ROLLOUTS)), 0
            self.every = max(FULL_SWEEP_EVERY, len(self._names))  # about the number of version folders
        out = []
        taken = 0
        while self._next < len(self._names) and taken < self.folders_per_collection:
            name = self._names[self._next]
            self._next += 1
            v = layout.parse_version_dir(name)
            if v is None or v in window:
                continue
            taken += 1
            out += [(v, key) for key in self.store.list(f"{layout.ROLLOUTS}{name}/")
                    if layout.version_of_rollout_key(key) == v]
        if self._next >= len(self._names):
            self._names, self._since = None, 0
        return out

    def collected(self) -> None:
        """One more collection ended."""
        if self._names is None and self._since is not None:
            self._since += 1


class Janitor:
    """Deletes the files of banned actors, one at a time in a daemon thread: ``clear`` never waits on the store.
    A file that is gone already is skipped; a delete that fails is logged and left (the key may come again)."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.deleted: Counter[str] = Counter()
        """Per actor: its files deleted so far."""
        self._unlogged: Counter[str] = Counter()

    def clear(self, key: str) -> None:
        with self._lock:
            if key in self._queued or self._stopping.is_set():
                return
            self._queued.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="echo2-janitor", daemon=True)
                self._thread.start()
        self._queue.put(key)

    def pending(self, key: str) -> bool:
        """Whether ``key`` is queued and not deleted yet."""
        with self._lock:
            return key in self._queued

    def _run(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    self._log()
                    return
                if self._stopping.is_set():
                    continue
                actor = (layout.parse_rollout_key(key) or (0, "?"))[1]
                try:
                    self.store.delete(key)
                except NotFound:
                    pass
                except Exception as exc:  # the janitor must never stop the run: the next listing brings it back
                    log.warning("janitor: could not delete %s: %s: %s", key, type(exc).__name__, str(exc)[:200])
                    with self._lock:
                        self._queued.discard(key)
                    continue
                with self._lock:
                    self._queued.discard(key)
                    self.deleted[actor] += 1
                    self._unlogged[actor] += 1
                if self._queue.empty() or sum(self._unlogged.values()) >= LOG_EVERY:
                    self._log()
            finally:
                self._queue.task_done()

    def _log(self) -> None:
        with self._lock:
            done, self._unlogged = dict(self._unlogged), Counter()
        for actor, n in sorted(done.items()):
            log.warning("janitor: deleted %d files of banned actor %s (%d in all)", n, actor, self.deleted[actor])

    def drain(self) -> None:
        """Wait until every file queued so far is deleted (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Stop the thread after the file it is deleting: what is still queued stays where it is (the final
        entry lists it). The janitor deletes nothing more."""
        self._stopping.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join()
