"""The ``echo2-train`` Prefect flow: one training run, each optimizer step a Prefect task.

    prepare the run (create, or resume from the last checkpoint) and publish the initial policy
    start the actor fleet
    evaluate before training
    until max_steps: train one step (collect fresh rollouts, GRPO update, publish, checkpoint)
                     and reconcile the fleet
    evaluate after training
    stop the fleet (always), write the reports
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from echo2.config import Config, config_from_dict, load_config
from echo2.data.store import open_store
from echo2.fleet.local import LocalFleet
from echo2.learner.run import LearnerRun
from echo2.progress import reporter


def _run_name() -> str:
    return (flow_run.parameters.get("config") or {}).get("run", {}).get("id") or "echo2-run"


@task(cache_policy=NO_CACHE)
def prepare_run(config: Config, resume: bool) -> LearnerRun:
    runs = open_store(config.store.url, config.store.options).child("runs")
    return LearnerRun(config, runs, resume=resume)


@task(cache_policy=NO_CACHE)
def start_fleet(run: LearnerRun) -> LocalFleet:
    fleet = LocalFleet(run.config.fleet, run.store, store_options=run.config.store.options, log_dir=run.log_dir,
                       run_key=run.key)
    fleet.start()
    return fleet


@task(cache_policy=NO_CACHE)
def evaluate(run: LearnerRun, label: str) -> dict:
    return run.evaluate(label)


@task(cache_policy=NO_CACHE, task_run_name="train-step-{step}")
def train_step(run: LearnerRun, fleet: LocalFleet, step: int) -> dict:
    return run.train_step(should_abort=fleet.reconcile)


@task(cache_policy=NO_CACHE)
def reconcile_fleet(fleet: LocalFleet) -> dict:
    return fleet.reconcile()


@task(cache_policy=NO_CACHE)
def write_reports(run: LearnerRun) -> dict:
    return run.finish()


@flow(name="echo2-train", flow_run_name=_run_name)
def train(config: dict | None = None, config_path: str = "configs/quickstart.yaml",
          overrides: list[str] | None = None, resume: bool = False) -> dict:
    """Train with a resolved ``config`` mapping (what ``echo2 run`` passes), or a YAML path plus overrides."""
    cfg = config_from_dict(config) if config is not None else load_config(config_path, overrides or [])
    run = prepare_run(cfg, resume)
    fleet = start_fleet(run)
    ui = reporter()
    try:
        if cfg.eval.before:
            ui.eval("before", evaluate(run, "before"))
        ui.start(run.run_id, cfg.train.max_steps, run.step)
        while run.step < cfg.train.max_steps:
            metrics = train_step(run, fleet, step=run.step + 1)
            ui.step(metrics, reconcile_fleet(fleet))
    finally:
        ui.stop()
        fleet.stop()
    if cfg.eval.after:
        ui.eval("after", evaluate(run, "after"))
    return write_reports(run)
