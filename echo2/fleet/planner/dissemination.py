"""How many bytes a policy version is, as echo2 publishes it, and how long it takes to reach every actor (D).

Bytes per version (``version_bytes``). With ``publish.delta`` the learner publishes a full keyframe every
``keyframe_every`` (K) versions and, between them, sparse deltas (``echo2/data/delta.py``, ``learner/publisher.py``):

* a keyframe weighs ``total_params x bytes_per_param`` (bf16: 2 bytes; the safetensors headers are ignored);
* a delta at changed fraction p stores, per changed element, its position and its change, each stream zstd-coded:
  positions as byte-coded gaps (a bitmap above ``BITMAP_ABOVE``), which zstd brings to the entropy of the changed
  mask, ``H(p)`` bits per element (``H`` the binary entropy; at most 1 bit, the bitmap uncompressed), and the
  change as a zigzag byte that zstd brings to ``VALUE_BITS`` bits per changed element. So a delta weighs
  ``total_params x (min(H(p), 1) + p x VALUE_BITS) / 8`` bytes, never more than a keyframe. Tensors with no change
  cost nothing, per-tensor headers are ignored.
* the publisher also starts a keyframe early when the deltas since the last one would outgrow a full version, so
  a cycle holds ``min(K - 1, floor(keyframe / delta))`` deltas; ``mean`` is the average version over a cycle.

Calibration (the numbers in ``echo2/data/delta.py``'s docstring and ``docs/benchmarks.md``, SmolLM2-135M bf16,
measured 2026-12-02): the positions stream measured 2.04% and 0.96% of the full version at p = 6.2% and 2.3%,
where ``H(p) / 16`` gives 2.10% and 0.99%; the changes measured 0.95% and 0.53%, i.e. 2.5 and 3.7 bits per changed
element. ``VALUE_BITS`` takes the larger (the later step, nearer the steady state). Checked against the run's v16
(1.42% changed): the model gives 1.00% of the full version where it measured 1.03%.

D (``dissemination_seconds``): the relay forest of ``echo2/broadcast/topology.py``. ``regions`` regions each hold
``actors / regions`` actors (rounded up) and ``roots`` roots per region (the region-aware plan: each region has
its own roots reading the store). Node k >= roots of a region's tree has parent ``(k - roots) // fanout``. Where
the regions hold unequal shares, the largest sets the depth: pass ``actors = regions x the largest region's count``
for that (the even split is the optimistic case).
Assumptions of the model:

* the store's uplink (``store_gbit``) is shared by the roots reading it at once, as in ``echo2 bench broadcast``
  (the store-only time there grows with the readers); a root reads at ``min(store_gbit / readers, peer_gbit)``;
* a relay node uploads each chunk to its ``fanout`` children over one uplink of ``peer_gbit``: each child gets
  ``peer_gbit / fanout``; downlinks are not the bottleneck;
* chunks are pipelined (``broadcast.chunk_mb``, smaller for a small version: ``broadcast.min_chunks``): the
  version streams at the slowest rate on the path, and each hop below the store adds one chunk's time at that
  hop's rate (the fill time of the pipeline);
* no latency, no TLS or CPU cost, no retries, no failed parents (the bench measured the relay within 1.07-1.26x of
  this ideal on 200 Mbit/s links, CPU-bound at 16 receivers);
* every actor reading the store (``broadcast.mode: store``) is ``roots >= actors``: the store's uplink is then
  shared by all of them.

D here is for one version of the given size; pass ``version_bytes(...)["mean"]`` for the run's mean, or
``["keyframe"]`` for the slowest version (every K-th).
"""

from __future__ import annotations

import json
import math

from echo2.config import BroadcastConfig
from echo2.data.manifest import chunk_size_for
from echo2.errors import Echo2InputError

VALUE_BITS = 3.7
"""Bits per changed element of the zstd-coded zigzag changes (measured 3.7 at 2.3% changed, 2.5 at 6.2%)."""
BITMAP_ABOVE = 0.15
"""``echo2.data.delta.BITMAP_ABOVE``: above this changed share positions are a bitmap (at most 1 bit an element)."""

DEFAULT_CHANGED_FRACTION = 0.021
DEFAULT_CHANGED_FRACTION_SOURCE = (
    "2.1%: the mean changed share of the bf16 elements over 16 consecutive versions of the quickstart run "
    "(SmolLM2-135M, lr 1e-5, AdamW; 6.21% at v1, 1.42% at v16), measured 2026-12-02 with "
    "`echo2 bench broadcast --delta --from-run` (docs/benchmarks.md, Sparse delta versions); its deltas weighed "
    "1.37% of the full version on average. A larger model or another learning rate may change more or less per step: "
    "`--from-run` reads a run's own figure")
DEFAULT_KEYFRAME_EVERY = 16
"""``publish.keyframe_every``'s default."""
DEFAULT_CHUNK_MB: float = BroadcastConfig.model_fields["chunk_mb"].default
"""``broadcast.chunk_mb``'s default."""
DEFAULT_MIN_CHUNKS: int = BroadcastConfig.model_fields["min_chunks"].default
"""``broadcast.min_chunks``'s default."""
DEFAULT_MIN_CHUNK_MB: float = BroadcastConfig.model_fields["min_chunk_mb"].default
"""``broadcast.min_chunk_mb``'s default."""


def _entropy_bits(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def delta_bytes_per_element(changed_fraction: float) -> float:
    """Bytes a delta costs per element of the model at ``changed_fraction`` (see the module docstring)."""
    if not 0.0 <= changed_fraction <= 1.0:
        raise Echo2InputError(f"changed fraction must be in [0, 1], got {changed_fraction!r}")
    return (min(_entropy_bits(changed_fraction), 1.0) + changed_fraction * VALUE_BITS) / 8


def version_bytes(total_params: float, *, keyframe_every: int, changed_fraction: float,
                  bytes_per_param: float = 2.0) -> dict:
    """``{"keyframe", "delta", "mean", "deltas_per_keyframe"}``: bytes of a keyframe, of one delta, and the mean
    version over a keyframe cycle, as ``learner/publisher.py`` publishes them (``keyframe_every`` = 1: every
    version is a keyframe, i.e. no deltas)."""
    if not (total_params > 0 and math.isfinite(total_params)):
        raise Echo2InputError(f"total parameters must be a positive number, got {total_params!r}")
    if not (isinstance(keyframe_every, int) and keyframe_every >= 1):
        raise Echo2InputError(f"keyframe_every must be an integer >= 1, got {keyframe_every!r}")
    if not (bytes_per_param > 0 and math.isfinite(bytes_per_param)):
        raise Echo2InputError(f"bytes per parameter must be > 0, got {bytes_per_param!r}")
    keyframe = total_params * bytes_per_param
    delta = min(keyframe, total_params * delta_bytes_per_element(changed_fraction))
    deltas = keyframe_every - 1
    if delta > 0:
        deltas = min(deltas, math.floor(keyframe / delta))  # the publisher's "chain outgrows a full version"
    mean = (keyframe + deltas * delta) / (deltas + 1)
    return {"keyframe": keyframe, "delta": delta, "mean": mean, "deltas_per_keyframe": deltas}


def _depth(n: int, roots: int, fanout: int) -> int:
    """Levels below the roots of a tree of ``n`` nodes where node k >= roots has parent (k - roots) // fanout."""
    depth, level, placed = 0, roots, roots
    while placed < n:
        level *= fanout
        placed += level
        depth += 1
    return depth


def dissemination_seconds(version_bytes: float, *, store_gbit: float, peer_gbit: float, actors: int,
                          fanout: int = 2, roots: int = 1, regions: int = 1,
                          chunk_mb: float = DEFAULT_CHUNK_MB, min_chunks: int = DEFAULT_MIN_CHUNKS,
                          min_chunk_mb: float = DEFAULT_MIN_CHUNK_MB) -> float:
    """Seconds until the last of ``actors`` holds a version of ``version_bytes`` (the module docstring's model)."""
    for name, value in (("version bytes", version_bytes), ("store_gbit", store_gbit), ("peer_gbit", peer_gbit),
                        ("chunk_mb", chunk_mb)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise Echo2InputError(f"{name} must be a number >= 0, got {value!r}")
    if store_gbit <= 0 or peer_gbit <= 0 or chunk_mb <= 0:
        raise Echo2InputError("store_gbit, peer_gbit and chunk_mb must be > 0")
    for name, value in (("actors", actors), ("fanout", fanout), ("roots", roots), ("regions", regions)):
        if not (isinstance(value, int) and value >= 1):
            raise Echo2InputError(f"{name} must be an integer >= 1, got {value!r}")
    if version_bytes == 0:
        return 0.0
    regions = min(regions, actors)
    per_region = math.ceil(actors / regions)
    region_roots = min(roots, per_region)
    readers = region_roots * regions
    chunk = chunk_size_for(version_bytes, largest_mb=chunk_mb, smallest_mb=min_chunk_mb, at_least=max(1, min_chunks))
    bits, chunk_bits = version_bytes * 8, min(version_bytes, chunk) * 8
    root_rate = min(store_gbit / readers, peer_gbit) * 1e9
    depth = _depth(per_region, region_roots, fanout)
    if depth == 0:
        return bits / root_rate
    hop_rate = peer_gbit / fanout * 1e9
    return bits / min(root_rate, hop_rate) + depth * chunk_bits / hop_rate


def changed_fraction_from_run(run: str) -> float:
    """The mean changed share of the delta versions a run published (``publish_changed_fraction`` in its
    ``reports/metrics.json``, weighted by the full bytes of each version); Echo2InputError when it published none."""
    from echo2.data import layout
    from echo2.data.store import NotFound
    from echo2.fleet.sizing.fit import open_run

    store = open_run(run)
    try:
        history = json.loads(store.get(layout.report_key("metrics.json")))
    except NotFound:
        raise Echo2InputError(f"{run} has no reports/metrics.json yet: read a run that has finished") from None
    except ValueError:
        raise Echo2InputError(f"{run}: reports/metrics.json is not JSON") from None
    if not isinstance(history, list):
        raise Echo2InputError(f"{run}: reports/metrics.json is not a list of steps")
    weighted = total = 0.0
    for m in history:
        if not isinstance(m, dict):
            continue
        p, full = m.get("publish_changed_fraction"), m.get("publish_full_bytes", 1)
        if isinstance(p, (int, float)) and isinstance(full, (int, float)) and 0 <= p <= 1 and full > 0 \
                and math.isfinite(full):
            weighted += p * full
            total += full
    if total == 0:
        raise Echo2InputError(f"{run} published no sparse deltas (no publish_changed_fraction in its metrics): "
                              "run with publish.delta: true and publish.dtype: bfloat16")
    return weighted / total
