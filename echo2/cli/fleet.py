"""The fleet's commands: ``echo2 plan``, ``echo2 prices``, ``echo2 fleet down`` and ``echo2 fleet learner-job``.
Bad input prints one line and exits 2, as everywhere in the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from echo2.cli.common import fail
from echo2.errors import Echo2InputError

fleet_app = typer.Typer(no_args_is_help=True, help="Cloud actor fleets (SkyPilot) outside a run.")


def plan_fleet(
    workload_file: Optional[str] = typer.Option(None, "--workload",
                                                help="A workload: NAME of infra/workloads/NAME.yaml (e.g. "
                                                     "echo2-paper-30b) or a YAML FILE; the flags below override it."),
    model_params: Optional[float] = typer.Option(None, "--model-params",
                                                 help="Model size in billions of parameters (total, e.g. 0.5)."),
    active_params: Optional[float] = typer.Option(None, "--active-params",
                                                  help="Active parameters per token, billions (an MoE, e.g. 3.3)."),
    profile_size: Optional[float] = typer.Option(None, "--profile-size",
                                                 help="Same as --model-params (a profiled size's figures are used "
                                                      "as listed)."),
    train_seconds: Optional[float] = typer.Option(None, "--train-seconds",
                                                  help="T: learner busy seconds per step \\[the FLOP model]."),
    mfu_from: Optional[Path] = typer.Option(None, "--mfu-from",
                                            help="`echo2 bench learner --json` output: the learner's MFU."),
    mfu: Optional[float] = typer.Option(None, "--mfu", help="The learner's MFU for the FLOP model [0.25]."),
    learner_gpu: Optional[str] = typer.Option(None, "--learner-gpu", help="The learner's GPU [H100]."),
    learner_gpus: Optional[int] = typer.Option(None, "--learner-gpus", help="The learner's GPUs [1]."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Learner steps of the run: gives hours and $."),
    groups_per_step: Optional[int] = typer.Option(None, "--groups-per-step", help="R: groups per learner step [64]."),
    groups_per_batch: Optional[int] = typer.Option(None, "--groups-per-batch",
                                                   help="b: groups per actor batch (rollout file) [8]."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="G: completions per prompt [8]."),
    completion_tokens: Optional[float] = typer.Option(None, "--completion-tokens",
                                                      help="Mean output tokens per completion [512]."),
    completion_tokens_p95: Optional[float] = typer.Option(None, "--completion-tokens-p95",
                                                          help="95th percentile output tokens (the batch tail)."),
    staleness: Optional[int] = typer.Option(None, "--staleness", help="S [2]."),
    publish_every: Optional[int] = typer.Option(None, "--publish-every",
                                                help="k (kappa): publish a version every k steps [1]."),
    max_pending_batches: Optional[int] = typer.Option(None, "--max-pending-batches",
                                                      help="Q: flow control \\[ceil(R / b)]."),
    dissemination_seconds: Optional[float] = typer.Option(None, "--dissemination-seconds",
                                                          help="D \\[keyframes + deltas through the relay]."),
    changed_fraction: Optional[float] = typer.Option(None, "--changed-fraction",
                                                     help="Share of parameters a delta carries [2.1%, measured]."),
    changed_from_run: Optional[str] = typer.Option(None, "--changed-from-run",
                                                   help="Read the changed fraction from a run's metrics."),
    bandwidth_gbit: Optional[float] = typer.Option(None, "--bandwidth-gbit",
                                                   help="Store and peer link speed, Gbit/s [10 and 1]."),
    upload_seconds: Optional[float] = typer.Option(None, "--upload-seconds",
                                                   help="U: batch upload until the learner sees it [1]."),
    catalog: Optional[Path] = typer.Option(None, "--catalog",
                                           help="Price catalog CSV \\[infra/prices/gpu-offers-2026-11.csv]."),
    profiles: Optional[Path] = typer.Option(None, "--profiles",
                                            help="Worker profiles \\[infra/profiles/rollout-throughput.yaml]."),
    spot: Optional[bool] = typer.Option(None, "--spot/--on-demand", help="Actors at spot (default) or on-demand."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu",
                                            help="Only these actor GPUs (repeatable), e.g. --gpu L4 --gpu 'RTX 4090'."),
    target_utilization: Optional[float] = typer.Option(None, "--target-utilization",
                                                       help="Share of time the learner must train [0.95]."),
    max_usd_per_hour: Optional[float] = typer.Option(None, "--max-usd-per-hour", help="Budget for the whole fleet."),
    max_per_type: Optional[int] = typer.Option(None, "--max-per-type", help="At most this many of one offer."),
    budget_usd: Optional[float] = typer.Option(None, "--budget-usd", help="What the whole run may cost: hours bought."),
    deadline_hours: Optional[float] = typer.Option(None, "--deadline-hours", help="When the run must end."),
    hours: Optional[float] = typer.Option(None, "--hours", help="Simulate spot reclaims over this many hours."),
    reclaim_rate: Optional[float] = typer.Option(None, "--reclaim-rate",
                                                 help="Reclaims per spot instance-hour \\[providers.py's table]."),
    replacement_seconds: Optional[float] = typer.Option(None, "--replacement-seconds",
                                                        help="Reclaim to replacement producing [600]."),
    from_run: Optional[str] = typer.Option(None, "--from-run",
                                           help="Fit the workload from a finished run; compare predicted with "
                                                "measured."),
    machine: Optional[Path] = typer.Option(None, "--machine",
                                           help="With --from-run: predict that run from its config and this "
                                                "machine profile (echo2 bench machine) alone, beside the run."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    point: bool = typer.Option(False, "--point",
                               help="One point at the likely inputs, with every assumption, instead of the range."),
    draws: int = typer.Option(400, "--draws", min=10, help="Monte Carlo draws of the uncertain inputs."),
    seed: int = typer.Option(0, "--seed", help="Seed of the draws (same seed, same answer)."),
) -> None:
    """A run's fleet, hours and dollars: a workload (file or flags) planned by the one chooser echo2 buys with,
    as P10/P50/P90 over its uncertain inputs (--point: one point)."""
    from echo2.fleet.planner.run_plan import plan_run
    from echo2.fleet.planner.workload_file import from_flags, load_workload, parse_workload
    from echo2.fleet.prices.catalog import DEFAULT_CATALOG, DEFAULT_PROFILES, load_catalog, load_profiles

    out: dict = {}
    try:
        fitted = None
        if from_run:
            from echo2.fleet.sizing.fit import fit_summary  # reads run folders: only --from-run needs it

            out["fit"], fitted = fit_summary(from_run)
            if machine is not None:
                from echo2.fleet.planner.run_check import check_run

                out["check"] = check_run(from_run, machine, draws=draws, seed=seed)
        elif machine is not None:
            fail("--machine checks a finished run: give --from-run RUN as well")
        size = model_params if model_params is not None else profile_size
        if workload_file is None and size is None and fitted is None:
            fail("give the model size: --model-params BILLIONS or --profile-size SIZE, or --workload NAME|FILE")
        if workload_file is not None or size is not None:
            source = load_workload(workload_file) if workload_file else None
            base = source.model_dump(exclude={"base_dir"}, exclude_unset=True) if source else {}
            if fitted is not None:  # the fitted run's values, under the flags
                _merge(base, {"train": {"train_seconds": fitted.train_seconds, "staleness": fitted.staleness,
                                        "groups_per_step": fitted.groups_per_step},
                              "publish": {"every": fitted.publish_every},
                              "rollout": {"max_pending_batches": fitted.max_pending_batches,
                                          "groups_per_batch": fitted.groups_per_batch},
                              "network": {"upload_seconds": fitted.upload_seconds,
                                          "dissemination_seconds": fitted.dissemination_seconds}})
            _merge(base, {
                "model": {"total_params_b": size, "active_params_b": active_params},
                "rollout": {"group_size": group_size, "groups_per_batch": groups_per_batch,
                            "completion_tokens_mean": completion_tokens, "completion_tokens_p95": completion_tokens_p95,
                            "max_pending_batches": max_pending_batches},
                "train": {"max_steps": steps, "groups_per_step": groups_per_step, "staleness": staleness,
                          "train_seconds": train_seconds},
                "publish": {"every": publish_every},
                "learner": {"gpu": learner_gpu, "gpus": learner_gpus, "mfu": mfu},
                "actors": {"market": None if spot is None else "spot" if spot else "on-demand", "gpus": gpu or None,
                           "target_utilization": target_utilization, "reclaim_per_hour": reclaim_rate,
                           "replacement_seconds": replacement_seconds,
                           "caps": None if max_per_type is None else {"*": max_per_type}},
                "network": {"dissemination_seconds": dissemination_seconds, "upload_seconds": upload_seconds,
                            "changed_fraction": changed_fraction, "store_gbit": bandwidth_gbit,
                            "peer_uplink_gbit": bandwidth_gbit}})
            if source is not None:
                workload = parse_workload(base, where=f"workload {workload_file}", base_dir=source.base_dir)
            else:
                workload = from_flags(**base)
            measured_mfu = None
            if mfu_from is not None:
                from echo2.fleet.planner.step_time import mfu_from_bench

                measured_mfu = mfu_from_bench(mfu_from)
            changed = None
            if changed_from_run:
                from echo2.fleet.planner.dissemination import changed_fraction_from_run

                changed = (changed_fraction_from_run(changed_from_run), f"measured: {changed_from_run}'s metrics")
            offers = load_catalog(catalog or DEFAULT_CATALOG, spot=None)
            loaded = load_profiles(profiles or DEFAULT_PROFILES)
            keep: dict = {}
            out.update(plan_run(workload, offers, loaded, mfu=measured_mfu,
                                changed_fraction=changed, budget_usd=budget_usd, deadline_hours=deadline_hours,
                                budget_usd_per_hour=max_usd_per_hour, reclaim_hours=hours, keep=keep))
            if not point and out.get("feasible") and "steps" in out:
                from echo2.fleet.planner.run_range import plan_range

                out["range"] = plan_range(workload, keep, out, loaded, offers, draws=draws, seed=seed)
    except Echo2InputError as exc:
        fail(str(exc))
    except ValueError as exc:  # Workload's own checks
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(_range_json(out) if "range" in out else out))
    elif "check" in out and "fleet" not in out:
        from echo2.fleet.planner.run_check import print_check

        print_check(out["check"])
    elif "range" in out:
        from echo2.fleet.planner.range_table import print_range

        print_range(out)
    else:
        from echo2.fleet.planner.plan_table import print_plan

        print_plan(out)
    if "fleet" in out and not out["feasible"]:
        typer.echo(f"no plan: {out['reason']}; see the neighbouring S", err=True)
        raise typer.Exit(1)


def _range_json(out: dict) -> dict:
    """The range's JSON: P10/P50/P90 at the top, the fleet bought, and the likely inputs' whole plan beside them."""
    likely = {k: v for k, v in out.items() if k != "range"}
    return {**out["range"], "workload_name": out["workload_name"], "steps": out["steps"], "learner": out["learner"],
            "checkpoints": out["checkpoints"], "compare": out.get("compare", []), "likely_plan": likely}


def _merge(base: dict, flags: dict) -> None:
    """Flags given (not None) over the workload's sections, in place."""
    for section, values in flags.items():
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            base.setdefault(section, {}).update(given)


def prices_table(
    gpu: Optional[List[str]] = typer.Option(None, "--gpu",
                                            help="Only these GPUs (repeatable), e.g. --gpu H100 --gpu L4."),
    spot: Optional[bool] = typer.Option(None, "--spot/--on-demand",
                                        help="Only offers with a spot (or an on-demand) price; both by default."),
    source: str = typer.Option("snapshot", "--source",
                               help="Price source: snapshot, aws (live spot prices), skypilot."),
    catalog: Optional[Path] = typer.Option(None, "--catalog",
                                           help="Snapshot CSV (snapshot, aws) "
                                                "\\[infra/prices/gpu-offers-2026-11.csv]."),
    region: Optional[List[str]] = typer.Option(None, "--region",
                                               help="aws: regions to ask (repeatable) \\[the snapshot's]."),
    limit: int = typer.Option(40, "--limit", help="Rows in the table (0 = all); --json prints all."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of offers, cheapest first."),
) -> None:
    """GPU offers and their prices, cheapest first, from the snapshot catalog, AWS or SkyPilot."""
    from echo2.fleet.prices import cheapest_first, make_price_source
    from echo2.fleet.prices.table import print_offers

    try:
        src = make_price_source(source, catalog=catalog, regions=region)
        offers = cheapest_first(src.offers(gpu, spot), spot)
    except Echo2InputError as exc:
        fail(str(exc))
    if not offers:
        fail(f"no offer{' of ' + ', '.join(gpu) if gpu else ''} in the {source} price source", code=1)
    if as_json:
        typer.echo(json.dumps([o.as_dict() for o in offers]))
    else:
        print_offers(offers, src.describe(), spot, limit)


@fleet_app.command("down")
def fleet_down(
    run: str = typer.Argument(..., help="Run id, or the run folder (path or URL of STORE/runs/ID)."),
) -> None:
    """Tear down every SkyPilot cluster labelled with the run (after a learner crash, or to be sure)."""
    from echo2.fleet.backends.skypilot import fleet_down as down_all
    from echo2.fleet.backends.skypilot_api import SkyPilotUnavailable

    run_id = run.rstrip("/").rsplit("/", 1)[-1]
    try:
        names = down_all(run_id)
    except SkyPilotUnavailable as exc:
        fail(str(exc))
    typer.echo(f"{len(names)} SkyPilot cluster(s) of run {run_id} torn down"
               + (f": {', '.join(names)}" if names else ""))


@fleet_app.command("learner-job")
def learner_job(
    config: Path = typer.Argument(..., help="YAML config inside the workdir, e.g. configs/spot-multicloud.yaml."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field (repeatable), at every start."),
    run_id: Optional[str] = typer.Option(None, "--run-id",
                                         help="The run every start trains (default: run.id, else a new id)."),
    task_file: Optional[Path] = typer.Option(None, "--task-file",
                                             help="SkyPilot task file (default: infra/skypilot/learner-spot.yaml)."),
    workdir: Path = typer.Option(Path("."), "--workdir", help="The checkout the job uploads and runs from."),
) -> None:
    """Launch the learner as a SkyPilot managed job on spot machines: relaunched elsewhere after a reclaim, resuming
    the same run (its key as a SkyPilot secret)."""
    from echo2.fleet.backends.skypilot_api import SkyPilotUnavailable
    from echo2.fleet.learner_job import launch_learner_job

    try:
        job = launch_learner_job(str(config), list(set_ or []), run_id=run_id, task_file=task_file, workdir=workdir)
    except (Echo2InputError, SkyPilotUnavailable) as exc:
        fail(str(exc))
    typer.echo(f"managed job {job.name} (id {job.job_id}) trains run {job.run_id} in {job.store_url}"
               + ("; its new signing key is in your secrets folder" if job.created_key else "")
               + f"; watch it with `sky jobs logs {job.job_id}`")
