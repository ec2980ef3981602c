"""Object stores: the write-once storage every plane talks through. The interface and its errors are in
``base.py`` (re-exported here, so callers write ``from echo2.data.store import ObjectStore, NotFound``),
one implementation per file, chosen by the scheme of the store's URL (``store.url``); ``open_store`` is the
only place that maps a URL to its implementation.

    fsspec_store  every scheme fsspec knows: a plain path or ``file://``, ``memory://``, ``s3://``, ``gs://``

Adding a store is three steps:

1. its URL scheme: the scheme is the discriminator of the ``store`` section (``StoreConfig`` in
   ``echo2/config/__init__.py``: ``url``, ``options`` handed to the implementation, ``retry_s``), as ``kind``
   is of ``rollout.engine``;
2. one file here, a subclass of ``base.ObjectStore`` that imports from ``echo2.data.store.base`` only;
3. one branch in ``open_store`` below, for its scheme, ahead of the fsspec one that takes every other.
"""

from __future__ import annotations

from typing import Any

from echo2.data.store.base import AlreadyExists, NotFound, ObjectStore, StoreError, is_transient, is_unreadable_object


def open_store(url: str, options: dict[str, Any] | None = None, *, retry_s: float | None = None) -> ObjectStore:
    """Open ``url`` (a path, ``file://``, ``memory://``, ``s3://``, ``gs://`` ...): every scheme goes through
    fsspec today. ``retry_s``: how long transient errors are retried (default ``fsspec_store.RETRY_S``).
    The implementation is imported only when opened."""
    from echo2.data.store.fsspec_store import RETRY_S, FsspecStore

    return FsspecStore(url, options or {}, retry_s=RETRY_S if retry_s is None else retry_s)


__all__ = ["AlreadyExists", "NotFound", "ObjectStore", "StoreError", "is_transient", "is_unreadable_object",
           "open_store"]
