"""The ``ObjectStore`` interface: the only channel between the planes (the implementations and
``open_store``, which picks one, are the package's: ``echo2/data/store/__init__.py``).

Keys are ``/``-separated paths relative to the store's root (a run root, usually). Every object
is written once and becomes visible atomically: ``put(..., if_absent=True)`` either creates the
whole object or raises ``AlreadyExists``; readers never see a partial object (a replaced one
shows its old or its new value whole). Three kinds of object are replaced in place, each through
``put_pointer`` and each by its one writer:

- ``policy/LATEST``, the newest published version (the learner);
- ``ledger/consumed/collecting.json``, the collection in progress while the learner waits for
  rollouts (the collector); it is not a ledger entry, and the step's entry that follows records
  the same files written once;
- ``peers/<actor>.json``, an actor's relay record, refreshed by its heartbeat (that actor).

Everything else a run commits is written once. The exceptions are outputs derived from committed
objects, which their one writer may write again with ``if_absent=False`` when it redoes the work:
the files of a weights or checkpoint folder whose manifest (written once, last) is not there yet,
the report under ``report/``, and the copies and reason records under ``quarantine/`` and
``orphaned/``.
"""

from __future__ import annotations

import errno
import json
from abc import ABC, abstractmethod
from typing import Any, Iterator


class StoreError(Exception):
    """An object store operation failed."""


class AlreadyExists(StoreError):
    """A create-if-absent write found the key already there."""


class NotFound(StoreError, KeyError):
    """The key does not exist."""


class ShortRead(StoreError):
    """An object ended before the byte range read from it (``stream_range``)."""


TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO), errno.ECONNRESET,
                              errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE, errno.EAGAIN})
"""OSError numbers that mean "not now" rather than an answer: s3fs maps S3's 503 SlowDown /
ServiceUnavailable to EBUSY and its 500 InternalError to EREMOTEIO (s3fs/errors.py)."""

_TRANSIENT_TYPES = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "HTTPClientError", "ResponseParserError", "IncompleteRead", "ResponseStreamingError",  # botocore / http.client
    "IncompleteReadError",  # botocore: a body that ended before its Content-Length (the connection dropped)
    "ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",  # aiohttp
})
"""Exception classes (or their bases, by name: no client library is imported for them) of a request
that got no usable answer: what s3fs and botocore retried themselves before echo2 made them stop."""

_TRANSIENT_HTTP = frozenset({408, 409, 429})
"""4xx answers that still mean "try again": request timeout, a conflicting operation in progress, throttling."""
_TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "XAmzContentSHA256Mismatch"})
"""S3 error codes that mean "try again" whatever their status (a body corrupted in transit is one)."""


def _http_answer(exc: BaseException) -> tuple[int, str] | None:
    """(HTTP status, error code) when ``exc`` is (or was translated from) an error answer of the store."""
    for err in (exc, exc.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status, str(response.get("Error", {}).get("Code", ""))
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether a store error means "the store is not answering now" (retry, and never blame an object)
    rather than an answer about this request (missing, exists, denied, not valid for the object's
    storage class): network failures, timeouts, throttling and 5xx answers are transient; any other
    4xx answer is not, even where s3fs files an unknown error code under ``EIO``."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, StoreError)):
        return False
    answer = _http_answer(exc)
    if answer is not None:
        status, code = answer
        return status >= 500 or status in _TRANSIENT_HTTP or code in _TRANSIENT_CODES
    if isinstance(exc, (ConnectionError, TimeoutError)) or any(
            c.__name__ in _TRANSIENT_TYPES for c in type(exc).__mro__):
        return True
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


_CREDENTIAL_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                               "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AccountProblem"})
"""S3 error codes that refuse the credentials, not the object: the learner's own objects would be refused too."""


def is_unreadable_object(exc: BaseException) -> bool:
    """Whether a store error says that this object cannot be read or copied by anyone holding the run's
    credentials: an S3 answer about the object itself (its storage class: ``InvalidObjectState`` on GET,
    ``ObjectNotInActiveTierError`` on CopyObject; a customer key it was encrypted with: ``InvalidRequest``).
    Not a transient error, not a missing object, and not a refusal of the credentials (``AccessDenied``:
    a learner whose role lost a permission must stop and say so, never take its own objects for junk);
    a local file store's PermissionError is about the process's rights, so it is not one either."""
    if is_transient(exc) or isinstance(exc, (NotFound, FileNotFoundError)):
        return False
    answer = _http_answer(exc)
    if answer is None:
        return False
    status, code = answer
    return 400 <= status < 500 and status != 404 and code not in _CREDENTIAL_CODES


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

    @property
    def can_stream(self) -> bool:
        """Whether ``stream_range`` reads a range here as one streamed request; where not, it raises
        ``NotImplementedError`` and a caller reads the pieces with ``get_range``."""
        return False

    def stream_range(self, key: str, start: int, sizes: list[int]) -> Iterator[bytes]:
        """Bytes [start, start + sum(sizes)) of an object as consecutive pieces of ``sizes``, in order, each
        yielded as soon as it is read, from one request (one ranged GET on S3) whose body is read a piece at a
        time, never the whole range at once. ``NotFound`` if absent; ``ShortRead`` (naming the key and the
        sizes) where the object ends first, after the pieces it holds whole: never a short piece."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream a byte range")

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

    def copy(self, src: str, dst: str) -> None:
        """Make ``dst`` a copy of ``src`` (replacing ``dst``) without the bytes passing through this
        process: a store copies server-side. Only for destinations no one else writes (``quarantine/``,
        ``orphaned/``): the copy is not create-if-absent. ``NotFound`` if ``src`` is absent."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy objects server-side")

    def move(self, src: str, dst: str) -> None:
        """Copy then delete: used to set a rejected file aside without losing it (and without reading
        it: an object an actor wrote may be any size, or unreadable). A move interrupted between the
        two is simply done again: the copy replaces the earlier one."""
        self.copy(src, dst)
        self.delete(src)
