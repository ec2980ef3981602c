"""The learner's GRPO step on a tiny model: full fine-tuning and LoRA both move the policy."""

import math

import pytest
import torch
from helpers import rollout_bytes

from echo2.config import TrainConfig
from echo2.data.rollouts import decode_rollouts
from echo2.learner.columns import step_columns
from echo2.learner.learner import Learner
from echo2.learner.packing import Ragged, StepColumns, assemble_packed


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


def test_groups_of_the_same_name_in_two_files_stay_two_groups(tiny_model):
    """Before, rows were grouped by group_id across files: two files' "g0" became one group of 4."""
    learner = Learner(tiny_model, TrainConfig(lr=1e-2), temperature=1.0)
    same = decode_rollouts(rollout_bytes(0, n_groups=1, reward=lambda g, s: 1.0))   # "g0": no signal
    other = decode_rollouts(rollout_bytes(0, n_groups=1, reward=lambda g, s: 0.0))  # "g0" too: no signal
    metrics = learner.train_step([same, other])
    assert metrics["groups"] == 2 and metrics["groups_with_signal"] == 0 and metrics["train_tokens"] == 0


def test_the_no_signal_filter_drops_whole_groups_only(tiny_model):
    """A row whose reward equals its group's mean (A = 0) still counts in the token average of the step."""
    learner = Learner(tiny_model, TrainConfig(lr=1e-2), temperature=1.0)
    rewards = {0: 0.0, 1: 0.5, 2: 1.0}
    table = decode_rollouts(rollout_bytes(0, n_groups=2, group_size=3,
                                          reward=lambda g, s: rewards[s] if g == 0 else 1.0))
    metrics = learner.train_step([table])
    assert metrics["groups_with_signal"] == 1
    assert metrics["train_tokens"] == 3 * 3  # all three rows of group 0 (3 tokens each), none of group 1


def test_dropout_is_off_in_the_learners_forward(tmp_path):
    """Ratios are taken against the behavior policy, which sampled without dropout."""
    from conftest import make_tiny_model
    from transformers import AutoConfig

    path = make_tiny_model(tmp_path / "m")
    config = AutoConfig.from_pretrained(path)
    config.attention_dropout = 0.5
    config.save_pretrained(path)
    learner = Learner(path, TrainConfig(), temperature=1.0)
    columns = step_columns([decode_rollouts(rollout_bytes(0))])
    batch = assemble_packed(columns, range(columns.num_rows), torch.zeros(columns.num_rows))
    def logprobs():
        return learner.policy(batch.input_ids, batch.targets, position_ids=batch.position_ids)

    first = logprobs()
    assert torch.equal(first, logprobs())
    first.sum().backward()  # and gradients still flow
    assert any(p.grad is not None for p in learner.model.parameters())


def test_recomputed_logprobs_on_a_packed_batch_equal_the_engines(tiny_model):
    from transformers import AutoTokenizer

    from echo2.rollout.engines import SamplingParams
    from echo2.rollout.engines.transformers import TransformersEngine

    learner = Learner(tiny_model, TrainConfig(), temperature=0.8)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = TransformersEngine(tiny_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine.load_weights(learner.full_tensors().items())
    prompts = [tok(t)["input_ids"] for t in ("What is 1 + 2?", "What is 13 + 4? Think hard about it.", "9")]
    groups = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8, temperature=0.8, seed=3))
    completions = [(p, c) for p, g in zip(prompts, groups) for c in g]
    assert len({len(p) + len(c.token_ids) for p, c in completions}) > 1  # mixed lengths
    n = len(completions)
    columns = StepColumns(
        prompt=Ragged.from_lists([p for p, _ in completions], torch.int32),
        completion=Ragged.from_lists([c.token_ids for _, c in completions], torch.int32),
        completion_mask=torch.ones(sum(len(c.token_ids) for _, c in completions), dtype=torch.int8),
        behavior_logprobs=Ragged.from_lists([c.logprobs for _, c in completions], torch.float32).values,
        reward=torch.zeros(n), group_index=torch.zeros(n, dtype=torch.int64),
        policy_version=torch.zeros(n, dtype=torch.int64))
    batch = assemble_packed(columns, range(n), torch.zeros(n))  # every completion in one packed row
    with torch.no_grad():
        logprobs = learner.policy(batch.input_ids, batch.targets, position_ids=batch.position_ids)
    m = batch.mask.bool()
    assert torch.allclose(logprobs[m], batch.behavior_logprobs[m], atol=1e-4)


def test_the_most_extreme_file_validation_accepts_gives_a_finite_step(tiny_model):
    """Logprobs at the floor, rewards at the task's bounds: the loss and gradient stay finite."""
    from echo2.data.rollouts import LOGPROB_FLOOR

    learner = Learner(tiny_model, TrainConfig(lr=1e-2), temperature=1.0)
    table = decode_rollouts(rollout_bytes(0, group_size=8, logprob=LOGPROB_FLOOR, reward=lambda g, s: float(s == 0)))
    metrics = learner.train_step([table])
    assert not metrics["nonfinite"] and metrics["groups_with_signal"] == 2
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])


def test_a_non_finite_step_changes_no_weight_and_says_so(tiny_model):
    learner = Learner(tiny_model, TrainConfig(lr=1e-2), temperature=1.0)
    with torch.no_grad():
        learner.model.get_input_embeddings().weight[4, 0] = float("inf")  # a diverged policy
    before = {k: v.clone() for k, v in learner.full_tensors().items()}
    metrics = learner.train_step([decode_rollouts(rollout_bytes(0))])
    assert metrics["nonfinite"] and learner.version == 1
    after = learner.full_tensors()
    assert all(torch.equal(before[k], after[k]) or torch.isnan(before[k]).any() for k in before)


@pytest.mark.e2e
def test_an_exported_lora_version_computes_what_the_learner_trained(tiny_model, tmp_path):
    """Export of an adapter version (base + (alpha/r) B A, merged by the CLI) gives the learner's own logits.
    The adapter is trained with signal first, so B != 0: a merge that dropped or mis-scaled B A fails."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from transformers import AutoModelForCausalLM

    from echo2.config import BroadcastConfig
    from echo2.data.run_folder import create_run
    from echo2.data.store import open_store
    from echo2.learner.publisher import Publisher

    cfg = TrainConfig(lr=5e-2, lora_rank=4, lora_alpha=8.0)
    learner = Learner(tiny_model, cfg, temperature=1.0)
    store = open_store(str(tmp_path / "run"))
    key = Ed25519PrivateKey.generate()
    create_run(store, "lora", {}, key=key, echo2_version="test")  # export checks versions with run.json's key
    publisher = Publisher(store, train=cfg, broadcast=BroadcastConfig(mode="store"), key=key,
                          extra_files=learner.extra_files)
    publisher.publish(0, *learner.policy_version_tensors())
    for _ in range(2):
        learner.train_step([decode_rollouts(rollout_bytes(0, reward=lambda g, s: float(s == 0)))])
    publisher.publish(2, *learner.policy_version_tensors())
    b = [v for k, v in learner.adapter_tensors().items() if "lora_B" in k]
    assert any(t.abs().sum() > 0 for t in b)

    # a machine without the run's key (export then checks with run.json's; the session's secrets folder may
    # hold the key of another run named "lora", which export would rightly refuse to take for this one's)
    env = {**os.environ, "ECHO2_SECRETS": str(tmp_path / "secrets")}
    env.pop("ECHO2_RUN_KEY", None)
    subprocess.run([sys.executable, "-m", "echo2.cli", "export", str(tmp_path / "run"), str(tmp_path / "out")],
                   check=True, cwd=REPO, capture_output=True, env=env)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = torch.tensor([[1, 5, 9, 30, 2, 7]])
    with torch.no_grad():
        ours = learner.model(input_ids=ids).logits
        assert torch.allclose(exported(input_ids=ids).logits, ours, atol=1e-4)
        assert not torch.allclose(base(input_ids=ids).logits, ours, atol=1e-4)
