r"""Token log-probabilities of a causal LM without the full logits: the decoder once, the head in chunks.

For final hidden states h (N tokens x H), head weight W (V x H), temperature T and targets y:

    z_n      = W h_n / T                                   (one chunk of C tokens at a time: C x V)
    lse_n    = logsumexp_v z_nv                            (fp32)
    out_n    = z_{n, y_n} - lse_n = log softmax(z_n)[y_n]

Backward, for upstream gradient g_n (what the loss puts on out_n):

    dL/dz_n  = g_n (onehot(y_n) - softmax(z_n)) / T         (recomputed per chunk from h, W and lse)
    dL/dh_n  = dL/dz_n W            dL/dW = sum_n dL/dz_n^T h_n  (accumulated in fp32 over the chunks)

The forward keeps only h, W, y and lse (N floats), so no tensor of tokens x vocabulary exists beyond one
chunk's C x V: peak memory has no rows x tokens x vocabulary term. With ``where`` (the learner passes the
loss's mask) only the chosen tokens reach the head at all, forward or backward; without it every token is
computed in the forward and those whose upstream gradient is zero are still skipped in the backward.

Precision: the matmul runs in the inputs' dtype (under autocast: the autocast dtype, bf16, as the HF head
does) and, on a GPU, accumulates into fp32 logits directly (``mm(..., out_dtype=float32)``: a bf16 logit keeps
8 bits of mantissa, a poor input to a log-softmax over 150k entries); elsewhere its output is taken to fp32
before the temperature, and log-softmax, softmax and the gradient of
the logits are fp32 (the gradient is rounded to the inputs' dtype only for its two matmuls; the head
weight's gradient accumulates over the chunks in fp32). Only torch is imported: the GPU benchmark uses this
file with nothing but torch and transformers installed.
"""

from __future__ import annotations

import contextlib

import torch

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                     "output_multiplier", "inv_norm_factor")
"""Config/model attributes of transformers models whose logits are more than ``lm_head(hidden)``."""


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
"""Device types autocast knows (``meta``, the tests' stand-in for a GPU, is not one)."""


def _no_autocast(device: str):
    """Autocast off on ``device`` for the block (nothing to turn off on a device autocast does not know)."""
    return torch.autocast(device, enabled=False) if device in _AUTOCAST_DEVICES else contextlib.nullcontext()


_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")
"""Whether this torch has ``mm(..., out_dtype=...)`` (a bf16 matmul accumulated into an fp32 result)."""


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 (C, V) = hidden (C, H) @ weight (V, H).T / temperature: bf16 inputs accumulate straight into fp32 logits
    on a GPU (``out_dtype``), never rounded to bf16 first; elsewhere the matmul's output is taken to fp32."""
    if hidden.dtype != torch.float32 and hidden.device.type == "cuda" and _MM_OUT_DTYPE:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32).div_(temperature)
    return torch.mm(hidden, weight.t()).float().div_(temperature)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_tokens, skip_zero_gradients):
        # the output has the targets' shape and is no view (FSDP2 warns of a root unit returning a view)
        shaped = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        out, targets = shaped.view(-1), targets.reshape(-1)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _logits(hidden[rows], weight, temperature)
            picked = logits.gather(1, targets[rows].unsqueeze(1)).squeeze(1)
            # logsumexp in place (torch.logsumexp would allocate a second C x V buffer for the exponentials)
            top = logits.amax(dim=1, keepdim=True)
            lse[rows] = logits.sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))
            out[rows] = picked - lse[rows]
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_tokens, ctx.skip_zero_gradients = temperature, chunk_tokens, skip_zero_gradients
        return shaped

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_out = grad_out.reshape(-1)
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        # only tokens with a gradient contribute (prompt and padding positions, clipped tokens have g = 0); finding
        # them reads the device back, so the caller says whether to (``skip_zero_gradients``)
        live = grad_out.nonzero().squeeze(1) if ctx.skip_zero_gradients else None
        tokens = live.numel() if live is not None else grad_out.numel()
        with _no_autocast(hidden.device.type):
            for start in range(0, tokens, chunk_tokens):
                if live is None:
                    index = slice(start, start + chunk_tokens)
                    h, g, chunk_lse, chunk_targets = hidden[index], grad_out[index], lse[index], targets[index]
                else:
                    index = live[start : start + chunk_tokens]
                    h, g = hidden.index_select(0, index), grad_out.index_select(0, index)
                    chunk_lse, chunk_targets = lse.index_select(0, index), targets.index_select(0, index)
                g = g.float() / temperature
                # softmax from the saved logsumexp, in place: one C x V buffer
                grad_logits = _logits(h, weight, temperature).sub_(chunk_lse.unsqueeze(1)).exp_()
                grad_logits.mul_(-g.unsqueeze(1))
                grad_logits.scatter_add_(1, chunk_targets.unsqueeze(1), g.unsqueeze(1))
                grad_logits = grad_logits.to(hidden.dtype)
                if want_hidden and live is None:
                    grad_hidden[index] = torch.mm(grad_logits, weight)
                elif want_hidden:
                    grad_hidden.index_copy_(0, index, torch.mm(grad_logits, weight))
                if want_weight and h.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)  # no vocabulary x hidden temporary per chunk
                elif want_weight:
                    grad_weight.add_(torch.mm(grad_logits.t(), h))
                del grad_logits
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           temperature: float, chunk_tokens: int, *, where: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(hidden @ weight.T / temperature) at ``targets``, fp32, ``chunk_tokens`` tokens at a time.

    ``hidden``: (..., H); ``weight``: (V, H); ``targets``: (...) long, each in [0, V). Returns (...) float32.
    ``where`` (bool, like ``targets``; or the flat positions of the chosen tokens, int64, which the learner counts on
    the CPU so that choosing them reads nothing back from the device): compute only these tokens; the others are 0
    and take no gradient (the loss's mask: a prompt token's log-probability is never used, and its head matmul
    costs as much).
    Under autocast the matmuls run in the autocast dtype (the inputs are cast once, outside the chunks,
    so autograd carries the cast's gradient back to fp32 parameters).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on the tokens")
    device = hidden.device.type
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    with _no_autocast(device):
        if where is None:
            return _ChunkedTokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype),
                                               targets, float(temperature), int(chunk_tokens), True)
        if where.dtype == torch.bool:
            if where.shape != targets.shape:
                raise ValueError(f"where must be a bool tensor shaped like targets {tuple(targets.shape)}")
            where = where.reshape(-1).nonzero().squeeze(1)
        elif where.dtype != torch.int64 or where.dim() != 1:
            raise ValueError("where must be a bool mask like targets or a 1-D int64 tensor of positions")
        flat = hidden.reshape(-1, hidden.shape[-1])
        # the backward skips tokens whose gradient is zero (clipped, zero advantage) only on the CPU: finding them
        # reads the device back, which a GPU step must not do once per pack
        chosen = _ChunkedTokenLogprobs.apply(flat.index_select(0, where).to(dtype), weight.to(dtype),
                                             targets.reshape(-1).index_select(0, where), float(temperature),
                                             int(chunk_tokens), hidden.device.type == "cpu")
        # a fresh tensor, no view: FSDP2 warns of a root unit returning a view
        out = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        out.view(-1).index_copy_(0, where, chosen)
        return out


def refuse_unsupported_head(lm: torch.nn.Module) -> None:
    """Raise if the logits of ``lm`` are more than a bias-free linear head of the last hidden state."""
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # a LoRA-wrapped or otherwise replaced head: its .weight is not all
        raise ValueError(f"{type(lm).__name__}: the output head is a {type(head).__name__}, not a plain Linear; "
                         "chunked log-probabilities only take lm_head(hidden) with one weight matrix")
    if head.bias is not None:
        raise ValueError(f"{type(lm).__name__}: the output head has a bias; chunked log-probabilities take none")
    configs = [lm.config, getattr(lm.config, "text_config", None)]
    for owner in [lm, *(c for c in configs if c is not None)]:
        for name in _LOGIT_TRANSFORMS:
            value = getattr(owner, name, None)
            if value is not None and not (isinstance(value, (int, float)) and value == 1):
                raise ValueError(f"{type(lm).__name__}: its logits are transformed after the head ({name}={value!r}); "
                                 "chunked log-probabilities compute only lm_head(hidden), so they would be wrong")


class PolicyLogprobs(torch.nn.Module):
    """Token log-probabilities of a Hugging Face causal LM (also peft-wrapped) at one temperature.

    ``forward(input_ids (B, W), targets (B, W), position_ids, attention_mask, where) -> (B, W) float32``:
    element [b, j] = log p(targets[b, j] | input_ids[b, :j+1]) (0 where ``where`` is given and False). The decoder
    runs once and the chunked head runs inside
    this module's forward, so when this wrapper is FSDP2's root unit the head's weight is unsharded here.
    """

    def __init__(self, lm: torch.nn.Module, *, temperature: float, chunk_tokens: int):
        super().__init__()
        self.lm = lm
        self.temperature = float(temperature)
        self.chunk_tokens = int(chunk_tokens)
        refuse_unsupported_head(self.causal_lm)

    @property
    def causal_lm(self) -> torch.nn.Module:
        """The transformers model under a peft wrapper (LoRA layers are injected into it in place)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, where: torch.Tensor | None = None,
                **attention) -> torch.Tensor:
        """``where`` (optional, bool like ``targets``): the only positions computed; 0 elsewhere. ``attention``: keyword
        arguments the decoder passes to every attention call (a pack's boundaries, ``attention.py``)."""
        lm = self.causal_lm
        hidden = lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False, **attention).last_hidden_state
        return chunked_token_logprobs(hidden, lm.get_output_embeddings().weight, targets, self.temperature,
                                      self.chunk_tokens, where=where)
