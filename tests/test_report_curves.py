"""reports/curves.png: reward, held-out metric and lag per step (issue 24, item 4)."""

from __future__ import annotations

import io

from PIL import Image

from echo2.learner.report import _curves_png, held_out_points

HISTORY = [{"step": s, "reward": 0.1 * s, "lag_mean": 0.5, "lag_max": 1} for s in range(1, 7)]


def test_held_out_points_place_each_evaluation_at_its_step():
    evals = {"before": {"score": 0.5}, "step-2": {"score": 0.6}, "step-4": {"accuracy": 0.7},
             "after": {"score": 0.9}, "step-x": {"score": 1.0}, "step-5": {"n": 3}}
    assert held_out_points(evals, HISTORY) == [(0, 0.5), (2, 0.6), (4, 0.7), (6, 0.9)]


def test_held_out_points_of_a_resumed_run_start_at_its_resume_step():
    resumed = [{"step": s, "reward": 0.0, "lag_mean": 0, "lag_max": 0} for s in (9, 10)]
    assert held_out_points({"before": {"score": 0.4}, "after": {"score": 0.8}}, resumed) == [(8, 0.4), (10, 0.8)]


def test_curves_png_has_three_panels_with_or_without_evaluations():
    with_evals = Image.open(io.BytesIO(_curves_png(HISTORY, {"before": {"score": 0.5}, "after": {"score": 0.9}},
                                                   "accuracy")))
    without = Image.open(io.BytesIO(_curves_png(HISTORY)))
    assert with_evals.size == without.size == (1200, 320)
