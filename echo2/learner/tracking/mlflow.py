"""MLflow, through its client (no process-wide active run): the experiment ``logging.project``, one MLflow run per
echo2 run, found again by its tag ``echo2.run_id`` (a resumed learner continues it), named ``logging.run_name`` or
the run id. Params are the resolved config, flattened to dotted keys; a value longer than MLflow takes is cut,
and a resume logs only keys the run lacks (MLflow never changes a logged param). Metrics carry the step; a
completions table is ``log_table``'s JSON artifact ``completions/step-NNNNNN.json``."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from echo2.learner.tracking.base import COMPLETION_COLUMNS, Tracker, TrackerRun

log = logging.getLogger("echo2.learner")

RUN_ID_TAG = "echo2.run_id"
_BATCH = 100  # MLflow's most params (and 1000 metrics) per log_batch call
_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")  # what MLflow allows in a param or metric key


def flat_params(tree: Any, prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: ``train.lr`` -> ``"1e-05"``; lists and empty mappings as their text."""
    if isinstance(tree, dict) and tree:
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(flat_params(value, f"{prefix}{_KEY.sub('_', str(key))}."))
        return out
    return {prefix.rstrip(".")[:250]: str(tree)}


class MlflowTracker(Tracker):
    def __init__(self, run: TrackerRun):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
        except ImportError:  # where a version moves it: the oldest limit MLflow had
            limit = 500
        s = run.settings
        self.client = MlflowClient(tracking_uri=s.mlflow_tracking_uri)
        experiment = self.client.get_experiment_by_name(s.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(s.project)
        quoted = run.run_id.replace("'", "\\'")
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{quoted}'",
                                        max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            logged = found[0].data.params
        else:
            tags = {RUN_ID_TAG: run.run_id, **{tag: "" for tag in s.tags}, **({"group": s.group} if s.group else {})}
            self.run_id = self.client.create_run(experiment_id, run_name=s.run_name or run.run_id,
                                                 tags=tags).info.run_id
            logged = {}
        params = {k: v[:limit] for k, v in flat_params(run.config).items()}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.info("MLflow run %s keeps the params it was first given; changed on resume: %s", self.run_id,
                     ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), _BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + _BATCH])

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_KEY.sub("_", k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _BATCH])

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_table(self.run_id, data={c: [row[c] for row in rows] for c in COMPLETION_COLUMNS},
                              artifact_file=f"completions/step-{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
