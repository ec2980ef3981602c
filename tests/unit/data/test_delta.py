"""The sparse delta codec (echo2/data/delta.py): bit-exact round trips, and hostile delta shards
that must be refused with the base left exactly as it was."""

from __future__ import annotations

import random

import pytest
import torch
from delta_shared import nudged, same
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from echo2.data.delta import BITMAP_ABOVE, DeltaRejected, NeedsKeyframe, apply_delta, encode_delta, tensor_table


def copy(tensors):
    return {k: v.clone() for k, v in tensors.items()}


def round_trip(base, new, max_file_bytes=2**20):
    delta = encode_delta(base, new, max_file_bytes=max_file_bytes)
    rebuilt = copy(base)
    apply_delta(rebuilt, delta.files, delta.table)
    assert same(rebuilt, new)
    return delta


@pytest.mark.parametrize("share", [0.0, 0.001, 0.05, BITMAP_ABOVE + 0.05, 1.0])
def test_round_trip_at_every_density(share):
    gen = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(300, 70, generator=gen).to(torch.bfloat16),
            "b": torch.randn(70, generator=gen).to(torch.bfloat16)}
    new = {k: nudged(v, share, gen) for k, v in base.items()}
    delta = round_trip(base, new)
    changed = sum(e["changed"] for e in delta.table.values())
    assert changed == sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in base)
    if share == 0:  # an empty change: nothing but the table travels
        assert changed == 0 and all(e["changed"] == 0 for e in delta.table.values())
    if share == 1.0:  # a dense change: every element, positions as a bitmap
        assert delta.table["w"]["encoding"] == "bitmap" and delta.table["w"]["changed"] > 0.9 * 300 * 70


def test_round_trip_odd_shapes_dtypes_and_layouts():
    gen = torch.Generator().manual_seed(2)
    base = {
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "one": torch.ones(1, dtype=torch.float16),
        "odd": torch.randn(3, 5, 7, generator=gen).to(torch.bfloat16),
        "fp32": torch.randn(257, generator=gen),
        "ints": torch.arange(1000, dtype=torch.int64),
        "mask": torch.rand(99, generator=gen) < 0.5,
        "bytes": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=gen),
    }
    new = copy(base)
    new["scalar"] = torch.tensor(-1.5, dtype=torch.bfloat16)
    new["odd"] = nudged(base["odd"], 0.3, gen).transpose(0, 2).contiguous().transpose(0, 2)  # not contiguous
    assert not new["odd"].is_contiguous()
    new["fp32"] = nudged(base["fp32"], 0.5, gen, ulps=(5000, -70000))  # big jumps: escaped changes
    new["ints"][::400] += 10**12
    new["mask"] = ~base["mask"]
    new["bytes"][3] += 200  # wraps
    round_trip(base, new)
    # a non-contiguous base is fine too
    base_t = {"m": torch.randn(40, 30, generator=gen).to(torch.bfloat16).t()}
    round_trip(base_t, {"m": nudged(base_t["m"].contiguous(), 0.1, gen)})


def test_far_apart_changes_use_escaped_gaps_and_several_shards():
    gen = torch.Generator().manual_seed(3)
    base = {f"t{i}": torch.randn(5000, generator=gen).to(torch.bfloat16) for i in range(6)}
    new = copy(base)
    for t in new.values():
        t[[0, 300, 4999]] += 1  # gaps of 300 and 4699: beyond one byte
    delta = round_trip(base, new, max_file_bytes=64)
    assert len(delta.files) > 1  # the tensors fill several delta shards


def test_real_tensors_through_an_optimizer_step(tiny_model):
    """The tiny model after one AdamW step, in bf16: the published copy and its successor."""
    from transformers import AutoModelForCausalLM

    from echo2.data.weights import unique_state_dict

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = unique_state_dict(model, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 300, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    after = unique_state_dict(model, torch.bfloat16)
    delta = round_trip(before, after)
    assert 0 < delta.changed_fraction < 1 and delta.nbytes < sum(t.numel() * 2 for t in after.values())


def test_a_tensor_set_that_changed_needs_a_keyframe():
    base = {"a": torch.zeros(4, dtype=torch.bfloat16)}
    for new in ({"b": torch.zeros(4, dtype=torch.bfloat16)}, {"a": torch.zeros(5, dtype=torch.bfloat16)},
                {"a": torch.zeros(4)}):
        with pytest.raises(NeedsKeyframe):
            encode_delta(base, new, max_file_bytes=2**20)


# -- hostile or wrong input: refused, base unchanged ------------------------------------------------

@pytest.fixture
def case():
    gen = torch.Generator().manual_seed(4)
    base = {"w": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
            "v": torch.randn(500, generator=gen).to(torch.bfloat16),
            "d": torch.randn(80, generator=gen).to(torch.bfloat16)}
    new = {"w": nudged(base["w"], 0.05, gen), "v": nudged(base["v"], 0.02, gen), "d": nudged(base["d"], 0.9, gen)}
    return base, new, encode_delta(base, new, max_file_bytes=2**20)


def refused(base, files, table):
    held = copy(base)
    with pytest.raises(DeltaRejected):
        apply_delta(held, files, table)
    assert same(held, base)  # never half-applied


def reshard(files, edit):
    tensors = {}
    for f in files:
        tensors.update(st_load(f))
    edit(tensors)
    return [st_save(tensors)]


def test_the_wrong_base_is_refused_and_left_alone(case):
    base, new, delta = case
    other = copy(base)
    other["v"][7] += 1  # one bit off: a corrupted base, or the version before a missed delta
    refused(other, delta.files, delta.table)
    refused(new, delta.files, delta.table)  # applying it twice


def test_tables_that_do_not_match_are_refused(case):
    import copy as deep

    base, new, delta = case
    for edit in (lambda t: t["w"].update(changed=t["w"]["changed"] + 1), lambda t: t["w"].update(changed=10**9),
                 lambda t: t["w"].update(sha256="0" * 64), lambda t: t["v"].update(encoding="raw"),
                 lambda t: t["v"].update(shape=[5, 100]), lambda t: t["v"].update(dtype="float16"),
                 lambda t: t.pop("d"), lambda t: t.update(extra={"dtype": "bfloat16", "shape": [1], "changed": 0}),
                 lambda t: t["w"].update(changed=True), lambda t: t["v"].update(changed=0)):
        table = deep.deepcopy(delta.table)
        edit(table)
        refused(base, delta.files, table)
    refused(base, delta.files, None)
    refused(base, delta.files, [])


def test_malformed_shards_are_refused(case):
    import zstandard

    base, new, delta = case
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 50_000_000)  # a small frame that inflates to 50 MB
    for files in (
        [], [b""], [b"not safetensors"], [delta.files[0][:-5]], delta.files + delta.files,
        reshard(delta.files, lambda t: t.pop("w::changes")),
        reshard(delta.files, lambda t: t.update({"x::positions": torch.zeros(1, dtype=torch.uint8)})),
        reshard(delta.files, lambda t: t.update({"w::positions": torch.zeros(3, dtype=torch.int32)})),
        reshard(delta.files,
                lambda t: t.update({"w::positions": torch.frombuffer(bytearray(bomb), dtype=torch.uint8)})),
        reshard(delta.files, lambda t: t.update({"w::changes": t["v::changes"].clone()})),
        reshard(delta.files, lambda t: t.update({"v::positions": t["w::positions"].clone()})),
        reshard(delta.files, lambda t: t.update({"d::positions": torch.zeros(0, dtype=torch.uint8)})),
    ):
        refused(base, files, delta.table)


def test_positions_out_of_range_are_refused(case):
    import numpy as np
    import zstandard

    base, new, delta = case
    count = delta.table["v"]["changed"]
    z = zstandard.ZstdCompressor()
    as_stream = lambda a: torch.frombuffer(bytearray(z.compress(a.tobytes())), dtype=torch.uint8)  # noqa: E731
    for gaps in (np.full(count, 250, np.uint8),  # runs past the end of a 500-element tensor
                 np.zeros(count, np.uint8)):  # a gap of 0: the same position twice
        files = reshard(delta.files, lambda t: t.update({"v::positions": as_stream(gaps)}))
        refused(base, files, delta.table)
    # an escaped gap past the end
    gaps = np.ones(count, np.uint8)
    gaps[0] = 255
    files = reshard(delta.files, lambda t: t.update({"v::positions": as_stream(gaps),
                                                     "v::positions_escaped": as_stream(np.array([10**6], "<u4"))}))
    refused(base, files, delta.table)


def test_random_corruption_never_gets_through(case):
    """Bytes flipped anywhere in a delta shard: refused with the base intact, or (a byte nothing reads)
    the exact version. Never an exception of another kind, never other weights."""
    base, new, delta = case
    rng = random.Random(5)
    blob = delta.files[0]
    outcomes = {"refused": 0, "exact": 0}
    for _ in range(150):
        mutated = bytearray(blob)
        for _ in range(rng.choice((1, 1, 2, 8))):
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        held = copy(base)
        try:
            apply_delta(held, [bytes(mutated)], delta.table)
        except DeltaRejected:
            assert same(held, base)
            outcomes["refused"] += 1
        else:
            assert same(held, new)
            outcomes["exact"] += 1
    assert outcomes["refused"] > 100, outcomes


def test_the_table_names_every_tensor_with_its_hash():
    t = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2, 2)}
    table = tensor_table(t)
    assert table["a"]["dtype"] == "bfloat16" and table["b"]["shape"] == [2, 2] and len(table["a"]["sha256"]) == 64
    assert table["a"]["sha256"] != tensor_table({"a": torch.ones(3, dtype=torch.float16)})["a"]["sha256"]


def test_a_keyframe_that_differs_from_its_table_is_refused():
    from echo2.data.delta_chain import full_tensors

    tensors = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2)}
    manifest = {"version": 0, "files": [{"name": "s", "kind": "shard"}], "tensors": tensor_table(tensors)}
    assert same(full_tensors(manifest, {"s": st_save(tensors)}), tensors)
    wrong_hash = {**manifest["tensors"], "a": {**manifest["tensors"]["a"], "sha256": "0" * 64}}
    for table in ({"a": "x", "b": manifest["tensors"]["b"]}, wrong_hash, {}, "nope", [1]):
        with pytest.raises(DeltaRejected):
            full_tensors({**manifest, "tensors": table}, {"s": st_save(tensors)})
    with pytest.raises(DeltaRejected):
        full_tensors(manifest, {"s": b"\x08" + b"\0" * 20})
