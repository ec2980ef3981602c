"""Delta chains in a real store: the learner's Publisher (keyframes, deltas, its own check, garbage
collection), and an actor's Reconstructor behind a real PolicyReceiver (signed manifests, verified
chunks): the common case, a missed delta, a corrupted base, a late joiner, a broken chain."""

from __future__ import annotations

import pytest
import torch
from delta_shared import bits, same
from delta_versions_shared import MODEL_FILES, make_publisher, publish_all, versions
from relay_helpers import KEY, PUBLIC, RUN_ID, TOKEN

from echo2.broadcast.receiver import PolicyReceiver
from echo2.broadcast.reconstruct import Reconstructor
from echo2.config import BroadcastConfig, PublishConfig, TrainConfig
from echo2.data import layout
from echo2.data.delta import DeltaRejected
from echo2.data.delta_chain import read_version
from echo2.data.store import open_store
from echo2.data.weights import delete_folder, published_versions
from echo2.learner import publisher as publisher_module
from echo2.learner.publisher import Publisher


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "run"))


def test_a_chain_rebuilds_every_version_exactly(store):
    vs = versions(8)
    results = publish_all(make_publisher(store), vs)
    kinds = [m["weights"] for m, _ in results]
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta", "delta", "delta"]  # keyframe_every=4
    for i, (manifest, stats) in enumerate(results):
        tensors, keyframe = read_version(store, i)
        assert same(tensors, vs[i]), i
        assert keyframe["version"] == (0 if i < 4 else 4)
        if manifest["weights"] == "delta":
            assert manifest["base_version"] == i - 1 and manifest["keyframe"] == keyframe["version"]
            assert not [e for e in manifest["files"] if e["kind"] != "delta"]  # no model files ride along
            assert stats["publish_bytes"] < 0.2 * stats["publish_full_bytes"]
            assert 0.01 < stats["publish_changed_fraction"] < 0.05 and stats["publish_apply_seconds"] >= 0
        else:
            assert stats["publish_keyframe"] == 1 and {e["name"] for e in manifest["files"]} >= set(MODEL_FILES)


def test_garbage_collection_keeps_what_a_chain_needs(store):
    pub = make_publisher(store, keep_versions=1, staleness=1)
    publish_all(pub, versions(7))
    # v6 needs v5 and keyframe v4; v5 is still usable (t - S); nothing older is
    assert published_versions(store) == [4, 5, 6]
    assert same(read_version(store, 6)[0], versions(7)[6])


def test_dense_changes_or_a_new_shape_make_a_keyframe(store):
    pub = make_publisher(store)
    v0 = versions(1)[0]
    pub.publish(0, v0, {"weights": "full"})
    gen = torch.Generator().manual_seed(1)  # not the global generator: what earlier tests drew must not matter
    dense = [{k: torch.randn(t.shape, generator=gen).to(torch.bfloat16) for k, t in v0.items()} for _ in range(2)]
    _, stats = pub.publish(1, dense[0], {"weights": "full"})
    assert stats["publish_changed_fraction"] > 0.9 and stats["publish_bytes"] <= stats["publish_full_bytes"]
    # a second delta of that size would make the chain since v0 larger than one full version
    manifest, stats = pub.publish(2, dense[1], {"weights": "full"})
    assert manifest["weights"] == "full" and manifest["keyframe"] == 2 and stats["publish_keyframe"] == 1
    assert stats["publish_delta_bytes"] > 0  # measured all the same
    grown = {**dense[1], "extra": torch.zeros(3, dtype=torch.bfloat16)}
    assert pub.publish(3, grown, {"weights": "full"})[0]["keyframe"] == 3
    assert same(read_version(store, 3)[0], grown) and same(read_version(store, 1)[0], dense[0])


def test_a_resumed_learner_starts_with_a_keyframe(store):
    vs = versions(4)
    publish_all(make_publisher(store), vs[:2])
    manifest, _ = make_publisher(store).publish(2, vs[2], {"weights": "full"})  # a fresh process, as after resume
    assert manifest["weights"] == "full" and manifest["keyframe"] == 2


def test_a_delta_that_fails_its_own_check_is_never_published(store, monkeypatch):
    vs = versions(3)
    real = publisher_module.encode_delta

    def broken_encoder(base, new, **kw):
        delta = real(base, new, **kw)
        name = next(n for n, e in delta.table.items() if e["changed"])
        delta.table[name]["sha256"] = "0" * 64  # an encoder bug: the table and the shards disagree
        return delta

    pub = make_publisher(store)
    pub.publish(0, vs[0], {"weights": "full"})
    monkeypatch.setattr(publisher_module, "encode_delta", broken_encoder)
    manifest, _ = pub.publish(1, vs[1], {"weights": "full"})
    assert manifest["weights"] == "full"  # a keyframe went out instead
    monkeypatch.setattr(publisher_module, "encode_delta", real)
    assert pub.publish(2, vs[2], {"weights": "full"})[0]["weights"] == "delta"
    assert same(read_version(store, 2)[0], vs[2])


def test_published_tensors_that_are_the_live_weights_are_copied(store):
    """float32 publishing hands the learner's own parameters over (``.to`` is a no-op): the publisher
    must keep a copy, or the optimizer's next step would change its base under it."""
    live = {"w": torch.randn(64, 32)}
    pub = make_publisher(store)
    pub.publish(0, live, {"weights": "full"})
    with torch.no_grad():
        live["w"][::3] += 1e-3  # the next optimizer step, in place
    pub.publish(1, live, {"weights": "full"})
    assert bits(read_version(store, 1)[0]["w"]) == bits(live["w"])


# -- an actor's side, through a real receiver -------------------------------------------------------

@pytest.fixture
def published(store):
    vs = versions(8)
    publish_all(make_publisher(store), vs)  # keyframes 0 and 4
    receiver = PolicyReceiver(store, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2, run_id=RUN_ID)
    yield vs, receiver
    receiver.close()


def take(rec, receiver, version):
    buffer = receiver.fetch_blocking(version)
    return rec.weights(buffer.manifest, buffer.files())


def test_an_actor_follows_deltas_and_recovers_from_missing_ones(published):
    vs, receiver = published
    rec = Reconstructor(receiver.manifest, receiver.fetch_blocking)
    assert same(take(rec, receiver, 0), vs[0]) and rec.route == "full"
    assert same(take(rec, receiver, 1), vs[1]) and rec.route == "delta on v0"
    # missed v2: v3's base is not held; the deltas from the held v1 cost less than the keyframe route
    assert same(take(rec, receiver, 3), vs[3]) and rec.route.startswith("from v1 held here (+2 deltas")
    # missed v4 (a keyframe) and v5: the held v3 is not on v6's chain
    assert same(take(rec, receiver, 6), vs[6]) and rec.route.startswith("from keyframe v4 (+2 deltas")


def test_a_corrupted_base_is_refused_and_rebuilt_from_the_keyframe(published):
    vs, receiver = published
    rec = Reconstructor(receiver.manifest, receiver.fetch_blocking)
    take(rec, receiver, 4)
    take(rec, receiver, 5)
    rec.held[1]["layer.w"].view(torch.int16)[3, 3] ^= 1  # one flipped bit in the weights held
    assert same(take(rec, receiver, 6), vs[6]) and rec.route.startswith("from keyframe v4")


def test_a_late_joiner_starts_from_the_newest_keyframe(published):
    vs, receiver = published
    rec = Reconstructor(receiver.manifest, receiver.fetch_blocking)
    assert same(take(rec, receiver, 7), vs[7]) and rec.route.startswith("from keyframe v4 (+3 deltas")
    assert MODEL_FILES.items() <= rec.model_files.items()  # what a new actor builds its engine from
    assert same(take(rec, receiver, 7 - 3), vs[4])  # a keyframe after that: taken as it is


def test_a_broken_chain_is_refused_and_nothing_wrong_is_held(published, store):
    vs, receiver = published
    rec = Reconstructor(receiver.manifest, receiver.fetch_blocking)
    take(rec, receiver, 5)
    target = receiver.fetch_blocking(7)
    delete_folder(store, layout.policy_dir(6))  # gone before the actor fetched it
    with pytest.raises(DeltaRejected):
        rec.weights(target.manifest, target.files())
    assert rec.held is None or same(rec.held[1], vs[rec.held[0]])  # whatever it holds is exactly a version


def test_publish_delta_leaves_a_lora_run_as_it_was(store):
    """A LoRA run publishes its base, then adapters only: ``publish.delta`` (on in a shared config) changes nothing."""
    pub = make_publisher(store, lora_rank=4)
    manifest, stats = pub.publish(0, versions(1)[0], {"weights": "full"})
    assert manifest["weights"] == "full" and "tensors" not in manifest and "publish_keyframe" not in stats
    manifest, _ = pub.publish(1, {"base_model.model.x.lora_A.weight": torch.zeros(4, 16)},
                              {"weights": "lora", "base_version": 0})
    assert manifest["weights"] == "lora" and published_versions(store) == [0, 1]


def test_a_small_version_is_cut_into_min_chunks_and_still_rebuilds(store):
    """A relay forwards a chunk once it holds it whole, so a version in few large chunks spends its time filling
    the chain: a sparse delta of a few MB in 8 MB chunks was one chunk, and every hop waited for all of it. Each
    version is now cut into ``min_chunks`` chunks (here 16), none under ``min_chunk_mb``, none over ``chunk_mb``."""
    smallest = 256
    broadcast = BroadcastConfig(mode="store", chunk_mb=8, min_chunks=16, min_chunk_mb=smallest / 2**20)
    publish = PublishConfig(delta=True, keyframe_every=4, keep_versions=100)
    pub = Publisher(store, train=TrainConfig(staleness=2), publish=publish, broadcast=broadcast, key=KEY,
                    extra_files=MODEL_FILES)
    vs = versions(2)
    (full, _), (delta, stats) = publish_all(pub, vs)
    assert (full["weights"], delta["weights"]) == ("full", "delta")
    full_bytes = sum(t.numel() * t.element_size() for t in vs[0].values())
    assert full["chunk_size"] == -(-full_bytes // 16) < 8 * 2**20
    assert delta["chunk_size"] == max(smallest, -(-stats["publish_delta_bytes"] // 16))
    for i in (0, 1):
        assert same(read_version(store, i)[0], vs[i]), i
    assert broadcast.chunk_bytes(10**10) == 8 * 2**20  # a large version: chunk_mb
    assert BroadcastConfig(chunk_mb=0.01).chunk_bytes(10**6) == int(0.01 * 2**20)  # a chunk_mb under the floor wins
