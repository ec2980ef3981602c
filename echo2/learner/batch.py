"""Batch assembly: rollout rows -> right-padded tensors aligned for next-token log-probabilities.

Row i holds prompt p and completion c. The sequence p + c is right-padded to the longest in the
micro-batch; position j predicts token j + 1, so the completion's tokens are the targets at
positions len(p) - 1 ... len(p) + len(c) - 2. Right padding keeps every real token at the
position it had when the actor generated it (pads only follow it, and the causal mask hides
them), so the recomputed log-probabilities match the engine's behavior log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from echo2.learner.loss import token_logprobs


@dataclass
class TokenBatch:
    input_ids: torch.Tensor
    """(B, W) prompt + completion, right-padded."""
    attention_mask: torch.Tensor
    """(B, W) 1 on real tokens."""
    targets: torch.Tensor
    """(B, W-1) the token each position predicts (completion tokens only; 0 elsewhere)."""
    mask: torch.Tensor
    """(B, W-1) 1 where the target is a token the policy produced (completion_mask), else 0."""
    behavior_logprobs: torch.Tensor
    """(B, W-1) the sampling policy's log-probabilities at the targets (0 elsewhere)."""


def assemble(rows: list[dict], pad_token_id: int) -> TokenBatch:
    """``rows``: dicts with prompt_token_ids, completion_token_ids, completion_mask, behavior_logprobs."""
    lengths = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.zeros((len(rows), width - 1), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    behavior = torch.zeros((len(rows), width - 1))
    for i, r in enumerate(rows):
        p, c = r["prompt_token_ids"], r["completion_token_ids"]
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        span = slice(len(p) - 1, len(p) - 1 + len(c))
        targets[i, span] = torch.tensor(c)
        mask[i, span] = torch.tensor(r["completion_mask"], dtype=torch.float32)
        behavior[i, span] = torch.tensor(r["behavior_logprobs"], dtype=torch.float32)
    return TokenBatch(ids, attn, targets, mask, behavior)


def policy_logprobs(model, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """(B, W-1) log-probabilities of the targets under ``model`` at ``temperature``, in fp32."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return token_logprobs(logits, batch.targets, temperature)
