"""The two training steps ``echo2 bench learner`` measures side by side, and the model they train.

Imports torch, transformers and the standard library only, besides echo2's torch-only learner modules
(``packing``, ``logprobs``, ``loss``): the GPU path of the benchmark runs where nothing else is installed.

echo2's step (``echo2_step``) is the learner's own code: ``Learner.step_on_columns`` with its helpers
``_backward`` / ``_micro_batch`` / ``_compute_dtype`` composed here call for call (the Learner itself imports
the config and so pydantic): group advantages, rows of groups without signal left out, first-fit-decreasing
packs of at most ``micro_batch_tokens`` tokens (``pack_by_tokens``), each pack laid out padding-free
(``assemble_packed``), ``PolicyLogprobs`` (the decoder once, then the head in chunks of ``chunk_tokens``
tokens, over the loss's tokens only: ``where=mask``) under bf16 autocast when the dtype is bfloat16 (columns and
packs are built on the CPU, as the learner builds them; on a GPU each pack's tensors are then moved to it),
``policy_loss`` with per-token advantages, backward
per pack, gradient clipping and AdamW. tests/test_bench_learner.py checks that it leaves the same weights as
``Learner.step_on_columns``. Activation checkpointing is the Learner's too: torch's composable ``checkpoint``
on every decoder layer.

The baseline (``baseline_step``) is the learner as it was before issue 19, written out here: rows sorted by
length, micro-batches of ``micro_batch_rows`` rows right-padded to their longest, ``model(...).logits`` in
full, ``log_softmax(logits.float() / T)`` and a gather, the same loss with per-row advantages, backward,
clipping and AdamW. One change: it passes ``use_cache=False`` (the old code built a KV cache it never read;
with it the baseline would only look worse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from echo2.learner.logprobs import PolicyLogprobs
from echo2.learner.loss import group_advantages, groups_with_signal, policy_loss
from echo2.learner.packing import Ragged, StepColumns, assemble_packed, pack_by_tokens

LR, MAX_GRAD_NORM, WEIGHT_DECAY = 1e-5, 1.0, 0.0
LOSS = {"clip_low": 0.2, "clip_high": 0.28, "is_cap": 3.0}
"""TrainConfig's defaults (tests/test_bench_learner.py keeps them equal); the bench cannot import the config."""
TEMPERATURE = 1.0


def make_columns(prompt_tokens: int, completion_lengths: list[int], group_size: int, vocab: int,
                 seed: int) -> StepColumns:
    """A step of ``len(completion_lengths)`` rows in groups of ``group_size`` (one random prompt per group).

    Rewards are distinct within every group, so every group has signal and every row trains; behavior
    log-probabilities sit near a random model's (-log V), so importance ratios are near 1."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(completion_lengths)
    groups = math.ceil(rows / group_size)
    prompts = torch.randint(0, vocab, (groups, prompt_tokens), generator=gen)
    group_index = torch.arange(rows) // group_size
    lengths = torch.tensor(completion_lengths, dtype=torch.int64)
    completion = _ragged(torch.randint(0, vocab, (int(lengths.sum()),), generator=gen), lengths)
    behavior = -math.log(vocab) + 0.1 * torch.randn(completion.values.shape, generator=gen)
    return StepColumns(
        prompt=_ragged(prompts[group_index].reshape(-1), torch.full((rows,), prompt_tokens)),
        completion=completion, completion_mask=torch.ones(completion.values.shape, dtype=torch.int8),
        behavior_logprobs=behavior, reward=torch.rand(rows, generator=gen), group_index=group_index,
        policy_version=torch.zeros(rows, dtype=torch.int64))


def _ragged(values: torch.Tensor, lengths: torch.Tensor) -> Ragged:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return Ragged(offsets, values)


@dataclass
class StepStats:
    padding_fraction: float
    """Share of the positions the model ran on that held no token."""
    micro_batches: int
    loss: float


def _signal(columns: StepColumns) -> tuple[torch.Tensor, list[int], int]:
    """Per-row advantages, the rows of groups with signal, and their policy tokens (step_on_columns' own)."""
    rewards, group_index = columns.reward.float(), columns.group_index
    advantages = group_advantages(rewards, group_index, scale=True)
    keep = groups_with_signal(rewards, group_index)[group_index].nonzero().squeeze(1).tolist()
    n_tokens = int(columns.policy_tokens()[keep].sum())
    return advantages, keep, n_tokens


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    # the gradients stay allocated (zeroed, not freed): they belong to the footprint measured before the step
    optimizer.zero_grad(set_to_none=False)


def _autocast(device: torch.device, dtype: torch.dtype):
    """The Learner's ``_compute_dtype``: bf16 autocast around a forward whose parameters are fp32."""
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)


def echo2_step(policy: PolicyLogprobs, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               columns: StepColumns, *, micro_batch_tokens: int, dtype: torch.dtype) -> StepStats:
    """One optimizer step as ``Learner.step_on_columns`` takes it (module docstring)."""
    advantages, keep, n_tokens = _signal(columns)
    lengths = columns.sequence_lengths()[keep].tolist()
    packs = [[keep[i] for i in pack] for pack in pack_by_tokens(lengths, micro_batch_tokens)]
    device = next(model.parameters()).device
    loss = 0.0
    for pack in packs:
        batch = assemble_packed(columns, pack, advantages)
        ids, targets, positions, behavior, pack_advantages, mask = (
            t.to(device, non_blocking=True) for t in (batch.input_ids, batch.targets, batch.position_ids,
                                                      batch.behavior_logprobs, batch.advantages, batch.mask))
        with _autocast(device, dtype):  # only the tokens the loss weighs go through the head, as in _micro_batch
            logprobs = policy(ids, targets, position_ids=positions, where=mask > 0)
        terms = policy_loss(logprobs, behavior, pack_advantages, mask, n_tokens=n_tokens, **LOSS)
        terms.loss.backward()
        loss += terms.loss.item()
    _optimizer_step(model, optimizer)
    # a packed row is exactly its sequences' tokens: no position is padding
    return StepStats(padding_fraction=0.0, micro_batches=len(packs), loss=loss)


def baseline_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, columns: StepColumns, *,
                  micro_batch_rows: int, dtype: torch.dtype) -> StepStats:
    """One optimizer step as the learner took it before issue 19 (module docstring)."""
    advantages, keep, n_tokens = _signal(columns)
    device = next(model.parameters()).device
    totals = (columns.prompt.lengths + columns.completion.lengths).tolist()
    keep.sort(key=lambda i: totals[i])
    padded = real = 0
    loss = 0.0
    batches = [keep[start : start + micro_batch_rows] for start in range(0, len(keep), micro_batch_rows)]
    for rows in batches:
        ids, attention, targets, mask, behavior = _padded(columns, rows, device)
        padded += ids.numel()
        real += int(attention.sum())
        with _autocast(device, dtype):
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        del logits
        terms = policy_loss(logprobs, behavior, advantages[rows].to(device), mask, n_tokens=n_tokens, **LOSS)
        terms.loss.backward()
        loss += terms.loss.item()
    _optimizer_step(model, optimizer)
    return StepStats(padding_fraction=1 - real / padded, micro_batches=len(batches), loss=loss)


def _padded(columns: StepColumns, rows: list[int], device: torch.device):
    """The old ``batch.assemble``: right-padded (B, W) ids and attention mask, (B, W-1) targets, mask, behavior."""
    p, c = columns.prompt, columns.completion
    width = max(int(p.lengths[i] + c.lengths[i]) for i in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    attention = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    targets = torch.zeros((len(rows), width - 1), dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width - 1), device=device)
    behavior = torch.zeros((len(rows), width - 1), device=device)
    for b, i in enumerate(rows):
        prompt = p.values[p.offsets[i] : p.offsets[i + 1]].long()
        completion = c.values[c.offsets[i] : c.offsets[i + 1]].long()
        n_p, n_c = len(prompt), len(completion)
        ids[b, : n_p + n_c] = torch.cat([prompt, completion])
        attention[b, : n_p + n_c] = 1
        span = slice(n_p - 1, n_p - 1 + n_c)
        targets[b, span] = completion
        mask[b, span] = columns.completion_mask[c.offsets[i] : c.offsets[i + 1]].float()
        behavior[b, span] = columns.behavior_logprobs[c.offsets[i] : c.offsets[i + 1]].float()
    return ids, attention, targets, mask, behavior


def build_model(config, *, device: torch.device, activation_checkpointing: bool, seed: int):
    """A random-weight causal LM from ``config`` in fp32 (the master weights), in eval mode as the learner
    keeps it, every decoder layer checkpointed when asked (the Learner's ``_checkpoint_layers``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for layer in model.get_decoder().layers:
            checkpoint(layer)
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The learner's AdamW, its state and the gradients allocated now (an AdamW step on zero gradients
    moves no weight at weight decay 0), so that memory measured after this holds all of them."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.999))
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return optimizer


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters a token's forward multiplies by: all but the input embedding (a lookup; counted once when
    tied to the head, as the head), and of each MoE layer's experts only top-k of num_experts."""
    config = model.config
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = 0
    for name, p in model.named_parameters():
        if p is embedding and p is not head:
            continue
        if ".experts." in name:
            total += p.numel() * config.num_experts_per_tok // config.num_experts
        else:
            total += p.numel()
    return total


PEAK_BF16_TFLOPS = {"H200": 989.0, "GH200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H20": 148.0,
                    "B200": 2250.0, "A100": 312.0, "A10G": None, "A10": 125.0, "L40S": 362.0, "L40": 181.0,
                    "L4": 121.0}
"""Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, from NVIDIA's datasheets (SXM parts; the H100 PCIe
apart); matched as substrings of the device name in this order, the more specific names first (H200 before
H20, H100 PCIe before H100, A10G before A10, L40S before L40 before L4). None: no figure here (no MFU)."""


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_name.lower():
            return tflops
    return None
