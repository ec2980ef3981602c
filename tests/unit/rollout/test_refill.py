"""Refill (``rollout.refill``): the transformers engine's stream (``engines/transformers_refill.py``) samples tokens
whose logprobs are those a clean forward of prompt + completion gives under the same weights, with groups joining
as others finish; the default stream of an engine without one goes batch by batch; the actor's streams
(``rollout/refill.py``) commit whole batches, each file tagged with the version whose weights sampled every row of
it, also when a new version lands mid-stream (the groups in flight finish on the old weights, then the swap)."""

from __future__ import annotations

import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo2.bench.overlap_actor import TimingEngine
from echo2.config import Config
from echo2.data import layout
from echo2.data.relay_tokens import RELAY_TOKEN_ENV
from echo2.data.rollouts import decode_rollouts
from echo2.data.run_folder import create_run
from echo2.data.store import open_store
from echo2.data.weights import publish_version, unique_state_dict
from echo2.rollout.actor import Actor
from echo2.rollout.engines import Completion, Engine, SamplingParams
from echo2.rollout.engines.transformers import TransformersEngine
from echo2.rollout.refill import refillable
from echo2.tasks import make_task

EOS_BOOST = 4.0
"""Added to the end-of-sequence logit of the random model (~1/300 per token otherwise): completions end after a few
tokens or run to the cut, so groups finish at different steps and the stream refills."""


def _engine(model_dir, *, slots: int, n: int) -> tuple[TransformersEngine, int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = TransformersEngine(model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                batch_size=slots * n)
    engine.load_weights(unique_state_dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)).items())
    eos = tok.eos_token_id

    def boost(_module, _inputs, logits):
        logits = logits.clone()
        logits[..., eos] += EOS_BOOST
        return logits

    engine.model.get_output_embeddings().register_forward_hook(boost)
    return engine, eos


def _teacher_forced(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log mu of each completion token from one clean forward of prompt + completion (no cache, no padding)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    steps = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return lp[steps, torch.tensor(completion)]


def test_refill_samples_the_logprobs_of_its_tokens_under_the_weights(tiny_model):
    n, slots, temperature, max_new = 3, 2, 0.8, 16
    engine, eos = _engine(tiny_model, slots=slots, n=n)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["What is 1 + 2?", "What is 13 + 4? Think.", "9", "What is 7 + 7? Think step by step, then answer.",
             "What is 0 + 5?", "2 + 2", "What is 8 + 1? Answer."]
    prompts = {f"g{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}
    assert min(len(p) for p in prompts.values()) == 1  # a one-token prompt joins with no cache of its own
    in_flight_at_take: list[int] = []
    returned: list[str] = []

    def source():
        for key, prompt in prompts.items():
            in_flight_at_take.append(len(in_flight_at_take) - len(returned))
            yield key, prompt

    out = {}
    for key, group in engine.generate_stream(source(), SamplingParams(n=n, max_new_tokens=max_new,
                                                                      temperature=temperature, seed=3), window=8):
        returned.append(key)
        out[key] = group
    assert sorted(returned) == sorted(prompts) and len(returned) == len(set(returned))
    # the first `slots` groups start together; later ones only into a free slot, and some joined a batch that still
    # held another group's rows decoding: the refill
    assert in_flight_at_take[:slots] == list(range(slots)) and max(in_flight_at_take) == slots - 1
    assert any(k >= 1 for k in in_flight_at_take[slots:])
    lengths = set()
    for key, group in out.items():
        assert len(group) == n
        for c in group:
            assert 0 < len(c.token_ids) == len(c.logprobs) <= max_new
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == eos) and eos not in c.token_ids[:-1]
            assert c.finish_reason == "stop" or len(c.token_ids) == max_new
            expected = _teacher_forced(engine.model, prompts[key], c.token_ids, temperature)
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4), (key, c.logprobs, expected)
            lengths.add(len(c.token_ids))
    assert len(lengths) > 2  # mixed lengths: the refill path was exercised


def test_refill_takes_a_group_only_when_a_slot_is_free(tiny_model):
    """The stream pulls lazily, so the caller's checks before each take (flow control, a new version) decide."""
    engine, _ = _engine(tiny_model, slots=2, n=2)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok("What is 3 + 4?")["input_ids"]
    taken, stream = [], None

    def source():
        for i in range(5):
            taken.append(i)
            yield i, prompt
            if i == 2:
                return  # the caller says no more: the groups in flight still finish

    stream = engine.generate_stream(source(), SamplingParams(n=2, max_new_tokens=6, seed=1), window=2)
    first = next(stream)
    assert len(taken) == 2 and first[0] in (0, 1)  # two slots: two groups taken before anything came back
    rest = list(stream)
    assert sorted([first[0]] + [k for k, _ in rest]) == [0, 1, 2] and taken == [0, 1, 2]


class _Batches(Engine):
    """An engine without a stream of its own: ``generate`` records each call's prompts."""

    def __init__(self):
        self.calls: list[list[list[int]]] = []

    def load_weights(self, tensors) -> None:
        pass

    def generate(self, prompts, params):
        self.calls.append(prompts)
        return [[Completion([p[0]], [-1.0], "length")] * params.n for p in prompts]


def test_the_default_stream_is_batch_by_batch():
    engine = _Batches()
    groups = iter([(f"k{i}", [i]) for i in range(5)])
    out = list(engine.generate_stream(groups, SamplingParams(n=2, max_new_tokens=1), window=2))
    assert engine.calls == [[[0], [1]], [[2], [3]], [[4]]]
    assert [k for k, _ in out] == ["k0", "k1", "k2", "k3", "k4"] and all(len(g) == 2 for _, g in out)


def test_a_multi_turn_task_is_not_refilled():
    from echo2.tasks.poker import PokerTask

    assert refillable(make_task(Config().task))
    assert not refillable(object.__new__(PokerTask))  # it picks each prompt from the last reply


class _StreamingTiming(TimingEngine):
    """The timing workload's engine with a stream: groups take 1-3 steps, at most ``window`` in flight, and every
    logprob says which load of weights sampled it (-0.01 x loads), so a file shows the weights behind each row."""

    def __init__(self, tokenizer, on_group):
        super().__init__(tokenizer, 0.0, seed=7)
        self.loads = 0
        self.open = False
        self.on_group = on_group

    def load_weights(self, tensors) -> None:
        assert not self.open, "weights changed while a stream had groups in flight"
        super().load_weights(tensors)
        self.loads += 1

    def generate_stream(self, groups, params, *, window):
        self.open = True
        try:
            in_flight: list[list] = []
            exhausted = False
            while True:
                while len(in_flight) < window and not exhausted:
                    try:
                        key, prompt = next(groups)
                    except StopIteration:
                        exhausted = True
                        break
                    in_flight.append([key, prompt, self.rng.randint(1, 3), self.loads])
                if not in_flight:
                    return
                for g in in_flight:
                    g[2] -= 1
                for g in [g for g in in_flight if g[2] <= 0]:
                    in_flight.remove(g)
                    assert g[3] == self.loads  # it finishes on the weights it started with
                    group = []
                    for _ in range(params.n):
                        c = self._completion(self._answer(g[1]), params)
                        group.append(Completion(c.token_ids, [-0.01 * self.loads] * len(c.token_ids), c.finish_reason))
                    self.on_group()
                    yield g[0], group
        finally:
            self.open = False


def test_an_actor_in_refill_mode_tags_every_file_with_the_weights_that_sampled_it(tmp_path, tiny_model, monkeypatch):
    """v1 lands while a stream has groups in flight: they finish on v0's weights and go into v0's files, then the
    actor swaps, and every later file is v1's; every file holds whole batches."""
    store = open_store(str(tmp_path / "store" / "runs" / "r1"))
    key = Ed25519PrivateKey.generate()
    config = Config.model_validate({
        "run": {"id": "r1"}, "fleet": {"learner_silence_s": 3600},
        "rollout": {"group_size": 2, "groups_per_batch": 2, "max_new_tokens": 4, "poll_seconds": 0.01,
                    "max_pending_batches": 50, "refill": True},
        "broadcast": {"mode": "store"},
    })
    create_run(store, "r1", config.model_dump(mode="json"), key=key, echo2_version="test")
    aux = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    publish_version(store, 0, {"w": torch.zeros(4)}, extra_files=aux, shard_mb=1, key=key)
    monkeypatch.setenv(RELAY_TOKEN_ENV, "e2rt1.not.checked-here")
    finished = {"groups": 0}
    swap = {"published": False, "delivered": False}

    def on_group():
        finished["groups"] += 1
        if finished["groups"] == 3:  # mid-stream: batch 0 is committed, batch 1 half done, batch 2 maybe taken
            publish_version(store, 1, {"w": torch.ones(4)}, extra_files=aux, shard_mb=1, key=key)
            swap["published"] = True
        if finished["groups"] == 12:
            store.put_json(layout.SUMMARY, {"done": True})  # the run is over: the actor stops

    actor = Actor(store, "a0", engine_factory=lambda model_dir, tokenizer: _StreamingTiming(tokenizer, on_group))
    real_poll = actor.source.poll

    def poll(*, native_lora):
        """Deterministic arrival: once v1 is published, the stream's next check waits until it is received."""
        ready = real_poll(native_lora=native_lora)
        if ready is None and swap["published"] and not swap["delivered"]:
            deadline = time.time() + 60
            while ready is None and time.time() < deadline:
                time.sleep(0.02)
                ready = real_poll(native_lora=native_lora)
        if ready is not None and ready.version == 1:
            swap["delivered"] = True
        return ready

    actor.source.poll = poll
    actor.run()
    assert swap["delivered"]
    files = {k: decode_rollouts(store.get(k)) for k in store.list(layout.ROLLOUTS) if k.endswith(".arrow")}
    by_version: dict[int, int] = {}
    for k, table in files.items():
        version = layout.version_of_rollout_key(k)
        rows = table.to_pylist()
        assert {r["policy_version"] for r in rows} == {version}
        # v0 was the engine's first load, v1 its second: every row of a file was sampled by its version's weights
        assert all(lp == pytest.approx(-0.01 * (version + 1)) for r in rows for lp in r["behavior_logprobs"])
        assert len({r["group_id"] for r in rows}) == 2 and len(rows) == 4  # whole batches of 2 groups x 2
        by_version[version] = by_version.get(version, 0) + 1
    assert by_version.get(0, 0) >= 2 and by_version.get(1, 0) >= 1, by_version


class _FakeVllmEngine:
    """vLLM's ``LLMEngine`` as ``VllmEngine.generate_stream`` uses it (add_request, step, has_unfinished_requests,
    abort_request): request k finishes after (k % 3) + 1 steps with n completions [k, eos]. Only the control flow is
    checked here; vLLM itself is not installed (tests/unit/rollout/test_vllm_engine.py has the real check)."""

    def __init__(self, eos: int, rename: bool = False):
        self.eos, self.rename = eos, rename
        self.requests: dict[str, list] = {}
        self.aborted: list[str] = []
        self.most_in_flight = 0

    def add_request(self, request_id, prompt, params, lora_request=None):
        assert params.output_kind == "final" and params.n == 2 and lora_request is None
        k = prompt["prompt_token_ids"][0]
        self.requests[request_id] = [k, k % 3 + 1, params.n]
        self.most_in_flight = max(self.most_in_flight, len(self.requests))

    def step(self):
        from types import SimpleNamespace as NS

        out = []
        for request_id, r in list(self.requests.items()):
            r[1] -= 1
            if r[1] == 0:
                del self.requests[request_id]
                samples = [NS(index=i, token_ids=[r[0], self.eos],
                              logprobs=[{r[0]: NS(logprob=-0.5)}, {self.eos: NS(logprob=-0.25)}]) for i in range(r[2])]
                out.append(NS(request_id=request_id + ("?" if self.rename else ""), finished=True, outputs=samples))
        return out

    def has_unfinished_requests(self):
        return bool(self.requests)

    def abort_request(self, request_ids):
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.requests.pop(request_id, None)


def _vllm_engine(monkeypatch, fake):
    """A ``VllmEngine`` around ``fake``, with the two names of vLLM it imports provided by stand-ins."""
    import itertools
    import sys
    import types

    vllm = types.ModuleType("vllm")
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.RequestOutputKind = types.SimpleNamespace(FINAL_ONLY="final")
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(output_kind=None, **kw)
    vllm.sampling_params = sampling_params
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling_params)
    from echo2.rollout.engines.vllm import VllmEngine

    engine = object.__new__(VllmEngine)  # no vLLM engine to start: only the stream's own logic runs
    engine.eos, engine._lora, engine._request_ids = fake.eos, None, itertools.count()
    engine.llm = types.SimpleNamespace(llm_engine=fake)
    return engine


def test_the_vllm_stream_adds_a_group_as_one_finishes_and_aborts_what_it_abandons(monkeypatch):
    fake = _FakeVllmEngine(eos=9)
    engine = _vllm_engine(monkeypatch, fake)
    params = SamplingParams(n=2, max_new_tokens=4)
    out = list(engine.generate_stream(iter([(f"k{k}", [k]) for k in range(7)]), params, window=3))
    assert sorted(key for key, _ in out) == [f"k{k}" for k in range(7)] and fake.most_in_flight == 3
    # in the order they finished (k takes k % 3 + 1 steps from when it went in), not the order they went in
    assert [key for key, _ in out] == ["k0", "k1", "k3", "k2", "k4", "k6", "k5"]
    for key, group in out:
        k = int(key[1:])
        assert [(c.token_ids, c.logprobs, c.finish_reason) for c in group] == [([k, 9], [-0.5, -0.25], "stop")] * 2
    stream = engine.generate_stream(iter([(f"k{k}", [k]) for k in range(7)]), params, window=3)
    next(stream)
    stream.close()  # a stop or an error: nothing may go on running in vLLM's engine
    assert len(fake.aborted) == 2 and not fake.has_unfinished_requests()
    lost = _FakeVllmEngine(eos=9, rename=True)
    with pytest.raises(RuntimeError, match="without returning"):
        list(_vllm_engine(monkeypatch, lost).generate_stream(iter([("k0", [0])]), params, window=1))


def test_the_refill_bench_runs_both_modes_on_the_same_groups():
    """``echo2 bench refill`` in its smallest form: both modes generate every group; the timing is not checked."""
    import json

    from typer.testing import CliRunner

    from echo2.cli import app

    result = CliRunner().invoke(app, ["bench", "refill", "--groups", "4", "--group-size", "2", "--groups-per-batch",
                                      "2", "--max-new-tokens", "6", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout[result.stdout.index("{"):])
    (repeat,) = out["repeats"]
    assert repeat["batch"]["groups"] == repeat["refill"]["groups"] == 4 and out["ratio"] > 0
    assert CliRunner().invoke(app, ["bench", "refill", "--mean-tokens", "1"]).exit_code == 2
