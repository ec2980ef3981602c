"""Sharded checkpoint files: ``torch.distributed.checkpoint`` (DCP) over echo2's object store, verified on read.

Write (every rank, inside ``dcp.save``): ``StoreWriter`` is DCP's ``FileSystemWriter`` over a file system whose
files are store objects. Each rank writes only what its state dict holds (under FSDP2 its DTensor shards of the
weights and of the AdamW moments; DCP plans the shards, and an item every rank holds, such as AdamW's step
count, is written once), in files of at most ``file_mb`` (model and optimizer items in separate files, so that
reading the weights alone reads no optimizer byte). A file is built in memory, then put with the store's
retries (``ObjectStore.put``): the extra memory of a save is one file, never the rank's whole shard. DCP's
coordinator (rank 0) writes ``.metadata`` in its finish step, after every rank's write results reached it; each
rank returns the name, size and sha256 of every file it wrote, for the signed manifest rank 0 writes last
(``checkpoint.py``).

Names: DCP names its files ``__R_I.distcp`` and ``.metadata``; a manifest names only files that begin with a
letter or a digit (``manifest.FILE_NAME``), so each DCP name is stored as ``dcp-`` + the name without its
leading ``_`` and ``.`` (``store_name``).

Read (every rank, inside ``dcp.load``): ``VerifiedReader`` is DCP's ``FileSystemReader`` over a local temporary
folder. Before DCP starts, ``.metadata`` is downloaded and checked against the manifest, and then unpickled by an
unpickler that builds DCP's metadata classes and nothing else (exact names: ``_MetadataUnpickler``). In
``prepare_local_plan``, which DCP runs on every rank before any rank reads a byte (a failure on one rank fails the
load on all of them), each file this rank's plan reads is downloaded into the folder in ranged reads, hashed on the
way, and refused (``CorruptWeights``) if the manifest does not name it or its size or sha256 differs. Only then does
``read_data`` read the verified copies, so a refused checkpoint has changed no weight. A rank reads what its own
shards need: on another rank count DCP reshards, and a rank may read parts of several files. The cost: the files a
rank's plan touches are on its local disk during the load (on more ranks than wrote the checkpoint, each rank may
touch most of them), and DCP holds one stored piece of a tensor at a time in memory (a whole tensor, where one
process wrote the checkpoint).
Non-tensor values (the optimizer's hyper-parameters) are read with ``torch.load(weights_only=True)``, not
DCP's default ``weights_only=False``: a file of the run's own signed checkpoint still never runs code.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import queue
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
    _item_size,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from echo2.data.manifest import ManifestRejected
from echo2.data.store import NotFound, ObjectStore, is_unreadable_object
from echo2.data.weights import CorruptWeights

METADATA = ".metadata"
"""DCP's own name of its metadata file (stored as ``store_name(METADATA)``)."""
READ_CHUNK = 8 * 2**20
"""Bytes per ranged read when a file is downloaded and hashed."""


def store_name(dcp_name: str) -> str:
    """The store's (and the manifest's) name of a DCP file: ``__0_1.distcp`` -> ``dcp-0_1.distcp``."""
    return "dcp-" + dcp_name.lstrip("_.")


# -- write ------------------------------------------------------------------------------------------
class _Buffer(io.BytesIO):
    """A file being written, whose bytes outlive its closing."""

    data = b""

    def close(self) -> None:
        if not self.closed:
            self.data = self.getvalue()
        super().close()


class _StoreFiles(FileSystemBase):
    """DCP's file-system interface over store keys: a written file is buffered and put when closed."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self.written: dict[str, dict] = {}
        """Manifest entries of the files this rank wrote, by name."""
        self._pending: dict[str, bytes] = {}  # DCP writes .metadata.tmp, then renames it

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            raise ValueError(f"{path}: a checkpoint being written is not read back ({mode})")
        buf = _Buffer()
        yield buf
        buf.close()  # (DCP closes a data file itself)
        if str(path).endswith(".tmp"):
            self._pending[str(path)] = buf.data
        else:
            self._put(str(path), buf.data)

    def _put(self, key: str, data: bytes) -> None:
        # overwrite: the folder is nobody's until its manifest exists (checkpoint.py cleared it first)
        self.store.put(key, data, if_absent=False)
        name = key.rsplit("/", 1)[-1]
        kind = "aux" if name == store_name(METADATA) else "shard"
        self.written[name] = {"name": name, "kind": kind, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def concat_path(self, path, suffix: str) -> str:
        return f"{path}/{store_name(suffix)}"

    def init_path(self, path) -> str:
        return str(path)

    def rename(self, path, new_path) -> None:
        self._put(str(new_path), self._pending.pop(str(path)))

    def mkdir(self, path) -> None:
        """Object stores have no folders."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def exists(self, path) -> bool:
        return self.store.exists(str(path))

    def rm_file(self, path) -> None:
        self.store.delete(str(path))


class StoreWriter(FileSystemWriter):
    """DCP's file-system writer into ``store`` under ``prefix``, files of at most ``file_mb``."""

    def __init__(self, store: ObjectStore, prefix: str, *, file_mb: int):
        super().__init__(prefix, sync_files=False, overwrite=True)
        self.fs = _StoreFiles(store)
        self.path = prefix
        self.file_bytes = file_mb * 2**20

    def write_data(self, plan, planner):
        files: queue.Queue = queue.Queue()
        for index, items in enumerate(_buckets(plan.items, self.file_bytes)):
            name = f"{plan.storage_data.prefix}{index}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)

    @property
    def written(self) -> list[dict]:
        return list(self.fs.written.values())


def _buckets(items: list, limit: int) -> list[list]:
    """Write items grouped by top-level key (``model``, ``optim``), then cut into files of at most ``limit``
    bytes (a larger tensor shard gets a file of its own)."""
    out: list[list] = []
    for top in sorted({i.index.fqn.split(".", 1)[0] for i in items}):
        size = 0
        current: list = []
        for item in sorted((i for i in items if i.index.fqn.split(".", 1)[0] == top), key=lambda i: i.index.fqn):
            n = 0 if item.type == WriteItemType.BYTE_IO else _item_size(item)
            if current and size + n > limit:
                out.append(current)
                current, size = [], 0
            current.append(item)
            size += n
        out.append(current)
    return out


@contextmanager
def _one_process_is_meant():
    """DCP warns on every call without a process group that it assumes one process: here that is the intent (a
    learner on one process), and the warning would be printed into the run's output at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_sharded(store: ObjectStore, prefix: str, state_dict: dict, *, file_mb: int) -> list[dict]:
    """``dcp.save`` of ``state_dict`` (this rank's shards) under ``prefix``: every rank of the group calls it
    (or one process without a group). Returns the manifest entries of the files this rank wrote."""
    writer = StoreWriter(store, prefix, file_mb=file_mb)
    try:
        with _one_process_is_meant():
            dcp.save(state_dict, storage_writer=writer, no_dist=not _in_group(), process_group=_control())
    except CheckpointException as exc:
        raise _raised_inside(exc) from exc
    return writer.written


def _control():
    """DCP's planning runs over the learner's gloo control group (``process_group.py``), never NCCL: a rank may
    spend minutes writing its files to the store while another waits for the plan's next exchange."""
    if not _in_group():
        return None
    from echo2.learner.process_group import control_group

    return control_group()


def _in_group() -> bool:
    """Whether this process is a rank of a process group (else DCP runs alone: ``no_dist``)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# -- read -------------------------------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: each global it may name is an exact (module, name) pair of DCP's own
    metadata classes, ``torch.Size``, a torch dtype or layout, never a module prefix and never a dotted name (pickle
    protocol 4 resolves ``a.b`` as attribute after attribute, so any module's ``os`` would lead to ``os.system``)."""

    ALLOWED = frozenset({
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    })

    def find_class(self, module: str, name: str):
        if "." not in name and ((module, name) in self.ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a checkpoint's {METADATA} may not name {module}.{name}"[:300])

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"a checkpoint's {METADATA} holds a persistent id")


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values are read with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


class _SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


def _load_bytes(planner: DefaultLoadPlanner, read_item, value: io.BytesIO) -> None:
    from torch.distributed.checkpoint._nested_dict import set_element

    obj = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class VerifiedReader(FileSystemReader):
    """DCP's file-system reader over ``local``, where each file is downloaded from ``prefix`` and checked
    against ``entries`` (the signed manifest's, by name) before DCP reads it."""

    def __init__(self, store: ObjectStore, prefix: str, entries: dict[str, dict], local: Path):
        super().__init__(local)
        self.store, self.prefix, self.entries, self.local = store, prefix, entries, local
        with open(self.fetch(METADATA), "rb") as f:  # here, not inside DCP: its failure is this one line
            self.metadata = _MetadataUnpickler(f).load()
        if not isinstance(self.metadata, Metadata):
            raise CorruptWeights(f"{self.prefix}/{store_name(METADATA)} is not DCP metadata")

    def fetch(self, dcp_name: str) -> Path:
        """Download DCP file ``dcp_name`` into the local folder, refused unless it matches its manifest entry."""
        dest = self.local / dcp_name
        if dest.exists():
            return dest
        name = store_name(dcp_name)
        entry = self.entries.get(name)
        where = f"{self.prefix}/{name}"
        if entry is None:
            raise CorruptWeights(f"{where} is read by the checkpoint but not named in its manifest")
        try:
            size = self.store.size(where)
            if size != entry["size"]:
                raise CorruptWeights(f"{where} does not match its manifest (size {size}, expected {entry['size']})")
            digest = hashlib.sha256()
            partial = dest.with_name(dest.name + ".part")
            with open(partial, "wb") as out:
                for offset in range(0, size, READ_CHUNK):
                    data = self.store.get_range(where, offset, min(offset + READ_CHUNK, size))
                    digest.update(data)
                    out.write(data)
        except Exception as exc:
            if not is_unreadable_object(exc):
                raise
            raise CorruptWeights(f"the store will not return {where} ({exc})") from None
        if digest.hexdigest() != entry["sha256"]:
            partial.unlink()
            raise CorruptWeights(f"{where} does not match its manifest (sha256 differs)")
        partial.rename(dest)
        return dest

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never falls back to per-rank metadata
        metadata = self.metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_local_plan(self, plan):
        for relative in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self.fetch(relative)
        return plan


UNLOADABLE = (ManifestRejected, CorruptWeights, NotFound)


def _raised_inside(exc: CheckpointException) -> BaseException:
    """What a rank raised inside DCP. DCP wraps every failure in ``CheckpointException``, a BaseException, even
    a signal's: unwrapped, a SIGTERM (Prefect's TerminationSignal) or Ctrl-C landing in a checkpoint stays an
    interruption (the flow then checkpoints and stops), and a store error stays the error its callers handle.
    A signal's exception first, also where a clean-up raised over it (``torch.save`` interrupted inside its zip
    writer raises "unexpected pos" from the writer's ``__exit__``, the signal only its context), else the
    lowest rank's error."""
    errors = [error for _, (error, _) in sorted(exc.failures.items())]
    return next((s for e in errors if (s := _signal_in(e)) is not None), errors[0] if errors else exc)


def _signal_in(error: BaseException) -> BaseException | None:
    """The first exception that is not an ``Exception`` (a signal's) in ``error`` and its causes and contexts."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if not isinstance(error, Exception):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _unwrap(exc: CheckpointException) -> BaseException:
    """The first refusal (``UNLOADABLE``) any rank raised inside DCP, as one line; else what was raised
    (``_raised_inside``)."""
    for rank, (error, _) in sorted(exc.failures.items()):
        if isinstance(error, UNLOADABLE):
            return type(error)(f"{error} (rank {rank})") if not isinstance(error, NotFound) else CorruptWeights(
                f"{error} is gone (rank {rank})")
    return _raised_inside(exc)


def load_sharded(store: ObjectStore, prefix: str, entries: dict[str, dict], state_dict: dict) -> None:
    """``dcp.load`` into ``state_dict`` (this rank's shards, in place) from the files of ``prefix``, each
    checked against ``entries`` first; every rank of the group calls it. A missing or altered file on any
    rank raises ``CorruptWeights`` (or ``ManifestRejected``) on every rank, before any tensor is written."""
    with tempfile.TemporaryDirectory(prefix="echo2-ckpt-") as tmp:
        try:
            reader = VerifiedReader(store, prefix, entries, Path(tmp))
            with _one_process_is_meant():
                dcp.load(state_dict, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=not _in_group(),
                         process_group=_control())
        except CheckpointException as exc:
            raise _unwrap(exc) from None
        except pickle.UnpicklingError as exc:
            raise CorruptWeights(f"{prefix}/{store_name(METADATA)}: {exc}") from None


def load_full(store: ObjectStore, prefix: str, entries: dict[str, dict], keys: set[str]) -> dict[str, Any]:
    """The whole of the top-level ``keys`` (``{"model"}``) in this process, with no process group: every
    rank's shards put together (export, eval). Only the files holding those keys are read, each verified."""
    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="echo2-ckpt-") as tmp:
        try:
            reader = VerifiedReader(store, prefix, entries, Path(tmp))
            # (dcp.load copies an empty dict before filling it: the function under it fills this one)
            _load_state_dict(state, storage_reader=reader, planner=_SafeEmptyPlanner(keys=keys), no_dist=True)
        except CheckpointException as exc:
            raise _unwrap(exc) from None
        except pickle.UnpicklingError as exc:
            raise CorruptWeights(f"{prefix}/{store_name(METADATA)}: {exc}") from None
    return state


def local_sizes(state_dict: dict) -> dict[str, tuple[int, ...]]:
    """Shape of what this rank holds of each tensor (a DTensor's local shard), by flattened key: what a test
    checks to see that no rank holds a full optimizer state."""
    out = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            out[prefix] = tuple(local.shape)

    walk("", state_dict)
    return out
