"""``echo2``: the command line.

    echo2 run CONFIG [--set key=value ...] [--resume] [--dry-run]
    echo2 learner CONFIG [--nproc P] [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT]   (torchrun)
    echo2 actor --run STORE/runs/ID --actor-id ID          (started by the fleet)
    echo2 export RUN [--step N] DIR
    echo2 eval MODEL_OR_CHECKPOINT [--task T] [--config C] [--set k=v] [--json]   (held-out metrics)
    echo2 report RUN                                        (cost report from the run's ledger)
    echo2 audit RUN [--json]                                (every rollout file accounted for)
    echo2 fleet down RUN                                    (tear down a run's SkyPilot clusters)

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
from typing import TYPE_CHECKING, List, Optional

import typer

from echo2.errors import Echo2InputError

if TYPE_CHECKING:  # the launcher's helpers are imported where used: an actor's `echo2` imports no echo2.learner
    from echo2.learner.torchrun import Rendezvous

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="echo2: distributed RL post-training with bounded staleness.")

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "echo2",
    # the fleet's background threads (reclaim injector, SkyPilot launches) log outside the flow run's
    # context: to the console only, without a warning per line
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}


class _CtrlC:
    """Whether the user pressed Ctrl-C, or the process got SIGTERM (``kill``, a supervisor, a CI job's
    timeout): both stop the run the same way. Prefect can turn the KeyboardInterrupt into another
    error (a ValueError when it lands while a task run is being created), so the exception alone
    cannot tell. During a flow run Prefect puts its own SIGTERM handler in place (it marks the flow
    run crashed, then sends the signal again to the handler it replaced: this one)."""

    pressed = False
    signum = signal.SIGINT

    @classmethod
    def handler(cls, signum, frame) -> None:
        cls.pressed, cls.signum = True, signum
        raise KeyboardInterrupt

    @classmethod
    def install(cls) -> None:
        """Ctrl-C (SIGINT) and SIGTERM stop the run cleanly (checkpoint, actors stopped, Prefect's
        temporary server stopped at exit; exit 130 or 143) however we were started: a shell script
        that puts a job in the background makes it inherit SIGINT ignored, and the default action of
        SIGTERM would end this process without a word, leaving Prefect's server behind."""
        cls.pressed, cls.signum = False, signal.SIGINT
        signal.signal(signal.SIGINT, cls.handler)
        signal.signal(signal.SIGTERM, cls.handler)

    @classmethod
    def exit_code(cls) -> int:
        return 128 + int(cls.signum)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


LEARNER_EXTRA = ("prefect", "tensorboard", "matplotlib")


def _need_learner_extra(what: str) -> None:
    """One line, exit 2, where the learner's packages are missing (an actor-only install)."""
    import importlib.util

    missing = [name for name in LEARNER_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        _fail(f"{what} needs the learner extra ({', '.join(missing)} not installed): pip install 'echo2[learner]'")


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
    _launch(config, set_ or [], resume, dry_run, verbose, rdzv_endpoint=None, rdzv_timeout=None)


def _launch(config: Path, overrides: list[str], resume: bool, dry_run: bool, verbose: bool, *,
            rdzv_endpoint: str | None, rdzv_timeout: float | None) -> None:
    """Resolve the run (run id, key, store), then run the flow here or torchrun's processes (node 0 of several
    with ``train.nnodes > 1``)."""
    from echo2.config import dump_config
    from echo2.learner.torchrun import DEFAULT_RDZV_TIMEOUT_S, Rendezvous, write_rank_file

    _CtrlC.install()
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    _need_learner_extra("echo2 run")
    from echo2.launch import resolve_launch

    try:
        cfg = resolve_launch(config, overrides, resume, dry_run=dry_run)
        if dry_run:
            typer.echo(dump_config(cfg), nl=False)
            return
        if cfg.train.nnodes > 1 and rdzv_endpoint is None:
            raise Echo2InputError(f"train.nnodes is {cfg.train.nnodes}: start the learner with `echo2 learner CONFIG "
                                  f"--nnodes {cfg.train.nnodes} --node-rank R --rdzv-endpoint HOST:PORT` on each "
                                  "node, HOST:PORT on node 0")
        rendezvous = Rendezvous(cfg.train.nnodes, 0, rdzv_endpoint, rdzv_timeout or DEFAULT_RDZV_TIMEOUT_S)
    except Echo2InputError as exc:
        _fail(str(exc))
    if cfg.train.nproc * cfg.train.nnodes > 1:  # the learner over several processes: torchrun, this flow in rank 0
        _torchrun(cfg.train.nproc, rendezvous, write_rank_file(cfg.model_dump(mode="json")), resume, verbose)
    _run_flow(cfg, f"echo2 run {config}", resume, verbose)


def _run_flow(cfg, rerun: str, resume: bool, verbose: bool, *, rank_0: bool = False) -> None:
    """The echo2-train flow in this process (``rank_0``: of a learner under torchrun), with progress, and what to
    print or exit with."""
    from flows.api_server import start_prefect_api

    try:  # a signal before the flow starts: Prefect's temporary server is stopped at exit all the same
        prefect_api_ready = start_prefect_api(own_session=rank_0)  # comes up while torch and transformers import (flows.train)
        from echo2.progress import RichReporter, make_reporter, set_reporter

        # a live bar in a terminal; one plain flushed line per step when stdout is a file or a pipe
        reporter = make_reporter()
        _setup_logging(verbose, reporter.console if isinstance(reporter, RichReporter) else None)
        set_reporter(reporter)
        from flows.train import train

        prefect_api_ready()
        summary = train(config=cfg.model_dump(mode="json"), resume=resume)
    except BaseException as exc:
        if _CtrlC.pressed or isinstance(exc, KeyboardInterrupt):  # the flow has already stopped the fleet
            typer.echo(f"interrupted: every actor was stopped; continue with `{rerun} --resume "
                       f"--set run.id={cfg.run.id}`", err=True)
            raise typer.Exit(_CtrlC.exit_code()) from None
        if isinstance(exc, Echo2InputError):
            _fail(str(exc))
        if isinstance(exc, TimeoutError):  # no rollouts arrived: say so plainly, the logs have the rest
            _fail(str(exc), code=1)
        raise
    before, after = summary["eval_before"], summary["eval_after"]
    typer.echo(json.dumps(summary, indent=1))
    if before is not None and after is not None:
        metric = summary.get("eval_metric", "accuracy")
        name = "held-out greedy accuracy" if metric == "accuracy" else f"held-out {metric}"
        typer.echo(f"{name}: {before:.3f} -> {after:.3f} ({after - before:+.3f}) "
                   f"in {summary['steps']} steps, {summary['wall_seconds']:.0f}s; run {summary['run_id']}")
        metrics = summary.get("eval_metrics", {})
        shown = set(metrics.get("before", {})) & set(metrics.get("after", {}))
        for key in sorted(k for k in shown if k not in ("n", "k", "score", metric) and not k.endswith(".hands")):
            b, a = metrics["before"][key], metrics["after"][key]
            typer.echo(f"  {key}: {b:.3f} -> {a:.3f} ({a - b:+.3f})")


def _torchrun(nproc: int, rendezvous: Rendezvous, rank_file: Path, resume: bool, verbose: bool) -> None:
    """Run this node's ``nproc`` learner processes under ``torchrun`` (``echo2/learner/torchrun.py``) and exit
    with its code; they start from ``rank_file`` (private, removed once they have formed the group, else here)."""
    import subprocess

    from echo2.learner.torchrun import never_joined, torchrun_command

    program = ["-m", "echo2.cli", "learner", "--rank-config", str(rank_file), *(["--resume"] if resume else []),
               *(["-v"] if verbose else [])]
    proc = subprocess.Popen(torchrun_command(nproc, rendezvous, program))
    try:
        forwarded = False
        while True:  # torchrun passes a signal on to every rank: rank 0 checkpoints, then releases the others
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # Ctrl-C reached the whole process group; a SIGTERM only us, once is enough
                if _CtrlC.signum == signal.SIGTERM and not forwarded:
                    proc.send_signal(signal.SIGTERM)
                    forwarded = True
    finally:
        never_formed = rank_file.exists()
        rank_file.unlink(missing_ok=True)
    if _CtrlC.pressed:  # as the one-process learner exits (130, 143), whatever torchrun made of the signal
        raise typer.Exit(_CtrlC.exit_code())
    if code != 0 and never_formed and rendezvous.nnodes > 1:
        _fail(never_joined(rendezvous), code=1)  # last, under torchrun's traceback
    raise typer.Exit(code)


@app.command()
def learner(
    config: Optional[Path] = typer.Argument(None, help="YAML config (as for `echo2 run`), the same on every node."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its last checkpoint (node 0)."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Learner processes on this node (train.nproc)."),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", help="Nodes of the learner (train.nnodes)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node: 0 resolves the run and runs the flow, the "
                                                          "others only follow."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT on node 0 where the nodes "
                                                                              "meet (needed with --nnodes > 1)."),
    rdzv_timeout: Optional[float] = typer.Option(None, "--rdzv-timeout", show_default="600",
                                                 help="Seconds to wait for every node at the rendezvous before failing."),
    rank_config: Optional[Path] = typer.Option(None, "--rank-config", hidden=True,
                                               help="Inside torchrun: the file this node's processes start from."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logs and Prefect's own logs."),
) -> None:
    """The learner on N processes (torchrun, FSDP), on this node or several; rank 0 runs the echo2-train flow."""
    if rank_config is not None:
        _learner_process(rank_config, resume, verbose)
        return
    if config is None:  # the launcher of a node
        _fail("echo2 learner needs a config file")
    overrides = [*(set_ or []), *([f"train.nproc={nproc}"] if nproc else []),
                 *([f"train.nnodes={nnodes}"] if nnodes else [])]
    if node_rank == 0:  # resolve the run once, then torchrun (or the flow here, on one process)
        _launch(config, overrides, resume, False, verbose, rdzv_endpoint=rdzv_endpoint, rdzv_timeout=rdzv_timeout)
        return
    _follower_node(config, overrides, node_rank, rdzv_endpoint, rdzv_timeout, verbose)


def _follower_node(config: Path, overrides: list[str], node_rank: int, rdzv_endpoint: str | None,
                   rdzv_timeout: float | None, verbose: bool) -> None:
    """Node 1..N-1: resolves no run and never opens the store (``torchrun.prepare_follower_node``)."""
    from echo2.learner.torchrun import DEFAULT_RDZV_TIMEOUT_S, RendezvousFailed, prepare_follower_node

    _CtrlC.install()
    try:
        nproc, rendezvous, rank_file = prepare_follower_node(config, overrides, node_rank, rdzv_endpoint,
                                                              rdzv_timeout or DEFAULT_RDZV_TIMEOUT_S)
    except Echo2InputError as exc:
        _fail(str(exc), code=1 if isinstance(exc, RendezvousFailed) else 2)
    except KeyboardInterrupt:
        raise typer.Exit(_CtrlC.exit_code()) from None
    _torchrun(nproc, rendezvous, rank_file, False, verbose)


def _learner_process(rank_config: Path, resume: bool, verbose: bool) -> None:
    """One process under torchrun: rank 0 runs the flow on the run's config; every other rank, on this node or
    another, follows rank 0 (``distributed.start_process``) and returns when it says stop."""
    from echo2.learner.distributed import release_followers, start_process

    cfg = start_process(rank_config, on_follow=lambda: _setup_logging(verbose))
    if cfg is None:
        return
    _CtrlC.install()
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    rerun = f"echo2 learner CONFIG --nproc {cfg.train.nproc}"
    if cfg.train.nnodes > 1:
        rerun += f" --nnodes {cfg.train.nnodes} --node-rank 0 --rdzv-endpoint {os.environ.get('MASTER_ADDR')}:" \
                 f"{os.environ.get('MASTER_PORT')}"
    try:
        _run_flow(cfg, rerun, resume, verbose, rank_0=True)
    finally:
        release_followers()


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
    """Export a published version or checkpoint as a from_pretrained-loadable directory: only one the
    run's key signed, every file checked against its manifest (else one line, exit 2)."""
    from echo2.data import layout
    from echo2.data.delta import DeltaRejected
    from echo2.data.manifest import ManifestRejected
    from echo2.data.store import NotFound, StoreError, open_store
    from echo2.data.weights import CorruptWeights, latest_version

    created = not dest.exists()
    try:  # every manifest read names plain files of its folder only, or is refused (ManifestRejected)
        store = open_store(run, _store_options_from_env())
        if step is None:
            step = latest_version(store)
            if step is None:
                _fail(f"{run} has no published policy version")
        candidates = [layout.checkpoint_dir(step), layout.policy_dir(step)]
        for prefix in candidates:
            if store.exists(f"{prefix}/{layout.MANIFEST}"):
                manifest = _download_weights(store, prefix, dest)
                break
        else:
            _fail(f"{run} has neither checkpoint {step} nor policy version {step}")
    except (StoreError, NotFound, ManifestRejected, DeltaRejected, CorruptWeights, Echo2InputError) as exc:
        if created:  # the files that verified before one did not are no model: leave no folder of them
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
        _fail(str(exc))
    typer.echo(f"exported {prefix} ({len(manifest['files'])} files, verified) to {dest}")


def _download_weights(store, prefix: str, dest: Path) -> dict:
    """A weights folder of a run (checkpoint or policy version) as a ``from_pretrained`` folder at ``dest``,
    every byte checked against its manifest, and every manifest against the run's key (``run_folder.weights_key``:
    a folder the run's learner did not sign is refused, ManifestRejected); an adapter version is folded into its
    base. Returns the manifest."""
    from echo2.data import layout
    from echo2.data.run_folder import RunRecordRejected, weights_key
    from echo2.data.store import NotFound
    from echo2.data.weights import download, iter_tensors, merge_into_folder

    try:
        public_key = weights_key(store.get_json(layout.RUN_JSON))
    except (NotFound, ValueError):
        raise RunRecordRejected(f"{store.url} has no readable {layout.RUN_JSON}: not a run folder, so there is no key "
                                "to check its weights with") from None
    if prefix.startswith(layout.CHECKPOINTS):  # every rank's shards, put together here (checkpoint.py)
        from echo2.learner.checkpoint import export_checkpoint

        step = layout.parse_step_dir(prefix.rsplit("/", 1)[-1])
        if step is None:
            raise NotFound(f"{store.url}/{prefix} is not a checkpoint folder (checkpoints/step-N)")
        return export_checkpoint(store, step, dest, public_key)
    manifest = download(store, prefix, dest, public_key=public_key)
    if manifest.get("weights") == "lora":
        adapter = {k: v for k, v in iter_tensors(store, prefix, manifest)}
        download(store, layout.policy_dir(manifest["base_version"]), dest, public_key=public_key)
        merge_into_folder(dest, adapter, rank=manifest["lora_rank"], alpha=manifest["lora_alpha"])
    if manifest.get("weights") == "delta":  # a sparse delta: rebuilt through its chain, every link verified
        from echo2.data.delta_chain import read_version
        from echo2.data.weights import save_as_indexed

        tensors, keyframe = read_version(store, manifest["version"], public_key)
        download(store, layout.policy_dir(keyframe["version"]), dest, kinds=("aux",), public_key=public_key)
        save_as_indexed(dest, tensors)
    for extra in ("optimizer.pt", "trainer_state.json", "adapter.safetensors"):  # learner state, not the model
        (dest / extra).unlink(missing_ok=True)
    return manifest


@app.command("eval")
def eval_policy(
    model: str = typer.Argument(..., help="A model (local folder, Hugging Face id, smollm2-135m-instruct) or a run's "
                                          "weights folder: RUN/checkpoints/step-N or RUN/policy/vN."),
    task: Optional[str] = typer.Option(None, "--task", help="arithmetic, math or poker (default: the config's task)."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML config whose task and eval sections are used."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: --set eval.k=8 (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Held-out metrics of a model or checkpoint: pass@1 (greedy) and pass@k (eval.k samples); poker:
    bb/100 per opponent with a 95% interval over duplicate deals, and the illegal-action rate."""
    import tempfile

    from echo2.config import apply_overrides, config_from_dict, load_config

    _quiet_transformers()
    try:
        cfg = load_config(config)
        data = cfg.model_dump(mode="json")
        if task is not None and data["task"]["name"] != task:
            data["task"] = {"name": task}  # another task than the config's: its defaults
        cfg = config_from_dict(apply_overrides(data, set_ or []), str(config or "(defaults)"))
        with tempfile.TemporaryDirectory(prefix="echo2-eval-") as tmp:
            result = _evaluate_model(model, cfg, Path(tmp))
    except Echo2InputError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    from echo2.learner.evaluate import flat_metrics

    table = Table(title=f"{cfg.task.name}: {model}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in flat_metrics(result).items():
        table.add_row(key, f"{value:.4g}")
    Console().print(table)


def _evaluate_model(model: str, cfg, tmp: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2.data import layout
    from echo2.data.manifest import ManifestRejected
    from echo2.data.store import NotFound, StoreError, open_store
    from echo2.data.weights import CorruptWeights
    from echo2.learner.evaluate import evaluate_policy
    from echo2.models import resolve_model
    from echo2.tasks import make_task

    folder = model.rstrip("/")
    parent, _, name = folder.rpartition("/")
    run_root, _, kind = parent.rpartition("/")
    if kind in (layout.CHECKPOINTS.rstrip("/"), layout.POLICY.rstrip("/")) and run_root:
        try:
            store = open_store(run_root, _store_options_from_env())
            if not store.exists(f"{kind}/{name}/{layout.MANIFEST}"):
                _fail(f"{model} is not a committed weights folder (no {layout.MANIFEST})")
            _download_weights(store, f"{kind}/{name}", tmp)
        except (StoreError, NotFound, ManifestRejected, CorruptWeights) as exc:
            _fail(str(exc))
        model_dir = tmp
    else:
        model_dir = resolve_model(model)
    task = make_task(cfg.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    e = cfg.eval
    result = evaluate_policy(policy, tokenizer, task, max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
                             k=e.k, temperature=e.temperature)
    return {"model": model, "task": task.name, **result}




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
    _need_learner_extra("echo2 report")
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


from echo2.bench.commands import bench_app  # noqa: E402  (commands that live beside their plane)
from echo2.chaos.command import chaos  # noqa: E402
from echo2.fleet.commands import fleet_app, plan_fleet, prices_table  # noqa: E402

app.add_typer(bench_app, name="bench")
app.command("chaos")(chaos)

app.command("plan")(plan_fleet)
app.command("prices")(prices_table)
app.add_typer(fleet_app, name="fleet")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
