"""Token-budget micro-batches: a step's sequences packed padding-free into rows of at most B tokens, each shared
prompt laid down once.

Imports torch and the standard library only (the GPU benchmark runs it where nothing else is installed).

Columns. A step's rollouts arrive as ``StepColumns``: every list column is a ``Ragged`` (offsets +
values tensors, as Arrow stores it; ``echo2/learner/columns.py`` builds them from rollout files without
Python lists). Row r's prompt is ``prompt.values[prompt.offsets[r]:prompt.offsets[r+1]]``; its
completion mask and behavior log-probabilities share the completion's offsets.

Packing. Sequence r reads ``len(prompt) + len(completion) - 1`` tokens: the prompt and every
completion token but the last, which is only ever a target. A GRPO step holds each prompt G times, so with a
shared prompt (``share_prompts``: the learner's own attention, ``attention.py``) the rows of a group that share
one go together and count it once: its prefix (the prompt but its last token) is laid down once, then each row's
segment (the prompt's last token and the completion but its last), ``p - 1 + sum(c_i)`` tokens for the group
(``group_tokens``). ``pack_rows`` puts the step's groups (or, without sharing, its sequences) into micro-batches
of at most ``budget`` tokens by first-fit decreasing (``pack_by_tokens``: longest first, each into the first
pack it fits; FFD uses at most 11/9 OPT + 6/9 packs); a group too big for one pack is cut into pieces that fit,
each with its own prefix, and a row longer than the budget is never split (attention needs it whole): it gets a
micro-batch of its own.

Assembly. ``assemble_packed`` lays a pack's pieces end to end in one row (1, N), N = the pack's tokens, with no
padding at all:
    input_ids[j]     the token at position j of its row's sequence (a prefix token stands for every row of its group)
    position_ids[j]  its position within that sequence: 0 at every prompt's first token, a segment going on from
                     its prompt's last token, so rotary embeddings see what the actor saw
    targets[j]       the next token of the same sequence (position j predicts targets[j])
    mask[j]          completion_mask of that target where it is a completion token, else 0 (a prefix's targets
                     are prompt tokens: all 0)
    behavior[j]      the behavior log-probability of that target (0 where mask is 0)
    advantages[j]    the row's advantage (per token, so one loss call covers the whole pack)
    layout           per group: its prefix's tokens and each row's segment's tokens (the attention's shape)
Attention never crosses into another row or group: with ``train.attention`` varlen (the default) the learner passes
the layout to ``attention.py``'s attention function (a prefix causal over itself, a segment over its prefix and
causally over itself; no mask at all). With sdpa nothing is shared: called with ``position_ids`` and no
``attention_mask``, transformers (``masking_utils.find_packed_sequence_indices``) reads a new sequence wherever the
position does not follow the previous one by 1 and builds a dense block-diagonal causal mask (exact, but N x N).
(tests/unit/learner/test_packing.py: a packed row's log-probabilities equal each sequence's alone, shared prompts or
not.)
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
    layout: list[tuple[int, list[int]]]
    """Per group of rows that share a prompt, in order: the shared prefix's tokens (the prompt but its last token)
    and each row's segment's tokens (its prompt's last token and its completion but the last); host ints, which shape
    the attention call (``attention.py``). A row alone is one group: prefix + segment = its sequence."""

    policy_tokens: int = 0
    """Tokens the loss weighs (the mask's sum), counted on the CPU where the pack was laid out."""
    weighed: torch.Tensor | None = None
    """(policy_tokens,) int64: the positions of those tokens in the row, found on the CPU (``where`` of the chunked
    head: only they go through it, and choosing them on the device would read it back)."""

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def sequence_lengths(self) -> list[int]:
        """Tokens of each independent sequence of the row (prefix + segment: only where no prompt is shared)."""
        if any(len(segments) != 1 for _, segments in self.layout):
            raise ValueError("rows that share a prompt are no independent sequences")
        return [prefix + segments[0] for prefix, segments in self.layout]

    def to(self, device: torch.device) -> "PackedBatch":
        """The pack's tensors on ``device`` (``layout`` stays on the host: it shapes the attention call)."""
        if self.input_ids.device == device:
            return self
        moved = {name: getattr(self, name).to(device, non_blocking=True) for name in
                 ("input_ids", "position_ids", "targets", "mask", "behavior_logprobs", "advantages", "weighed")}
        return PackedBatch(**moved, rows=self.rows, layout=self.layout, policy_tokens=self.policy_tokens)


def prompt_groups(columns: StepColumns, rows: Sequence[int]) -> list[list[int]]:
    """``rows`` (in order) cut into runs of consecutive rows of one group with the same prompt tokens: the rows that
    can share one prefix. Prompts are compared token by token: rows of one group always share theirs, but that is
    the task's promise, not something assumed here."""
    runs: list[list[int]] = []
    last = None
    for r in rows:
        key = (int(columns.group_index[r]), _prompt_of(columns, r))
        if runs and key == last:
            runs[-1].append(int(r))
        else:
            runs.append([int(r)])
        last = key
    return runs


def _prompt_of(columns: StepColumns, r: int) -> tuple[int, ...]:
    start, end = int(columns.prompt.offsets[r]), int(columns.prompt.offsets[r + 1])
    return tuple(columns.prompt.values[start:end].tolist())


def group_tokens(columns: StepColumns, rows: Sequence[int]) -> int:
    """Tokens rows that share one prompt put in a pack: the prefix once (the prompt but its last token) and each row's
    segment (the prompt's last token and the completion but its last): p - 1 + sum of completion lengths."""
    return int(columns.prompt.lengths[rows[0]]) - 1 + int(columns.completion.lengths[list(rows)].sum())


def pack_rows(columns: StepColumns, rows: Sequence[int], budget, *, share_prompts: bool) -> list[list[int]]:
    """``rows`` packed first-fit decreasing into packs of at most ``budget(tokens of all rows)`` tokens.

    With ``share_prompts`` the rows of a group that share a prompt go together, their prompt counted once (a GRPO
    step holds each prompt G times); a group too big for one pack is cut into pieces that each fit (each with its
    own prefix), and a row alone over the budget gets a pack of its own. Without it every row is its own piece (its
    sequence: prompt + completion - 1 tokens). Deterministic, as ``pack_by_tokens``."""
    pieces = prompt_groups(columns, rows) if share_prompts else [[int(r)] for r in rows]
    limit = budget(sum(group_tokens(columns, piece) for piece in pieces))
    cut: list[list[int]] = []
    for piece in pieces:
        part: list[int] = []
        for r in piece:
            if part and group_tokens(columns, [*part, r]) > limit:
                cut.append(part)
                part = []
            part.append(r)
        cut.append(part)
    packs = pack_by_tokens([group_tokens(columns, piece) for piece in cut], limit)
    return [[r for j in pack for r in cut[j]] for pack in packs]


def pack_tokens(columns: StepColumns, rows: Sequence[int], *, share_prompts: bool) -> int:
    """Tokens of the pack of ``rows`` (as ``assemble_packed`` lays it out)."""
    pieces = prompt_groups(columns, rows) if share_prompts else [[int(r)] for r in rows]
    return sum(group_tokens(columns, piece) for piece in pieces)


def assemble_packed(columns: StepColumns, indices: Sequence[int], advantages: torch.Tensor, *,
                    share_prompts: bool = False) -> PackedBatch:
    """The pack of rows ``indices`` of ``columns``; ``advantages``: (R,) per row of ``columns``. With
    ``share_prompts``, consecutive rows of a group with the same prompt share one prefix (the module docstring)."""
    rows = torch.as_tensor(list(indices), dtype=torch.int64)
    groups = prompt_groups(columns, rows.tolist()) if share_prompts else [[int(r)] for r in rows]
    first = torch.tensor([i == 0 for g in groups for i in range(len(g))], dtype=torch.bool)
    p_len = columns.prompt.lengths[rows]
    c_len = columns.completion.lengths[rows]
    lead = torch.where(first, p_len - 1, torch.zeros_like(p_len))  # the prefix, laid down before a group's first row
    span = lead + c_len
    n = int(span.sum())
    seq = torch.repeat_interleave(torch.arange(len(rows)), span)  # which row each token belongs to
    k = torch.arange(n) - (torch.cumsum(span, 0) - span)[seq]  # the token's place in its row's span
    here_lead, p_here = lead[seq], p_len[seq]
    # its position in the row's own sequence (prompt then completion): the prefix as laid down, then the segment,
    # which goes on from the prompt's last token, so rotary embeddings see what the actor saw
    pos = torch.where(k < here_lead, k, p_here - 1 + k - here_lead)
    p_start, c_start = columns.prompt.offsets[rows][seq], columns.completion.offsets[rows][seq]

    def token(j: torch.Tensor) -> torch.Tensor:
        """Token j of each position's sequence (prompt then completion), j < prompt + completion."""
        in_prompt = j < p_here
        from_prompt = columns.prompt.values[torch.where(in_prompt, p_start + j, 0)]
        from_completion = columns.completion.values[torch.where(in_prompt, 0, c_start + j - p_here)]
        return torch.where(in_prompt, from_prompt.long(), from_completion.long())

    target_in_completion = pos + 1 >= p_here
    c_index = torch.where(target_in_completion, c_start + pos + 1 - p_here, 0)
    zero = torch.zeros((), dtype=torch.float32)
    mask = torch.where(target_in_completion, columns.completion_mask[c_index].float(), zero)
    behavior = torch.where(target_in_completion, columns.behavior_logprobs[c_index].float(), zero)
    c_list, lead_list = c_len.tolist(), lead.tolist()
    layout, j = [], 0
    for g in groups:
        layout.append((lead_list[j], c_list[j : j + len(g)]))
        j += len(g)
    return PackedBatch(
        input_ids=token(pos)[None], position_ids=pos[None], targets=token(pos + 1)[None], mask=mask[None],
        behavior_logprobs=behavior[None], advantages=torch.repeat_interleave(advantages[rows].float(), span)[None],
        rows=[int(i) for i in rows], layout=layout, policy_tokens=int(mask.sum()),
        weighed=(mask > 0).nonzero().squeeze(1))
