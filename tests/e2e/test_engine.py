"""The transformers engine: behavior logprobs agree with the learner's recomputation (``PolicyLogprobs``),
it runs on the device it is given (the meta device standing in for a GPU, ``tests/support/placement.py``) and never
holds the whole generation's logits; the vLLM engine's per-version weights file (its helpers only: vLLM is
not installed here)."""

import subprocess
import sys

import pytest
import torch
from placement import PlacementGuard
from pydantic import ValidationError
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from echo2.config import ConfigError, TransformersEngineConfig, load_config
from echo2.data.weights import unique_state_dict
from echo2.errors import Echo2InputError
from echo2.learner.logprobs import PolicyLogprobs
from echo2.rollout.engines import SamplingParams, make_engine
from echo2.rollout.engines.transformers import TransformersEngine


def test_behavior_logprobs_match_teacher_forced_fp32(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    engine = TransformersEngine(tiny_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine.load_weights(unique_state_dict(model).items())
    prompts = [tok("What is 1 + 2?")["input_ids"], tok("What is 13 + 4? Think.")["input_ids"]]  # unequal lengths
    temperature = 0.7
    groups = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=6, temperature=temperature, seed=1))
    assert [len(g) for g in groups] == [3, 3]
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) > 0
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == tok.eos_token_id
            ids = torch.tensor([prompt + c.token_ids])
            targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # the last position predicts nothing here
            with torch.no_grad():
                lp = PolicyLogprobs(model, temperature=temperature, chunk_tokens=4)(ids, targets)
            lp = lp[0, len(prompt) - 1 : -1]
            assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4), (lp, c.logprobs)


def test_engine_refuses_weights_that_do_not_fit(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = TransformersEngine(tiny_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    import pytest

    with pytest.raises(ValueError, match="do not fit"):
        engine.load_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])


@pytest.mark.e2e
def test_actor_side_never_imports_prefect():
    code = ("import sys, echo2.cli, echo2.rollout.actor, echo2.rollout.engines.transformers; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'prefect' "
            "or m.startswith(('echo2.flows', 'echo2.learner'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generates_on_its_device(tiny_model):
    """The model on meta (a GPU's stand-in): every tensor the engine makes for generate (ids, mask, the
    logprob recorder's) must be there too, or the guard refuses the op that mixes them. No weights: meta
    has no data to load into."""
    engine = TransformersEngine(tiny_model, eos_token_id=2, pad_token_id=2, batch_size=8, device="meta")
    assert {p.device.type for p in engine.model.parameters()} == {"meta"}
    prompts = [[1, 5, 6, 7], [1, 8]]
    # one batch (the guard's read count runs on across batches); generate reads a few flags before its loop:
    # 10 false reads leave it several decoding steps, so the recorder gathers tokens from the next step's
    # inputs under the guard, not only from the final sequences
    with PlacementGuard(false_reads=10):
        groups = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8, temperature=0.7, seed=0))
    assert [len(g) for g in groups] == [3, 3]
    for c in (c for g in groups for c in g):
        assert len(c.token_ids) == len(c.logprobs) >= 2


class LargestAllocation(TorchDispatchMode):
    """The most bytes any op's freshly allocated output held (views and in-place results, whose storage is
    an input's, are not allocations)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.largest:  # rare: check it
                inputs = tree_flatten((args, kwargs))[0]
                if all(t.untyped_storage().data_ptr() != i.untyped_storage().data_ptr()
                       for i in inputs if isinstance(i, torch.Tensor)):
                    self.largest = t.numel() * t.element_size()
        return out


@pytest.mark.e2e
def test_generation_never_holds_the_logits_of_every_step(tmp_path):
    """A 32k vocabulary and up to 256 new tokens: the largest tensor generate allocates is one step's scores
    (B x V), not B x T x V (the engine once stacked every step's logits: 4 x 256 x 32k fp32, 134 MB, here)."""
    rows, vocab, new_tokens = 4, 32768, 256
    LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True).save_pretrained(tmp_path)
    engine = TransformersEngine(tmp_path, eos_token_id=0, pad_token_id=0, batch_size=rows)
    with LargestAllocation() as mode:
        groups = engine.generate([[1, 2, 3]], SamplingParams(n=rows, max_new_tokens=new_tokens, temperature=0.7,
                                                             seed=0))
    assert [len(g) for g in groups] == [rows]
    generated = max(len(c.token_ids) for c in groups[0])  # sampling may stop at eos early: not asserted on
    step = rows * vocab * 4  # one step's fp32 scores
    assert mode.largest < 4 * step, (mode.largest, step, f"B x T x V would be {rows * generated * vocab * 4}")


def test_a_gpu_asked_for_without_cuda_is_refused_in_one_line(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine, also on a GPU one
    config = load_config(None, ["rollout.engine.device=cuda"])
    with pytest.raises(Echo2InputError, match="CUDA is not available") as err:
        make_engine(config, tiny_model, AutoTokenizer.from_pretrained(tiny_model), seed=1)
    assert "rollout.engine.device" in str(err.value) and "\n" not in str(err.value)


def test_engine_device_names_are_checked_in_the_config():
    for name in ("auto", "cpu", "cuda", "cuda:1", "meta"):
        assert TransformersEngineConfig(device=name).device == name
    with pytest.raises(ValidationError, match="not a device"):
        TransformersEngineConfig(device="gpu")
    with pytest.raises(ConfigError, match=r"rollout\.engine\..*device.*cuda0"):
        load_config(None, ["rollout.engine.device=cuda0"])


def test_vllm_weights_file_holds_the_dtype_vllm_computes_in(tiny_model, tmp_path, monkeypatch):
    from echo2.rollout.engines import vllm as engine_module
    from echo2.rollout.engines.vllm import file_dtype, file_tensor, write_weights_file

    fp32, bf16 = torch.float32, torch.bfloat16
    assert file_dtype("bfloat16", fp32, fp32) == bf16  # the engine's dtype named: that one
    assert file_dtype("float16", bf16, fp32) == torch.float16
    assert file_dtype("auto", bf16, fp32) == bf16  # auto: the model config's (a torch dtype or its name)
    assert file_dtype("auto", "bfloat16", fp32) == bf16
    assert file_dtype("auto", None, fp32) == fp32  # a config that names none: the published tensor's
    assert file_tensor("bfloat16", None, torch.arange(3)).dtype == torch.int64  # integers are left alone
    state = {k: v.clone() for k, v in unique_state_dict(AutoModelForCausalLM.from_pretrained(tiny_model)).items()}
    tensors = dict(state)
    path = tmp_path / "weights.safetensors"
    written = write_weights_file(path, tensors, engine_dtype="auto", model_dtype=bf16)
    assert all(t.dtype == bf16 for t in tensors.values())  # converted in place: no second dict
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(state)
        for name in state:
            assert torch.equal(f.get_tensor(name), state[name].to(bf16))
    assert written == path.stat().st_size < sum(t.numel() * 4 for t in state.values()) * 0.6
    assert [p.name for p in tmp_path.iterdir()] == ["weights.safetensors"]

    def crash(tensors, filename):  # a write that dies half way: no file under the name the reload reads
        open(filename, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(engine_module, "save_file", crash)
    path.unlink()
    with pytest.raises(OSError, match="disk full"):
        write_weights_file(path, dict(state), engine_dtype="float32", model_dtype=None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_vllm_engine_module_imports_vllm_only_when_an_engine_is_built():
    code = "import sys, echo2.rollout.engines.vllm; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_prompt_repeated_in_a_batch_is_prefilled_once_and_samples_the_same(tiny_model):
    """GRPO asks for G completions of each prompt: the engine prefills each distinct prompt once and repeats its KV
    cache for the rows that share it. Under the same seed the tokens are the same and the log-probabilities within
    float order of a prefill per row."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = TransformersEngine(tiny_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engine.load_weights(unique_state_dict(model).items())
    distinct = [tok("What is 1 + 2?")["input_ids"], tok("What is 13 + 4? Think.")["input_ids"]]
    prompts = [p for p in distinct for _ in range(3)] + [distinct[0]]  # repeats, and rows of unequal length
    prefills = []
    engine.model.register_forward_pre_hook(lambda _m, args, kwargs: prefills.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    out = {}
    for share in (False, True):
        engine.share_prefill = share
        prefills.clear()
        out[share] = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=6, temperature=0.8, seed=5))
        first = prefills[0]
        assert first[0] == (2 if share else len(prompts)) and first[1] > 1  # one prefill row per distinct prompt
    for (a,), (b,) in zip(out[False], out[True]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
