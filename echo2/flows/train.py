"""The ``echo2-train`` Prefect flow: one training run, each stage a Prefect task.

    resolve the launch (config + overrides, or the run being resumed)
    prepare the run (create, or resume from the last checkpoint) and publish the initial policy
    start the actor fleet
    evaluate before training
    until max_steps: collect fresh rollouts (a store outage is ridden out by the store layer, not here)
                     update the policy (GRPO step, publish, checkpoint)
                     evaluate every eval.every steps (when set)
                     reconcile the fleet (fleet.actors: auto: sized by the capacity model),
                     forward actor logs, update the artifacts
    on cancel, Ctrl-C or SIGTERM: checkpoint so `resume: true` continues from here, while the fleet
                     is told to stop (both inside Prefect's grace: 30 s from its SIGTERM to SIGKILL)
    on a spot learner's notice (learner.market: spot; SIGTERM or the machine's metadata): finish the step
                     if it ends in time, else abandon it; checkpoint, and leave the fleet running for the
                     relaunched learner (echo2/learner/notice.py); the flow run fails with LearnerReclaimed.
                     A SIGTERM while Prefect cancels the flow run (its state CANCELLING) is a cancel, not a
                     notice: checkpoint and stop the fleet, as on-demand
    when a newer learner incarnation took the run (LeaseLost, echo2/data/lease.py): leave at once, writing
                     nothing and stopping nothing (the fleet is the new incarnation's now)
    else, always: stop the fleet
    evaluate after training, write the reports and the cost report artifact

A rerun of the same flow run (a flow-run retry, the UI's Retry on a failed or crashed run) continues the
run it started instead of starting over: a launch that names no ``run.id`` gets one derived from the
flow run id, the flow run records itself in the run's ledger (a ``flow_run`` event), and a run folder
this flow run made is resumed from its last checkpoint, not created again.

Tasks that return live objects (the run, the fleet, a selection of rollout tables) say that their results
are never persisted (``persist_result=False``), whatever a user's settings (PREFECT_RESULTS_PERSIST_BY_DEFAULT)
or a later Prefect default to: a model and its threads do not belong in a result store. (In Prefect 3.9
``NO_CACHE`` alone already kept them out: with that setting on, only the flow's summary was stored.)
"""

from __future__ import annotations

import logging

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as this_flow_run

from echo2.config import Config, config_from_dict, load_config
from echo2.data import layout
from echo2.data.ledger import read_events, write_event
from echo2.data.store import open_store
from echo2.fleet.make import make_fleet
from echo2.fleet.manager import FleetManager
from echo2.fleet.sizing import autosize
from echo2.flows.events import forward_run_events
from echo2.flows.observe import RunWatch
from echo2.flows.secret_blocks import load_secret_blocks
from echo2.launch import resolve_launch
from echo2.learner.collector import Selection
from echo2.learner.notice import LearnerExit, LearnerReclaimed, spot_notice
from echo2.learner.run import LearnerRun

log = logging.getLogger("echo2.flows")

class _ReclaimedQuietly(logging.Filter):
    """Prefect logs a flow's exception at ERROR with its traceback; a spot learner's notice exit is an expected end
    (``LearnerReclaimed``): one warning line, the flow run FAILED all the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], LearnerReclaimed):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


logging.getLogger("prefect.flow_runs").addFilter(_ReclaimedQuietly())

FLOW_RUN_EVENT = "flow_run"
"""The ledger event a flow run writes into the run it trains (``flow_run_id``, ``attempt``)."""


@task(cache_policy=NO_CACHE, persist_result=False)
def prepare_run(config: Config, resume: bool) -> LearnerRun:
    store = open_store(config.store.url, config.store.options, retry_s=config.store.retry_s)
    return LearnerRun(config, store.child(layout.RUNS), resume=resume)


@task(cache_policy=NO_CACHE, persist_result=False)
def start_fleet(run: LearnerRun, ending: LearnerExit) -> FleetManager:
    """Started by ``ending``, which holds it from before its start: stopped at the end, or left running on a notice."""
    fleet = make_fleet(run.config.fleet, run.store, store_options=run.config.store.options, log_dir=run.log_dir,
                       run_key=run.key, seed=run.config.run.seed, run_id=run.run_id,
                       model_params_b=run.model_params_b, active_params_b=run.active_params_b)
    return ending.start(fleet)


@task(cache_policy=NO_CACHE)
def evaluate(run: LearnerRun, label: str) -> dict:
    return run.evaluate(label)


# No Prefect retries here, or on any task of this flow (one layer owns retries). A store
# error that reaches this task has already been retried by the store itself for store.retry_s
# (echo2/data/store/fsspec_store.py, the single owner: botocore and s3fs are told not to retry); retrying the
# task on top ran that whole window again, three more times, so a dead store took 4 x retry_s (8 minutes)
# to surface. Nothing else that can fail here is worth a rerun: a SkyPilot API hiccup is ridden out by
# the fleet's reconcile pass, "no usable rollouts" already waited rollout_timeout_s, and anything else
# is a bug or an answer. A run that ends on a store outage longer than store.retry_s is resumed by
# rerunning its flow run (it continues from its last checkpoint).
@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="collect-rollouts-{step}")
def collect_rollouts(run: LearnerRun, fleet: FleetManager, step: int) -> Selection:
    def between_polls():  # a wait for rollouts may be long: the lease shows this learner lives all along
        if run.lease is not None:
            run.lease.renew()
        return fleet.reconcile()

    return run.collect(should_abort=between_polls)


@task(cache_policy=NO_CACHE, task_run_name="update-policy-{step}")
def update_policy(run: LearnerRun, selection: Selection, step: int) -> dict:
    return run.update(selection)


@task(cache_policy=NO_CACHE)
def reconcile_fleet(fleet: FleetManager, run: LearnerRun) -> dict:
    """With ``fleet.actors: auto``, resize to what the capacity model asks for; expel the actors the learner
    caught lying, replace dead ones; the next version tells relays to refuse every actor that left."""
    fleet.autosize(run.step, lambda: autosize.auto_fleet_size(run.config, run.store, run.history))
    status = fleet.reconcile(expel=run.banned)
    run.revoke(status["revoked"])
    return status


@task(cache_policy=NO_CACHE)
def write_reports(run: LearnerRun) -> dict:
    return run.finish()


def derived_run_id(name: str, flow_run_id: str) -> str:
    """The run id of a flow run whose launch names none: the same at every rerun of that flow run."""
    return f"{name}-{flow_run_id.replace('-', '')[:12]}"


def _launch(config: dict | None, config_path: str, settings: list[str], resume: bool) -> tuple[Config, bool]:
    """The config this flow run trains with, and whether it resumes (see the module docstring)."""
    flow_run_id = this_flow_run.id  # the same at every rerun of this flow run; None outside one
    derived = False
    if config is not None:  # `echo2 run`: resolved (run.id included) before the flow started
        cfg = config_from_dict(config)
    else:
        named = load_config(config_path, settings) if not resume and flow_run_id else None
        if named is not None and named.run.id is None:
            settings = [*settings, f"run.id={derived_run_id(named.run.name, flow_run_id)}"]
            derived = True
        cfg = resolve_launch(config_path, settings, resume)
    if resume or not flow_run_id:
        return cfg, resume
    runs = open_store(cfg.store.url, cfg.store.options, retry_s=cfg.store.retry_s).child(layout.RUNS)
    run_store = runs.child(cfg.run.id)
    if not run_store.exists(layout.RUN_JSON):
        return cfg, False
    # a folder named after this flow run, or one whose ledger names it, is this flow run's own: a rerun
    if derived or any(e.get("kind") == FLOW_RUN_EVENT and e.get("flow_run_id") == flow_run_id
                      for e in read_events(run_store)):
        log.warning("flow run %s ran before (attempt %s): resuming its run %s", flow_run_id, this_flow_run.run_count,
                    cfg.run.id)
        return cfg, True
    return cfg, False  # someone else's run of that id: creating it fails, naming --resume


def flow_run_cancelling() -> bool:
    """Whether Prefect is cancelling this flow run: it sets CANCELLING before it sends the process SIGTERM."""
    flow_run_id = this_flow_run.id
    if not flow_run_id:
        return False
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    return state is not None and state.type.value in ("CANCELLING", "CANCELLED")


@flow(name="echo2-train")
def train(config_path: str = "configs/quickstart.yaml", model: str | None = None, task: str | None = None,
          staleness: int | None = None, max_steps: int | None = None, fleet_budget_usd_per_hour: float | None = None,
          overrides: list[str] | None = None, resume: bool = False, config: dict | None = None) -> dict:
    """Train a policy with GRPO on a fleet of rollout actors.

    config_path: YAML config; model/task/staleness/max_steps/fleet_budget_usd_per_hour override its
    most-changed fields; overrides: more `key=value` settings; resume: continue the run named by
    `run.id` (or the newest unfinished one) from its last checkpoint.
    """
    shortcuts = {"model.name": model, "task.name": task, "train.staleness": staleness,
                 "train.max_steps": max_steps, "fleet.max_usd_per_hour": fleet_budget_usd_per_hour}
    settings = [f"{k}={v}" for k, v in shortcuts.items() if v is not None] + list(overrides or [])
    load_secret_blocks()  # $ECHO2_SECRET_BLOCKS: the run key, store keys from Prefect Secret blocks
    cfg, resume = _launch(config, config_path, settings, resume)
    # a spot learner's SIGTERM and metadata notice (learner.market: spot) leave the fleet running (notice.py); notable
    # ledger events become Prefect events too (echo2/flows/events.py)
    with spot_notice(cfg.learner, cancelled=flow_run_cancelling) as notice, forward_run_events(cfg.run.id):
        watch = RunWatch(cfg)
        with LearnerExit(notice, cfg.run.id, on_stopped=watch.stopped) as ending:  # the fleet stopped, or left
            run = ending.prepared(prepare_run(cfg, resume))
            if this_flow_run.id:
                write_event(run.store, FLOW_RUN_EVENT, "learner", flow_run_id=this_flow_run.id,
                            attempt=this_flow_run.run_count, step=run.step)
            fleet = start_fleet(run, ending)
            run.revoke(fleet.revoked)  # actors the resume could not adopt: revoked before the first publish
            if cfg.eval.before:
                watch.eval("before", evaluate(run, "before"))
            watch.started(run.step)
            while run.step < cfg.train.max_steps:
                selection = collect_rollouts(run, fleet, step=run.step + 1)
                metrics = update_policy(run, selection, step=run.step + 1)
                ending.leave_if_noticed()  # a notice that let the step finish: leave now
                watch.step(metrics, reconcile_fleet(fleet, run), fleet.new_log_lines(), fleet.cost_so_far())
                if cfg.eval.every and run.step % cfg.eval.every == 0 and run.step < cfg.train.max_steps:
                    watch.eval(f"step-{run.step}", evaluate(run, f"step-{run.step}"))
        if cfg.eval.after:
            watch.eval("after", evaluate(run, "after"))
        summary = write_reports(run)
        watch.finished(summary, run.report_file("curves.png"), run.cost_markdown())
        return summary
