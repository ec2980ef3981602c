"""End-of-run reports: ``reports/summary.json`` (what scripts read), metrics, and curves of reward,
held-out metric and lag per step (``reports/curves.png``).

Counts come from the ledger, the record of what each step used, dropped or quarantined, so the
summary can never disagree with it. The cost report (cost.json, cost.md, cost.png) is
``echo2/fleet/bill/``'s, the one owner of every cost figure. The rest comes in a plain record
(``ReportInputs``, which ``LearnerRun.finish`` fills), so this module needs nothing of the run itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from echo2.data import layout
from echo2.data.ledger import consumed_keys
from echo2.fleet.bill.report import write_cost_reports
from echo2.learner.evaluate import flat_metrics
from echo2.plots import figure_png


@dataclass(frozen=True)
class ReportInputs:
    """What the end-of-run reports say of a run beside its ledger and its costs."""

    run_id: str
    steps: int
    """The final policy version (the number of steps trained)."""
    wall_seconds: float
    evals: dict[str, dict]
    """Every evaluation's result by label ("before", "after", "step-N")."""
    eval_metric: str
    """The task's headline metric (accuracy, bb/100)."""
    staleness_bound: int
    history: list[dict]
    """Every step's metrics, in order."""
    spot_check: dict
    """What the spot checks of actors found (``LearnerRun.spot_check_summary``)."""


def ledger_totals(store) -> dict:
    """Counts over the ledger. A step's amendment (files quarantined after a non-finite step) moves
    them from used to quarantined; the final entry lists what was left unused."""
    keys = consumed_keys(store)
    records = [store.get_json(key) for key in keys]
    amended = {item["key"] for r in records for item in r.get("quarantined", []) if r.get("amendment")}
    used = dropped = quarantined = completions = unused = 0
    max_lag = 0
    lags: dict[int, int] = {}
    for key, record in zip(keys, records):
        for item in record.get("used", []):
            if item["key"] in amended:
                continue
            used += 1
            completions += item.get("rows", 0)
            max_lag = max(max_lag, item["lag"])
            lags[item["lag"]] = lags.get(item["lag"], 0) + 1
        if key == layout.FINAL_CONSUMED:
            unused += len(record.get("dropped", []))
        else:
            dropped += len(record.get("dropped", []))
        quarantined += len(record.get("quarantined", []))
    return {"rollouts_used": used, "completions_used": completions, "rollouts_dropped_stale": dropped,
            "rollouts_quarantined": quarantined, "rollouts_unused_at_end": unused, "max_lag_used": max_lag,
            "lag_histogram": {str(k): v for k, v in sorted(lags.items())}}


def publish_totals(history: list[dict]) -> dict:
    """Bytes the run's versions weighed in full and what was sent (sparse deltas, keyframes), steps 1..n."""
    full = sum(m.get("publish_full_bytes", 0) for m in history)
    sent = sum(m.get("publish_bytes", 0) for m in history)
    return {"published_full_bytes": full, "published_sent_bytes": sent,
            "published_sent_over_full": round(sent / full, 5) if full else None}


def held_out_points(evals: dict[str, dict], history: list[dict]) -> list[tuple[int, float]]:
    """The held-out metric per step, from the run's evaluations by label: "before" at the step before the
    first one trained here (0 for a new run), "step-N" at N, "after" at the last step; unscored ones left out."""
    return [(step, score) for step, score, _ in held_out_evaluations(evals, history)]


def held_out_evaluations(evals: dict[str, dict], history: list[dict],
                         metric: str | None = None) -> list[tuple[int, float, tuple[float, float] | None]]:
    """``held_out_points`` with each evaluation's 95% interval of its headline (None where it has none)."""
    first = history[0]["step"] - 1 if history else 0
    last = history[-1]["step"] if history else 0
    points = {}
    for label, result in evals.items():
        score = _score(result)
        if score is None:
            continue
        interval = score_interval(result, metric or result.get("metric") or "accuracy")
        if label == "before":
            points[first] = (score, interval)
        elif label == "after":
            points[last] = (score, interval)
        elif label.startswith("step-") and label[5:].isdigit():
            points[int(label[5:])] = (score, interval)
    return [(step, score, interval) for step, (score, interval) in sorted(points.items())]


def score_interval(result: dict | None, metric: str) -> tuple[float, float] | None:
    """The 95% interval an evaluation computed for its headline ``metric`` (an evaluation result, or its
    ``flat_metrics`` as in ``summary.json``): accuracy is greedy pass@1, whose Wilson interval the task names
    ``pass_at_1_ci95_*``; another metric's is ``<metric>_ci95_*`` or the result's own ``ci95_*``."""
    if not isinstance(result, dict):
        return None
    name = "pass_at_1" if metric == "accuracy" else metric
    for low, high in ((f"{name}_ci95_low", f"{name}_ci95_high"), ("ci95_low", "ci95_high")):
        lo, hi = result.get(low), result.get(high)
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
            return float(lo), float(hi)
    return None


def curves_figure(history: list[dict], evals: dict[str, dict] | None = None, metric: str = "score"):
    """Reward, held-out metric and policy lag per step, side by side (the Prefect run page shows it). The reward
    is a line (a value every step); an evaluation is a point with its 95% interval and nothing joins two of them,
    since the run knows nothing of the metric between the steps it was evaluated at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 3.2))
    steps = [m["step"] for m in history]
    ax1.plot(steps, [m["reward"] for m in history])
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean reward of the batch")
    held_out = held_out_evaluations(evals or {}, history, None if metric == "score" else metric)
    if held_out:
        xs, ys = [s for s, _, _ in held_out], [v for _, v, _ in held_out]
        # an evaluation without an interval gets a zero-length bar, not a made-up one
        below = [v - i[0] if i else 0.0 for _, v, i in held_out]
        above = [i[1] - v if i else 0.0 for _, v, i in held_out]
        ax2.errorbar(xs, ys, yerr=[below, above], fmt="s", linestyle="none", color="tab:green", capsize=4,
                     label="evaluation (95% interval)")
        ax2.set_xlim(min(xs + steps) - 0.5, max(xs + steps) + 0.5)
        ax2.legend(loc="best", fontsize="small")
    else:
        ax2.text(0.5, 0.5, "no held-out evaluation", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"held-out {metric}")
    ax3.plot(steps, [m["lag_mean"] for m in history], marker="o", label="mean")
    ax3.plot(steps, [m["lag_max"] for m in history], marker="x", label="max")
    ax3.set_xlabel("step")
    ax3.set_ylabel("policy lag t - v")
    ax3.legend()
    return fig


def _curves_png(history: list[dict], evals: dict[str, dict] | None = None, metric: str = "score") -> bytes:
    return figure_png(curves_figure(history, evals, metric))


def _score(result: dict | None) -> float | None:
    """The headline of an evaluation (``accuracy`` in runs from before evaluations had a ``score``)."""
    return None if result is None else result.get("score", result.get("accuracy"))


def write_reports(store, run: ReportInputs) -> dict:
    """Write ``reports/`` into the run folder ``store`` (summary.json last) and return the summary."""
    summary = {
        "run_id": run.run_id,
        "steps": run.steps,
        "wall_seconds": round(run.wall_seconds, 1),
        "eval_before": _score(run.evals.get("before")),
        "eval_after": _score(run.evals.get("after")),
        "eval_n": run.evals.get("after", run.evals.get("before", {})).get("n"),
        "eval_metric": run.eval_metric,
        "eval_metrics": {label: flat_metrics(result) for label, result in run.evals.items()},
        "staleness_bound": run.staleness_bound,
        **ledger_totals(store),
        **publish_totals(run.history),
        "final_version": run.steps,
        "spot_check": run.spot_check,
        "cost_usd": None,
        "cost_priced": None,
        "finished_at": time.time(),
    }
    store.put(layout.report_key("metrics.json"), json.dumps(run.history, indent=1).encode(), if_absent=False)
    if run.history:
        store.put(layout.report_key("curves.png"), _curves_png(run.history, run.evals, run.eval_metric),
                  if_absent=False)
    # cost.json, cost.md (the Prefect cost artifact) and cost.png: every figure from fleet/bill/
    cost = write_cost_reports(store, summary=summary)
    summary["cost_usd"], summary["cost_priced"] = cost["total_usd"], cost["priced_resources"]
    store.put_json(layout.SUMMARY, summary)
    return summary
