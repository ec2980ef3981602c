"""The overlap benchmark's harness on one tiny grid point: real learner loop, real actor processes
on the timing workload, fitted inputs and the model's prediction. Accuracy is what
``echo2 bench overlap`` prints; this only checks the structure and that the values are sane."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from echo2.bench.overlap import Point, Settings, print_table, run_overlap_bench, summary_line
from echo2.cli import app


@pytest.mark.e2e
def test_one_point_through_the_harness(tmp_path):
    settings = Settings(train_seconds=0.3, batch_seconds=0.1, ballast_mb=0.5, warmup_steps=1, measured_steps=3)
    secrets_before = os.environ.get("ECHO2_SECRETS")
    results = run_overlap_bench(settings=settings, points=[Point(1, 2, "T")], plan=False, keep=tmp_path / "bench")
    assert os.environ.get("ECHO2_SECRETS") == secrets_before  # the run keys lived in the bench's folder only
    assert len(results) == 1
    r = results[0]
    for key in ("staleness", "actors", "dissemination_s", "measured_utilization", "predicted_utilization",
                "steps_per_minute", "sync_steps_per_minute"):
        assert key in r
    assert (r["staleness"], r["actors"], r["scenario"]) == (1, 2, "grid")
    assert 0 < r["measured_utilization"] <= 1
    assert 0 < r["predicted_utilization"] <= 1
    assert r["steps"] > 0 and r["steps_per_minute"] > 0
    assert r["dissemination_s"] > 0 and r["train_seconds"] >= settings.train_seconds
    assert len(r["batch_seconds"]) == 2 and all(g >= settings.batch_seconds for g in r["batch_seconds"])
    assert r["sync_steps_per_minute"] is None and r["ratio"] is None  # no S = 0 point in this grid
    assert r["rollouts_quarantined"] == 0  # the timing engine's completions pass the learner's checks
    assert abs(sum(r["lag_histogram"].values()) - 1) < 1e-6
    assert all(0 <= int(lag) <= 1 for lag in r["lag_histogram"])  # never beyond S
    json.dumps(results)
    print_table(results)
    assert "max |predicted - measured| utilization" in summary_line(results)


def test_cli_lists_the_benchmark():
    result = CliRunner().invoke(app, ["bench", "overlap", "--help"])
    assert result.exit_code == 0
    assert "--quick" in result.output and "--json" in result.output
