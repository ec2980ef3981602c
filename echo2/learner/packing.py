"""Token-budget micro-batches: a step's sequences packed padding-free into rows of at most B tokens.

Imports torch and the standard library only (the GPU benchmark runs it where nothing else is installed).

Columns. A step's rollouts arrive as ``StepColumns``: every list column is a ``Ragged`` (offsets +
values tensors, as Arrow stores it; ``echo2/learner/columns.py`` builds them from rollout files without
Python lists). Row r's prompt is ``prompt.values[prompt.offsets[r]:prompt.offsets[r+1]]``; its
completion mask and behavior log-probabilities share the completion's offsets.

Packing. Sequence r reads ``len(prompt) + len(completion) - 1`` tokens: the prompt and every
completion token but the last, which is only ever a target. ``pack_by_tokens`` puts the step's
sequences into micro-batches of at most ``budget`` tokens by first-fit decreasing (longest first, each
into the first pack it fits; FFD uses at most 11/9 OPT + 6/9 packs). A sequence longer than the budget
is never split (attention needs it whole): it gets a micro-batch of its own.

Assembly. ``assemble_packed`` lays a pack's sequences end to end in one row (1, N), N = the pack's
tokens, with no padding at all:
    input_ids[j]     the token at position j of its sequence
    position_ids[j]  its position within its own sequence: 0 at every sequence's first token
    targets[j]       the next token of the same sequence (position j predicts targets[j])
    mask[j]          completion_mask of that target where it is a completion token, else 0
    behavior[j]      the behavior log-probability of that target (0 where mask is 0)
    advantages[j]    the sequence's advantage (per token, so one loss call covers the whole pack)
Attention never crosses a sequence boundary: with ``train.attention`` varlen (the default) the learner passes
the pack's sequence boundaries to ``attention.py``'s attention function, which runs each sequence causally on its
own (torch's variable-length flash attention on a GPU; sdpa per sequence elsewhere; no mask at all).
With sdpa, called with ``position_ids`` and no ``attention_mask``, transformers (``masking_utils.find_packed_sequence_indices``) reads a
new sequence wherever the position does not follow the previous one by 1 and builds a dense block-diagonal
causal mask (exact, but N x N). Every position keeps the index it had when the actor
generated it (0 at the prompt's first token), so rotary embeddings see what the actor saw.
(tests/test_packing.py: a packed row's log-probabilities equal each sequence's alone.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Ragged:
    """A list column: row r holds ``values[offsets[r] : offsets[r + 1]]``; ``offsets[0] == 0``."""

    offsets: torch.Tensor
    """(R + 1,) int64."""
    values: torch.Tensor
    """(offsets[-1],)."""

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets.diff()

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence], dtype: torch.dtype) -> "Ragged":
        """From Python lists (tests and benchmarks; the learner reads Arrow through ``columns.py``)."""
        lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
        offsets = torch.zeros(len(lists) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        values = torch.tensor([v for x in lists for v in x], dtype=dtype)
        return cls(offsets, values)


@dataclass
class StepColumns:
    """The rows of a step, column by column (R rows)."""

    prompt: Ragged
    """Prompt token ids (int32 or int64)."""
    completion: Ragged
    """Completion token ids; ``completion_mask`` and ``behavior_logprobs`` share its offsets."""
    completion_mask: torch.Tensor
    """(completion.offsets[-1],) 1 where the policy produced the token (trained on), 0 where the environment did."""
    behavior_logprobs: torch.Tensor
    """(completion.offsets[-1],) float32: the sampling policy's log-probability of each completion token."""
    reward: torch.Tensor
    """(R,) float32."""
    group_index: torch.Tensor
    """(R,) int64 in 0..G-1: the row's group (one group_id of one file), numbered by first appearance."""
    policy_version: torch.Tensor
    """(R,) int64: the version that sampled the row."""

    @property
    def num_rows(self) -> int:
        return int(self.reward.shape[0])

    def sequence_lengths(self) -> torch.Tensor:
        """(R,) the tokens each row puts in a micro-batch: prompt + completion - 1."""
        return self.prompt.lengths + self.completion.lengths - 1

    def policy_tokens(self) -> torch.Tensor:
        """(R,) the tokens each row trains on (its completion mask's sum)."""
        per_token = self.completion_mask.to(torch.int64)
        row = torch.repeat_interleave(torch.arange(self.num_rows), self.completion.lengths)
        return torch.zeros(self.num_rows, dtype=torch.int64).index_add_(0, row, per_token)


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` packed first-fit decreasing into packs of at most ``budget`` tokens.

    Every index appears in exactly one pack. A length over ``budget`` is alone in its pack. Deterministic:
    ties in length keep index order, so every rank of a distributed step computes the same packs."""
    if budget < 1:
        raise ValueError(f"a micro-batch budget of {budget} tokens holds nothing")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    packs: list[list[int]] = []
    free: list[int] = []  # tokens left in each pack
    for i in order:
        n = int(lengths[i])
        for p, room in enumerate(free):
            if n <= room:
                packs[p].append(i)
                free[p] -= n
                break
        else:
            packs.append([i])
            free.append(max(budget - n, 0))
    return packs


@dataclass
class PackedBatch:
    """One micro-batch: several sequences end to end in one row (see the module docstring)."""

    input_ids: torch.Tensor
    """(1, N) int64."""
    position_ids: torch.Tensor
    """(1, N) int64, restarting at 0 at each sequence."""
    targets: torch.Tensor
    """(1, N) int64: position j predicts targets[:, j]."""
    mask: torch.Tensor
    """(1, N) float32: 1 where the target is a token the policy produced."""
    behavior_logprobs: torch.Tensor
    """(1, N) float32 (0 where the target is a prompt token)."""
    advantages: torch.Tensor
    """(1, N) float32: each token carries its sequence's advantage."""
    rows: list[int]
    """The step rows this pack holds, in order."""
    sequence_lengths: torch.Tensor
    """(n_rows,) tokens of each sequence in the row."""

    policy_tokens: int = 0
    """Tokens the loss weighs (the mask's sum), counted on the CPU where the pack was laid out."""
    weighed: torch.Tensor | None = None
    """(policy_tokens,) int64: the positions of those tokens in the row, found on the CPU (``where`` of the chunked
    head: only they go through it, and choosing them on the device would read it back)."""

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> "PackedBatch":
        """The pack's tensors on ``device`` (``sequence_lengths`` stays on the CPU: it shapes the attention call)."""
        if self.input_ids.device == device:
            return self
        moved = {name: getattr(self, name).to(device, non_blocking=True) for name in
                 ("input_ids", "position_ids", "targets", "mask", "behavior_logprobs", "advantages", "weighed")}
        return PackedBatch(**moved, rows=self.rows, sequence_lengths=self.sequence_lengths,
                           policy_tokens=self.policy_tokens)


def assemble_packed(columns: StepColumns, indices: Sequence[int], advantages: torch.Tensor) -> PackedBatch:
    """The pack of rows ``indices`` of ``columns``; ``advantages``: (R,) per row of ``columns``."""
    rows = torch.as_tensor(list(indices), dtype=torch.int64)
    p_len = columns.prompt.lengths[rows]
    c_len = columns.completion.lengths[rows]
    seq_len = p_len + c_len - 1
    n = int(seq_len.sum())
    seq = torch.repeat_interleave(torch.arange(len(rows)), seq_len)  # which sequence each token belongs to
    starts = torch.cumsum(seq_len, 0) - seq_len
    pos = torch.arange(n) - starts[seq]  # position within the sequence
    p_start, c_start = columns.prompt.offsets[rows][seq], columns.completion.offsets[rows][seq]
    p_here = p_len[seq]

    def token(k: torch.Tensor) -> torch.Tensor:
        """Token k of each position's sequence (prompt then completion), k < prompt + completion."""
        in_prompt = k < p_here
        from_prompt = columns.prompt.values[torch.where(in_prompt, p_start + k, 0)]
        from_completion = columns.completion.values[torch.where(in_prompt, 0, c_start + k - p_here)]
        return torch.where(in_prompt, from_prompt.long(), from_completion.long())

    target_in_completion = pos + 1 >= p_here
    c_index = torch.where(target_in_completion, c_start + pos + 1 - p_here, 0)
    zero = torch.zeros((), dtype=torch.float32)
    mask = torch.where(target_in_completion, columns.completion_mask[c_index].float(), zero)
    behavior = torch.where(target_in_completion, columns.behavior_logprobs[c_index].float(), zero)
    return PackedBatch(
        input_ids=token(pos)[None], position_ids=pos[None], targets=token(pos + 1)[None], mask=mask[None],
        behavior_logprobs=behavior[None],
        advantages=torch.repeat_interleave(advantages[rows].float(), seq_len)[None],
        rows=[int(i) for i in rows], sequence_lengths=seq_len, policy_tokens=int(mask.sum()),
        weighed=(mask > 0).nonzero().squeeze(1))
