"""``echo2``: the command line.

    echo2 run CONFIG [--set key=value ...] [--resume] [--dry-run]
    echo2 actor --run STORE/runs/ID --actor-id ID          (started by the fleet)
    echo2 export RUN [--step N] DIR

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
    from echo2.data.store import NotFound, StoreError, open_store
    from echo2.data.weights import download, iter_tensors, latest_version

    try:
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
    except (StoreError, NotFound) as exc:
        _fail(str(exc))
    if manifest.get("weights") == "lora":  # an adapter version: fold it into its base
        from echo2.data.weights import merge_into_folder

        adapter = {k: v for k, v in iter_tensors(store, prefix, manifest)}
        download(store, layout.policy_dir(manifest["base_version"]), dest)
        merge_into_folder(dest, adapter, rank=manifest["lora_rank"], alpha=manifest["lora_alpha"])
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
) -> None:
    """Relay vs store-only dissemination across network namespaces with tc-shaped links."""
    from echo2.bench.broadcast import namespaces_available, run_broadcast_bench

    counts = receivers or [2, 4, 8, 16]
    shaped = False if loopback else namespaces_available()
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


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
