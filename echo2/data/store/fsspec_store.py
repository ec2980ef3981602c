"""``ObjectStore`` over fsspec: local files, ``memory://``, S3 (s3fs) and any other fsspec backend.

Atomic create-if-absent, per backend:
- local files: write a uniquely named temp file beside the target, then ``os.link`` it to the
  final name (``link`` fails if the name exists), then drop the temp name;
- S3: ``PutObject`` with ``If-None-Match: *`` (412 when the key exists);
- memory: check-and-set under a process-wide lock (the memory filesystem is per process);
- others: exclusive-create open (``mode="xb"``) where the backend supports it.

Retries have one owner: this module's tenacity loop (``retry_s``, the run's ``store.retry_s``). s3fs
and botocore are told not to retry (s3fs's ``retries`` and botocore's ``retries.max_attempts``), where
each otherwise retried on its own, inside every one of our attempts: a dead store then took many times
``retry_s`` to surface. What counts as transient is ``base.is_transient``.

Streamed range reads (``stream_range``): local and memory files are opened, positioned and read a piece at a
time; on S3 one ranged GetObject (s3fs's ``_call_s3``, on s3fs's event loop through fsspec's ``sync``) whose
body is read a piece at a time, so the range is never held whole: aiohttp stops reading the socket while its
small buffer is full, and the store's read timeout (botocore's ``read_timeout``) bounds each wait for bytes.
Other backends do not stream (``can_stream`` is False). Only the request and the piece being read are retried:
a transient error mid-piece drops the request and asks for the rest of the range again from that piece's
start, so a piece already yielded is never read or yielded again.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import fsspec
from fsspec.asyn import sync
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from echo2.data.store.base import AlreadyExists, NotFound, ObjectStore, ShortRead, StoreError, is_transient

_TMP_MARK = ".tmp-"
_memory_lock = threading.Lock()


RETRY_S = 120.0
"""How long a store operation keeps retrying transient errors (an outage of the store) before it raises:
long enough to ride out a restart of the store or of the network, short enough to fail a dead one."""


def _policy(retry_s: float) -> dict:
    return dict(retry=retry_if_exception(is_transient), stop=stop_after_delay(retry_s),
                wait=wait_exponential(multiplier=0.2, max=5), reraise=True)


def _retry(method):
    """Retry ``method`` on transient errors for the store's ``retry_s`` seconds."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        for attempt in Retrying(**_policy(self.retry_s)):
            with attempt:
                return method(self, *args, **kwargs)
    return wrapper

# How often a local write creates its folder when a concurrent ``delete_prefix`` tidied it away
# between ``mkdir`` and opening the temp file; each round needs a new race to fail, so a few suffice.
_FOLDER_RACE_ROUNDS = 5


def split_url(url: str) -> tuple[str, str]:
    """Return (protocol, path); a plain path becomes an absolute local path."""
    if "://" not in url:
        return "file", str(Path(url).expanduser().resolve())
    protocol, rest = url.split("://", 1)
    if protocol == "file":
        return "file", str(Path(rest or "/").expanduser().resolve())
    return protocol, rest.rstrip("/")


def _in_new_or_existing_folder(path: Path, create):
    """``create(path)`` (open a new file, link one) after creating its folder.

    A concurrent ``delete_prefix`` may remove the folder after ``mkdir`` made it and before the
    create, which then fails with ``FileNotFoundError`` (or ``mkdir`` itself with
    ``FileExistsError``, when the folder vanishes between its two checks): create it again.
    """
    for _ in range(_FOLDER_RACE_ROUNDS - 1):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return create(path)
        except (FileNotFoundError, FileExistsError):
            continue  # the folder vanished meanwhile: make it again
    path.parent.mkdir(parents=True, exist_ok=True)
    return create(path)  # a persistent cause (a file where the folder should be, no source) raises here


def _no_client_retries(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options with botocore's own retries off (unless the store's options set them): ours own them."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": 0})  # botocore: retries after the first attempt
    return {**options, "config_kwargs": config}


class FsspecStore(ObjectStore):
    def __init__(self, url: str, options: dict[str, Any], _fs: Any = None, *, retry_s: float = RETRY_S):
        self.protocol, self.root = split_url(url)
        self.options = dict(options)
        self.retry_s = retry_s
        """Seconds a transient store error is retried before an operation raises (``RETRY_S``)."""
        self.url = f"{self.protocol}://{self.root}"
        if _fs is not None:
            self.fs = _fs
        else:
            fs_options = dict(self.options)
            if self.protocol not in ("file", "memory"):
                # objects appear while we run: a cached listing would hide them (s3fs also sizes
                # reads from it), so every listing and read goes to the store
                fs_options.setdefault("use_listings_cache", False)
            if self.protocol in ("s3", "s3a"):
                fs_options = _no_client_retries(fs_options)
            try:
                self.fs = fsspec.filesystem(self.protocol, **fs_options)
            except (ImportError, ValueError) as exc:
                raise StoreError(f"cannot open store {self.url}: {exc}") from None
            if self.protocol in ("s3", "s3a"):
                # s3fs retries some errors itself, ``retries`` times per request and again per read
                # (a class attribute, not an option); one attempt each, and our loop retries
                self.fs.retries = 1

    # -- helpers ---------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        key = key.strip("/")
        if not key:
            return self.root
        if ".." in key.split("/"):
            raise ValueError(f"store key {key!r} must not contain '..'")
        return f"{self.root}/{key}"

    def _key(self, path: str) -> str:
        path = self.fs._strip_protocol(path)
        root = self.fs._strip_protocol(self.root)
        return path[len(root) :].lstrip("/")

    def child(self, prefix: str) -> "FsspecStore":
        return FsspecStore(f"{self.protocol}://{self._path(prefix)}", self.options, _fs=self.fs, retry_s=self.retry_s)

    # -- writes ----------------------------------------------------------------------------
    def put(self, key: str, data: bytes, *, if_absent: bool = True) -> None:
        """Write ``data`` under ``key``, retrying transient (network) errors.

        A create can meet the object an earlier try of its own wrote: on S3 the PutObject may have
        landed while its response was lost, and the retry then gets 412 -- a retry of ours or one a
        client library made inside a single attempt of ours, which we cannot tell apart. So every
        ``AlreadyExists`` reads the object back: holding our bytes, the create succeeded and the put
        returns; holding anything else, it raises ``AlreadyExists``. Racing creators of different
        bytes still have exactly one winner; a racing writer of the very same bytes is
        indistinguishable from our own earlier try, and both succeed: the object is the same
        either way.
        """
        path = self._path(key)
        for attempt in Retrying(**_policy(self.retry_s)):
            with attempt:
                try:
                    self._put_once(key, path, data, if_absent)
                except AlreadyExists:
                    if self._holds(key, data):
                        return
                    raise

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether ``key`` is an object with exactly ``data``: the size first (one HEAD), then a read
        bounded by our own size (the object may have been replaced by a bigger one meanwhile). An
        object we may not read is not shown to be ours."""
        try:
            return self.size(key) == len(data) and (not data or self.get_range(key, 0, len(data) + 1) == data)
        except (NotFound, PermissionError):
            return False

    def _put_once(self, key: str, path: str, data: bytes, if_absent: bool) -> None:
        if self.protocol == "file":
            self._put_local(path, data, if_absent)
        elif self.protocol == "memory":
            with _memory_lock:
                if if_absent and self.fs.exists(path):
                    raise AlreadyExists(key)
                self.fs.pipe_file(path, data)
        elif self.protocol in ("s3", "s3a"):
            try:
                self.fs.pipe_file(path, data, mode="create" if if_absent else "overwrite")
            except FileExistsError:
                raise AlreadyExists(key) from None
            except OSError as exc:  # some S3 servers omit the Condition field on 412
                if exc.errno == errno.EINVAL and "Precondition" in str(exc):
                    raise AlreadyExists(key) from None
                raise
        else:
            if if_absent:
                try:
                    with self.fs.open(path, "xb") as f:
                        f.write(data)
                except FileExistsError:
                    raise AlreadyExists(key) from None
            else:
                self.fs.pipe_file(path, data)

    def _put_local(self, path: str, data: bytes, if_absent: bool) -> None:
        final = Path(path)
        tmp = final.with_name(f"{final.name}{_TMP_MARK}{uuid.uuid4().hex}")
        # once the temp file exists its folder is not empty, so nothing tidies it away until the
        # link/replace below has put the final name in it
        with _in_new_or_existing_folder(tmp, lambda p: open(p, "wb")) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            if if_absent:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise AlreadyExists(str(final)) from None
            else:
                os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def put_pointer(self, key: str, data: bytes) -> None:
        self.put(key, data, if_absent=False)

    @_retry
    def copy(self, src: str, dst: str) -> None:
        """Server-side: a hard link on local files (no byte is read, however big), CopyObject on S3
        (UploadPartCopy above 5 GB), the backend's own copy elsewhere. S3 cannot copy an object it
        cannot read either (GLACIER: ``ObjectNotInActiveTierError``); that raises."""
        source, target = self._path(src), self._path(dst)
        try:
            if self.protocol == "file":
                self._copy_local(source, Path(target))
            elif self.protocol == "memory":
                with _memory_lock:
                    self.fs.cp_file(source, target)
            else:
                self.fs.cp_file(source, target)
        except FileNotFoundError:
            raise NotFound(src) from None

    def _copy_local(self, source: str, final: Path) -> None:
        if not os.path.isfile(source):
            raise FileNotFoundError(source)
        tmp = final.with_name(f"{final.name}{_TMP_MARK}{uuid.uuid4().hex}")
        try:  # a new name for the same bytes, then swapped in: readers see the old copy or the new one
            _in_new_or_existing_folder(tmp, lambda p: os.link(source, p))
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    @_retry
    def delete(self, key: str) -> None:
        """Remove one object. Folders stay, even emptied ones: another process may be about to
        write into one (between its ``mkdir`` and its open), and removing it would fail that write.
        """
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under ``prefix``, then (local files) the folders that left empty.

        Used to collect whole policy-version and checkpoint folders, which only the learner
        writes; a local writer that still races the tidying re-creates its folder (``_put_local``).
        """
        super().delete_prefix(prefix)
        if self.protocol != "file":
            return  # object stores have no folders to leave behind
        top = Path(self._path(prefix))
        if top == Path(self.root):
            return  # the store's own root stays
        for folder, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(folder)
            except OSError:
                pass  # not empty (a file arrived meanwhile) or already gone: leave it

    # -- reads -----------------------------------------------------------------------------
    @_retry
    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise NotFound(key) from None
        except IsADirectoryError:
            raise NotFound(key) from None

    @_retry
    def get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:  # S3 reads "bytes=o-(o-1)" as no range at all and answers with the whole object
            return b""
        try:
            return self.fs.cat_file(self._path(key), start=start, end=end)
        except FileNotFoundError:
            raise NotFound(key) from None

    @property
    def can_stream(self) -> bool:
        """Local and memory files, and S3 (module docstring)."""
        return self.protocol in _STREAMING

    def stream_range(self, key: str, start: int, sizes: list[int]) -> Iterator[bytes]:
        """``ObjectStore.stream_range``: one request for the range (another only where a transient error broke
        it: the rest of the range, from the piece it broke in); an all-empty range asks nothing, not even
        whether ``key`` exists. Pieces are read lazily, as the iterator is advanced; closing it drops the
        request."""
        if start < 0 or any(size < 0 for size in sizes):
            raise ValueError(f"stream_range({key!r}, {start}, {sizes}): negative offset or size")
        if self.protocol not in _STREAMING:
            return super().stream_range(key, start, sizes)
        opener = self._open_s3_range if self.protocol in ("s3", "s3a") else self._open_file_range
        return self._stream(key, start, list(sizes), opener)

    def _stream(self, key: str, start: int, sizes: list[int],
                opener: Callable[[str, int, int], "_Source"]) -> Iterator[bytes]:
        end = start + sum(sizes)
        source: _Source | None = None
        offset = start
        try:
            for i, size in enumerate(sizes):
                piece = b""
                for attempt in Retrying(**_policy(self.retry_s)):
                    with attempt:  # no yield in here: tenacity would take the generator's own exit for an error
                        if size and source is None:
                            source = opener(key, offset, end)
                        try:
                            piece = _read_exactly(source.read, size) if size else b""
                        except BaseException:
                            source.close()  # a broken request: the next attempt asks again from this piece
                            source = None
                            raise
                if len(piece) != size:
                    shown = sizes if len(sizes) <= 8 else f"[{sizes[0]}, ..., {sizes[-1]}] ({len(sizes)} pieces)"
                    raise ShortRead(f"{key} ended inside piece {i} of bytes [{start}, {end}) in pieces of {shown}: "
                                    f"{len(piece)} of its {size} bytes at offset {offset}")
                yield piece
                offset += size
        finally:
            if source is not None:
                source.close()

    def _open_file_range(self, key: str, offset: int, end: int) -> "_Source":
        try:
            f = self.fs.open(self._path(key), "rb")
        except (FileNotFoundError, IsADirectoryError):
            raise NotFound(key) from None
        f.seek(offset)
        return _Source(f.read, f.close)

    def _open_s3_range(self, key: str, offset: int, end: int) -> "_Source":
        fs = self.fs
        bucket, name, version_id = fs.split_path(self._path(key))
        request = {"Bucket": bucket, "Key": name, "Range": f"bytes={offset}-{end - 1}"}
        if version_id:
            request["VersionId"] = version_id
        try:
            answer = sync(fs.loop, fs._call_s3, "get_object", **request)
        except FileNotFoundError:
            raise NotFound(key) from None
        except OSError as exc:  # 416: the object ends before the range starts, so nothing is there (as at a file's end)
            if getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code") == "InvalidRange":
                return _Source(lambda n: b"", lambda: None)
            raise
        body = answer["Body"]

        def close() -> None:  # on s3fs's loop, whose connections these are; a loop already closed took them along
            if not fs.loop.is_closed():
                fs.loop.call_soon_threadsafe(body.close)

        source = _Source(lambda n: sync(fs.loop, body.read, n), close)
        # an answer from the wrong offset (a server that ignored the range) would put bytes in the wrong pieces
        got = answer.get("ContentRange")
        if (got is None and offset != 0) or (got is not None and not got.startswith(f"bytes {offset}-")):
            source.close()
            raise StoreError(f"{key}: asked for bytes [{offset}, {end}), the store answered range {got!r}")
        return source

    @_retry
    def size(self, key: str) -> int:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            raise NotFound(key) from None
        if info.get("type") != "file":
            raise NotFound(key)  # a folder or common prefix, not an object
        return int(info["size"])

    @_retry
    def modified(self, key: str) -> float:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        try:
            return self.fs.modified(path).timestamp()
        except FileNotFoundError:
            raise NotFound(key) from None

    @_retry
    def exists(self, key: str) -> bool:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        try:
            return self.fs.isfile(path)
        except FileNotFoundError:
            return False

    @_retry
    def list(self, prefix: str = "") -> list[str]:
        path = self._path(prefix)
        self.fs.invalidate_cache(path)
        try:
            found = self.fs.find(path)
        except FileNotFoundError:
            return []
        keys = [self._key(p) for p in found]
        return sorted(k for k in keys if _TMP_MARK not in k.rsplit("/", 1)[-1])

    @_retry
    def list_folders(self, prefix: str) -> list[str]:
        path = self._path(prefix).rstrip("/")
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries
                      if e.get("type") == "directory" or e.get("type") == "DIRECTORY")

    def check(self) -> None:
        """Raise ``StoreError`` when the store cannot be listed (unreachable, no bucket, no permission).

        Probes with short timeouts and no retries, so a wrong endpoint fails in seconds.
        """
        try:
            if self.protocol == "file":
                Path(self.root).mkdir(parents=True, exist_ok=True)
                if not os.access(self.root, os.W_OK):
                    raise PermissionError(f"{self.root} is not writable")
                return
            fs = self.fs
            if self.protocol in ("s3", "s3a"):
                config = {"connect_timeout": 3, "read_timeout": 5, "retries": {"max_attempts": 1},
                          **self.options.get("config_kwargs", {})}
                fs = fsspec.filesystem(self.protocol, **{**self.options, "config_kwargs": config},
                                       skip_instance_cache=True)
                from echo2.data.store.s3_access import check_bucket

                check_bucket(fs, self.url, self.root.split("/", 1)[0])
            fs.invalidate_cache(self.root)
            fs.exists(self._path("__echo2_probe__"))
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"store {self.url} is unreachable: {type(exc).__name__}: {exc}") from None


_STREAMING = frozenset({"file", "memory", "s3", "s3a"})
"""Backends whose ``stream_range`` streams (module docstring)."""


class _Source:
    """An open range: ``read(n)`` returns at most ``n`` bytes (``b""`` at its end); ``close()`` drops it, from any
    thread (a generator closed by the garbage collector runs its ``finally`` wherever that happens)."""

    def __init__(self, read: Callable[[int], bytes], close: Callable[[], Any]):
        self.read, self.close = read, close


def _read_exactly(read: Callable[[int], bytes], size: int) -> bytes:
    """``size`` bytes from ``read``, fewer only where it ends first (a socket or a body hands out what it has)."""
    parts, got = [], 0
    while got < size:
        part = read(size - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)
