"""The GRPO loss against numbers worked out by hand (see echo2/learner/loss.py for the formula)."""

import math

import pytest
import torch

from echo2.learner.loss import group_advantages, policy_loss


def test_group_advantages_normalize_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups)
    # group 0: mean 0.25, centered [.75, -.25, -.25, -.25], unbiased std 0.5
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-3)
    assert adv[4:].tolist() == [0.0, 0.0]  # equal rewards: no signal
    centered = group_advantages(rewards, groups, scale=False)
    assert centered.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0])


def test_clipped_ratio_with_truncation_matches_hand_computation():
    ln = math.log
    # sequence 0 (A=+0.5): ratios 1.0, 1.5 (clipped to 1.28), then one padding token
    # sequence 1 (A=-0.5): ratios 0.5 (clipped to 0.8), 4.0 (truncated at C=3), 2.0 (inside C)
    logp = torch.tensor([[ln(0.5), ln(0.6), 0.0], [ln(0.2), ln(0.8), ln(0.6)]], requires_grad=True)
    behavior = torch.tensor([[ln(0.5), ln(0.4), 0.0], [ln(0.4), ln(0.2), ln(0.3)]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([0.5, -0.5])
    terms = policy_loss(logp, behavior, adv, mask, n_tokens=5, clip_low=0.2, clip_high=0.28, is_cap=3.0)
    # objectives: 0.5, 0.64 | -0.4, max(-2.0, -1.5) = -1.5, -1.0  -> sum -1.76
    assert terms.loss.item() == pytest.approx(1.76 / 5, rel=1e-5)
    terms.loss.backward()
    # only unclipped, untruncated tokens carry gradient: d(-A*r)/dlogp / n = -A*r/n
    expected = torch.tensor([[-0.5 * 1.0 / 5, 0.0, 0.0], [0.0, 0.0, 0.5 * 2.0 / 5]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert terms.clip_fraction.item() == pytest.approx(3 / 5)
    assert terms.ratio_mean.item() == pytest.approx((1.0 + 1.5 + 0.5 + 4.0 + 2.0) / 5, rel=1e-5)


def test_on_policy_loss_is_the_policy_gradient():
    """With pi == mu the ratio is 1, nothing is clipped, and the gradient is -A/n per token."""
    logp = torch.log(torch.tensor([[0.3, 0.7]])).requires_grad_()
    terms = policy_loss(logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2), n_tokens=2,
                        clip_low=0.2, clip_high=0.2, is_cap=3.0)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(-2.0)
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -1.0])
    assert terms.clip_fraction.item() == 0.0


def test_kl_penalty_k3():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    base = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), n_tokens=1, clip_low=0.2,
                       clip_high=0.2, is_cap=3.0)
    with_kl = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), n_tokens=1, clip_low=0.2,
                          clip_high=0.2, is_cap=3.0, ref_logprobs=ref, kl_coef=0.1)
    d = math.log(0.25) - math.log(0.5)
    assert with_kl.loss.item() - base.loss.item() == pytest.approx(0.1 * (math.exp(d) - d - 1), rel=1e-5)
