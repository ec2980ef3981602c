"""A notice, Ctrl-C or a stop never checkpoints torn weights (``learner/notice.py``, "Safe points"; ``Learner.torn``).

Inside ``optimizer.step()`` some parameters and moments are updated and others not. Here AdamW's update itself is
patched (``torch.optim.AdamW.step``) so that something lands in the middle of it: a real SIGTERM sent from inside the
update (a spot notice that cannot let the step finish), or an error raised after some parameters were updated. Every
checkpoint the run then holds must hold exactly the weights of its step: the weights the learner had when that step's
version was reached, compared tensor by tensor with what the checkpoint saved."""

from __future__ import annotations

import signal

import pytest
import torch
from helpers import rollout_bytes

from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.rollouts import decode_rollouts
from echo2.data.store import open_store
from echo2.learner.checkpoint import checkpoint_weights, load_checkpoint, verified_steps
from echo2.learner.collector import Selection
from echo2.learner.notice import NoticeInterrupt, SpotNotice
from echo2.learner.run import LearnerRun

RUN = "torn-step"


def _run(tmp_path, monkeypatch, tiny_model) -> LearnerRun:
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    config = config_from_dict({
        "run": {"id": RUN}, "store": {"url": str(tmp_path / "store")}, "model": {"name": str(tiny_model)},
        "rollout": {"group_size": 2, "groups_per_batch": 2, "max_new_tokens": 4},
        "train": {"max_steps": 10, "checkpoint_every": 1000, "groups_per_step": 2, "lr": 0.01},
        "trust": {"spot_check_fraction": 0}, "learner": {"num_threads": 1, "market": "spot"},
        "eval": {"before": False, "after": False}, "fleet": {"actors": 1},
    })
    return LearnerRun(config, open_store(str(tmp_path / "store")).child(layout.RUNS), resume=False)


def _selection(run: LearnerRun) -> Selection:
    step = run.step + 1
    data = rollout_bytes(run.step, run_id=RUN, salt=f"-{step}")
    return Selection(step=step, learner_version=run.step, tables=[decode_rollouts(data)],
                     used=[{"key": layout.rollout_key(run.step, "a", step), "sha256": f"{step:064d}", "groups": 2}])


def _weights(run: LearnerRun) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in run.learner.full_tensors().items()}


def _assert_every_checkpoint_is_its_steps(run: LearnerRun, weights_at: dict[int, dict[str, torch.Tensor]]) -> list:
    steps = verified_steps(run.store, run.key.public_key())
    for step in steps:
        saved = checkpoint_weights(run.store, load_checkpoint(run.store, step, run.key.public_key()))
        expected = weights_at[step]
        differ = [k for k in expected if k in saved and not torch.equal(saved[k], expected[k])]
        assert not differ, f"checkpoint {step} holds weights that are not step {step}'s: {differ[:3]}"
    return steps


def test_a_notice_inside_the_optimizer_update_never_checkpoints_a_torn_step(tmp_path, monkeypatch, tiny_model):
    """A SIGTERM sent from inside AdamW's update, with a notice too short to let the step finish: the update runs to
    its end (the signal waits for the version to move), and the checkpoint the notice writes holds that step's
    weights under that step's number."""
    run = _run(tmp_path, monkeypatch, tiny_model)
    weights_at = {0: _weights(run)}
    run.update(_selection(run))
    weights_at[1] = _weights(run)
    notice = SpotNotice(0.01).install()  # no step fits 10 ms: the notice abandons what it can
    notice.attach(run.clock, lambda: run.step)
    real_step = torch.optim.AdamW.step

    def update_then_notice(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        signal.raise_signal(signal.SIGTERM)  # lands after the parameters moved, before the version did
        return result

    try:
        with monkeypatch.context() as mp:
            mp.setattr(torch.optim.AdamW, "step", update_then_notice)
            with pytest.raises(NoticeInterrupt):
                run.update(_selection(run))
        if run.step == 2:
            weights_at[2] = _weights(run)
        notice.leave()
        left = run.leave_on_notice(notice.heard, notice.abandoned(run.step))
    finally:
        notice.close()
    steps = _assert_every_checkpoint_is_its_steps(run, weights_at)
    assert steps == [left["checkpoint_step"]] == [2] and not run.learner.torn


def test_an_error_inside_the_optimizer_update_leaves_the_last_checkpoint_standing(tmp_path, monkeypatch, tiny_model):
    """AdamW's update raises after it updated half of the parameters (what an interrupt landing inside it leaves):
    the learner is torn, and the stop that follows (``interrupted``) checkpoints nothing of it."""
    run = _run(tmp_path, monkeypatch, tiny_model)
    weights_at = {0: _weights(run)}
    run.update(_selection(run))
    weights_at[1] = _weights(run)
    real_step = torch.optim.AdamW.step

    def half_an_update(self, *args, **kwargs):
        params = [p for group in self.param_groups for p in group["params"]]
        kept = [p.detach().clone() for p in params[len(params) // 2:]]
        real_step(self, *args, **kwargs)
        with torch.no_grad():  # the second half as it was: updated only in part
            for p, old in zip(params[len(params) // 2:], kept):
                p.copy_(old)
        raise KeyboardInterrupt  # as Ctrl-C's handler would, landing inside the update

    with monkeypatch.context() as mp:
        mp.setattr(torch.optim.AdamW, "step", half_an_update)
        with pytest.raises(KeyboardInterrupt):
            run.update(_selection(run))
    run.interrupted()
    assert _assert_every_checkpoint_is_its_steps(run, weights_at) == []
    assert run.step == 1 and run.learner.torn
    with pytest.raises(RuntimeError, match="torn"):
        run.checkpoint()


def test_a_step_abandoned_at_a_safe_point_leaves_no_gradient(tmp_path, monkeypatch, tiny_model):
    """A step abandoned before its update drops its gradients. Before, they stayed; an optimizer with no state yet
    then saved none on that rank while a rank without gradients saved zero moments (DCP's get_state_dict), and a
    two-rank checkpoint after Ctrl-C failed ("Failed to validate global plan")."""
    run = _run(tmp_path, monkeypatch, tiny_model)
    learner = run.learner
    calls = []

    def abandon_at_the_second():
        calls.append(1)
        if len(calls) == 2:  # the first pack's backward is done: gradients exist
            raise KeyboardInterrupt

    monkeypatch.setattr(learner, "_safe_point", abandon_at_the_second)
    monkeypatch.setattr(learner, "_pack_budget", lambda total: 1)  # one row a pack: several safe points
    with pytest.raises(KeyboardInterrupt):
        learner.train_step([decode_rollouts(rollout_bytes(0))])
    assert len(calls) == 2 and not learner.optimizer.state and learner.version == 0
    assert all(p.grad is None for p in learner.model.parameters())
    run.sink.close()
