"""Staleness benchmark: does training on rollouts up to S versions old learn as well as training on fresh ones?

ECHO-2's central claim (reward parity at S up to 6, instability at S = 11) decides whether a cheap, slow,
distributed fleet costs anything in quality. Here the same task, model, seeds and step count are trained at each
S in ``staleness`` (default 0, 1, 2, 4, 8), one run after the other, each a real ``echo2 run`` (the Prefect flow,
a real learner, real actor processes, the local store), differing only in:

    train.staleness          S
    rollout.max_pending_batches
                             S x the batches one step eats (at least one step's worth): the actors may run S
                             steps ahead of the learner, so the staleness bound is what limits the lag, not
                             the backlog. Whether the lag is actually used depends on the fleet being faster
                             than the learner: the mean lag and the lag histogram are printed, never assumed.

Per S it reports, from each run's ``reports/summary.json`` and ``metrics.json``:

    final held-out metric    ``eval_after`` (greedy, on the task's held-out problems), with a 95% interval:
                             over seeds (Student t) when there are two or more, else, for a share metric such
                             as accuracy, the Wilson interval over the ``eval_n`` problems of the one run
    reward area              the mean of the per-step batch reward over the run (the area under the reward
                             curve divided by the steps): a curve that rises sooner has more area
    mean lag                 the mean of t - v over the groups used, and the histogram
    wall time and learner utilization
                             (sum of step seconds minus rollout waits) / (sum of step seconds)

and writes one plot: each S's reward curve and its held-out points (``--plot``, default
``reports/staleness.png``). Every run folder stays under ``--keep`` (default: a temporary folder, removed).

Not measured here: kappa (the actors' version-skip bound) is left at the config's value; one task per sweep.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from echo2.learner.report import held_out_points
from echo2.plots import figure_png
from echo2.tasks.base import wilson_95

DEFAULT_STALENESS = (0, 1, 2, 4, 8)
DEFAULT_ACTORS = 2
"""Actors of every run: on the 2-core development machine two actors fill a step's batch about twice as fast as
the learner eats it (measured 2026-12-03: at S=4 the lag climbed 0, 1, 2, 3, 4 over the first five steps), so
the backlog fills and the lag reaches S; the quickstart's one actor leaves less of the bound used."""
QUICK_STALENESS = (0, 2)
QUICK_SETTINGS = ["rollout.group_size=4", "rollout.groups_per_batch=2", "train.groups_per_step=2",
                  "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "task.eval_size=10", "train.lr=1e-3",
                  "eval.before=false", "train.checkpoint_every=2", "train.max_steps=2"]
"""The smoke form: a tiny random-weight model, two steps per S (checks the harness, says nothing of learning)."""

T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Two-sided 95% Student t quantiles by degrees of freedom (1.96 beyond the table)."""


@dataclass
class Sweep:
    config: str = "configs/quickstart.yaml"
    staleness: tuple[int, ...] = DEFAULT_STALENESS
    seeds: tuple[int, ...] = (0,)
    steps: int | None = None
    """train.max_steps of every run (None: the config's)."""
    actors: int | None = None
    """fleet.actors of every run (None: the config's; the CLI passes DEFAULT_ACTORS unless --quick)."""
    overrides: list[str] = field(default_factory=list)


def interval_95(values: list[float], n_problems: int | None = None) -> tuple[float, float] | None:
    """A 95% interval for the final metric: Student t over seeds (two or more runs), else the Wilson score
    interval of one run's share over ``n_problems`` (None when neither applies)."""
    if len(values) >= 2:
        mean, sd = statistics.fmean(values), statistics.stdev(values)
        half = T_95.get(len(values) - 1, 1.96) * sd / math.sqrt(len(values))
        return mean - half, mean + half
    if len(values) == 1 and n_problems and 0.0 <= values[0] <= 1.0:
        return wilson_95(round(values[0] * n_problems), n_problems)
    return None


def run_summary(run_dir: Path) -> dict:
    """What the sweep reads of one finished run folder."""
    summary = json.loads((run_dir / "reports" / "summary.json").read_text())
    history = json.loads((run_dir / "reports" / "metrics.json").read_text())
    steps = sum(m["seconds"] for m in history)
    busy = sum(m["seconds"] - m.get("wait_seconds", 0.0) for m in history)
    lags = {int(k): v for k, v in summary.get("lag_histogram", {}).items()}
    evals = {label: {"score": value} for label, value in
             (("before", summary.get("eval_before")), ("after", summary.get("eval_after"))) if value is not None}
    for label, metrics in summary.get("eval_metrics", {}).items():
        if label.startswith("step-") and isinstance(metrics, dict):
            score = metrics.get("score", metrics.get("accuracy"))
            if score is not None:
                evals[label] = {"score": score}
    return {
        "final": summary.get("eval_after"), "before": summary.get("eval_before"), "eval_n": summary.get("eval_n"),
        "metric": summary.get("eval_metric"), "wall_seconds": summary.get("wall_seconds"),
        "reward_area": statistics.fmean(m["reward"] for m in history) if history else None,
        "mean_lag": sum(k * v for k, v in lags.items()) / sum(lags.values()) if lags else None,
        "lag_histogram": {str(k): v for k, v in sorted(lags.items())},
        "utilization": busy / steps if steps else None,
        "curve": [(m["step"], m["reward"]) for m in history],
        "held_out": held_out_points(evals, history),
    }


def _run_one(sweep: Sweep, s: int, seed: int, workdir: Path, model: str | None) -> Path:
    run_id = f"staleness-s{s}-seed{seed}"
    sets = [f"store.url={workdir}", f"run.id={run_id}", f"run.seed={seed}", f"train.staleness={s}", *sweep.overrides]
    if model:
        sets.append(f"model.name={model}")
    if sweep.steps:
        sets.append(f"train.max_steps={sweep.steps}")
    if sweep.actors:
        sets.append(f"fleet.actors={sweep.actors}")
    # the backlog lets the actors run S steps ahead; the groups one step eats in batches: ceil(gps / gpb)
    sets.append(f"rollout.max_pending_batches={_pending_for(sweep, s, sets)}")
    env = {**os.environ, "PREFECT_HOME": str(workdir / "prefect-home"), "ECHO2_SECRETS": str(workdir / "secrets"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("ECHO2_RUN_KEY", None)
    args = [sys.executable, "-m", "echo2.cli", "run", sweep.config, *[a for x in sets for a in ("--set", x)]]
    log = workdir / f"{run_id}.log"
    with open(log, "w") as out:
        code = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"the run at S={s}, seed {seed} failed (exit {code}); its log ends:\n{tail}")
    return workdir / "runs" / run_id


def _pending_for(sweep: Sweep, s: int, sets: list[str]) -> int:
    from echo2.config import load_config

    cfg = load_config(sweep.config, [x for x in sets if not x.startswith("store.")])
    per_step = -(-cfg.train.groups_per_step // cfg.rollout.groups_per_batch)
    return per_step * max(1, s)


def run_staleness_bench(sweep: Sweep, *, quick: bool = False, keep: Path | None = None,
                        progress: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Train at every S and seed, one run after the other; one row per S (see the module docstring)."""
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="echo2-staleness-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = None
    if quick:
        from echo2.bench.tiny_model import make_tiny_model

        model = str(workdir / "tiny-model")
        if not (Path(model) / "config.json").exists():
            make_tiny_model(Path(model))
        sweep = Sweep(config=sweep.config, staleness=sweep.staleness, seeds=sweep.seeds, steps=sweep.steps,
                      actors=sweep.actors, overrides=[*QUICK_SETTINGS, *sweep.overrides])
    rows = []
    try:
        for s in sweep.staleness:
            runs = []
            for seed in sweep.seeds:
                t0 = time.time()
                progress(f"S={s} seed {seed}: training ...")
                runs.append(run_summary(_run_one(sweep, s, seed, workdir, model)))
                progress(f"S={s} seed {seed}: held-out {runs[-1]['final']} in {time.time() - t0:.0f}s")
            finals = [r["final"] for r in runs if r["final"] is not None]
            rows.append({
                "staleness": s, "seeds": list(sweep.seeds), "metric": runs[0]["metric"],
                "final": statistics.fmean(finals) if finals else None,
                "final_95": interval_95(finals, runs[0]["eval_n"]),
                "before": runs[0]["before"], "eval_n": runs[0]["eval_n"],
                **{k: statistics.fmean(r[k] for r in runs if r[k] is not None)
                   if any(r[k] is not None for r in runs) else None
                   for k in ("reward_area", "mean_lag", "wall_seconds", "utilization")},
                "lag_histogram": runs[0]["lag_histogram"],
                "curves": [r["curve"] for r in runs], "held_out": [r["held_out"] for r in runs],
            })
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def staleness_png(rows: list[dict]) -> bytes:
    """Reward per step (left) and held-out metric per step (right), one colour per S (every seed drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, row in enumerate(rows):
        colour = f"C{i}"
        for j, curve in enumerate(row["curves"]):
            ax1.plot([s for s, _ in curve], [r for _, r in curve], color=colour, alpha=0.8,
                     label=f"S={row['staleness']}" if j == 0 else None)
        for j, points in enumerate(row["held_out"]):
            ax2.plot([s for s, _ in points], [v for _, v in points], marker="o", color=colour,
                     label=f"S={row['staleness']}" if j == 0 else None)
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean reward of the batch")
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"held-out {rows[0]['metric'] if rows else ''}")
    ax1.legend()
    ax2.legend()
    return figure_png(fig)


def table_rows(rows: list[dict]) -> list[list[str]]:
    """The printed table: one row per S."""
    def num(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    out = []
    for r in rows:
        ci = r["final_95"]
        out.append([str(r["staleness"]), num(r["before"]), num(r["final"]),
                    "-" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]", num(r["reward_area"]),
                    num(r["mean_lag"], "{:.2f}"), r["lag_histogram"] and json.dumps(r["lag_histogram"]),
                    num(r["wall_seconds"], "{:.0f}"), num(r["utilization"], "{:.2f}")])
    return out


COLUMNS = ["S", "held-out before", "held-out after", "95% interval", "reward area", "mean lag", "lag histogram",
           "wall s", "learner util."]
