"""The dissemination model (echo2/fleet/planner/dissemination.py): version bytes as echo2 publishes them, checked by
hand, against the deltas measured on the quickstart run and against echo2's own delta encoder; D through the relay
forest, checked by hand and against `echo2 bench broadcast`'s measurements; `--from-run`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from echo2.data.delta import encode_delta
from echo2.errors import Echo2InputError
from echo2.fleet.planner.dissemination import (
    DEFAULT_CHANGED_FRACTION,
    DEFAULT_CHANGED_FRACTION_SOURCE,
    changed_fraction_from_run,
    delta_bytes_per_element,
    dissemination_seconds,
    version_bytes,
)

MIB = 2**20
CHUNK_8MB_AT_HALF_GBIT = 8 * MIB * 8 / 0.5e9  # 0.134218 s: one 8 MiB chunk over a 0.5 Gbit/s link
CHUNK_OF_1GB_AT_HALF_GBIT = 3_906_250 * 8 / 0.5e9  # 0.0625 s: 1 GB in broadcast.min_chunks = 256 chunks


def test_version_bytes_by_hand():
    # p = 0.021: H(p) = 0.021 x 5.57346 + 0.979 x 0.0306193 = 0.117043 + 0.029976 = 0.147019 bits an element;
    # changes 0.021 x 3.7 = 0.0777 bits; (0.147019 + 0.0777) / 8 = 0.0280899 bytes an element
    v = version_bytes(1e9, keyframe_every=16, changed_fraction=0.021)
    assert v["keyframe"] == 2e9
    assert v["delta"] == pytest.approx(28.0899e6, rel=1e-4)
    assert v["deltas_per_keyframe"] == 15
    assert v["mean"] == pytest.approx((2e9 + 15 * 28.0899e6) / 16, rel=1e-4)  # 151.33 MB
    assert v["delta"] / v["keyframe"] == pytest.approx(0.01404, abs=1e-4)  # measured mean 1.37% (docs/benchmarks.md)


def test_keyframe_every_version_and_float32():
    v = version_bytes(1e9, keyframe_every=1, changed_fraction=0.021, bytes_per_param=4.0)
    assert v["keyframe"] == v["mean"] == 4e9 and v["deltas_per_keyframe"] == 0


def test_the_chain_of_deltas_never_outgrows_a_keyframe():
    # p = 0.5: positions min(H, 1) = 1 bit, changes 1.85 bits: 2.85 / 8 = 0.35625 bytes an element; the publisher
    # starts a keyframe once the deltas since the last would outgrow 2 bytes: floor(2 / 0.35625) = 5 deltas
    v = version_bytes(1.0, keyframe_every=16, changed_fraction=0.5)
    assert v["delta"] == pytest.approx(0.35625)
    assert v["deltas_per_keyframe"] == 5
    assert v["mean"] == pytest.approx((2 + 5 * 0.35625) / 6)
    # everything changed: a delta would outweigh a keyframe, so it is capped at one
    assert version_bytes(1.0, keyframe_every=16, changed_fraction=1.0)["delta"] <= 2.0


@pytest.mark.parametrize("changed, measured_mb", [(0.0232, 3.94), (0.0142, 2.63)])
def test_delta_bytes_against_the_quickstart_run(changed, measured_mb):
    """v2 and v16 of the 2026-12-02 quickstart run (docs/benchmarks.md): 256.6 MB of bf16, i.e. 134.5 M elements."""
    elements = 256.6 * MIB / 2
    model_mb = elements * delta_bytes_per_element(changed) / MIB
    assert model_mb == pytest.approx(measured_mb, rel=0.06)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy()


def test_positions_cost_what_echo2s_encoder_writes():
    """echo2's own encoder on 2M bf16 elements with 2% of them moved by one ulp at random positions: its position
    streams weigh H(p) / 8 bytes an element (within 5%), and the whole delta no more than the model says (the model's
    3.7 bits a change is for real steps, wider than +-1 ulp)."""
    rng = np.random.default_rng(0)
    n, p = 2_000_000, 0.02
    base = torch.randn(n).to(torch.bfloat16)
    new = base.clone()
    idx = np.flatnonzero(rng.random(n) < p)
    bits = _bits(new)
    bits[idx] += rng.choice(np.array([-1, 1], dtype=np.int16), size=len(idx))
    delta = encode_delta({"w": base}, {"w": new}, max_file_bytes=2**30)
    sizes = {k: v.numel() for blob in delta.files for k, v in st_load(blob).items()}
    positions = sizes["w::positions"] + sizes["w::positions_escaped"]
    p_real = delta.changed_fraction
    h = -p_real * math.log2(p_real) - (1 - p_real) * math.log2(1 - p_real)
    assert positions == pytest.approx(n * h / 8, rel=0.05)
    assert delta.nbytes <= n * delta_bytes_per_element(p_real)


def test_default_changed_fraction_has_its_measured_source():
    assert DEFAULT_CHANGED_FRACTION == 0.021
    assert "2026-12-02" in DEFAULT_CHANGED_FRACTION_SOURCE and "docs/benchmarks.md" in DEFAULT_CHANGED_FRACTION_SOURCE


def test_dissemination_by_hand():
    # 1 GB, 16 actors, one root, fan-out 2: levels of 1, 2, 4, 8 (+1) nodes -> 4 levels below the root; each child
    # gets 1 Gbit/s / 2: 8e9 / 0.5e9 = 16 s, and 4 hops each add one chunk at 0.5 Gbit/s: 1 GB in 256 chunks
    # (broadcast.min_chunks: 8 MiB chunks would give 120), 3.9 MB each
    d = dissemination_seconds(1e9, store_gbit=10, peer_gbit=1, actors=16, fanout=2, roots=1)
    assert d == pytest.approx(16 + 4 * CHUNK_OF_1GB_AT_HALF_GBIT)
    # 8 GB: 256 chunks would be 31 MB, over chunk_mb: 8 MiB chunks
    big = dissemination_seconds(8e9, store_gbit=10, peer_gbit=1, actors=16, fanout=2, roots=1)
    assert big == pytest.approx(128 + 4 * CHUNK_8MB_AT_HALF_GBIT)
    # 16 MB (a sparse delta): 256 chunks would be 62.5 KB, under min_chunk_mb: 0.25 MiB chunks
    small = dissemination_seconds(16e6, store_gbit=10, peer_gbit=1, actors=16, fanout=2, roots=1)
    assert small == pytest.approx(16e6 * 8 / 0.5e9 + 4 * MIB / 4 * 8 / 0.5e9)
    # two regions of 8 actors, one root each: the store's 10 Gbit/s is shared by 2 readers, each still capped at
    # its own 1 Gbit/s; 8 nodes under one root -> 3 levels
    d2 = dissemination_seconds(1e9, store_gbit=10, peer_gbit=1, actors=16, fanout=2, roots=1, regions=2)
    assert d2 == pytest.approx(16 + 3 * CHUNK_OF_1GB_AT_HALF_GBIT)
    # every actor reading the store (roots = actors): 16 readers share 10 Gbit/s: 8e9 / 0.625e9 = 12.8 s
    assert dissemination_seconds(1e9, store_gbit=10, peer_gbit=1, actors=16, roots=16) == pytest.approx(12.8)
    # a slow store: the roots' link is the slowest on the path and sets the pace
    slow = dissemination_seconds(1e9, store_gbit=0.25, peer_gbit=1, actors=16, fanout=2)
    assert slow == pytest.approx(8e9 / 0.25e9 + 4 * CHUNK_OF_1GB_AT_HALF_GBIT)
    assert dissemination_seconds(0, store_gbit=1, peer_gbit=1, actors=4) == 0.0


def test_dissemination_against_the_broadcast_bench():
    """`echo2 bench broadcast` (docs/benchmarks.md, 2026-11-30): 256 MiB, 200 Mbit/s links, 1 MB chunks, a chain
    (fan-out 1): relay 11.52 s at 2 receivers and 13.50 s at 16 (CPU-bound there), store-only 179.74 s at 16.
    The model is the ideal: at or below the relay's measured times, within 10% of them below 16 receivers."""
    payload = 256 * MIB
    for n, measured in ((2, 11.52), (4, 11.65), (8, 11.90), (16, 13.50)):
        model = dissemination_seconds(payload, store_gbit=0.2, peer_gbit=0.2, actors=n, fanout=1, chunk_mb=1)
        assert model <= measured
        if n < 16:
            assert model == pytest.approx(measured, rel=0.10)
    store_only = dissemination_seconds(payload, store_gbit=0.2, peer_gbit=0.2, actors=16, roots=16, chunk_mb=1)
    assert store_only == pytest.approx(179.74, rel=0.05)


def test_more_changed_means_more_bytes_and_a_longer_d():
    ds = []
    for p in (0.005, 0.015, 0.05, 0.15):
        mean = version_bytes(30.5e9, keyframe_every=16, changed_fraction=p)["mean"]
        ds.append(dissemination_seconds(mean, store_gbit=1, peer_gbit=1, actors=16))
    assert ds == sorted(ds) and ds[0] < ds[-1]


@pytest.mark.parametrize("kwargs", [{"actors": 0}, {"actors": 2, "fanout": 0}, {"actors": 2, "store_gbit": 0},
                                    {"actors": 2, "peer_gbit": -1}, {"actors": 2, "roots": 1.5}])
def test_bad_dissemination_input(kwargs):
    args = {"store_gbit": 1, "peer_gbit": 1, **kwargs}
    with pytest.raises(Echo2InputError):
        dissemination_seconds(1e9, **args)


@pytest.mark.parametrize("kwargs", [{"changed_fraction": 1.5}, {"changed_fraction": -0.1},
                                    {"changed_fraction": 0.02, "keyframe_every": 0}])
def test_bad_version_input(kwargs):
    with pytest.raises(Echo2InputError):
        version_bytes(1e9, **{"keyframe_every": 16, **kwargs})
    with pytest.raises(Echo2InputError):
        version_bytes(0, keyframe_every=16, changed_fraction=0.02)


def _run(tmp_path, history):
    (tmp_path / "run.json").write_text(json.dumps({"config": {}}))
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "metrics.json").write_text(json.dumps(history))
    return str(tmp_path)


def test_changed_fraction_from_a_runs_metrics(tmp_path):
    # a keyframe (no changed share), then deltas of 6% and 2% of two versions of equal size: (6 + 2) / 2 = 4%
    run = _run(tmp_path, [{"step": 1, "publish_full_bytes": 100, "publish_keyframe": 1},
                          {"step": 2, "publish_full_bytes": 100, "publish_changed_fraction": 0.06},
                          {"step": 3, "publish_full_bytes": 100, "publish_changed_fraction": 0.02},
                          {"step": 4, "publish_changed_fraction": "junk"}])
    assert changed_fraction_from_run(run) == pytest.approx(0.04)


def test_changed_fraction_from_a_run_without_deltas(tmp_path):
    run = _run(tmp_path, [{"step": 1, "publish_full_bytes": 100}])
    with pytest.raises(Echo2InputError, match="no sparse deltas"):
        changed_fraction_from_run(run)
    with pytest.raises(Echo2InputError, match="not a run folder"):
        changed_fraction_from_run(str(tmp_path / "nowhere"))


def test_the_models_chunk_defaults_are_the_configs():
    """The planner's model cuts a version as the publisher does: the same defaults, the same rule."""
    from echo2.config import BroadcastConfig
    from echo2.fleet.planner import dissemination

    config = BroadcastConfig()
    assert (dissemination.DEFAULT_CHUNK_MB, dissemination.DEFAULT_MIN_CHUNKS, dissemination.DEFAULT_MIN_CHUNK_MB) == (
        config.chunk_mb, config.min_chunks, config.min_chunk_mb)
    assert config.chunk_bytes(64 * MIB) == MIB // 4 and config.chunk_bytes(10**10) == 8 * MIB
