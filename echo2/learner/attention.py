"""Attention over a packed row without an N x N mask: each sequence attends causally to itself alone.

A packed micro-batch (``packing.py``) lays several sequences end to end in one row. Left to itself, transformers
reads the restarting position ids as a pack and builds a dense (1, 1, N, N) block-diagonal mask for sdpa, which
rules out sdpa's flash kernel, repeats K/V to every query head and does N^2 work for sum(L_i^2) of use. Here the
learner passes the pack's sequence boundaries (``cu_seq_lens``, cumulative lengths) down to the attention layers,
and an attention function registered with transformers (``ATTENTION``, through ``AttentionInterface``) runs

    on CUDA, bf16/fp16   torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``,
                         causal per sequence; K/V heads repeated where the installed torch lacks its GQA option)
    elsewhere            scaled_dot_product_attention per sequence, causal, no mask (exact: each sequence is
                         computed exactly as it would be alone; a fp32 GPU step and the CPU take this path)

No mask builder is registered beside it: transformers then builds no mask for the model and does not look for packs
in the position ids. A call without boundaries is one causal sequence (transformers' sdpa function, no mask).
Generation needs a padding mask and a KV cache, so the learner generates inside ``masked_attention``, which puts
the model back on transformers' sdpa and its masks for the call.

Chosen by ``train.attention`` (``auto``: this on CUDA, transformers' masked sdpa on the CPU). Imports torch and
transformers only (the GPU check runs it where nothing else is installed).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F

ATTENTION = "echo2_varlen"
"""The name this attention is registered under (a model's ``config._attn_implementation``)."""


def sequence_boundaries(lengths: torch.Tensor, device: torch.device) -> dict:
    """The keyword arguments that carry a pack's boundaries to ``varlen_attention`` (transformers passes a
    decoder's extra keyword arguments down to every attention call): cumulative int32 lengths on ``device``, the
    longest, and the same boundaries as a host list. ``lengths``: (n,) the pack's sequence lengths, on the CPU."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(lengths.to(torch.int32), 0, out=cu[1:])
    longest = int(lengths.max()) if len(lengths) else 0
    bounds = [0, *torch.cumsum(lengths, 0).tolist()]  # host copy: the per-sequence path never reads the device's
    cu = cu.to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": longest, "max_length_k": longest, "pack_bounds": bounds}


def _flash_varlen():
    """torch's varlen flash attention and the keywords this torch takes for causality and GQA, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def _per_sequence(query, key, value, cu: list[int], scale: float | None) -> torch.Tensor:
    """(T, H, D) causal attention of each sequence alone with sdpa (no mask: ``is_causal`` within a sequence)."""
    out = torch.empty_like(query)
    for start, end in zip(cu[:-1], cu[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # (H, L, D)
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                        enable_gqa=k.shape[0] != q.shape[0]).transpose(0, 1)
    return out


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, cu_seq_lens_q=None,
                     max_length_q=None, pack_bounds=None, **kwargs):
    """A transformers attention function: query (1, Hq, T, D), key/value (1, Hkv, T, D) -> ((1, T, Hq, D), None)."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, not {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    flash = _flash_varlen() if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) else None
    if flash is None:
        out = _per_sequence(q, k, v, pack_bounds if pack_bounds is not None else cu_seq_lens_q.tolist(), scaling)
    else:
        kernel, causal, gqa = flash
        extra = dict(causal)
        if k.shape[1] != q.shape[1]:
            if gqa:
                extra["enable_gqa"] = True
            else:  # this torch's kernel wants as many K/V heads as query heads: (T, Hkv, D) -> (T, Hq, D)
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = kernel(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **extra)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def masked_attention(model: torch.nn.Module):
    """transformers' sdpa, with the masks transformers builds, for the block: generation with left padding and a KV
    cache (evaluation with the policy itself) needs the padding mask, which a model on ``ATTENTION`` never builds."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = before


def register() -> str:
    """Register the attention function with transformers (idempotent); returns the name. No mask builder is
    registered beside it, so transformers builds no mask at all (nor looks for packs in the position ids, which
    reads the device back) for a model on ``ATTENTION``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
    return ATTENTION
