"""``echo2``: the command line.

    echo2 run CONFIG [--set key=value ...] [--resume] [--dry-run]
    echo2 actor --run STORE/runs/ID --actor-id ID          (started by the fleet)
    echo2 export RUN [--step N] DIR
    echo2 report RUN                                        (cost report from the run's ledger)
    echo2 audit RUN [--json]                                (every rollout file accounted for)

Bad input (config, model, store) prints one line and exits 2. This module imports Prefect only
inside ``run``, so actors never load it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import List, Optional

import typer

from echo2.errors import Echo2InputError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="echo2: distributed RL post-training with bounded staleness.")

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "echo2",
}


class _CtrlC:
    """Whether the user pressed Ctrl-C. Prefect can turn the KeyboardInterrupt into another error
    (a ValueError when it lands while a task run is being created), so the exception alone
    cannot tell."""

    pressed = False

    @classmethod
    def handler(cls, signum, frame) -> None:
        cls.pressed = True
        raise KeyboardInterrupt


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _store_options_from_env() -> dict:
    raw = os.environ.get("ECHO2_STORE_OPTIONS")
    return json.loads(raw) if raw else {}


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would tear the progress display
    hf_logging.set_verbosity_error()


def _setup_logging(verbose: bool, console=None) -> None:
    """Logs through rich beside the progress bar (``console``), or, without one (output to a file
    or a pipe), as plain timestamped lines on stderr."""
    _quiet_transformers()
    if console is not None:
        from rich.logging import RichHandler

        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], format="%(message)s", force=True)
    logging.getLogger("echo2").setLevel(logging.DEBUG if verbose else logging.INFO)


@app.command()
def run(
    config: Path = typer.Argument(..., help="YAML config, e.g. configs/quickstart.yaml."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: --set train.lr=1e-5 (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run (run.id, or the newest unfinished one) from its last checkpoint."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and print the resolved config; start nothing."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logs and Prefect's own logs."),
) -> None:
    """Run GRPO training: learner + actor fleet, driven by the echo2-train Prefect flow."""
    from echo2.config import dump_config

    # Ctrl-C (SIGINT) stops the run cleanly (checkpoint, actors stopped, exit 130) however we were
    # started: a shell script that puts a job in the background makes it inherit SIGINT ignored
    _CtrlC.pressed = False
    signal.signal(signal.SIGINT, _CtrlC.handler)

    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from echo2.launch import resolve_launch

    try:
        cfg = resolve_launch(config, set_ or [], resume)
    except Echo2InputError as exc:
        _fail(str(exc))
    if dry_run:
        typer.echo(dump_config(cfg), nl=False)
        return
    from echo2.progress import RichReporter, make_reporter, set_reporter

    # a live bar in a terminal; one plain flushed line per step when stdout is a file or a pipe
    reporter = make_reporter()
    _setup_logging(verbose, reporter.console if isinstance(reporter, RichReporter) else None)
    set_reporter(reporter)
    from flows.train import train

    try:
        summary = train(config=cfg.model_dump(mode="json"), resume=resume)
    except BaseException as exc:
        if _CtrlC.pressed or isinstance(exc, KeyboardInterrupt):  # the flow has already stopped the fleet
            typer.echo(f"interrupted: every actor was stopped; continue with `echo2 run {config} --resume "
                       f"--set run.id={cfg.run.id}`", err=True)
            raise typer.Exit(130) from None
        if isinstance(exc, Echo2InputError):
            _fail(str(exc))
        if isinstance(exc, TimeoutError):  # no rollouts arrived: say so plainly, the logs have the rest
            _fail(str(exc), code=1)
        raise
    before, after = summary["eval_before"], summary["eval_after"]
    typer.echo(json.dumps(summary, indent=1))
    if before is not None and after is not None:
        typer.echo(f"held-out greedy accuracy: {before:.3f} -> {after:.3f} ({after - before:+.3f}) "
                   f"in {summary['steps']} steps, {summary['wall_seconds']:.0f}s; run {summary['run_id']}")


@app.command()
def actor(
    run: str = typer.Option(..., "--run", help="Run root: STORE/runs/ID."),
    actor_id: str = typer.Option(..., "--actor-id", help="Unique id of this actor (names its rollout files)."),
    parent_pid: Optional[int] = typer.Option(None, "--parent-pid", help="Exit when this process is gone."),
) -> None:
    """Run one rollout actor until the run ends or it is told to stop (started by the fleet)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("echo2").setLevel(logging.INFO)
    _quiet_transformers()
    from echo2.rollout.actor import run_actor

    run_actor(run, actor_id, _store_options_from_env(), parent_pid=parent_pid)


@app.command()
def export(
    run: str = typer.Argument(..., help="Run root (path or URL of STORE/runs/ID)."),
    dest: Path = typer.Argument(..., help="Directory to write a Hugging Face model into."),
    step: Optional[int] = typer.Option(None, "--step", help="Checkpoint or policy version N (default: latest policy)."),
) -> None:
    """Export a published version or checkpoint as a from_pretrained-loadable directory."""
    from echo2.data import layout
    from echo2.data.delta import DeltaRejected
    from echo2.data.manifest import ManifestRejected
    from echo2.data.store import NotFound, StoreError, open_store
    from echo2.data.weights import download, iter_tensors, latest_version

    try:  # every manifest read names plain files of its folder only, or is refused (ManifestRejected)
        store = open_store(run, _store_options_from_env())
        if step is None:
            step = latest_version(store)
            if step is None:
                _fail(f"{run} has no published policy version")
        candidates = [layout.checkpoint_dir(step), layout.policy_dir(step)]
        for prefix in candidates:
            if store.exists(f"{prefix}/{layout.MANIFEST}"):
                manifest = download(store, prefix, dest)
                break
        else:
            _fail(f"{run} has neither checkpoint {step} nor policy version {step}")
        if manifest.get("weights") == "lora":  # an adapter version: fold it into its base
            from echo2.data.weights import merge_into_folder

            adapter = {k: v for k, v in iter_tensors(store, prefix, manifest)}
            download(store, layout.policy_dir(manifest["base_version"]), dest)
            merge_into_folder(dest, adapter, rank=manifest["lora_rank"], alpha=manifest["lora_alpha"])
        if manifest.get("weights") == "delta":  # a sparse delta: rebuilt through its chain, every link verified
            from echo2.data.delta_chain import read_version
            from echo2.data.weights import save_as_indexed

            tensors, keyframe = read_version(store, step)
            download(store, layout.policy_dir(keyframe["version"]), dest, kinds=("aux",))
            save_as_indexed(dest, tensors)
    except (StoreError, NotFound, ManifestRejected, DeltaRejected) as exc:
        _fail(str(exc))
    for extra in ("optimizer.pt", "trainer_state.json", "adapter.safetensors"):  # learner state, not the model
        (dest / extra).unlink(missing_ok=True)
    typer.echo(f"exported {prefix} ({len(manifest['files'])} files, verified) to {dest}")


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured side by side.")
app.add_typer(bench_app, name="bench")


@bench_app.command("broadcast")
def bench_broadcast(
    receivers: Optional[List[int]] = typer.Option(None, "--receivers", help="Receiver counts (repeatable; default 2 4 8 16)."),
    size_mb: float = typer.Option(256.0, "--size-mb", help="Payload (one policy version) in MB."),
    link_mbit: float = typer.Option(200.0, "--link-mbit", help="Every node's uplink, the store's too."),
    chunk_mb: float = typer.Option(1.0, "--chunk-mb", help="Chunk size: smaller chunks fill a long chain sooner."),
    fanout: int = typer.Option(1, "--fanout", help="Relay fan-out (1 = chain)."),
    loopback: bool = typer.Option(False, "--loopback", help="Skip namespaces and tc: unshaped loopback."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object per receiver count)."),
    delta: bool = typer.Option(False, "--delta", help="Sparse delta vs full bf16 versions of a real quickstart run: "
                               "sizes, encode/apply time, then the relay time of each (one object per version "
                               "with --json, then one for the relay)."),
    steps: int = typer.Option(6, "--steps", help="With --delta: training steps (consecutive versions) to measure."),
    from_run: Optional[str] = typer.Option(None, "--from-run", help="With --delta: measure this run's versions "
                                           "(STORE/runs/ID, every version still kept) instead of training."),
) -> None:
    """Relay vs store-only dissemination across network namespaces with tc-shaped links."""
    from echo2.bench.broadcast import namespaces_available, run_broadcast_bench

    shaped = False if loopback else namespaces_available()
    if delta:
        _bench_delta(steps=steps, receivers=(receivers or [8])[0], link_mbit=link_mbit, chunk_mb=chunk_mb,
                     shaped=shaped, from_run=from_run, as_json=as_json)
        return
    counts = receivers or [2, 4, 8, 16]
    results = []
    for n in counts:
        result = run_broadcast_bench(n, size_mb, link_mbit, chunk_mb=chunk_mb, fanout=fanout, shaped=shaped)
        results.append(result)
        if as_json:
            typer.echo(json.dumps(result))
    if as_json:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"broadcast of {size_mb:g} MB, {link_mbit:g} Mbit/s links, {chunk_mb:g} MB chunks, "
                        f"fan-out {fanout} ({results[0]['network']})")
    for col in ("receivers", "relay s", "store-only s", "ideal s", "relay/ideal", "store-only/relay", "verified"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["receivers"]), f"{r['relay_s']:.2f}", f"{r['store_only_s']:.2f}", f"{r['ideal_s']:.2f}",
                      f"{r['relay_over_ideal']:.2f}", f"{r['store_only_over_relay']:.2f}", str(r["verified"]))
    Console().print(table)
    by_n = {r["receivers"]: r for r in results}
    if 4 in by_n and 16 in by_n:
        typer.echo(f"relay time N=16 / N=4: {by_n[16]['relay_s'] / by_n[4]['relay_s']:.2f}")


def _bench_delta(*, steps: int, receivers: int, link_mbit: float, chunk_mb: float, shaped: bool,
                 from_run: str | None, as_json: bool) -> None:
    from echo2.bench.delta import json_lines, print_delta, run_delta_bench
    from echo2.data.store import StoreError

    _quiet_transformers()
    try:
        result = run_delta_bench(steps=steps, receivers=receivers, link_mbit=link_mbit, chunk_mb=chunk_mb,
                                 shaped=shaped, from_run=from_run, progress=lambda line: typer.echo(line, err=True))
    except (StoreError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        for obj in json_lines(result):
            typer.echo(json.dumps(obj))
    else:
        print_delta(result)


@bench_app.command("overlap")
def bench_overlap(
    quick: bool = typer.Option(False, "--quick", help="Two or three points with a short step (under a minute)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: a list of grid points."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep the run folders and actor logs in this directory."),
) -> None:
    """Capacity model vs the real learner and actors on a timing workload: utilization, predicted and measured."""
    from echo2.bench.overlap import print_table, run_overlap_bench, summary_line

    _quiet_transformers()
    results = run_overlap_bench(quick=quick, keep=keep, progress=lambda line: typer.echo(line, err=True))
    if as_json:
        typer.echo(json.dumps(results, indent=1))
    else:
        print_table(results)
    typer.echo(summary_line(results), err=as_json)


@app.command("plan")
def plan_fleet(
    model_params: Optional[float] = typer.Option(None, "--model-params", help="Model size in billions of parameters (e.g. 0.5); speeds interpolated between profiled sizes."),
    profile_size: Optional[float] = typer.Option(None, "--profile-size", help="Use the figures of this profiled size exactly (e.g. 7)."),
    train_seconds: Optional[float] = typer.Option(None, "--train-seconds", help="T: learner busy seconds per step [60]."),
    groups_per_step: Optional[int] = typer.Option(None, "--groups-per-step", help="R: groups per learner step [64]."),
    groups_per_batch: Optional[int] = typer.Option(None, "--groups-per-batch", help="b: groups per actor batch (rollout file) [8]."),
    group_size: int = typer.Option(8, "--group-size", help="G: completions per prompt."),
    completion_tokens: float = typer.Option(512.0, "--completion-tokens", help="Mean output tokens per completion."),
    staleness: Optional[int] = typer.Option(None, "--staleness", help="S [2]."),
    publish_every: Optional[int] = typer.Option(None, "--publish-every", help="k: publish a version every k steps [1]."),
    max_pending_batches: Optional[int] = typer.Option(None, "--max-pending-batches", help="Q: flow control [ceil(R / b)]."),
    dissemination_seconds: Optional[float] = typer.Option(None, "--dissemination-seconds", help="D [bf16 weights over --bandwidth-gbit]."),
    bandwidth_gbit: float = typer.Option(1.0, "--bandwidth-gbit", help="Link speed for the default D."),
    upload_seconds: Optional[float] = typer.Option(None, "--upload-seconds", help="U: batch upload until the learner sees it [1]."),
    catalog: Optional[Path] = typer.Option(None, "--catalog", help="Price catalog CSV [infra/prices/gpu-offers-2026-11.csv]."),
    profiles: Optional[Path] = typer.Option(None, "--profiles", help="Worker profiles [infra/profiles/rollout-throughput.yaml]."),
    spot: bool = typer.Option(True, "--spot/--on-demand", help="Spot (default) or on-demand prices."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", help="Only these GPUs (repeatable), e.g. --gpu L4 --gpu 'RTX 4090'."),
    target_utilization: float = typer.Option(0.95, "--target-utilization", help="Share of time the learner must train."),
    max_usd_per_hour: Optional[float] = typer.Option(None, "--max-usd-per-hour", help="Budget for the whole fleet."),
    max_per_type: Optional[int] = typer.Option(None, "--max-per-type", help="At most this many workers of one type."),
    hours: Optional[float] = typer.Option(None, "--hours", help="Simulate spot reclaims over this many hours."),
    reclaim_rate: float = typer.Option(0.1, "--reclaim-rate", help="Reclaims per worker-hour (with --hours)."),
    replacement_seconds: float = typer.Option(300.0, "--replacement-seconds", help="Reclaim to replacement producing."),
    from_run: Optional[str] = typer.Option(None, "--from-run", help="Fit the workload from a finished run; compare predicted with measured."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Cheapest fleet of catalog offers that keeps the learner busy (capacity model), with neighbouring S."""
    import math

    from echo2.fleet.capacity import Workload
    from echo2.fleet.plan import fit_summary, plan, tokens_per_batch, worker_types
    from echo2.fleet.prices import DEFAULT_CATALOG, DEFAULT_PROFILES, load_catalog, load_profiles

    out: dict = {}
    try:
        fitted = None
        if from_run:
            out["fit"], fitted = fit_summary(from_run)
        size = model_params if model_params is not None else profile_size
        if size is None and fitted is None:
            _fail("give the model size: --model-params BILLIONS or --profile-size SIZE")
        if size is not None:
            if size <= 0:
                _fail(f"model size {size:g} must be > 0 (billions of parameters)")
            # options given on the command line win over the fitted run, which wins over the defaults
            base = {"train_seconds": 60.0, "groups_per_step": 64, "groups_per_batch": 8, "staleness": 2,
                    "publish_every": 1, "upload_seconds": 1.0,
                    "dissemination_seconds": size * 1e9 * 2 * 8 / (bandwidth_gbit * 1e9)}
            if fitted is not None:
                base.update({k: getattr(fitted, k) for k in base} | {"max_pending_batches": fitted.max_pending_batches})
            given = {"train_seconds": train_seconds, "groups_per_step": groups_per_step, "staleness": staleness,
                     "groups_per_batch": groups_per_batch, "publish_every": publish_every, "upload_seconds": upload_seconds,
                     "dissemination_seconds": dissemination_seconds, "max_pending_batches": max_pending_batches}
            base.update({k: v for k, v in given.items() if v is not None})
            base.setdefault("max_pending_batches", math.ceil(base["groups_per_step"] / base["groups_per_batch"]))
            workload = Workload(**base)
            offers = load_catalog(catalog or DEFAULT_CATALOG, spot=spot)
            types = worker_types(offers, load_profiles(profiles or DEFAULT_PROFILES), model_params_b=size,
                                 batch_tokens=tokens_per_batch(workload.groups_per_batch, group_size, completion_tokens),
                                 spot=spot, gpus=gpu, profile_size=profile_size)
            out.update(plan(workload, types, target_utilization=target_utilization, budget_usd_per_hour=max_usd_per_hour,
                            max_per_type=max_per_type, reclaim_hours=hours, reclaim_rate_per_hour=reclaim_rate,
                            replacement_seconds=replacement_seconds))
            out["required_tokens_per_second"] = out["required_throughput"] * group_size * completion_tokens
            out["prices"] = "spot" if spot else "on-demand"
    except Echo2InputError as exc:
        _fail(str(exc))
    except ValueError as exc:  # Workload's own checks
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(out))
    else:
        _print_plan(out)
    if "fleet" in out and not out["feasible"]:
        typer.echo(f"no plan: {out['reason']}; see the neighbouring S", err=True)
        raise typer.Exit(1)


def _print_plan(out: dict) -> None:
    """The plan as rich tables (``echo2 plan`` without --json)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if "fit" in out:
        f = out["fit"]
        table = Table(title=f"run {f['run'].rstrip('/').rsplit('/', 1)[-1]}: capacity model vs measured "
                            f"({f['steps']} steps)")
        for col in ("", "predicted", "measured"):
            table.add_column(col, justify="right")
        table.add_row("utilization", f"{f['predicted_utilization']:.3f}", f"{f['measured_utilization']:.3f}")
        table.add_row("step seconds", f"{f['predicted_step_seconds']:.2f}", f"{f['measured_step_seconds']:.2f}")
        table.add_row("lag shares", json.dumps({k: round(v, 2) for k, v in f["predicted_lag"].items()}),
                      json.dumps({k: round(v, 2) for k, v in f["measured_lag"].items()}))
        console.print(table)
    if "fleet" not in out:
        return
    w = out["workload"]
    table = Table(title=f"cheapest fleet ({out['prices']}) at S={w['staleness']} for "
                        f"{out['target_utilization']:.0%} learner utilization")
    for col in ("count", "offer", "GPUs", "$/h each", "$/h", "s/batch", "groups/s"):
        table.add_column(col, justify="left" if col == "offer" else "right")
    for row in out["fleet"]:
        o = row["offer"]
        table.add_row(str(row["count"]), o["name"], f"{o['gpu']} x{o['gpu_count']}", f"{row['usd_per_hour_each']:.4f}",
                      f"{row['usd_per_hour']:.4f}", f"{row['batch_seconds']:.1f}", f"{row['groups_per_second']:.2f}")
    console.print(table)
    console.print(f"required {out['required_throughput']:.3f} groups/s ({out['required_tokens_per_second']:.0f} tok/s): "
                  f"T={w['train_seconds']:g}s R={w['groups_per_step']} b={w['groups_per_batch']} "
                  f"D={w['dissemination_seconds']:.1f}s U={w['upload_seconds']:g}s k={w['publish_every']} "
                  f"Q={w['max_pending_batches']}")
    if out["feasible"]:
        console.print(f"fleet ${out['usd_per_hour']:.4f}/h, predicted utilization {out['predicted_utilization']:.3f} "
                      f"({out['bound']}-bound), step {out['step_seconds']:.1f}s, S_min {out['min_staleness']} "
                      f"(the learner never waits){'' if out['proven_optimal'] else '; search cut: maybe not optimal'}")
    table = Table(title="neighbouring S")
    for col in ("S", "workers", "$/h", "utilization", "step s", "$/step", "fleet"):
        table.add_column(col, justify="left" if col == "fleet" else "right")
    for n in sorted([out, *out["neighbours"]], key=lambda r: r["staleness"]):
        if not n["feasible"]:
            table.add_row(str(n["staleness"]), "-", "-", "-", "-", "-", n["reason"])
            continue
        fleet = ", ".join(f"{r['count']}x {r['offer']['gpu']}x{r['offer']['gpu_count']}" for r in n["fleet"])
        table.add_row(f"{n['staleness']}{' *' if n is out else ''}", str(n["workers"]), f"{n['usd_per_hour']:.4f}",
                      f"{n['predicted_utilization']:.3f}", f"{n['step_seconds']:.1f}", f"{n['usd_per_step']:.5f}", fleet)
    console.print(table)
    if "reclaims" in out:
        r = out["reclaims"]
        extra = ("not held even with the extras tried" if r["extra_workers"] is None else "no extra worker needed"
                 if r["extra_workers"] == 0 else f"+{r['extra_workers']} x {r['extra_offer']} -> "
                 f"${r['usd_per_hour_with_extra']:.4f}/h, {r['share_with_extra']:.1%} of the time at target")
        console.print(f"reclaims over {r['hours']:g}h at {r['reclaim_rate_per_hour']:g}/worker-h, replacement "
                      f"{r['replacement_seconds']:g}s: {r['expected_reclaims']:.1f} expected, planned throughput held "
                      f"{r['share_of_time_at_target']:.1%} of the time; to hold it {r['hold']:.0%}: {extra}")


def _open_run(run: str):
    """The store of a run folder (path or URL), or one line and exit 2 when there is no run there."""
    from echo2.data import layout
    from echo2.data.store import StoreError, open_store

    try:
        store = open_store(run, _store_options_from_env())
        if not store.exists(layout.RUN_JSON):
            _fail(f"{run} is not a run folder (no {layout.RUN_JSON})")
    except StoreError as exc:
        _fail(str(exc))
    return store


@app.command("report")
def report_costs(
    run: str = typer.Argument(..., help="Run folder (path or URL of STORE/runs/ID), finished or crashed."),
) -> None:
    """Recompute the cost report from the run's ledger: reports/cost.json, cost.md, cost.png."""
    from echo2.fleet.costs import cost_markdown, write_cost_reports

    report = write_cost_reports(_open_run(run))
    typer.echo(cost_markdown(report), nl=False)
    typer.echo(f"wrote reports/cost.json, reports/cost.md, reports/cost.png under {run}", err=True)


@app.command("audit")
def audit(
    run: str = typer.Argument(..., help="Run folder (path or URL of STORE/runs/ID)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Account for every committed rollout file from the ledger; exit 1 if one is lost or used twice."""
    from echo2.data.audit import audit_failed, audit_run

    result = audit_run(_open_run(run))
    if as_json:
        typer.echo(json.dumps(result, indent=1))
    else:
        dropped = ", ".join(f"{n} {reason}" for reason, n in result["dropped"].items()) or "none"
        typer.echo(f"{result['committed']} committed rollout files ({'finished' if result['finished'] else 'unfinished'}"
                   f" run): {result['used']} used, dropped {dropped}, {result['quarantined']} quarantined, "
                   f"{result['pending']} pending, {result['lost']} lost, {result['used_twice']} used twice")
        typer.echo(f"fleet: {result['reclaims']} reclaims, {result['crashes']} crashes, "
                   f"{result['replacements']} replaced" + (f"; not replaced: {', '.join(result['unreplaced'])}"
                                                           if result["unreplaced"] else ""))
        for problem in result["problems"]:
            typer.echo(f"problem: {problem}")
    if audit_failed(result):
        raise typer.Exit(1)


@app.command("prices")
def prices_table(
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", help="Only these GPUs (repeatable), e.g. --gpu H100 --gpu L4."),
    spot: Optional[bool] = typer.Option(None, "--spot/--on-demand", help="Only offers with a spot (or an on-demand) price; both by default."),
    source: str = typer.Option("snapshot", "--source", help="Price source: snapshot, aws (live spot prices), skypilot."),
    catalog: Optional[Path] = typer.Option(None, "--catalog", help="Snapshot CSV (snapshot, aws) [infra/prices/gpu-offers-2026-11.csv]."),
    region: Optional[List[str]] = typer.Option(None, "--region", help="aws: regions to ask (repeatable) [the snapshot's]."),
    limit: int = typer.Option(40, "--limit", help="Rows in the table (0 = all); --json prints all."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of offers, cheapest first."),
) -> None:
    """GPU offers and their prices, cheapest first, from the snapshot catalog, AWS or SkyPilot."""
    from echo2.fleet.price_sources import cheapest_first, make_price_source, print_offers

    try:
        src = make_price_source(source, catalog=catalog, regions=region)
        offers = cheapest_first(src.offers(gpu, spot), spot)
    except Echo2InputError as exc:
        _fail(str(exc))
    if not offers:
        _fail(f"no offer{' of ' + ', '.join(gpu) if gpu else ''} in the {source} price source", code=1)
    typer.echo(json.dumps([o.as_dict() for o in offers])) if as_json else print_offers(offers, src.describe(), spot, limit)


@bench_app.command("cost")
def bench_cost(
    rollouts_per_second: float = typer.Option(32.0, "--rollouts-per-second", help="R: rollouts (completions) per second the fleet must make."),
    model_params: float = typer.Option(4.0, "--model-params", help="Model size in billions (speeds interpolated between profiled sizes)."),
    completion_tokens: float = typer.Option(512.0, "--completion-tokens", help="Mean output tokens per rollout."),
    source: str = typer.Option("snapshot", "--source", help="Price source: snapshot, aws, skypilot."),
    reclaim_rate: Optional[List[str]] = typer.Option(None, "--reclaim-rate", help="Reclaims per instance-hour: KEY=RATE, KEY = spot, on-demand, provider, provider:market or offer (repeatable)."),
    cap: Optional[List[str]] = typer.Option(None, "--cap", help="Instances per offer at most: KEY=N, same keys (repeatable)."),
    recovery_seconds: float = typer.Option(600.0, "--recovery-seconds", help="Work lost per reclaim: until a replacement produces."),
    max_usd_per_hour: Optional[float] = typer.Option(None, "--max-usd-per-hour", help="Budget for activation's fleet."),
    measured_run: Optional[List[str]] = typer.Option(None, "--measured-run", help="Earlier run whose measured speeds replace the profiles' (repeatable)."),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="Also both figures at 8, 32, 128, 512, 1024 rollouts/s."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Activation's fleet $/h vs an all-on-demand single-GPU-type fleet of equal throughput."""
    from echo2.bench.cost import SWEEP, print_cost, run_cost_bench

    try:
        result = run_cost_bench(rollouts_per_second=rollouts_per_second, model_params_b=model_params, source=source,
                                completion_tokens=completion_tokens, reclaim=reclaim_rate, caps=cap,
                                recovery_seconds=recovery_seconds, budget_usd_per_hour=max_usd_per_hour,
                                measured_runs=measured_run, sweep=SWEEP if sweep else None)
    except Echo2InputError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(result, indent=1)) if as_json else print_cost(result)
    if result["activation_usd_per_hour"] is None:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
