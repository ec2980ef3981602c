"""Attention over a packed row without an N x N mask, and with each shared prompt computed once.

A packed micro-batch (``packing.py``) lays several pieces end to end in one row: per group of rows that share a
prompt (GRPO's G samples of one prompt), the prompt once (its prefix: all but its last token), then each row's
segment (the prompt's last token and its completion but the last); a row alone is its prefix and one segment, one
causal sequence. A prefix attends causally to itself, a segment to its group's prefix and causally to itself:
nothing crosses into another group or another row. Left to itself, transformers would read the restarting
position ids as a pack and build a dense (1, 1, N, N) block-diagonal mask for sdpa, which rules out sdpa's flash
kernel, repeats K/V to every query head, does N^2 work and cannot express a shared prefix. Here the learner passes
the pack's layout (``PackAttention``, keyword ``echo2_pack``) down to the attention layers, and an attention function
registered with transformers (``ATTENTION``, through ``AttentionInterface``) runs

    on CUDA, bf16/fp16   torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``): one
                         query sequence per piece, a segment's keys its prefix then itself (gathered), causal
                         aligned bottom-right; K/V heads repeated where the installed torch lacks its GQA option
    elsewhere            scaled_dot_product_attention piece by piece (exact: each row computed as it would be alone;
                         a fp32 GPU step and the CPU take this path)

No mask builder is registered beside it: transformers then builds no mask for the model and does not look for packs
in the position ids (which reads the device back). A call without a layout whose positions restart at 0 is read
as transformers would read it, one causal sequence per restart (``_pack_from_positions``); any other, one causal
sequence (transformers' sdpa function, no mask). Generation needs a padding mask and a KV cache, so the learner
generates inside ``masked_attention``, which puts the model back on transformers' sdpa and its masks for the call.

Chosen by ``train.attention`` (``auto``: this). Imports torch and transformers only (the GPU check runs it where
nothing else is installed).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = "echo2_varlen"
"""The name this attention is registered under (a model's ``config._attn_implementation``)."""


@dataclass
class PackAttention:
    """Who attends to what in a pack (``PackedBatch.layout``), ready for the attention call."""

    pieces: list[tuple[int, int, int, int]]
    """(query start, query length, its prefix's start, prefix length) per piece, in order; a prefix's own entry (or
    a row alone, laid as one sequence) has prefix length 0: its keys are itself."""
    cu_q: torch.Tensor
    """(pieces + 1,) int32 cumulative query lengths, on the device (the varlen kernel's)."""
    cu_k: torch.Tensor
    """(pieces + 1,) int32 cumulative key lengths (a segment's keys: its prefix then itself)."""
    max_q: int
    max_k: int
    kv_index: torch.Tensor | None
    """Every piece's keys as positions of the pack, on the device (the varlen kernel reads K and V gathered by it);
    None where every piece's keys are its own queries (no prompt shared)."""


def pack_attention(layout: list[tuple[int, list[int]]], device: torch.device) -> dict:
    """The keyword arguments that carry a pack's layout (``PackedBatch.layout``) to ``varlen_attention``
    (transformers passes a decoder's extra keyword arguments down to every attention call)."""
    pieces: list[tuple[int, int, int, int]] = []
    keys: list[range] = []
    cursor, shared = 0, False
    for prefix, segments in layout:
        start = cursor
        if len(segments) == 1:  # a row alone: one causal sequence over its prefix and its segment
            pieces.append((start, prefix + segments[0], start, 0))
            keys.append(range(start, start + prefix + segments[0]))
            cursor += prefix + segments[0]
            continue
        shared = True
        if prefix:
            pieces.append((start, prefix, start, 0))
            keys.append(range(start, start + prefix))
        cursor += prefix
        for length in segments:
            if length:
                pieces.append((cursor, length, start, prefix))
                keys.append(range(start, start + prefix))
                keys.append(range(cursor, cursor + length))
            cursor += length
    q_lengths = [q for _, q, _, _ in pieces]
    k_lengths = [q + p for _, q, _, p in pieces]
    cu_q, cu_k = (torch.zeros(len(pieces) + 1, dtype=torch.int32) for _ in range(2))
    torch.cumsum(torch.tensor(q_lengths, dtype=torch.int32), 0, out=cu_q[1:])
    torch.cumsum(torch.tensor(k_lengths, dtype=torch.int32), 0, out=cu_k[1:])
    kv_index = None
    if shared:
        kv_index = torch.tensor([i for run in keys for i in run], dtype=torch.int64).to(device, non_blocking=True)
    return {"echo2_pack": PackAttention(pieces, cu_q.to(device, non_blocking=True), cu_k.to(device, non_blocking=True),
                                        max(q_lengths, default=0), max(k_lengths, default=0), kv_index)}


def _flash_varlen():
    """torch's varlen flash attention and the keywords this torch takes for causality and GQA, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def _per_piece(query, key, value, pack: PackAttention, scale: float | None) -> torch.Tensor:
    """(T, H, D) attention piece by piece with sdpa: a prefix or a row alone causally, a segment over its prefix and
    causally over itself (a boolean mask of the segment's queries by its keys, causal aligned bottom-right)."""
    out = torch.empty_like(query)
    for start, length, prefix_start, prefix in pack.pieces:
        q = query[start : start + length].transpose(0, 1)  # (H, L, D)
        gqa = key.shape[1] != query.shape[1]
        if prefix:
            k, v = (torch.cat([t[prefix_start : prefix_start + prefix], t[start : start + length]]).transpose(0, 1)
                    for t in (key, value))
            mask = torch.ones(length, prefix + length, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            k, v = (t[start : start + length].transpose(0, 1) for t in (key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start : start + length] = o.transpose(0, 1)
    return out


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, echo2_pack=None,
                     **kwargs):
    """A transformers attention function: query (1, Hq, T, D), key/value (1, Hkv, T, D) -> ((1, T, Hq, D), None)."""
    if echo2_pack is None:
        echo2_pack = _pack_from_positions(query, key, attention_mask, kwargs.get("position_ids"))
    if echo2_pack is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, not {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    flash = _flash_varlen() if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) else None
    if flash is None:
        return _per_piece(q, k, v, echo2_pack, scaling).unsqueeze(0), None
    kernel, causal, gqa = flash
    extra = dict(causal)  # bottom-right aligned where a piece has more keys than queries, as flash attention is
    if k.shape[1] != q.shape[1]:
        if gqa:
            extra["enable_gqa"] = True
        else:  # this torch's kernel wants as many K/V heads as query heads: (T, Hkv, D) -> (T, Hq, D)
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if echo2_pack.kv_index is not None:  # each segment's keys: its group's prefix, then itself
        k, v = k.index_select(0, echo2_pack.kv_index), v.index_select(0, echo2_pack.kv_index)
    out = kernel(q, k, v, echo2_pack.cu_q, echo2_pack.cu_k, echo2_pack.max_q, echo2_pack.max_k, scale=scaling,
                 **extra)
    return out.unsqueeze(0), None


def _pack_from_positions(query, key, attention_mask, position_ids) -> PackAttention | None:
    """A caller that packed sequences without a layout (positions restarting at 0, no mask, no cache): the same
    sequences, found from the positions as transformers would find them (which reads the device back: the learner
    always passes its layout). None for anything else."""
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return None
    starts = (position_ids.reshape(-1) == 0).nonzero().reshape(-1).tolist()
    if starts[:1] != [0] or len(starts) == 1:
        return None
    ends = [*starts[1:], query.shape[2]]
    return pack_attention([(0, [end - start]) for start, end in zip(starts, ends)], query.device)["echo2_pack"]


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
