"""The transformers engine's refill stream (``rollout.refill``): a decode loop of its own in which the rows of a
finished group take the next group's prompt at the next step, so the batch stays full instead of decoding at
the pace of its slowest completion.

Why not transformers' own continuous batching (``generate_batch``, ``ContinuousBatchingManager``; transformers
5.17): it decodes in a background thread of its own (a weight swap or the actor's SIGTERM would have to stop
and rebuild it, and ``generate_batch`` logs a failed request instead of raising), sizes a paged cache from
workload hints, and takes the sampled token's logprob as ``log(softmax(.))`` of whatever its processors did.
This loop is ~200 lines the engine's tests check token by token against the learner's recomputation.

The batch is ``slots`` groups of ``n`` rows. Each group's prompt (all but its last token) is prefilled once and
its KV cache repeated for its n rows (as ``_shared_prefill`` does for ``generate``). The batch's KV cache is
one ``DynamicCache`` of width L whose rows are right-aligned: a row's prompt sits in the last columns when it
joins, padding columns before it are masked out (and zero, so nothing non-finite can reach a softmax), and each
step appends one column for every row. Each row carries its own position ids, so a row's keys and queries are
rotated exactly as in a prefill of its own sequence; a step's attention mask is the row's own columns plus the
new one. When no live row needs a leading column any more the columns are cut off, so L stays within the
longest live prompt + completion. Rows of a group that are done (or of a free slot) are fed the pad token and
ignored until the whole group is done, then the slot takes the next group: refill at the granularity of groups.

Sampling and logprobs: ``log_softmax(logits / temperature)`` in fp32 for the live rows, the token drawn from
its exponential (the distribution ``generate`` samples with the temperature warper alone) and its own value
kept: log mu of the sampled token under the weights the stream runs with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from echo2.rollout.engines.base import Completion, SamplingParams


@dataclass
class _Group:
    key: Hashable
    first_row: int
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str | None] = field(default_factory=list)


def check_plain_cache(model) -> None:
    """Raise unless the model's KV cache is one plain full-attention layer per block: the loop edits the columns of
    such a cache; a sliding window or a recurrent state would need edits of its own."""
    layers = DynamicCache(config=model.config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(f"rollout.refill with the transformers engine needs a model whose KV cache is plain "
                         f"full attention; {model.config.model_type} has {kinds or 'none'}")


class RefillLoop:
    """One stream: ``run`` yields each group's completions as the group finishes (see the module docstring)."""

    def __init__(self, model, *, slots: int, n: int, eos: int, pad: int, device: torch.device):
        self.model, self.slots, self.n, self.eos, self.pad, self.device = model, slots, n, eos, pad, device
        rows = slots * n
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (rows, heads, L, head_dim)
        self.cache: DynamicCache | None = None  # the kv above as the model's cache, rebuilt only when edited
        self.mask = torch.zeros(rows, 0, dtype=torch.long, device=device)  # (rows, L)
        self.last = torch.full((rows,), pad, dtype=torch.long, device=device)  # each row's next input token
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)  # and its position
        self.live = [False] * rows  # rows still sampling
        self.groups: list[_Group | None] = [None] * slots

    # -- admission -------------------------------------------------------------------------
    def _prefill(self, heads: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The KV cache of ``heads`` (each prompt but its last token), left-padded in one forward."""
        width = max(len(h) for h in heads)
        ids = torch.tensor([[self.pad] * (width - len(h)) + h for h in heads], dtype=torch.long, device=self.device)
        mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in heads], dtype=torch.long,
                            device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a left-padded row
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        return [(layer.keys, layer.values) for layer in cache.layers]

    def admit(self, joining: list[tuple[int, Hashable, list[int]]]) -> None:
        """Put each (slot, key, prompt) of ``joining`` into its slot's rows, ready for the next step."""
        # prefill only prompts of two tokens or more: a one-token prompt has no cache, only its first step
        heads = [prompt[:-1] for _, _, prompt in joining if len(prompt) > 1]
        width = max((len(h) for h in heads), default=0)
        prefilled = self._prefill(heads) if heads else []
        length = self.mask.shape[1]
        if width > length:  # a longer prompt than the batch is wide: widen every row on the left, masked out
            grow = width - length
            self.mask = torch.nn.functional.pad(self.mask, (grow, 0))
            if self.kv is not None:
                self.kv = [(torch.nn.functional.pad(k, (0, 0, grow, 0)), torch.nn.functional.pad(v, (0, 0, grow, 0)))
                           for k, v in self.kv]
            length = width
        if self.kv is None and prefilled:
            rows = self.slots * self.n
            self.kv = [(k.new_zeros(rows, k.shape[1], length, k.shape[3]), v.new_zeros(rows, v.shape[1], length,
                                                                                    v.shape[3]))
                       for k, v in prefilled]
        j = 0  # the prefill row of the next prompt that has one
        for slot, key, prompt in joining:
            rows = slice(slot * self.n, (slot + 1) * self.n)
            h = len(prompt) - 1
            self.mask[rows] = 0
            if self.kv is not None:
                for layer, (k, v) in enumerate(self.kv):
                    k[rows] = 0
                    v[rows] = 0
                    if h:  # the group's prompt once, repeated for its n rows by broadcasting
                        pk, pv = prefilled[layer]
                        k[rows, :, length - h:] = pk[j, :, pk.shape[2] - h:]
                        v[rows, :, length - h:] = pv[j, :, pv.shape[2] - h:]
            j += 1 if h else 0
            if h:
                self.mask[rows, length - h:] = 1
            self.last[rows] = prompt[-1]
            self.pos[rows] = h
            self.live[rows] = [True] * self.n
            self.groups[slot] = _Group(key, slot * self.n, [[] for _ in range(self.n)], [[] for _ in range(self.n)],
                                       [None] * self.n)
        self.cache = None

    # -- decoding --------------------------------------------------------------------------
    def step(self, params: SamplingParams) -> None:
        """One decode step of every row; the live rows sample their next token."""
        if self.cache is None:
            self.cache = (DynamicCache(ddp_cache_data=self.kv, config=self.model.config) if self.kv is not None
                          else DynamicCache(config=self.model.config))
        rows = self.mask.shape[0]
        # every row attends to its own new column, so a done or free row never attends to nothing (a NaN)
        mask = torch.cat([self.mask, torch.ones(rows, 1, dtype=torch.long, device=self.device)], dim=1)
        out = self.model(input_ids=self.last[:, None], attention_mask=mask, position_ids=self.pos[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.kv = [(layer.keys, layer.values) for layer in self.cache.layers]
        self.mask = mask
        live = [r for r, on in enumerate(self.live) if on]
        index = torch.tensor(live, dtype=torch.long, device=self.device)
        logprobs = torch.log_softmax(out.logits[index, -1, :].float() / params.temperature, dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1)
        token_lp = logprobs.gather(-1, tokens).squeeze(-1)
        tokens = tokens.squeeze(-1)
        self.last[index] = tokens
        self.pos[index] += 1
        for r, t, lp in zip(live, tokens.tolist(), token_lp.tolist()):  # one read-back each per step
            group = self.groups[r // self.n]
            i = r - group.first_row
            group.tokens[i].append(t)
            group.logprobs[i].append(lp)
            if t == self.eos or len(group.tokens[i]) >= params.max_new_tokens:
                group.finish[i] = "stop" if t == self.eos else "length"
                self.live[r] = False
                self.last[r] = self.pad

    def finished(self) -> list[tuple[int, Hashable, list[Completion]]]:
        """(slot, key, completions) of each group whose rows are all done; their slots are free from now on."""
        out = []
        for slot, group in enumerate(self.groups):
            if group is not None and all(f is not None for f in group.finish):
                out.append((slot, group.key, [Completion(t, lp, f) for t, lp, f in
                                              zip(group.tokens, group.logprobs, group.finish)]))
                self.groups[slot] = None
        return out

    def trim(self) -> None:
        """Cut the leading columns no live row attends to (they belonged to rows that finished)."""
        live = [r for r, on in enumerate(self.live) if on]
        if not live or self.mask.shape[1] == 0:
            return
        used = self.mask[torch.tensor(live, device=self.device)].any(dim=0)
        first = int(used.long().argmax()) if bool(used.any()) else self.mask.shape[1]
        if first == 0:
            return
        self.mask = self.mask[:, first:]
        if self.kv is not None:
            self.kv = [(k[:, :, first:], v[:, :, first:]) for k, v in self.kv]
        self.cache = None

    def run(self, groups: Iterator[tuple[Hashable, list[int]]], params: SamplingParams
            ) -> Iterator[tuple[Hashable, list[Completion]]]:
        exhausted = False
        while True:
            joining = []
            free = [s for s, g in enumerate(self.groups) if g is None]
            while free and not exhausted:
                try:  # take a group only when a slot is free: the caller decides at each take whether to go on
                    key, prompt = next(groups)
                except StopIteration:
                    exhausted = True
                    break
                if not prompt:
                    raise ValueError(f"group {key!r} has an empty prompt")
                joining.append((free.pop(0), key, list(prompt)))
            if joining:
                self.admit(joining)
            if not any(self.live):
                return  # nothing left in flight, and nothing more to take
            self.step(params)
            for _, key, completions in self.finished():
                yield key, completions
            self.trim()
