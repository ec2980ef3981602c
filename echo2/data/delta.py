"""Sparse delta versions: version v as the elements of the previous version whose bits changed.

The published copy of the policy is bf16 (the learner keeps fp32 master weights). An AdamW step
at RL learning rates moves most weights by less than half a bf16 ulp, so most bf16 elements keep
their bits from one version to the next. A delta lists, per tensor, the flat positions whose bits
changed and how, exactly: applying it to the previous version gives the new one bit for bit.

Encoding, per tensor (elements viewed as unsigned integers of their width, little-endian):

    positions  "gaps" (sparse): the gaps between successive changed positions (the first counted
               from -1), one byte each, 255 = escape to the next uint32 (uint64 for tensors of
               2**32 elements or more) of a side stream;
               "bitmap" (dense, more than BITMAP_ABOVE of the tensor changed): one bit per element
    values     the change itself, (new - old) mod 2**bits, zigzag-mapped to a byte (a move of
               +-1..127 ulps), 255 = escape to the raw wrapping difference in a side stream

Each stream is one zstd frame (level ZSTD_LEVEL, content size in the header). Why this one,
measured on consecutive bf16 versions of a real quickstart run (SmolLM2-135M, lr 1e-5, AdamW,
steps 1 and 2 of ``echo2 run configs/quickstart.yaml --set publish.dtype=bfloat16``;
6.2% and 2.3% of the elements changed; sizes in % of the full bf16 version):

    positions: gaps, byte + escape       2.04 / 0.96      values: zigzag byte + escape   0.95 / 0.53
               gaps, LEB128 varint       2.06 / 0.96              raw wrapping diff u16  1.14 / 0.66
               gaps, uint32 byte planes  2.10 / 0.98              diff as byte planes    1.53 / 0.75
               bitmap                    2.52 / 1.35              XOR as byte planes     1.40 / 0.70
               (dense: whole diff array, no index: 4.90 / -)      new values, planes     4.21 / 1.61

Changed positions carry about H(p)/p bits each (5.4 bits at p = 6.2%), and gaps + zstd reach
it; a varint is no smaller than byte + escape, which decodes without a loop over byte positions.
The changes themselves are mostly +-1 ulp (91% at step 1), which is why the difference beats the
new value by 4x. On synthetic masks (random positions, +-1/2/3 ulp changes) gaps beat a bitmap
below ~15% changed and lose above it (0.045 vs 0.049 of full at 10%, 0.081 vs 0.076 at 20%); a
whole diff array without an index never won, so there is no third encoding. zstd levels 1, 3
and 9 gave the same total within 1% (2.98, 2.98, 2.99% at step 1; level 9 shrinks the changes
and grows the gaps) at about 3x the time for level 9: level 1.

Delta shards (``shard-NNNN.safetensors``, kind ``delta`` in the manifest, each at most
``shard_mb``): safetensors files whose tensors are the compressed streams as flat uint8 arrays,
``<tensor>::positions``, ``<tensor>::positions_escaped``, ``<tensor>::changes``,
``<tensor>::changes_escaped`` (an empty stream is an empty array), for every tensor that changed.
Which encoding each tensor uses and how many of its elements changed are in the signed tensor
table of the manifest, beside its dtype, shape and sha256. A standard container parsed by
safetensors' own checked parser, so the layout's "shards of weights or a sparse delta" holds.

Trust: a delta file reaches the decoder only after its chunks matched the signed manifest, and
the manifest's tensor table (``tensor_table``: dtype, shape, sha256 and changed count of every
tensor of the version) is signed too. The decoder still treats the bytes as hostile: every size
it allocates is derived from the table and the base (never from a frame header it has not
checked), positions must be in range and strictly increasing, counts must match the table, and
any violation is a ``DeltaRejected`` that leaves the base as it was. ``apply_delta`` decodes
everything first, then applies, then checks the sha256 of every tensor against the table, and
undoes the change on a mismatch (a missed delta, a corrupted base), so a caller never holds
weights that differ from the learner's.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import zstandard
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

ZSTD_LEVEL = 1
BITMAP_ABOVE = 0.15
"""Changed share of a tensor above which its positions are a bitmap instead of gaps."""
ESCAPE = 255
SECTIONS = ("positions", "positions_escaped", "changes", "changes_escaped")
_HASH_THREADS = 2

_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class DeltaRejected(Exception):
    """A delta that does not apply: malformed, not for this base, or a reconstruction whose hash
    differs from the signed table. The base is left unchanged."""


class NeedsKeyframe(Exception):
    """The new version cannot be a delta of the base (a tensor appeared, vanished or changed shape/dtype)."""


# -- tensor tables and hashes ---------------------------------------------------------------

def _bits(t: torch.Tensor) -> np.ndarray:
    """The elements of contiguous ``t`` as a flat numpy array of unsigned ints (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy().view(_UINT[t.element_size()])


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())).hexdigest()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_table(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """dtype, shape and sha256 of every tensor (the hashes computed in parallel: hashlib drops the GIL)."""
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        digests = dict(zip(tensors, pool.map(tensor_sha256, tensors.values())))
    return {name: {"dtype": dtype_name(t), "shape": list(t.shape), "sha256": digests[name]}
            for name, t in tensors.items()}


def mismatches(tensors: dict[str, torch.Tensor], table: dict[str, dict]) -> list[str]:
    """Names of tensors that differ from ``table`` (missing, extra, other dtype/shape/hash); [] when all match."""
    bad = sorted(set(tensors) ^ set(table))
    same_kind = [n for n in table if n in tensors and _fits(tensors[n], table[n])]
    bad += sorted(n for n in table if n in tensors and n not in same_kind)
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        digests = dict(zip(same_kind, pool.map(lambda n: tensor_sha256(tensors[n]), same_kind)))
    return bad + [n for n in same_kind if digests[n] != table[n].get("sha256")]


def _fits(t: torch.Tensor, entry: object) -> bool:
    return isinstance(entry, dict) and dtype_name(t) == entry.get("dtype") and list(t.shape) == entry.get("shape")


# -- encoding -------------------------------------------------------------------------------

@dataclass
class Delta:
    files: list[bytes]
    table: dict[str, dict]
    """Tensor table of the new version, with the changed count of every tensor."""
    changed: int = 0
    elements: int = 0
    encodings: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.files)

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def _escaped(values: np.ndarray, side: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    small = values < ESCAPE
    return np.where(small, values, ESCAPE).astype(np.uint8), values[~small].astype(side)


def _zigzag(diff: np.ndarray) -> np.ndarray:
    """Wrapping differences (unsigned) -> zigzag codes of the same width: 0, -1, +1, -2, ... -> 0, 1, 2, 3, ..."""
    signed = diff.view(diff.dtype.str.replace("u", "i"))
    return ((signed << 1) ^ (signed >> (diff.dtype.itemsize * 8 - 1))).view(diff.dtype)


def _unzigzag(codes: np.ndarray) -> np.ndarray:
    return (codes >> 1) ^ (np.zeros_like(codes) - (codes & 1))


def _side_dtype(numel: int) -> np.dtype:
    """Escaped gaps: a gap is at most ``numel`` (a first change at the last position)."""
    return np.dtype("<u4") if numel < 2**32 else np.dtype("<u8")


def _changed_positions(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Flat positions where the bits differ. numpy, single-threaded: on a busy machine torch's
    ``ne`` + ``nonzero`` with 2 threads took 6-8 s for SmolLM2's 134M elements, numpy 0.3 s."""
    return np.flatnonzero(a != b)


def _encode_tensor(base: torch.Tensor, new: torch.Tensor, compressor) -> tuple[str, int, list[bytes]] | None:
    a, b = _bits(new), _bits(base)
    idx = _changed_positions(a, b)
    count = len(idx)
    if count == 0:
        return None
    if count / a.size > BITMAP_ABOVE:
        encoding = "bitmap"
        mask = np.zeros(a.size, dtype=bool)
        mask[idx] = True
        pos_main, pos_side = np.packbits(mask, bitorder="little"), np.empty(0, np.uint8)
    else:
        encoding = "gaps"
        gaps = np.diff(idx, prepend=-1).astype(np.uint64)
        pos_main, pos_side = _escaped(gaps, _side_dtype(a.size))
    diff = a[idx] - b[idx]  # wraps in the unsigned width: exactly invertible
    val_main, val_side = _escaped(_zigzag(diff), diff.dtype)
    return encoding, count, [compressor.compress(s.tobytes()) if s.size else b""
                             for s in (pos_main, pos_side, val_main, val_side)]


def encode_delta(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], *, max_file_bytes: int) -> Delta:
    """The delta that turns ``base`` into ``new`` (both left untouched); NeedsKeyframe if it cannot be one."""
    if set(base) != set(new):
        raise NeedsKeyframe(f"tensor names differ: {sorted(set(base) ^ set(new))[:3]}")
    for name, t in new.items():
        if t.dtype != base[name].dtype or t.shape != base[name].shape:
            raise NeedsKeyframe(f"{name} changed dtype or shape")
        if t.element_size() not in _UINT:
            raise NeedsKeyframe(f"{name}: {dtype_name(t)} elements of {t.element_size()} bytes have no delta encoding")
    new = {k: v.contiguous() for k, v in new.items()}
    table = tensor_table(new)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    delta = Delta(files=[], table=table)
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in new.items():
        encoded = _encode_tensor(base[name].contiguous(), t, compressor)
        delta.elements += t.numel()
        table[name]["changed"] = 0
        if encoded is None:
            continue
        encoding, count, sections = encoded
        table[name].update(changed=count, encoding=encoding)
        delta.changed += count
        delta.encodings[encoding] = delta.encodings.get(encoding, 0) + 1
        n = sum(len(x) for x in sections)
        if shard and size + n > max_file_bytes:
            delta.files.append(st_save(shard))
            shard, size = {}, 0
        for section, data in zip(SECTIONS, sections):
            shard[f"{name}::{section}"] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                torch.empty(0, dtype=torch.uint8)
        size += n
    if shard or not delta.files:
        delta.files.append(st_save(shard))
    return delta


# -- decoding -------------------------------------------------------------------------------

_DECOMPRESSOR = zstandard.ZstdDecompressor()


def _inflate(data: bytes, size: int, what: str) -> bytes:
    """One zstd frame of exactly ``size`` bytes: the size comes from the table, never from the frame."""
    if size == 0:
        if data:
            raise DeltaRejected(f"{what}: {len(data)} bytes where an empty stream belongs")
        return b""
    try:
        declared = zstandard.frame_content_size(data)
        if declared != size:
            raise DeltaRejected(f"{what}: frame declares {declared} bytes, expected {size}")
        out = _DECOMPRESSOR.decompress(data)
    except zstandard.ZstdError as exc:
        raise DeltaRejected(f"{what}: not a zstd frame: {exc}") from None
    if len(out) != size:
        raise DeltaRejected(f"{what}: inflates to {len(out)} bytes, expected {size}")
    return out


def _unescaped(main: np.ndarray, side: bytes, side_dtype: np.dtype, what: str) -> np.ndarray:
    out = main.astype(side_dtype)
    escaped = main == ESCAPE
    values = np.frombuffer(side, side_dtype)
    if len(values) != int(escaped.sum()):
        raise DeltaRejected(f"{what}: {len(values)} escaped values for {int(escaped.sum())} escapes")
    out[escaped] = values
    return out


@dataclass
class _Change:
    name: str
    positions: np.ndarray
    diff: np.ndarray


def _decode_tensor(name: str, sections: list[bytes], base: torch.Tensor, entry: dict) -> _Change:
    numel, width = base.numel(), base.element_size()
    count = entry["changed"]
    if not 0 < count <= numel:
        raise DeltaRejected(f"{name}: {count} changes listed for a tensor of {numel} elements")
    uint = _UINT[width]
    if entry.get("encoding") == "bitmap":
        bitmap = np.frombuffer(_inflate(sections[0], -(-numel // 8), f"{name} bitmap"), np.uint8)
        _inflate(sections[1], 0, f"{name} bitmap side")
        mask = np.unpackbits(bitmap, bitorder="little")
        if mask[numel:].any():
            raise DeltaRejected(f"{name}: bitmap sets bits past the end of the tensor")
        positions = np.flatnonzero(mask[:numel])
        if len(positions) != count:
            raise DeltaRejected(f"{name}: bitmap marks {len(positions)} changes, expected {count}")
    elif entry.get("encoding") == "gaps":
        main = np.frombuffer(_inflate(sections[0], count, f"{name} gaps"), np.uint8)
        side_dtype = _side_dtype(numel)
        escapes = int((main == ESCAPE).sum())
        side = _inflate(sections[1], escapes * side_dtype.itemsize, f"{name} escaped gaps")
        gaps = _unescaped(main, side, side_dtype, f"{name} gaps").astype(np.uint64)
        if not ((gaps >= 1) & (gaps <= numel)).all():
            raise DeltaRejected(f"{name}: a gap between changed positions is out of range")
        positions = np.cumsum(gaps) - np.uint64(1)
        if positions[-1] >= numel or (count > 1 and not (np.diff(positions).astype(np.int64) > 0).all()):
            raise DeltaRejected(f"{name}: changed positions run past the tensor ({numel} elements)")
        positions = positions.astype(np.int64)
    else:
        raise DeltaRejected(f"{name}: unknown encoding {entry.get('encoding')!r:.40}")
    codes_main = np.frombuffer(_inflate(sections[2], count, f"{name} values"), np.uint8)
    escapes = int((codes_main == ESCAPE).sum())
    side = _inflate(sections[3], escapes * width, f"{name} escaped values")
    diff = _unzigzag(_unescaped(codes_main, side, uint, f"{name} values"))
    if not diff.all():
        raise DeltaRejected(f"{name}: a position listed as changed does not change")
    return _Change(name, positions, diff)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _streams(files: list[bytes], table: dict[str, dict]) -> dict[str, list[bytes]]:
    """The four streams of every changed tensor, from the delta shards (parsed by safetensors)."""
    found: dict[str, bytes] = {}
    for i, blob in enumerate(files):
        try:
            tensors = st_load(blob)
        except (SafetensorError, ValueError, RuntimeError, OverflowError) as exc:
            raise DeltaRejected(f"delta shard {i} is not a safetensors file: {str(exc):.200}") from None
        for key, t in tensors.items():
            if key in found:
                raise DeltaRejected(f"delta shard {i}: {key!r:.100} is listed twice")
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise DeltaRejected(f"delta shard {i}: {key!r:.100} is not a flat byte stream")
            found[key] = t.numpy().tobytes()
    expected = {f"{name}::{section}" for name, e in table.items() if e["changed"] for section in SECTIONS}
    if set(found) != expected:
        odd = sorted(set(found) ^ expected)
        raise DeltaRejected(f"delta shards do not hold the streams the signed table lists ({odd[:3]})")
    return {name: [found[f"{name}::{s}"] for s in SECTIONS] for name, e in table.items() if e["changed"]}


def decode_delta(files: list[bytes], base: dict[str, torch.Tensor], table: dict[str, dict]) -> list[_Change]:
    """Every change the delta shards describe, checked against ``base`` and the signed ``table``."""
    if not isinstance(table, dict) or set(table) != set(base):
        raise DeltaRejected("the delta's tensor table does not name the base's tensors")
    for name, entry in table.items():
        if not isinstance(entry, dict) or not _fits(base[name], entry) or not _is_int(entry.get("changed")):
            raise DeltaRejected(f"{name}: the base does not have the dtype and shape of the delta's table")
    return [_decode_tensor(name, sections, base[name], table[name])
            for name, sections in _streams(files, table).items()]


def apply_delta(base: dict[str, torch.Tensor], files: list[bytes], table: dict[str, dict]) -> None:
    """Turn ``base`` into the version ``table`` describes, in place, and prove it by sha256.

    Everything is decoded and checked before anything changes; after the change every tensor's
    hash is compared with the table, and on any mismatch the change is undone and DeltaRejected
    raised. Non-contiguous or read-only base tensors are replaced by contiguous copies.
    """
    changes = decode_delta(files, base, table)
    replaced: dict[str, torch.Tensor] = {}
    undo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for change in changes:
        t = base[change.name]
        if not t.is_contiguous() or not _bits(t).flags.writeable:
            replaced[change.name] = t
            t = base[change.name] = t.contiguous().clone()
        flat = _bits(t)
        old = flat[change.positions]
        undo.append((flat, change.positions, old))
        flat[change.positions] = old + change.diff  # wraps: the encoder's difference, undone exactly
    bad = mismatches(base, table)
    if bad:
        for flat, positions, old in reversed(undo):
            flat[positions] = old
        base.update(replaced)
        raise DeltaRejected(f"reconstruction differs from the learner's in {len(bad)} tensors ({bad[:3]}): "
                            "the base is not the version this delta applies to")
