"""Chunked token log-probabilities (echo2/learner/logprobs.py) against the full-logits computation."""

from __future__ import annotations

import pytest
import torch
from logprobs_shared import tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from echo2.learner.logprobs import PolicyLogprobs, chunked_token_logprobs


def full_logprobs(hidden, weight, targets, temperature):
    """What the learner computed before: every logit, then log-softmax, then gather."""
    logits = (hidden.float() @ weight.float().T) / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def inputs(rows=3, tokens=7, width=16, vocab=50, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, tokens, width, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(vocab, width, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows, tokens), generator=gen)
    upstream = torch.randn(rows, tokens, generator=gen)
    upstream[0, :3] = 0.0  # masked tokens (prompt, padding): the backward skips them
    return hidden, weight, targets, upstream


def values_and_grads(fn, hidden, weight, targets, upstream):
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, targets)
    (out * upstream).sum().backward()
    return out.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 3, 4, 21, 1000])  # 3 and 4 do not divide the 21 tokens; 1000 > all
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_full_logits_in_fp32(chunk, temperature):
    hidden, weight, targets, upstream = inputs()
    expected = values_and_grads(lambda h, w, y: full_logprobs(h, w, y, temperature), hidden, weight, targets, upstream)
    got = values_and_grads(lambda h, w, y: chunked_token_logprobs(h, w, y, temperature, chunk),
                           hidden, weight, targets, upstream)
    assert got[0].dtype == torch.float32
    for name, a, b in zip(("logprobs", "grad hidden", "grad weight"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def lm_like_inputs():
    """Logits up to about 18 in magnitude, as a language model's are (bf16's rounding error grows with them)."""
    hidden, weight, targets, upstream = inputs(width=64, vocab=500)
    return (hidden.detach() * 0.5).requires_grad_(), weight, targets, upstream


def test_bf16_inputs_within_tolerance():
    """bf16 hidden and weight: fp32 log-softmax of bf16-rounded logits, within 0.03 nats of fp32 on average
    (0.1 at most) and gradients within 2% (the README has what it measured)."""
    hidden, weight, targets, upstream = lm_like_inputs()
    exact = values_and_grads(lambda h, w, y: full_logprobs(h, w, y, 1.0), hidden, weight, targets, upstream)
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    out, grad_h, grad_w = values_and_grads(lambda h, w, y: chunked_token_logprobs(h, w, y, 1.0, 5), h16, w16,
                                           targets, upstream)
    assert out.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: a logit near 16 is rounded by up to 0.03, and the inputs are rounded too
    assert (out - exact[0]).abs().max() < 0.1
    assert (out - exact[0]).abs().mean() < 0.03
    for got, want in ((grad_h, exact[1]), (grad_w, exact[2])):
        assert torch.linalg.vector_norm(got.float() - want) <= 0.02 * torch.linalg.vector_norm(want)


def test_autocast_runs_the_head_in_bf16_with_fp32_gradients_for_fp32_parameters():
    hidden, weight, targets, upstream = lm_like_inputs()
    exact = values_and_grads(lambda h, w, y: full_logprobs(h, w, y, 1.0), hidden, weight, targets, upstream)

    def under_autocast(h, w, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return chunked_token_logprobs(h, w, y, 1.0, 4)

    out, grad_h, grad_w = values_and_grads(under_autocast, hidden, weight, targets, upstream)
    assert out.dtype == grad_h.dtype == grad_w.dtype == torch.float32
    assert 0 < (out - exact[0]).abs().max() < 0.1  # nonzero: the matmul did run in bf16
    assert torch.linalg.vector_norm(grad_w - exact[2]) <= 0.02 * torch.linalg.vector_norm(exact[2])


def test_frozen_head_gets_no_gradient():
    """LoRA leaves the head frozen: only the hidden states' gradient is computed."""
    hidden, weight, targets, upstream = inputs()
    weight.requires_grad_(False)
    (chunked_token_logprobs(hidden, weight, targets, 1.0, 4) * upstream).sum().backward()
    expected = torch.autograd.grad((full_logprobs(hidden, weight, targets, 1.0) * upstream).sum(), hidden)[0]
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-6, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any op's output had (every tensor an op allocates is some op's output)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def largest_tensor(fn, rows, tokens, width, vocab):
    hidden, weight, targets, upstream = inputs(rows, tokens, width, vocab)
    with LargestTensor() as mode:
        (fn(hidden, weight, targets) * upstream).sum().backward()
    return mode.largest


def test_no_tensor_of_rows_tokens_vocabulary_in_forward_or_backward():
    rows, tokens, width, vocab, chunk = 4, 32, 8, 200, 16
    full = rows * tokens * vocab
    # the check sees the full-logits path's (rows, tokens, vocab) tensors ...
    assert largest_tensor(lambda h, w, y: full_logprobs(h, w, y, 1.0), rows, tokens, width, vocab) >= full
    # ... and the chunked path's largest is one chunk of logits (or the weight's gradient, vocab x width)
    largest = largest_tensor(lambda h, w, y: chunked_token_logprobs(h, w, y, 1.0, chunk), rows, tokens, width, vocab)
    assert largest == max(chunk * vocab, vocab * width)
    assert largest * 8 <= full


# -- PolicyLogprobs over a transformers model ---------------------------------------------------------


def shifted_reference(model, input_ids, attention_mask, temperature):
    """log p(input_ids[j+1] | input_ids[:j+1]) from the model's own logits, (B, W-1)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    return full_logprobs(logits, torch.eye(logits.shape[-1]), input_ids[:, 1:], temperature)


def test_policy_logprobs_equals_the_models_own_logits():
    model = tiny_llama()
    input_ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # a right-padded row
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    policy = PolicyLogprobs(model, temperature=0.8, chunk_tokens=5)
    got = policy(input_ids, targets, attention_mask=attention_mask)[:, :-1]
    expected = shifted_reference(model, input_ids, attention_mask, 0.8)
    real = attention_mask[:, 1:].bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-6, atol=1e-6)
    # the gradient reaches the decoder and the tied head/embedding
    got[real].sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_policy_logprobs_of_a_peft_model_uses_its_adapters():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    for name, p in model.named_parameters():  # a nonzero adapter, so that leaving it out would show
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    input_ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    got = PolicyLogprobs(model, temperature=1.0, chunk_tokens=4)(input_ids, targets)[:, :-1]
    expected = shifted_reference(model, input_ids, torch.ones_like(input_ids), 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    got.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_packed_position_ids_restart_each_sequence():
    """Two sequences in one row, position ids restarting: each equals that sequence run alone."""
    model = tiny_llama()
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 97, (1, 6), generator=gen), torch.randint(0, 97, (1, 5), generator=gen)
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(6), torch.arange(5)]).unsqueeze(0)
    targets = torch.cat([a[:, 1:], a[:, :1], b[:, 1:], b[:, :1]], dim=1)  # the column after each sequence: unused
    policy = PolicyLogprobs(model, temperature=1.0, chunk_tokens=3)
    got = policy(packed, targets, position_ids=positions)
    torch.testing.assert_close(got[:, :5], shifted_reference(model, a, torch.ones_like(a), 1.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 6:10], shifted_reference(model, b, torch.ones_like(b), 1.0), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (lambda m: setattr(m.config, "final_logit_softcapping", 30.0), "final_logit_softcapping"),
    (lambda m: setattr(m.config, "logits_scaling", 4.0), "logits_scaling"),
    (lambda m: setattr(m, "lm_head", torch.nn.Linear(32, 97, bias=True)), "bias"),
])
def test_refuses_a_model_whose_logits_are_more_than_the_head(change, message):
    model = tiny_llama(tie_word_embeddings=False)
    change(model)
    with pytest.raises(ValueError, match=message):
        PolicyLogprobs(model, temperature=1.0, chunk_tokens=4)


def test_refuses_a_lora_wrapped_head():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(tie_word_embeddings=False),
                           LoraConfig(r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0))
    with pytest.raises(ValueError, match="not a plain Linear"):
        PolicyLogprobs(model, temperature=1.0, chunk_tokens=4)


def test_where_computes_only_the_chosen_tokens():
    """``where`` (the loss's mask): the same values and gradients there, 0 elsewhere, and the head sees only them."""
    hidden, weight, targets, upstream = inputs(rows=2, tokens=12)
    where = torch.zeros_like(targets, dtype=torch.bool)
    where[0, 5:9] = where[1, 2:] = True
    masked = upstream * where
    expected = values_and_grads(lambda h, w, y: full_logprobs(h, w, y, 0.9), hidden, weight, targets, masked)
    got = values_and_grads(lambda h, w, y: chunked_token_logprobs(h, w, y, 0.9, 5, where=where), hidden, weight,
                           targets, masked)
    torch.testing.assert_close(got[0][where], expected[0][where], rtol=1e-6, atol=1e-6)
    assert (got[0][~where] == 0).all()
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-6, atol=1e-6)
    # with one chunk for everything, the largest logits block is the chosen tokens' alone
    vocab = weight.shape[0]
    largest = largest_tensor(lambda h, w, y: chunked_token_logprobs(h, w, y, 1.0, 10_000, where=where), 2, 12, 4,
                             vocab)
    assert largest == int(where.sum()) * vocab < 2 * 12 * vocab
