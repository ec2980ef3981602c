"""The fleet's commands: ``echo2 plan``, ``echo2 prices`` and ``echo2 fleet down``. Bad input prints one line and
exits 2, as everywhere in the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from echo2.cli.common import fail
from echo2.errors import Echo2InputError

fleet_app = typer.Typer(no_args_is_help=True, help="Cloud actor fleets (SkyPilot) outside a run.")


def plan_fleet(
    model_params: Optional[float] = typer.Option(None, "--model-params",
                                                 help="Model size in billions of parameters (e.g. 0.5); speeds "
                                                      "interpolated between profiled sizes."),
    profile_size: Optional[float] = typer.Option(None, "--profile-size",
                                                 help="Use the figures of this profiled size exactly (e.g. 7)."),
    train_seconds: Optional[float] = typer.Option(None, "--train-seconds",
                                                  help="T: learner busy seconds per step [60]."),
    groups_per_step: Optional[int] = typer.Option(None, "--groups-per-step", help="R: groups per learner step [64]."),
    groups_per_batch: Optional[int] = typer.Option(None, "--groups-per-batch",
                                                   help="b: groups per actor batch (rollout file) [8]."),
    group_size: int = typer.Option(8, "--group-size", help="G: completions per prompt."),
    completion_tokens: float = typer.Option(512.0, "--completion-tokens", help="Mean output tokens per completion."),
    staleness: Optional[int] = typer.Option(None, "--staleness", help="S [2]."),
    publish_every: Optional[int] = typer.Option(None, "--publish-every",
                                                help="k: publish a version every k steps [1]."),
    max_pending_batches: Optional[int] = typer.Option(None, "--max-pending-batches",
                                                      help="Q: flow control [ceil(R / b)]."),
    dissemination_seconds: Optional[float] = typer.Option(None, "--dissemination-seconds",
                                                          help="D [bf16 weights over --bandwidth-gbit]."),
    bandwidth_gbit: float = typer.Option(1.0, "--bandwidth-gbit", help="Link speed for the default D."),
    upload_seconds: Optional[float] = typer.Option(None, "--upload-seconds",
                                                   help="U: batch upload until the learner sees it [1]."),
    catalog: Optional[Path] = typer.Option(None, "--catalog",
                                           help="Price catalog CSV [infra/prices/gpu-offers-2026-11.csv]."),
    profiles: Optional[Path] = typer.Option(None, "--profiles",
                                            help="Worker profiles [infra/profiles/rollout-throughput.yaml]."),
    spot: bool = typer.Option(True, "--spot/--on-demand", help="Spot (default) or on-demand prices."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu",
                                            help="Only these GPUs (repeatable), e.g. --gpu L4 --gpu 'RTX 4090'."),
    target_utilization: float = typer.Option(0.95, "--target-utilization",
                                             help="Share of time the learner must train."),
    max_usd_per_hour: Optional[float] = typer.Option(None, "--max-usd-per-hour", help="Budget for the whole fleet."),
    max_per_type: Optional[int] = typer.Option(None, "--max-per-type", help="At most this many workers of one type."),
    hours: Optional[float] = typer.Option(None, "--hours", help="Simulate spot reclaims over this many hours."),
    reclaim_rate: float = typer.Option(0.1, "--reclaim-rate", help="Reclaims per worker-hour (with --hours)."),
    replacement_seconds: float = typer.Option(300.0, "--replacement-seconds", help="Reclaim to replacement producing."),
    from_run: Optional[str] = typer.Option(None, "--from-run",
                                           help="Fit the workload from a finished run; compare predicted with "
                                                "measured."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Cheapest fleet of catalog offers that keeps the learner busy (capacity model), with neighbouring S."""
    import math

    from echo2.fleet.prices.catalog import DEFAULT_CATALOG, DEFAULT_PROFILES, load_catalog, load_profiles
    from echo2.fleet.sizing.capacity import Workload
    from echo2.fleet.sizing.plan import fit_summary, plan, tokens_per_batch, worker_types

    out: dict = {}
    try:
        fitted = None
        if from_run:
            out["fit"], fitted = fit_summary(from_run)
        size = model_params if model_params is not None else profile_size
        if size is None and fitted is None:
            fail("give the model size: --model-params BILLIONS or --profile-size SIZE")
        if size is not None:
            if size <= 0:
                fail(f"model size {size:g} must be > 0 (billions of parameters)")
            # options given on the command line win over the fitted run, which wins over the defaults
            base = {"train_seconds": 60.0, "groups_per_step": 64, "groups_per_batch": 8, "staleness": 2,
                    "publish_every": 1, "upload_seconds": 1.0,
                    "dissemination_seconds": size * 1e9 * 2 * 8 / (bandwidth_gbit * 1e9)}
            if fitted is not None:
                base.update({k: getattr(fitted, k) for k in base} | {"max_pending_batches": fitted.max_pending_batches})
            given = {"train_seconds": train_seconds, "groups_per_step": groups_per_step, "staleness": staleness,
                     "groups_per_batch": groups_per_batch, "publish_every": publish_every,
                     "upload_seconds": upload_seconds, "dissemination_seconds": dissemination_seconds,
                     "max_pending_batches": max_pending_batches}
            base.update({k: v for k, v in given.items() if v is not None})
            base.setdefault("max_pending_batches", math.ceil(base["groups_per_step"] / base["groups_per_batch"]))
            workload = Workload(**base)
            offers = load_catalog(catalog or DEFAULT_CATALOG, spot=spot)
            batch_tokens = tokens_per_batch(workload.groups_per_batch, group_size, completion_tokens)
            types = worker_types(offers, load_profiles(profiles or DEFAULT_PROFILES), model_params_b=size,
                                 batch_tokens=batch_tokens, spot=spot, gpus=gpu, profile_size=profile_size)
            out.update(plan(workload, types, target_utilization=target_utilization,
                            budget_usd_per_hour=max_usd_per_hour, max_per_type=max_per_type, reclaim_hours=hours,
                            reclaim_rate_per_hour=reclaim_rate, replacement_seconds=replacement_seconds))
            out["required_tokens_per_second"] = out["required_throughput"] * group_size * completion_tokens
            out["prices"] = "spot" if spot else "on-demand"
    except Echo2InputError as exc:
        fail(str(exc))
    except ValueError as exc:  # Workload's own checks
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(out))
    else:
        from echo2.fleet.sizing.plan_table import print_plan

        print_plan(out)
    if "fleet" in out and not out["feasible"]:
        typer.echo(f"no plan: {out['reason']}; see the neighbouring S", err=True)
        raise typer.Exit(1)


def prices_table(
    gpu: Optional[List[str]] = typer.Option(None, "--gpu",
                                            help="Only these GPUs (repeatable), e.g. --gpu H100 --gpu L4."),
    spot: Optional[bool] = typer.Option(None, "--spot/--on-demand",
                                        help="Only offers with a spot (or an on-demand) price; both by default."),
    source: str = typer.Option("snapshot", "--source",
                               help="Price source: snapshot, aws (live spot prices), skypilot."),
    catalog: Optional[Path] = typer.Option(None, "--catalog",
                                           help="Snapshot CSV (snapshot, aws) [infra/prices/gpu-offers-2026-11.csv]."),
    region: Optional[List[str]] = typer.Option(None, "--region",
                                               help="aws: regions to ask (repeatable) [the snapshot's]."),
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
    from echo2.fleet.backends.skypilot import SkyPilotUnavailable
    from echo2.fleet.backends.skypilot import fleet_down as down_all

    run_id = run.rstrip("/").rsplit("/", 1)[-1]
    try:
        names = down_all(run_id)
    except SkyPilotUnavailable as exc:
        fail(str(exc))
    typer.echo(f"{len(names)} SkyPilot cluster(s) of run {run_id} torn down"
               + (f": {', '.join(names)}" if names else ""))
