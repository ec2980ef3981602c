"""The actor's one call for weights (``echo2.broadcast.weight_source``) behind a real PolicyReceiver on a
store (signed manifests, verified chunks): full versions, LoRA adapters merged here (the base fetched
once) or handed to an engine that applies them itself, sparse deltas rebuilt, a version no route
rebuilds refused."""

from __future__ import annotations

import time

import pytest
import torch
from delta_shared import same
from delta_versions_shared import MODEL_FILES, make_publisher, versions
from relay_helpers import KEY, PUBLIC, RUN_ID, TOKEN

from echo2.broadcast.receiver import PolicyReceiver
from echo2.broadcast.weight_source import VersionRejected, WeightSource
from echo2.config import BroadcastConfig
from echo2.data import layout
from echo2.data.delta import tensor_table
from echo2.data.lora import merge_lora
from echo2.data.store import open_store
from echo2.data.weights import delete_folder, publish_version

BASE = {"layer.weight": torch.randn(8, 16, generator=torch.Generator().manual_seed(0))}


def adapter(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"base_model.model.layer.lora_A.weight": torch.randn(4, 16, generator=gen),
            "base_model.model.layer.lora_B.weight": torch.randn(8, 4, generator=gen)}


LORA = {"weights": "lora", "base_version": 0, "lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "run"))


@pytest.fixture
def source(store, monkeypatch):
    """A source over a real receiver (store mode) whose whole-version fetches are counted in ``source.fetched``."""
    receiver = PolicyReceiver(store, "a0", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2, run_id=RUN_ID)
    fetched: list[int] = []
    real = receiver.fetch_blocking
    monkeypatch.setattr(receiver, "fetch_blocking", lambda v: fetched.append(v) or real(v))
    made: list[WeightSource] = []

    def make(*, lora: bool) -> WeightSource:
        made.append(WeightSource(receiver, lora=lora))
        made[-1].fetched = fetched
        return made[-1]

    yield make
    receiver.close()


def take(source: WeightSource, *, native_lora: bool = False, timeout: float = 30.0):
    """The next version ``source`` hands over (the receiver fetches in the background)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (ready := source.poll(native_lora=native_lora)) is not None:
            return ready
        time.sleep(0.02)
    raise AssertionError(f"no version within {timeout}s")


def publish(store, version, tensors, meta):
    publish_version(store, version, tensors, extra_files=MODEL_FILES, shard_mb=1, key=KEY, meta=meta)


def test_a_full_version_is_its_shards_with_its_model_files(store, source):
    publish(store, 0, BASE, {"weights": "full"})
    ready = take(source(lora=False))
    assert ready.version == 0 and same(ready.weights, BASE) and ready.adapter is None and ready.route == "full"
    assert MODEL_FILES.items() <= ready.model_files.items() and ready.received_at > ready.manifest["created_at"]


def test_adapters_merge_into_a_base_fetched_once(store, source):
    """A late joiner (LATEST is an adapter): the base is fetched once, every later adapter merges into it."""
    publish(store, 0, BASE, {"weights": "full"})
    publish(store, 1, adapter(1), LORA)
    src = source(lora=True)
    ready = take(src)
    assert ready.adapter is None and same(ready.weights, merge_lora(BASE, adapter(1), rank=4, alpha=8.0))
    publish(store, 2, adapter(2), LORA)
    ready = take(src)
    assert ready.version == 2 and same(ready.weights, merge_lora(BASE, adapter(2), rank=4, alpha=8.0))
    assert src.fetched == [0]


def test_an_actor_that_saw_the_base_fetches_nothing_more(store, source):
    publish(store, 0, BASE, {"weights": "full"})
    src = source(lora=True)
    assert same(take(src).weights, BASE)
    publish(store, 1, adapter(1), LORA)
    assert same(take(src).weights, merge_lora(BASE, adapter(1), rank=4, alpha=8.0)) and src.fetched == []


def test_a_native_lora_engine_gets_its_base_once_then_adapters_alone(store, source):
    """The first version builds the engine (nothing native yet: merged); then the base for the engine to
    hold unmerged (the one fetched for the merge, not fetched again), then each adapter on its own."""
    publish(store, 0, BASE, {"weights": "full"})
    publish(store, 1, adapter(1), LORA)
    src = source(lora=True)
    assert take(src).adapter is None  # merged: the engine does not exist yet
    publish(store, 2, adapter(2), LORA)
    ready = take(src, native_lora=True)
    assert same(ready.weights, BASE) and same(ready.adapter.tensors, adapter(2))
    assert (ready.adapter.rank, ready.adapter.alpha) == (4, 8.0)
    publish(store, 3, adapter(3), LORA)
    ready = take(src, native_lora=True)
    assert ready.weights is None and same(ready.adapter.tensors, adapter(3)) and src.fetched == [0]


def test_an_adapter_on_anything_but_a_plain_full_base_is_refused(store, source):
    publish(store, 0, BASE, {"weights": "full", "keyframe": 0, "tensors": tensor_table(BASE)})
    publish(store, 1, adapter(1), LORA)
    with pytest.raises(VersionRejected, match="not a plain full version") as refused:
        take(source(lora=True))
    assert refused.value.version == 1


def test_deltas_are_rebuilt_and_a_broken_chain_is_refused(store, source):
    vs = versions(4)
    pub = make_publisher(store)
    pub.publish(0, {k: t.clone() for k, t in vs[0].items()}, {"weights": "full"})  # a keyframe
    src = source(lora=False)
    ready = take(src)
    assert same(ready.weights, vs[0]) and ready.route == "full" and MODEL_FILES.items() <= ready.model_files.items()
    pub.publish(1, {k: t.clone() for k, t in vs[1].items()}, {"weights": "full"})
    ready = take(src)
    assert same(ready.weights, vs[1]) and ready.route == "delta on v0" and ready.rebuild_seconds > 0
    for v in (2, 3):
        pub.publish(v, {k: t.clone() for k, t in vs[v].items()}, {"weights": "full"})
    delete_folder(store, layout.policy_dir(2))  # v3's chain runs through v2, gone before the actor fetched it
    with pytest.raises(VersionRejected) as refused:
        take(src)
    assert refused.value.version == 3 and "v3" in refused.value.reason


# -- the actor loads what it is handed ------------------------------------------------------------------

class RecordingEngine:
    """Stands in for an engine at the load boundary only (no generation is asked of it here): records what
    the actor loads, with or without LoRA applied by the engine itself (vLLM's LoRA requests)."""

    def __init__(self, native_lora: bool):
        self.native_lora = native_lora
        self.loads: list[tuple[str, object]] = []

    def load_weights(self, tensors) -> None:
        self.loads.append(("weights", {k: v.clone() for k, v in tensors}))

    def load_lora(self, adapter, *, version: int, rank: int, alpha: float) -> None:
        self.loads.append(("lora", (version, adapter, rank, alpha)))

    def close(self) -> None:
        pass


def swap(actor, timeout: float = 30.0) -> bool:
    """``Actor._follow_policy`` until it swaps (True) or refuses a version (False, the version unchanged)."""
    before, deadline = actor.version, time.time() + timeout
    while time.time() < deadline:
        if actor._follow_policy():
            return True
        if actor.source.receiver.current != before:
            return False  # the receiver handed a version over, and the actor did not swap to it: refused
        time.sleep(0.02)
    raise AssertionError(f"no swap within {timeout}s")


@pytest.mark.parametrize("native_lora", [True, False])
def test_an_actor_loads_the_base_once_and_each_adapter(native_lora, tiny_model, tmp_path, monkeypatch):
    """A LoRA run through the real Actor: with an engine that applies adapters, the base once and each adapter
    alone; with one that does not, each adapter merged into the base. An adapter that names another adapter
    as its base is refused, and the actor stays on the version it had."""
    from actor_helpers import make_run
    from transformers import AutoModelForCausalLM

    from echo2.data.relay_tokens import RELAY_TOKEN_ENV, mint
    from echo2.data.weights import unique_state_dict
    from echo2.rollout.actor import Actor

    base = unique_state_dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    store, key, _ = make_run(tmp_path, tiny_model, base, {"train": {"lora_rank": 4, "lora_alpha": 8.0}}, monkeypatch)
    monkeypatch.setenv(RELAY_TOKEN_ENV, mint(key, "r1", "a0", time.time() + 3600))
    module = next(k.removesuffix(".weight") for k in base if k.endswith("q_proj.weight"))
    rows, cols = base[f"{module}.weight"].shape
    engine = RecordingEngine(native_lora)
    actor = Actor(store, "a0", engine_factory=lambda model_dir, tokenizer: engine)
    try:
        assert swap(actor) and actor.tokenizer is not None and engine.loads[0][0] == "weights"
        adapters = {}
        for version in (1, 2):
            gen = torch.Generator().manual_seed(version)
            adapters[version] = {f"base_model.model.{module}.lora_A.weight": torch.randn(4, cols, generator=gen),
                                 f"base_model.model.{module}.lora_B.weight": torch.randn(rows, 4, generator=gen)}
            publish_version(store, version, adapters[version], extra_files={}, shard_mb=64, key=key,
                            meta=LORA)
            assert swap(actor) and actor.version == version
        publish_version(store, 3, adapters[2], extra_files={}, shard_mb=64, key=key, meta={**LORA, "base_version": 2})
        assert not swap(actor) and actor.version == 2
    finally:
        actor.source.close()
    kinds = [kind for kind, _ in engine.loads]
    if native_lora:
        assert kinds == ["weights", "lora", "lora"] and same(engine.loads[0][1], base)
        for v in (1, 2):
            version, adapter, rank, alpha = engine.loads[v][1]
            assert (version, rank, alpha) == (v, 4, 8.0) and same(adapter, adapters[v])
    else:
        assert kinds == ["weights"] * 3
        for v in (1, 2):
            assert same(engine.loads[v][1], merge_lora(base, adapters[v], rank=4, alpha=8.0))
