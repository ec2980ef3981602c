"""The two training steps ``echo2 bench learner`` measures side by side, and the models they train.

Imports torch, transformers and the standard library, besides echo2's learner, which itself needs only those,
accelerate and pyarrow (what a stock GPU image holds: the GPU path runs where pydantic is not installed).

echo2's step is the learner's own: ``bench_learner`` builds the real ``Learner`` (``echo2/learner/learner.py``) on
a random-weight model saved to a folder, with ``TrainConfig``'s defaults (``LEARNER_DEFAULTS``, kept equal to them
by tests/e2e/test_bench_learner.py) and the bench's options, and ``echo2_step`` calls ``Learner.step_on_columns``: the
device and compute dtype it chooses, FSDP2 on a GPU, token-budget packs, the chunked head over the loss's tokens,
varlen attention on CUDA, activation checkpointing where asked, the GRPO loss, clipping and AdamW.

The baseline (``baseline_step``) is the learner as it was before token-budget packing, written out here: rows
sorted by length, micro-batches of ``micro_batch_rows`` rows right-padded to their longest, ``model(...).logits``
in full, ``log_softmax(logits.float() / T)`` and a gather, the same loss with per-row advantages, backward,
clipping and AdamW, under bf16 autocast when the dtype is bf16. One change: it passes ``use_cache=False`` (the old
code built a KV cache it never read; with it the baseline would only look worse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from echo2.learner.loss import group_advantages, groups_with_signal, policy_loss
from echo2.learner.packing import Ragged, StepColumns, pack_rows, pack_tokens, prompt_groups

LEARNER_DEFAULTS = {
    "dtype": "auto", "attention": "auto", "lr": 1e-5, "weight_decay": 0.0, "max_grad_norm": 1.0,
    "clip_low": 0.2, "clip_high": 0.28, "is_cap": 3.0, "kl_coef": 0.0, "scale_rewards": True,
    "micro_batch_tokens": 8192, "logprob_chunk_tokens": 1024, "activation_checkpointing": False, "lora_rank": 0,
    "lora_alpha": 32.0, "lora_target_modules": "all-linear",
}
"""The ``TrainConfig`` fields the ``Learner`` reads, at their defaults (tests/e2e/test_bench_learner.py keeps them
equal): the bench builds the real learner where pydantic, and so ``TrainConfig``, is not installed. Its device (and the
published dtype and shard size, which the bench never publishes) are the ``Learner``'s keywords."""
LR, MAX_GRAD_NORM = LEARNER_DEFAULTS["lr"], LEARNER_DEFAULTS["max_grad_norm"]
WEIGHT_DECAY = LEARNER_DEFAULTS["weight_decay"]
LOSS = {k: LEARNER_DEFAULTS[k] for k in ("clip_low", "clip_high", "is_cap")}
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
    """bf16 autocast around a forward whose parameters are fp32 (the baseline's)."""
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)


def learner_settings(**changes):
    """The ``TrainConfig`` fields the learner reads, at their defaults with ``changes``, without pydantic."""
    unknown = set(changes) - set(LEARNER_DEFAULTS)
    if unknown:
        raise ValueError(f"not learner settings: {sorted(unknown)}")
    return SimpleNamespace(**{**LEARNER_DEFAULTS, **changes})


def save_random_model(config, folder: Path, *, dtype: torch.dtype, seed: int) -> Path:
    """A random-weight model of ``config`` saved in ``dtype`` (a bf16 checkpoint, as published models are, on a GPU)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    return folder


def bench_learner(model_dir: Path, *, device: str, dtype: str, micro_batch_tokens: int, chunk_tokens: int,
                  activation_checkpointing: bool, attention: str = "auto"):
    """The real ``Learner`` on ``model_dir`` with its AdamW state made (one step on zero gradients, which moves no
    weight at weight decay 0), so that memory measured after this holds the model, gradients and optimizer."""
    from echo2.learner.learner import Learner

    learner = Learner(model_dir, learner_settings(dtype=dtype, micro_batch_tokens=micro_batch_tokens,
                                                  logprob_chunk_tokens=chunk_tokens, attention=attention,
                                                  activation_checkpointing=activation_checkpointing),
                      temperature=TEMPERATURE, device=device)
    for p in learner.model.parameters():
        p.grad = torch.zeros_like(p)
    learner.optimizer.step()
    return learner


def echo2_step(learner, columns: StepColumns) -> StepStats:
    """One optimizer step of the real learner (``Learner.step_on_columns``)."""
    metrics = learner.step_on_columns(columns)
    # a packed row is exactly its pieces' tokens: no position is padding
    return StepStats(padding_fraction=0.0, micro_batches=len(learner_packs(learner, columns)), loss=metrics["loss"])


def learner_packs(learner, columns: StepColumns) -> list[list[int]]:
    """The packs the learner makes of the rows it trains on (those of groups with signal)."""
    _, keep, _ = _signal(columns)
    return pack_rows(columns, keep, learner._pack_budget, share_prompts=learner.shares_prompts)


def computed_tokens(learner, columns: StepColumns) -> int:
    """Tokens the learner's model runs on in a step: each shared prompt once (``packing.py``)."""
    return sum(pack_tokens(columns, pack, share_prompts=learner.shares_prompts)
               for pack in learner_packs(learner, columns))


def attention_flops(columns: StepColumns, config, *, share_prompts: bool) -> float:
    """FLOPs of causal attention's two matmuls (scores and weighted values) in a training step (forward and
    backward, 3x the forward): 12 x layers x heads x head dim x query-key pairs attended, the pairs of each piece of a
    pack (a sequence alone: L^2 / 2; with a shared prompt its prefix once, L0^2 / 2, and each segment over it and
    itself, L0 L_i + L_i^2 / 2)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    _, keep, _ = _signal(columns)
    pairs = 0.0
    for group in (prompt_groups(columns, keep) if share_prompts else [[r] for r in keep]):
        prefix = int(columns.prompt.lengths[group[0]]) - 1
        segments = [int(columns.completion.lengths[r]) for r in group]
        if len(group) == 1:
            pairs += (prefix + segments[0]) ** 2 / 2
        else:
            pairs += prefix**2 / 2 + sum(c * prefix + c * c / 2 for c in segments)
    return 12.0 * config.num_hidden_layers * heads * head_dim * pairs


def baseline_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, columns: StepColumns, *,
                  micro_batch_rows: int, dtype: torch.dtype) -> StepStats:
    """One optimizer step as the learner took it before token-budget packing (module docstring)."""
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
    keeps it, every decoder layer checkpointed when asked (``learner/fsdp_units.py``: ``checkpoint_layers``)."""
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
