"""`echo2 bench staleness` (issue 24): its statistics by hand, and one real run through the harness.

What the sweep measures (whether stale rollouts learn as well) is what `make bench-staleness` prints; this
checks the arithmetic and that a real `echo2 run` per S lands in the table."""

from __future__ import annotations

import io
import json
import math

import pytest
from PIL import Image

from echo2.bench.staleness import Sweep, interval_95, run_staleness_bench, run_summary, staleness_png, table_rows


def test_interval_over_seeds_is_student_t():
    low, high = interval_95([0.8, 0.9, 1.0])
    half = 4.303 * 0.1 / math.sqrt(3)
    assert low == pytest.approx(0.9 - half) and high == pytest.approx(0.9 + half)


def test_interval_of_one_run_is_wilson_over_its_problems():
    low, high = interval_95([0.5], n_problems=50)
    assert low == pytest.approx(0.366, abs=1e-3) and high == pytest.approx(0.634, abs=1e-3)
    assert interval_95([0.0], n_problems=10)[0] == 0.0  # clamped, never below a share's range
    assert interval_95([-12.5], n_problems=100) is None  # bb/100 from one run: no share, no interval
    assert interval_95([]) is None


def test_run_summary_reads_lag_utilization_and_held_out_points(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    history = [{"step": 1, "reward": 0.2, "seconds": 4.0, "wait_seconds": 1.0},
               {"step": 2, "reward": 0.6, "seconds": 4.0, "wait_seconds": 3.0}]
    (reports / "metrics.json").write_text(json.dumps(history))
    (reports / "summary.json").write_text(json.dumps({
        "eval_before": 0.5, "eval_after": 0.9, "eval_n": 50, "eval_metric": "accuracy", "wall_seconds": 12.0,
        "lag_histogram": {"0": 8, "2": 8}, "eval_metrics": {"step-1": {"score": 0.7}}}))
    r = run_summary(tmp_path)
    assert r["reward_area"] == pytest.approx(0.4)
    assert r["mean_lag"] == pytest.approx(1.0)
    assert r["utilization"] == pytest.approx(4.0 / 8.0)
    assert r["held_out"] == [(0, 0.5), (1, 0.7), (2, 0.9)]


@pytest.mark.e2e
def test_one_staleness_point_through_real_runs(tmp_path):
    rows = run_staleness_bench(Sweep(config="configs/quickstart.yaml", staleness=(1,)), quick=True,
                               keep=tmp_path / "sweep")
    assert [r["staleness"] for r in rows] == [1]
    row = rows[0]
    assert row["final"] is not None and row["eval_n"] == 10 and row["final_95"] is not None
    assert all(int(lag) <= 1 for lag in row["lag_histogram"])  # never beyond S
    assert sum(row["lag_histogram"].values()) > 0 and 0 < row["utilization"] <= 1
    assert [s for s, _ in row["curves"][0]] == [1, 2]
    assert (tmp_path / "sweep" / "runs" / "staleness-s1-seed0" / "reports" / "summary.json").exists()
    assert len(table_rows(rows)[0]) == 9
    assert Image.open(io.BytesIO(staleness_png(rows))).size == (1000, 360)
