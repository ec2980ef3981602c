"""The learner's GRPO step on a tiny model: full fine-tuning and LoRA both move the policy."""

import pytest
import torch

from echo2.config import TrainConfig
from echo2.data.rollouts import decode_rollouts
from echo2.learner.learner import Learner
from helpers import rollout_bytes


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_step_with_signal_changes_the_policy_and_one_without_does_not(tiny_model, lora_rank):
    learner = Learner(tiny_model, TrainConfig(lr=1e-2, lora_rank=lora_rank), temperature=1.0)
    before = {k: v.clone() for k, v in learner.full_tensors().items()}
    flat = decode_rollouts(rollout_bytes(0, reward=lambda g, s: 0.0))  # equal rewards: no signal
    metrics = learner.train_step([flat])
    assert metrics["groups_with_signal"] == 0 and learner.version == 1
    assert all(torch.equal(before[k], v) for k, v in learner.full_tensors().items())

    mixed = decode_rollouts(rollout_bytes(0, reward=lambda g, s: float(s == 0)))
    metrics = learner.train_step([mixed])
    assert metrics["groups_with_signal"] == 2 and metrics["grad_norm"] > 0 and learner.version == 2
    after = learner.full_tensors()
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert changed
    if lora_rank:  # only adapted projections move; embeddings stay the base's
        assert all("proj" in k for k in changed)
        assert set(learner.adapter_tensors()) and all("lora_" in k for k in learner.adapter_tensors())
