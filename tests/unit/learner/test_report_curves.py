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


def test_evaluations_are_points_with_their_intervals_and_no_line_between_them():
    """Two evaluations are two points with their 95% intervals: a line between them would show values the run
    never measured, and the intervals are the run's own (the task's Wilson interval of greedy pass@1)."""
    from matplotlib.container import ErrorbarContainer

    from echo2.learner.report import curves_figure

    evals = {"before": {"score": 0.5, "metric": "accuracy", "pass_at_1_ci95_low": 0.3, "pass_at_1_ci95_high": 0.7},
             "after": {"score": 0.9, "metric": "accuracy", "pass_at_1_ci95_low": 0.75, "pass_at_1_ci95_high": 0.97}}
    fig = curves_figure(HISTORY, evals, "accuracy")
    reward, held_out = fig.axes[0], fig.axes[1]
    assert [line.get_linestyle() for line in reward.lines] == ["-"]  # the reward, every step: a line
    bars = [c for c in held_out.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 1
    points, _, (whiskers,) = bars[0].lines
    assert points.get_linestyle() == "None" and list(points.get_xdata()) == [0, 6]
    assert all(line.get_linestyle() == "None" for line in held_out.lines)  # nothing joins the evaluations
    spans = sorted((round(float(seg[0][1]), 6), round(float(seg[1][1]), 6)) for seg in whiskers.get_segments())
    assert spans == [(0.3, 0.7), (0.75, 0.97)]


def test_score_interval_reads_the_interval_of_the_headline_metric():
    from echo2.learner.report import score_interval

    flat = {"accuracy": 0.4, "pass_at_1_ci95_low": 0.2, "pass_at_1_ci95_high": 0.6}
    assert score_interval(flat, "accuracy") == (0.2, 0.6)
    assert score_interval({"bb_per_100": 3.0, "bb_per_100_ci95_low": -1, "bb_per_100_ci95_high": 7},
                          "bb_per_100") == (-1.0, 7.0)
    assert score_interval({"bb_per_100": 3.0}, "bb_per_100") is None and score_interval(None, "accuracy") is None
