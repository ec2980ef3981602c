"""A finished local run predicted from its config and this machine's profile alone, beside what it measured:
``echo2 plan --from-run RUN --machine PROFILE``.

The profile (``echo2 bench machine``) holds what a benchmark measured on this machine for the config's shapes,
never the run's own timings: decode seconds per position of an actor's batch and of the evaluation's batch, the
learner step as ``fixed + per_token x tokens``, each alone and while the config's actors decode, the prompt's
tokens, loading. What the config does not say is drawn from a range (``INPUTS``): how long completions are (their
mean sets the learner's tokens, the longest of a batch sets the batch's time: a batch decodes until its last row
ends), the share of groups with a reward signal (the learner drops the others before its forward pass), the
benchmark's own noise. The benchmark times the learner's bare step; what a run does around it (reading, validating
and spot-checking rollout files, serving the relay, its other threads) is one factor measured on one calibration run
(``calibrate``, ``echo2 bench machine --calibrate-run``), which is then never a check. Each draw:

    tokens per step  T_tok = signal x R x (P + G x mean x max_new_tokens)          (each prompt once per group)
    learner busy     T = (T_alone(T_tok) + (T_contended - T_alone) x d) x overhead  (d: share of time actors decode)
                       (+ publish seconds / publish_every + checkpoint seconds / checkpoint_every, in both)
    one batch        B = longest x max_new_tokens x (s_alone + (s_contended - s_alone) x u)
    step, u          the capacity model (``sizing/capacity.py``) on T, [B] x actors, S, k, Q
    d                = groups the learner uses per second x B / (actors x groups per batch), at most 1

(u and d depend on each other: six rounds of the two settle them.) Hours add loading, the evaluations before and
after (and every ``eval.every`` steps: batches of the evaluation's greedy decode, which ends early when every row
has stopped: ``eval_length``) and the first batch's fill. Dollars are hours times the fleet's hourly price: zero
for local processes that are not priced. P10/P50/P90 are over ``draws`` seeded draws.

Not modelled: reading, validating, re-scoring and spot-checking rollout files on the learner, a code task's sandbox
seconds on the actors, multi-turn tasks (the prompt is measured as one turn).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from echo2.fleet.sizing.capacity import Workload, predict

ROUNDS = 6
SIMULATED_STEPS = 100


@dataclass(frozen=True)
class Triangle:
    low: float
    likely: float
    high: float
    source: str

    def draw(self, rng: random.Random) -> float:
        return rng.triangular(self.low, self.high, self.likely)


INPUTS = {
    "mean_length": Triangle(0.3, 0.8, 1.0, "a completion's mean length over max_new_tokens: small models often run "
                            "to the limit; a task that answers in a line stops far before it"),
    "longest": Triangle(0.7, 1.0, 1.0, "a batch's longest row over max_new_tokens: among dozens of rows one almost "
                        "always reaches the limit"),
    "eval_length": Triangle(0.4, 0.9, 1.0, "the evaluation batch's longest greedy reply over eval.max_new_tokens"),
    "signal": Triangle(0.5, 0.85, 1.0, "share of groups whose rewards differ (the rest never reach the forward "
                       "pass)"),
    "noise": Triangle(0.85, 1.0, 1.15, "the benchmark's own spread on a shared, noisy machine"),
}


def _one(config, profile: dict, x: dict[str, float]) -> dict:
    r, t, e = config.rollout, config.train, config.eval
    actors = config.fleet.actors if isinstance(config.fleet.actors, int) else profile["decode"]["actors"]
    learner, decode = profile["learner"], profile["decode"]
    tokens = x["signal"] * t.groups_per_step * (profile["prompt_tokens"] + r.group_size * x["mean_length"]
                                                * r.max_new_tokens)
    # a step also publishes (every publish_every steps) and checkpoints (every checkpoint_every): their share
    extra = (profile.get("publish_seconds", 0.0) / config.publish.every
             + profile.get("checkpoint_seconds", 0.0) / t.checkpoint_every)
    # the run's own work around a step that the benchmark's bare step leaves out, as the calibration run measured it
    around = profile.get("calibration", {}).get("learner_overhead", 1.0) * x["noise"]
    alone = (learner["fixed_seconds_alone"] + learner["seconds_per_token_alone"] * tokens + extra) * around
    crowded = (learner["fixed_seconds_contended"] + learner["seconds_per_token_contended"] * tokens
               + extra) * around
    s_alone = decode["seconds_per_position_alone"] * x["noise"]
    s_crowded = (decode["seconds_per_position_contended"] or decode["seconds_per_position_alone"]) * x["noise"]
    positions = x["longest"] * r.max_new_tokens
    u = d = 1.0
    for _ in range(ROUNDS):
        train = alone + (crowded - alone) * d
        batch = positions * (s_alone + (s_crowded - s_alone) * u)
        workload = Workload(train_seconds=train, groups_per_step=t.groups_per_step,
                            groups_per_batch=r.groups_per_batch, staleness=t.staleness,
                            publish_every=config.publish.every, max_pending_batches=r.max_pending_batches)
        # the learner's poll is left out (at most one poll interval a step): simulated, a waiting learner's polls
        # are thousands of turns a draw
        p = predict(workload, [batch] * actors, steps=SIMULATED_STEPS)
        u = p.utilization
        d = min(1.0, t.groups_per_step / p.step_seconds * batch / (actors * r.groups_per_batch))
    evals = 2 + (t.max_steps // e.every if e.every else 0)
    eval_size = getattr(config.task, "eval_size", profile["eval_decode"]["rows"])
    per_eval = (math.ceil(eval_size / profile["eval_decode"]["rows"]) * profile["eval_decode"]["seconds_per_position"]
                * x["eval_length"] * e.max_new_tokens * x["noise"])
    seconds = profile["load_seconds"] + evals * per_eval + batch + t.max_steps * p.step_seconds
    return {"hours": seconds / 3600, "utilization": p.utilization, "step_seconds": p.step_seconds,
            "train_seconds": train, "batch_seconds": batch}


def predict_run(config, profile: dict, *, usd_per_hour: float = 0.0, draws: int = 400, seed: int = 0) -> dict:
    """P10/P50/P90 of a local run of ``config`` on the machine ``profile`` describes (see the module docstring)."""
    if profile.get("model") != config.model.name:
        raise ValueError(f"the machine profile measured {profile.get('model')!r}, the run trains "
                         f"{config.model.name!r}: measure this config with `echo2 bench machine --config ...`")
    rng = random.Random(seed)
    outcomes = [_one(config, profile, {k: v.draw(rng) for k, v in INPUTS.items()}) for _ in range(draws)]
    likely = _one(config, profile, {k: v.likely for k, v in INPUTS.items()})
    out = {}
    for key in ("hours", "utilization", "step_seconds", "train_seconds", "batch_seconds"):
        values = sorted(o[key] for o in outcomes)
        out[key] = {"p10": _quantile(values, 0.1), "p50": _quantile(values, 0.5), "p90": _quantile(values, 0.9),
                    "likely": likely[key]}
    out["usd"] = {k: v * usd_per_hour for k, v in out["hours"].items()}
    return out


def _quantile(values: list[float], q: float) -> float:
    position = q * (len(values) - 1)
    lo, hi = math.floor(position), math.ceil(position)
    return values[lo] + (values[hi] - values[lo]) * (position - lo)


def measured_run(store) -> dict:
    """What the finished run in ``store`` measured: wall hours and cost (its summary), learner utilization
    (``fit.fit_run``)."""
    from echo2.data import layout
    from echo2.fleet.sizing.fit import fit_run

    summary = json.loads(store.get(layout.report_key("summary.json")))
    fit = fit_run(store)
    return {"hours": summary["wall_seconds"] / 3600, "usd": summary.get("cost_usd", 0.0),
            "utilization": fit.measured_utilization, "step_seconds": fit.measured_step_seconds,
            "train_seconds": fit.workload.train_seconds,
            "batch_seconds": sum(fit.batch_seconds) / len(fit.batch_seconds)}


def compare(predicted: dict, measured: dict) -> list[dict]:
    """One row per quantity: the range, the measured value, whether it is inside P10-P90, P50's error."""
    rows = []
    for key in ("hours", "usd", "utilization", "step_seconds", "train_seconds", "batch_seconds"):
        p, m = predicted[key], measured[key]
        inside = p["p10"] - 1e-9 <= m <= p["p90"] + 1e-9
        error = (p["p50"] - m) / m if m else (0.0 if not p["p50"] else math.inf)
        rows.append({"quantity": key, **p, "measured": m, "inside": inside, "p50_error": error})
    return rows


def _run_id(store) -> str:
    """The run's id: its folder's name."""
    return store.url.rstrip("/").rsplit("/", 1)[-1]


def calibrate(profile: dict, run: str) -> dict:
    """The profile with ``calibration``: how much longer ``run``'s learner was busy a step than the benchmark's
    bare step predicts at the likely inputs (reading, validating and spot-checking rollout files, serving the relay,
    the run's other threads and processes). ``run`` then never counts as a check of the profile (``check_run``
    refuses it): it is the one run the prediction has seen."""
    from echo2.fleet.sizing.fit import open_run, run_config

    store = open_run(run)
    config = run_config(store)
    bare = {k: v for k, v in profile.items() if k != "calibration"}
    predicted = _one(config, bare, {k: v.likely for k, v in INPUTS.items()})["train_seconds"]
    measured = measured_run(store)["train_seconds"]
    return {**bare, "calibration": {"run_id": _run_id(store), "config": config.run.name,
                                    "learner_overhead": measured / predicted,
                                    "measured_train_seconds": measured, "bare_train_seconds": predicted}}


def check_run(run: str, machine, *, draws: int = 400, seed: int = 0) -> dict:
    """``echo2 plan --from-run RUN --machine PROFILE``: the run's config predicted on the profile, beside the run."""
    import yaml

    from echo2.errors import Echo2InputError
    from echo2.fleet.sizing.fit import open_run, run_config

    try:
        profile = yaml.safe_load(open(machine).read())
    except (OSError, yaml.YAMLError) as exc:
        raise Echo2InputError(f"cannot read the machine profile {machine}: {exc}") from None
    store = open_run(run)
    if profile.get("calibration", {}).get("run_id") == _run_id(store):
        raise Echo2InputError(f"{run} is the run this profile was calibrated on: check it on a run it did not see")
    config = run_config(store)
    try:
        predicted = predict_run(config, profile, draws=draws, seed=seed)
    except ValueError as exc:
        raise Echo2InputError(str(exc)) from None
    measured = measured_run(store)
    return {"run": run, "config": config.run.name, "machine": profile.get("machine", {}),
            "calibration": profile.get("calibration"),
            "profile_config": profile.get("config"), "draws": draws, "seed": seed,
            "inputs": {k: vars(v) for k, v in INPUTS.items()}, "rows": compare(predicted, measured)}


def print_check(check: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{check['config']}: predicted from its config and the machine profile, beside the run")
    for header in ("quantity", "P10", "P50", "P90", "measured", "inside P10-P90", "P50 error"):
        table.add_column(header, justify="right")
    for row in check["rows"]:
        table.add_row(row["quantity"], *(f"{row[k]:.3g}" for k in ("p10", "p50", "p90", "measured")),
                      "yes" if row["inside"] else "NO", f"{row['p50_error']:+.0%}" if math.isfinite(row["p50_error"])
                      else "-")
    Console(width=120).print(table)
