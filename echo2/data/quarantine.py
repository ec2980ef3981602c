"""Setting a rejected rollout file aside without reading it.

``quarantine/<key>.json`` holds the reason, written first (a quarantined file always has one), and
``quarantine/<key>`` the file itself: copied there server-side, then deleted from ``rollouts/``. No byte
of the file passes through the learner, so its size does not matter. Where the store cannot copy it
either (S3 copies no GLACIER object: ``ObjectNotInActiveTierError``), the file is quarantined *by
reference*: it stays where it is, and its reason record says so (``by_reference``, its size, the
copy's error). Either way the ledger's ``quarantined`` section settles the key, so no step reads it
and no actor counts it as pending again (``learner/collector.py`` records it; a learner killed first
finds the reason record at its next start).
"""

from __future__ import annotations

import logging
import time

from echo2.data import layout
from echo2.data.store import NotFound, ObjectStore, is_transient

log = logging.getLogger("echo2.data")


def quarantine(store: ObjectStore, key: str, reason: str) -> None:
    """Move ``key`` to ``quarantine/<key>`` beside its reason, or quarantine it by reference where the
    store cannot copy it. ``NotFound`` if the file is gone; a transient store error propagates."""
    store.put_json(layout.quarantine_reason_key(key), _record(key, reason), if_absent=False)
    try:
        store.copy(key, layout.quarantine_key(key))
    except NotFound:
        raise
    except Exception as exc:
        if is_transient(exc):
            raise
        by_reference(store, key, reason, exc)
        return
    store.delete(key)


def by_reference(store: ObjectStore, key: str, reason: str, error: BaseException) -> None:
    """Record ``key`` as quarantined where it lies: the store could not copy it (``error``)."""
    log.warning("quarantined %s by reference (it stays where it is): the store cannot copy it: %s", key, error)
    store.put_json(layout.quarantine_reason_key(key),
                   {**_record(key, reason), "by_reference": True, "size": _size_or_none(store, key),
                    "copy_error": f"{type(error).__name__}: {str(error)[:300]}"}, if_absent=False)


def _record(key: str, reason: str) -> dict:
    return {"key": key, "reason": reason, "at": time.time()}


def _size_or_none(store: ObjectStore, key: str) -> int | None:
    """The object's size for its record; None where the store will not say (a HEAD can fail too)."""
    try:
        return store.size(key)
    except Exception as exc:
        if is_transient(exc):
            raise
        return None
