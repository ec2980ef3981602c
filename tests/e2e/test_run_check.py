"""``echo2 plan --from-run RUN --machine PROFILE`` (echo2/fleet/planner/run_check.py): a local run predicted from
its config and a machine profile alone, against cases worked by hand."""

from __future__ import annotations

import pytest

from echo2.config import load_config
from echo2.fleet.planner import run_check


def _profile(*, fixed: float, per_token: float = 0.0, position: float, crowded: float = 1.0, model: str | None = None,
             load: float = 10.0, eval_position: float = 0.01) -> dict:
    """A profile whose learner step is ``fixed + per_token x tokens`` alone and ``crowded`` times that contended."""
    return {"model": model or "smollm2-135m-instruct", "config": "quickstart", "load_seconds": load,
            "prompt_tokens": 40,
            "decode": {"rows": 64, "threads": 1, "max_new_tokens": 24, "actors": 1,
                       "seconds_per_position_alone": position, "seconds_per_position_contended": position * crowded},
            "eval_decode": {"rows": 50, "max_new_tokens": 24, "seconds_per_position": eval_position},
            "learner": {"fixed_seconds_alone": fixed, "seconds_per_token_alone": per_token,
                        "fixed_seconds_contended": fixed * crowded, "seconds_per_token_contended": per_token * crowded}}


@pytest.fixture
def quickstart():
    return load_config("configs/quickstart.yaml")


def test_a_learner_bound_run_is_its_steps_plus_loading_and_evaluations(quickstart):
    """Decode is fast (a 24-position batch in 0.24 s) and the step a fixed 10 s: the learner is the bound, every step
    takes 10 s, and the hours are loading + 2 evaluations + the first batch + 16 steps."""
    profile = _profile(fixed=10.0, position=0.01)
    out = run_check.predict_run(quickstart, profile, draws=50)
    assert out["utilization"]["p50"] == pytest.approx(1.0, abs=0.02)
    assert out["step_seconds"]["p50"] == pytest.approx(10.0, rel=0.16)  # the noise input spans +-15%
    likely = out["hours"]["likely"] * 3600
    evals = 2 * 1 * 0.01 * 0.9 * 24  # one batch of 50 rows, 0.9 of 24 positions
    assert likely == pytest.approx(10.0 + evals + 0.24 + 16 * 10.0, rel=0.02)
    assert out["usd"]["p50"] == 0.0  # local processes are not priced


def test_publishes_and_checkpoints_add_their_share_to_every_step(quickstart):
    """The quickstart publishes every step and checkpoints every 8: 2 s a publish and 8 s a checkpoint add 3 s."""
    plain = run_check.predict_run(quickstart, _profile(fixed=10.0, position=0.01), draws=10)
    profile = {**_profile(fixed=10.0, position=0.01), "publish_seconds": 2.0, "checkpoint_seconds": 8.0}
    busier = run_check.predict_run(quickstart, profile, draws=10)
    assert busier["train_seconds"]["likely"] == pytest.approx(plain["train_seconds"]["likely"] + 3.0)


def test_the_calibrated_overhead_scales_the_learners_busy_time(quickstart):
    plain = run_check.predict_run(quickstart, _profile(fixed=10.0, position=0.01), draws=10)
    profile = {**_profile(fixed=10.0, position=0.01), "calibration": {"run_id": "x", "learner_overhead": 1.5}}
    calibrated = run_check.predict_run(quickstart, profile, draws=10)
    assert calibrated["train_seconds"]["likely"] == pytest.approx(1.5 * plain["train_seconds"]["likely"])


def test_an_actor_bound_run_waits_for_batches_and_contention_slows_both(quickstart):
    """One actor makes 8 groups a batch of 24 x 1 s; the learner needs 8 groups a step and trains 1 s: the actor is
    the bound (step ~ one batch, utilization ~ 1/24). Contention (x2 while the other side works) slows the batch by
    the learner's busy share (small here) and the step by the actor's (all of it)."""
    alone = run_check.predict_run(quickstart, _profile(fixed=1.0, position=1.0), draws=50)
    assert alone["utilization"]["likely"] < 0.1
    assert alone["step_seconds"]["likely"] == pytest.approx(24.0, rel=0.1)
    crowded = run_check.predict_run(quickstart, _profile(fixed=1.0, position=1.0, crowded=2.0), draws=50)
    assert crowded["train_seconds"]["likely"] == pytest.approx(2.0, rel=0.05)  # actor always decoding: d = 1
    assert crowded["batch_seconds"]["likely"] < 1.2 * alone["batch_seconds"]["likely"]


def test_the_range_holds_the_likely_point_and_is_seeded(quickstart):
    profile = _profile(fixed=2.0, per_token=0.01, position=0.1)
    a = run_check.predict_run(quickstart, profile, draws=80, seed=3)
    assert a == run_check.predict_run(quickstart, profile, draws=80, seed=3)
    for key in ("hours", "step_seconds"):
        assert a[key]["p10"] <= a[key]["p50"] <= a[key]["p90"]
        assert a[key]["p10"] < a[key]["p90"]  # the completion length moves the learner's tokens


def test_a_profile_of_another_model_is_refused(quickstart):
    with pytest.raises(ValueError, match="echo2 bench machine"):
        run_check.predict_run(quickstart, _profile(fixed=1.0, position=0.1, model="qwen3-8b"))


def test_compare_says_inside_and_the_p50_error():
    predicted = {k: {"p10": 1.0, "p50": 2.0, "p90": 3.0, "likely": 2.0}
                 for k in ("hours", "utilization", "step_seconds", "train_seconds", "batch_seconds")}
    predicted["usd"] = {"p10": 0.0, "p50": 0.0, "p90": 0.0, "likely": 0.0}
    measured = {"hours": 2.5, "usd": 0.0, "utilization": 4.0, "step_seconds": 1.0, "train_seconds": 2.0,
                "batch_seconds": 0.5}
    rows = {r["quantity"]: r for r in run_check.compare(predicted, measured)}
    assert rows["hours"]["inside"] and rows["hours"]["p50_error"] == pytest.approx(-0.2)
    assert not rows["utilization"]["inside"] and rows["step_seconds"]["inside"]
    assert rows["usd"]["inside"] and rows["usd"]["p50_error"] == 0.0
    assert not rows["batch_seconds"]["inside"]


@pytest.mark.e2e
def test_bench_machine_measures_a_profile_the_check_reads(tiny_model, tmp_path):
    """`echo2 bench machine` on a tiny model: every figure measured and positive (the step grows with its tokens or
    stays flat), the profile YAML the planner reads, and a prediction made from it."""
    import subprocess
    import sys

    import yaml

    tiny = ["train.groups_per_step=2", "rollout.group_size=4", "rollout.groups_per_batch=2", "rollout.max_new_tokens=8",
            "eval.max_new_tokens=4", "task.eval_size=4", f"model.name={tiny_model}"]
    out = tmp_path / "machine.yaml"
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "bench", "machine", "--config", "configs/quickstart.yaml",
                           *[a for s in tiny for a in ("--set", s)], "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    profile = yaml.safe_load(out.read_text())
    assert profile["model"] == str(tiny_model) and profile["decode"]["actors"] == 1
    assert profile["decode"]["seconds_per_position_alone"] > 0 and profile["eval_decode"]["seconds_per_position"] > 0
    learner = profile["learner"]
    assert learner["fixed_seconds_alone"] >= 0 and learner["seconds_per_token_alone"] >= 0
    assert learner["fixed_seconds_alone"] + learner["seconds_per_token_alone"] > 0
    assert [len(p) for p in learner["points_alone"]] == [2, 2]
    assert learner["points_alone"][0][0] < learner["points_alone"][1][0]  # a quarter of the limit, then all of it
    assert profile["prompt_tokens"] > 0 and profile["load_seconds"] > 0
    assert profile["publish_seconds"] > 0 and profile["checkpoint_seconds"] > 0
    config = load_config("configs/quickstart.yaml", tiny)
    predicted = run_check.predict_run(config, profile, draws=20)
    assert 0 < predicted["hours"]["p10"] <= predicted["hours"]["p90"]
