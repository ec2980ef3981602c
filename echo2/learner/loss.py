r"""GRPO with a token-level clipped ratio against the behavior policy and truncated importance weights.

Notation: a batch holds groups of G completions of one prompt. For completion i of group g with
reward r_i, and each produced token t of it (completion_mask = 1):

    advantage        A_i  = (r_i - mean_g(r)) / (std_g(r) + 1e-4)      (std: unbiased, within group g)
                     A_i  = r_i - mean_g(r)                            (when scale_rewards is False)
    ratio            rho_t = exp(log pi_theta(y_t | y_<t) - log mu(y_t | y_<t))
    clipped term     J_t  = min(rho_t A_i,  clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)
    truncation       J_t  = max(J_t, C A_i)                            (only for A_i < 0)
    loss             L    = - sum_t J_t / N_tokens  +  beta * sum_t k3_t / N_tokens
    k3 (optional)    k3_t = exp(l_ref - l_theta) - (l_ref - l_theta) - 1,  l = log-prob of y_t

mu is the policy that sampled the rollout; its log-probabilities come with the rollout (computed
by the actor in fp32 from its logits at the sampling temperature). pi_theta's are recomputed by
the learner with the same temperature.

Deviations from the GRPO paper (Shao et al., 2024), and why:
- The ratio is taken against the behavior policy mu, not against a fresh pi_old of the learner.
  With bounded staleness mu may be up to S versions old and run in another engine/precision, so
  this one ratio carries both the policy lag and the inference/training mismatch; clipping keeps
  the update inside a trust region around what was actually sampled.
- Truncated importance weights: for A < 0 the unclipped term rho A is unbounded as rho grows;
  the dual clip max(J, C A) caps the effective weight at C, bounding the variance that stale or
  mismatched tokens can inject (dual-clip PPO, Ye et al. 2020; truncated IS as in IMPALA/TIS).
- Asymmetric clip (eps_high > eps_low, "clip-higher") and token-level averaging over all tokens
  of the batch instead of per-sequence averaging (both from DAPO, Yu et al. 2025).
- Groups whose rewards are all equal carry no signal (A = 0) and are left out of the batch
  before the forward pass (DAPO's dynamic-sampling filter, without resampling).
- The KL term (k3 estimator to the initial policy) is off by default (beta = 0), as in DAPO/Dr. GRPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, scale: bool = True) -> torch.Tensor:
    """Per-completion advantages, normalized within each group (``group_index`` holds 0..n_groups-1)."""
    n_groups = int(group_index.max()) + 1
    counts = torch.bincount(group_index, minlength=n_groups).to(rewards.dtype)
    means = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, rewards) / counts
    centered = rewards - means[group_index]
    if not scale:
        return centered
    sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, centered**2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    return centered / (std[group_index] + 1e-4)


def groups_with_signal(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Per group (``group_index`` holds 0..n_groups-1), whether its rewards differ: a group whose rewards are all
    equal has A = 0 everywhere, no signal, and its rows are left out of the step before the forward pass."""
    n_groups = int(group_index.max()) + 1
    high = torch.full((n_groups,), -math.inf, device=rewards.device).scatter_reduce(0, group_index, rewards, "amax")
    low = torch.full((n_groups,), math.inf, device=rewards.device).scatter_reduce(0, group_index, rewards, "amin")
    return high > low


@dataclass
class LossTerms:
    loss: torch.Tensor
    """Scalar to backpropagate: (policy + KL) summed over tokens, divided by ``n_tokens``."""
    clip_fraction: torch.Tensor
    """Share of tokens whose gradient the clip or truncation removed."""
    ratio_mean: torch.Tensor
    kl_behavior: torch.Tensor
    """Mean of log mu - log pi over tokens (a cheap estimate of KL(mu || pi))."""


def policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    n_tokens: int,
    clip_low: float,
    clip_high: float,
    is_cap: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossTerms:
    """Token-level loss of one micro-batch. Shapes: (B, T) for token tensors; advantages (B,) per row or
    (B, T) per token (a packed row holds several sequences, each token carrying its own sequence's).

    ``n_tokens`` is the number of masked tokens in the whole step, so micro-batch losses add up
    to the step's token average.
    """
    mask = mask.to(logprobs.dtype)
    adv = (advantages if advantages.shape == mask.shape else advantages.unsqueeze(-1)).to(logprobs.dtype)
    log_ratio = logprobs - behavior_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    objective = torch.minimum(unclipped, clipped)
    objective = torch.where(adv < 0, torch.maximum(objective, is_cap * adv), objective)
    per_token = -objective
    if ref_logprobs is not None and kl_coef > 0:
        d = ref_logprobs - logprobs
        per_token = per_token + kl_coef * (torch.exp(d) - d - 1.0)
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        # a token lost its gradient when the chosen objective term does not depend on rho
        lost = (objective != unclipped) & (adv != 0)
        denom = mask.sum().clamp(min=1)
        clip_fraction = (lost.to(mask.dtype) * mask).sum() / denom
        ratio_mean = (ratio * mask).sum() / denom
        kl_behavior = (-log_ratio * mask).sum() / denom
    return LossTerms(loss, clip_fraction, ratio_mean, kl_behavior)
