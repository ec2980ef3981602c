"""The transformers engine's behavior logprobs agree with the learner's recomputation (``PolicyLogprobs``)."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo2.data.weights import unique_state_dict
from echo2.learner.logprobs import PolicyLogprobs
from echo2.rollout.engines import SamplingParams
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
            "bad = [m for m in sys.modules if m.split('.')[0] in ('prefect', 'flows') "
            "or m.startswith('echo2.learner')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
