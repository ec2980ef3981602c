"""``echo2 run`` and ``echo2 learner``: resolve the run, then the echo2-train flow in this process, or the learner's
processes under torchrun (``echo2/learner/torchrun.py``) with the flow in rank 0. Prefect is imported only here,
and only inside the commands, so actors never load it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

from echo2.cli.common import CtrlC, fail, need_learner_extra, prepare_flow_process, setup_logging
from echo2.errors import Echo2InputError

START_OR_RESUME = ("With run.id set: resume the run if it exists, else create it (the same command at every start "
                   "of a relaunched learner, e.g. a SkyPilot managed job).")

JSON_HELP = ("End by printing the run's whole summary as JSON (reports/summary.json) instead of its two-line "
             "digest.")

if TYPE_CHECKING:  # the launcher's helpers are imported where used: an actor's `echo2` imports no echo2.learner
    from echo2.learner.torchrun import Rendezvous


def run(
    config: Path = typer.Argument(..., help="YAML config, e.g. configs/quickstart.yaml."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: --set train.lr=1e-5 (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run (run.id, or the newest unfinished one) "
                                                        "from its last checkpoint."),
    start_or_resume: bool = typer.Option(False, "--start-or-resume", help=START_OR_RESUME),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and print the resolved config; start nothing."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logs and Prefect's own logs."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Run GRPO training: learner + actor fleet, driven by the echo2-train Prefect flow."""
    _launch(config, set_ or [], resume, dry_run, verbose, rdzv_endpoint=None, rdzv_timeout=None,
            start_or_resume=start_or_resume, json_out=json_out)


def _launch(config: Path, overrides: list[str], resume: bool, dry_run: bool, verbose: bool, *,
            rdzv_endpoint: str | None, rdzv_timeout: float | None, start_or_resume: bool = False,
            json_out: bool = False) -> None:
    """Resolve the run (run id, key, store), then run the flow here or torchrun's processes (node 0 of several
    with ``learner.nnodes > 1``)."""
    from echo2.config import dump_config
    from echo2.learner.torchrun import DEFAULT_RDZV_TIMEOUT_S, Rendezvous, write_rank_file

    prepare_flow_process(verbose)
    need_learner_extra("echo2 run")
    from echo2.launch import resolve_launch, run_exists

    try:
        if start_or_resume:
            resume = run_exists(config, overrides)
        cfg = resolve_launch(config, overrides, resume, dry_run=dry_run)
        if dry_run:
            typer.echo(dump_config(cfg), nl=False)
            return
        if cfg.learner.nnodes > 1 and rdzv_endpoint is None:
            raise Echo2InputError(f"learner.nnodes is {cfg.learner.nnodes}: start the learner with `echo2 learner "
                                  f"CONFIG --nnodes {cfg.learner.nnodes} --node-rank R --rdzv-endpoint HOST:PORT` "
                                  "on each node, HOST:PORT on node 0")
        rendezvous = Rendezvous(cfg.learner.nnodes, 0, rdzv_endpoint, rdzv_timeout or DEFAULT_RDZV_TIMEOUT_S)
    except Echo2InputError as exc:
        fail(str(exc))
    if cfg.learner.nproc * cfg.learner.nnodes > 1:  # the learner over several processes: torchrun, this flow in rank 0
        _torchrun(cfg.learner.nproc, rendezvous, write_rank_file(cfg.model_dump(mode="json")), resume, verbose,
                  json_out=json_out)
    _run_flow(cfg, f"echo2 run {config}", resume, verbose, json_out=json_out)


def _run_flow(cfg, rerun: str, resume: bool, verbose: bool, *, rank_0: bool = False, json_out: bool = False) -> None:
    """The echo2-train flow in this process (``rank_0``: of a learner under torchrun), with progress, and what to
    print or exit with."""
    from echo2.flows.api_server import start_prefect_api

    try:  # a signal before the flow starts: Prefect's temporary server is stopped at exit all the same
        # comes up while torch and transformers import (echo2.flows.train)
        prefect_api_ready = start_prefect_api(own_session=rank_0)
        from echo2.progress import RichReporter, make_reporter, set_reporter

        # a live bar in a terminal; one plain flushed line per step when stdout is a file or a pipe
        reporter = make_reporter()
        setup_logging(verbose, reporter.console if isinstance(reporter, RichReporter) else None)
        set_reporter(reporter)
        from echo2.flows.train import train

        prefect_api_ready()
        summary = train(config=cfg.model_dump(mode="json"), resume=resume)
    except BaseException as exc:
        from echo2.learner.notice import RECLAIMED_EXIT, LearnerReclaimed, NoticeInterrupt

        if isinstance(exc, (LearnerReclaimed, NoticeInterrupt)):  # a spot learner's notice: the actors keep running
            typer.echo(f"reclaimed: checkpointed, actors left running; continue with `{rerun} --resume "
                       f"--set run.id={cfg.run.id}` (a SkyPilot managed job does, on exit {RECLAIMED_EXIT})", err=True)
            raise typer.Exit(RECLAIMED_EXIT) from None
        if CtrlC.pressed or isinstance(exc, KeyboardInterrupt):  # the flow has already stopped the fleet
            typer.echo(f"interrupted: every actor was stopped; continue with `{rerun} --resume "
                       f"--set run.id={cfg.run.id}`", err=True)
            if not rank_0:  # rank 0 of torchrun does so once its followers are released (_learner_process)
                from echo2.flows.api_server import leave_prefect

                leave_prefect(CtrlC.exit_code())
            raise typer.Exit(CtrlC.exit_code()) from None
        if isinstance(exc, Echo2InputError):
            fail(str(exc))
        if isinstance(exc, TimeoutError):  # no rollouts arrived: say so plainly, the logs have the rest
            fail(str(exc), code=1)
        raise
    if json_out:
        typer.echo(json.dumps(summary, indent=1))
        return
    from echo2.data import layout

    reports = f"{cfg.store.url.rstrip('/')}/{layout.RUNS}/{summary['run_id']}/{layout.REPORTS}"
    for line in summary_lines(summary, reports):
        typer.echo(line)


def summary_lines(summary: dict, reports: str) -> list[str]:
    """The two lines a finished run ends with: the held-out metric before -> after with their 95% intervals, steps,
    wall time and cost; then where the reports are. The whole summary stays in ``reports/summary.json`` (or
    ``--json``): forty lines of JSON at the end of a run bury the one number a user looks for."""
    from echo2.learner.report import score_interval

    before, after = summary.get("eval_before"), summary.get("eval_after")
    metric = summary.get("eval_metric") or "accuracy"
    if before is not None and after is not None:
        name = "held-out greedy accuracy" if metric == "accuracy" else f"held-out {metric}"
        evals = summary.get("eval_metrics") or {}
        first = f"{name}: {_with_interval(before, score_interval(evals.get('before'), metric))} -> " \
                f"{_with_interval(after, score_interval(evals.get('after'), metric))} ({after - before:+.3f})"
    elif after is not None:  # a resumed run skips "before" (the killed run's, if any, is in its logs)
        first = f"held-out {metric} after training: " \
                f"{_with_interval(after, score_interval((summary.get('eval_metrics') or {}).get('after'), metric))}"
    else:
        first = "no held-out evaluation before and after"
    cost = summary.get("cost_usd")
    cost_text = ("cost unknown" if cost is None else "no priced resources" if summary.get("cost_priced") is False
                 else f"${cost:,.4f}")
    wall = float(summary.get("wall_seconds") or 0)
    return [f"{first}; {summary.get('steps')} steps, {_duration(wall)}, {cost_text}",
            f"run {summary.get('run_id')}: reports in {reports} (summary.json, curves.png, cost.md)"]


def _with_interval(value: float, interval: tuple[float, float] | None) -> str:
    return f"{value:.3f}" if interval is None else f"{value:.3f} [95% {interval[0]:.3f}, {interval[1]:.3f}]"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _torchrun(nproc: int, rendezvous: Rendezvous, rank_file: Path, resume: bool, verbose: bool, *,
              json_out: bool = False) -> None:
    """Run this node's ``nproc`` learner processes under ``torchrun`` (``echo2/learner/torchrun.py``) and exit
    with its code; they start from ``rank_file`` (private, removed once they have formed the group, else here)."""
    import subprocess

    from echo2.learner.torchrun import never_joined, torchrun_command

    program = ["-m", "echo2.cli", "learner", "--rank-config", str(rank_file), *(["--resume"] if resume else []),
               *(["-v"] if verbose else []), *(["--json"] if json_out else [])]
    proc = subprocess.Popen(torchrun_command(nproc, rendezvous, program))
    try:
        forwarded = False
        while True:  # torchrun passes a signal on to every rank: rank 0 checkpoints, then releases the others
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # Ctrl-C reached the whole process group; a SIGTERM only us, once is enough
                if CtrlC.signum == signal.SIGTERM and not forwarded:
                    proc.send_signal(signal.SIGTERM)
                    forwarded = True
    finally:
        never_formed = rank_file.exists()
        rank_file.unlink(missing_ok=True)
    if _reclaimed_marker(rank_file).exists():  # rank 0 left on a spot notice: say so, whatever torchrun's code
        from echo2.learner.notice import RECLAIMED_EXIT

        _reclaimed_marker(rank_file).unlink()
        raise typer.Exit(RECLAIMED_EXIT)
    if CtrlC.pressed:  # as the one-process learner exits (130, 143), whatever torchrun made of the signal
        raise typer.Exit(CtrlC.exit_code())
    if code != 0 and never_formed and rendezvous.nnodes > 1:
        fail(never_joined(rendezvous), code=1)  # last, under torchrun's traceback
    raise typer.Exit(code)


def learner(
    config: Optional[Path] = typer.Argument(None, help="YAML config (as for `echo2 run`), the same on every node."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its last checkpoint (node 0)."),
    start_or_resume: bool = typer.Option(False, "--start-or-resume", help=START_OR_RESUME + " Node 0."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Learner processes on this node (learner.nproc)."),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", help="Nodes of the learner (learner.nnodes)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node: 0 resolves the run and runs the flow, the "
                                                          "others only follow."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT on node 0 where the nodes "
                                                                              "meet (needed with --nnodes > 1)."),
    rdzv_timeout: Optional[float] = typer.Option(None, "--rdzv-timeout", show_default="600",
                                                 help="Seconds to wait for every node at the rendezvous before "
                                                      "failing."),
    rank_config: Optional[Path] = typer.Option(None, "--rank-config", hidden=True,
                                               help="Inside torchrun: the file this node's processes start from."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logs and Prefect's own logs."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The learner on N processes (torchrun, FSDP), on this node or several; rank 0 runs the echo2-train flow."""
    if rank_config is not None:
        _learner_process(rank_config, resume, verbose, json_out)
        return
    if config is None:  # the launcher of a node
        fail("echo2 learner needs a config file")
    overrides = [*(set_ or []), *([f"learner.nproc={nproc}"] if nproc else []),
                 *([f"learner.nnodes={nnodes}"] if nnodes else [])]
    if node_rank == 0:  # resolve the run once, then torchrun (or the flow here, on one process)
        _launch(config, overrides, resume, False, verbose, rdzv_endpoint=rdzv_endpoint, rdzv_timeout=rdzv_timeout,
                start_or_resume=start_or_resume, json_out=json_out)
        return
    _follower_node(config, overrides, node_rank, rdzv_endpoint, rdzv_timeout, verbose)


def _follower_node(config: Path, overrides: list[str], node_rank: int, rdzv_endpoint: str | None,
                   rdzv_timeout: float | None, verbose: bool) -> None:
    """Node 1..N-1: resolves no run and never opens the store (``torchrun.prepare_follower_node``)."""
    from echo2.learner.torchrun import DEFAULT_RDZV_TIMEOUT_S, RendezvousFailed, prepare_follower_node

    CtrlC.install()
    try:
        nproc, rendezvous, rank_file = prepare_follower_node(config, overrides, node_rank, rdzv_endpoint,
                                                              rdzv_timeout or DEFAULT_RDZV_TIMEOUT_S)
    except Echo2InputError as exc:
        fail(str(exc), code=1 if isinstance(exc, RendezvousFailed) else 2)
    except KeyboardInterrupt:
        raise typer.Exit(CtrlC.exit_code()) from None
    _torchrun(nproc, rendezvous, rank_file, False, verbose)


def _learner_process(rank_config: Path, resume: bool, verbose: bool, json_out: bool = False) -> None:
    """One process under torchrun: rank 0 runs the flow on the run's config; every other rank, on this node or
    another, follows rank 0 (``distributed.start_process``) and returns when it says stop."""
    from echo2.learner.distributed import release_followers, start_process
    from echo2.learner.process_group import leave

    cfg = start_process(rank_config, on_follow=lambda: setup_logging(verbose))
    if cfg is None:
        return
    prepare_flow_process(verbose)
    rerun = f"echo2 learner CONFIG --nproc {cfg.learner.nproc}"
    if cfg.learner.nnodes > 1:
        rerun += f" --nnodes {cfg.learner.nnodes} --node-rank 0 --rdzv-endpoint {os.environ.get('MASTER_ADDR')}:" \
                 f"{os.environ.get('MASTER_PORT')}"
    handled = None  # an end the launcher handles (interrupted, reclaimed, bad input)
    try:
        _run_flow(cfg, rerun, resume, verbose, rank_0=True, json_out=json_out)
    except typer.Exit as exc:
        from echo2.learner.notice import RECLAIMED_EXIT

        if exc.exit_code == RECLAIMED_EXIT:  # torchrun's own exit code would not tell the launcher
            _reclaimed_marker(rank_config).touch()
        handled = exc
    finally:
        release_followers()
    leave()  # a normal or handled end; any other exception leaves the groups as they are (a broken one stays up)
    if handled is not None:
        if CtrlC.pressed:
            from echo2.flows.api_server import leave_prefect

            leave_prefect(handled.exit_code)
        raise handled


def _reclaimed_marker(rank_file: Path) -> Path:
    """Beside the node's start file: rank 0 left on a spot notice (exit ``RECLAIMED_EXIT``)."""
    return rank_file.with_name(rank_file.name + ".reclaimed")
