"""The ``ObjectStore`` interface: the only channel between the planes.

Keys are ``/``-separated paths relative to the store's root (a run root, usually). Every object
is written once and becomes visible atomically: ``put(..., if_absent=True)`` either creates the
whole object or raises ``AlreadyExists``; readers never see a partial object. The one object
that is overwritten in place is a pointer (``policy/LATEST``), through ``put_pointer``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any


class StoreError(Exception):
    """An object store operation failed."""


class AlreadyExists(StoreError):
    """A create-if-absent write found the key already there."""


class NotFound(StoreError, KeyError):
    """The key does not exist."""


class ObjectStore(ABC):
    """Write-once object storage rooted at ``url``."""

    url: str

    @abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = True) -> None:
        """Store ``data`` under ``key`` atomically; with ``if_absent`` raise ``AlreadyExists`` if present."""

    @abstractmethod
    def put_pointer(self, key: str, data: bytes) -> None:
        """Atomically replace a small pointer object (readers see the old or the new value)."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Whole object; ``NotFound`` if absent."""

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (one ranged GET on S3)."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Size of an object in bytes, without reading it; ``NotFound`` if absent."""

    def modified(self, key: str) -> float:
        """When the store committed ``key``, by the store's own clock (seconds since the epoch); ``NotFound``
        if absent. Compared only with other objects' times of the same store (``data/audit.py``)."""
        raise NotImplementedError(f"{type(self).__name__} does not report modification times")

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is a committed object."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All committed keys under ``prefix`` (recursive), sorted, relative to the root."""

    def list_folders(self, prefix: str) -> list[str]:
        """Names of the folders directly under ``prefix`` (one listing request, not one per file below)."""
        return sorted({k[len(prefix):].split("/", 1)[0] for k in self.list(prefix) if "/" in k[len(prefix):]})

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object (garbage collection of superseded versions); absent keys are ignored."""

    @abstractmethod
    def child(self, prefix: str) -> "ObjectStore":
        """A store rooted at ``prefix`` under this one (for example a run root)."""

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under ``prefix`` (garbage collection of a whole version folder)."""
        for key in self.list(prefix):
            self.delete(key)

    def put_json(self, key: str, obj: Any, *, if_absent: bool = True) -> None:
        self.put(key, json.dumps(obj, indent=1, sort_keys=True).encode(), if_absent=if_absent)

    def get_json(self, key: str) -> Any:
        return json.loads(self.get(key))

    def move(self, src: str, dst: str) -> None:
        """Copy then delete: used to set a rejected file aside without losing it."""
        try:
            self.put(dst, self.get(src), if_absent=True)
        except AlreadyExists:
            pass  # an earlier, interrupted move already copied it
        self.delete(src)


def open_store(url: str, options: dict[str, Any] | None = None, *, retry_s: float | None = None) -> ObjectStore:
    """Open ``url`` (a path, ``file://``, ``memory://``, ``s3://``, ``gs://`` ...) through fsspec;
    ``retry_s``: how long transient errors are retried (default ``fsspec_store.RETRY_S``)."""
    from echo2.data.fsspec_store import RETRY_S, FsspecStore

    return FsspecStore(url, options or {}, retry_s=RETRY_S if retry_s is None else retry_s)
