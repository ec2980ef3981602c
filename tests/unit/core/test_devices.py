"""One device everywhere: the learner's step, its evaluation and its spot check keep every tensor on the
learner's device. On this CPU machine the ``meta`` device stands in for a GPU (``placement.py``): a tensor left on
the CPU next to the model is refused as CUDA would refuse it."""

from __future__ import annotations

import pytest
import torch
from helpers import step_files
from placement import MixedDevices, PlacementGuard
from typer.testing import CliRunner

from echo2.config import LearnerConfig, TrainConfig, load_config
from echo2.learner.columns import step_columns
from echo2.learner.evaluate import evaluate_policy
from echo2.learner.learner import Learner
from echo2.tasks import make_task

QUICKSTART = "configs/quickstart.yaml"


def tables():
    return step_files(completion=lambda f, i: [4 + (i * 7 + k) % 290 for k in range(3 + (i * 5 + f) % 11)],
                      behavior=lambda k: -5.6 - 0.05 * (k % 5))


@pytest.mark.parametrize("options", [{}, {"kl_coef": 0.1, "attention": "varlen", "micro_batch_tokens": 40}],
                         ids=["plain", "kl-varlen-packs"])
def test_a_step_on_the_device_mixes_no_tensor_left_on_the_cpu(tiny_model, options):
    learner = Learner(tiny_model, TrainConfig(**options), temperature=1.0, device="meta")
    assert {p.device.type for p in learner.model.parameters()} == {"meta"}
    with PlacementGuard() as guard:
        metrics = learner.train_step(tables())
    assert metrics["step"] == 1 and metrics["rollouts"] == 24
    assert guard.reads <= 4  # the step's numbers come back in one read, not one per pack


def test_a_model_left_on_the_cpu_beside_device_tensors_is_caught(tiny_model):
    """The guard itself: what CUDA refuses is refused here, where torch's meta kernels would let it through."""
    learner = Learner(tiny_model, TrainConfig(), temperature=1.0, device="meta")
    ids = torch.tensor([[1, 2, 3]])  # built on the CPU, as a forgotten .to(device) leaves it
    with PlacementGuard(), pytest.raises(MixedDevices, match="meta"):
        learner.policy(ids, ids)
    with PlacementGuard(), pytest.raises(MixedDevices):  # an op torch's own meta kernel accepts
        torch.mm(torch.ones(2, 2, device="meta"), torch.ones(2, 2))


def test_evaluation_generates_on_the_device(tiny_model):
    learner = Learner(tiny_model, TrainConfig(), temperature=1.0, device="meta")
    config = load_config(None, ["task.eval_size=4"])
    task = make_task(config.task)
    with PlacementGuard():
        result = evaluate_policy(learner.eval_model(), learner.tokenizer, task, max_new_tokens=4, batch_size=2)
    assert result["n"] == 4


def test_the_spot_check_computes_on_the_device(tiny_model):
    learner = Learner(tiny_model, TrainConfig(), temperature=1.0, device="meta")
    weights = {k: torch.zeros(v.shape) for k, v in learner.model.state_dict().items()}  # a version, on the CPU
    columns = step_columns(tables()[:1])
    with PlacementGuard():
        total, count = learner.behavior_gap(1, weights, columns, micro_batch_tokens=64)
    assert count >= 0 and total == 0.0  # read back from meta: no data, the shapes and devices were what counted


def test_cuda_on_a_machine_without_it_is_one_line_and_exit_2(tiny_model, tmp_path, monkeypatch):
    from echo2.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", str(_repo() / QUICKSTART), "--set", f"model.name={tiny_model}",
                                      "--set", f"store.url={tmp_path}", "--set", "learner.device=cuda"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "CUDA" in lines[0] and "learner.device" in lines[0], result.output


def test_a_device_name_that_is_no_device_is_refused_by_the_config():
    from echo2.config import ConfigError

    with pytest.raises(ConfigError, match="learner.device"):
        load_config(None, ["learner.device=gpu"])
    assert LearnerConfig(device="cuda:1").device == "cuda:1"


def _repo():
    from conftest import REPO

    return REPO

