"""What a user watching the flow run in the Prefect UI sees: name and tags, a progress artifact
updated every step, a metrics table updated in place every few steps (one artifact, not a new
version each time), actor logs in the run's log, and the cost report with the reward curve at the
end. Prefect-specific code lives here and in ``train.py``."""

from __future__ import annotations

import base64
import time

from prefect import get_client, get_run_logger
from prefect.artifacts import (
    TableArtifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.runtime import flow_run

from echo2.config import Config
from echo2.progress import reporter


def _key(run_id: str, what: str) -> str:  # artifact keys: lowercase letters, digits, dashes
    safe = "".join(c if c.isalnum() else "-" for c in run_id.lower()).strip("-")
    return f"{safe}-{what}"[:120]


def _metric_name(summary: dict) -> str:
    metric = summary.get("eval_metric", "accuracy")
    return "greedy accuracy" if metric == "accuracy" else metric


def _publish_columns(metrics: dict) -> dict:
    """What the step's publish moved (None on a step that published nothing): the full version's MB, the
    MB actually sent (a sparse delta's, or the full shards of a keyframe), the share of elements that
    changed, and the delta's encode and apply seconds (``echo2/learner/publisher.py``)."""
    def get(key, scale=1.0, digits=3):
        value = metrics.get(key)
        return None if value is None else round(value * scale, digits)

    return {"full_mb": get("publish_full_bytes", 2**-20, 1), "sent_mb": get("publish_bytes", 2**-20, 2),
            "changed_share": get("publish_changed_fraction", 1.0, 4), "encode_s": get("publish_encode_seconds"),
            "apply_s": get("publish_apply_seconds")}


class RunWatch:
    def __init__(self, config: Config, table_every: int = 2):
        self.config = config
        self.run_id = config.run.id
        self.table_every = table_every
        self.rows: list[dict] = []
        self.table_id = None
        """The metrics table artifact, made at its first showing and updated in place after."""
        self.log = get_run_logger()
        self.ui = reporter()
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=self.run_id, tags=[
                f"model:{config.model.name.rsplit('/', 1)[-1]}", f"task:{config.task.name}",
                f"fleet:{config.fleet.backend}", "echo2"])
        self.progress_id = create_progress_artifact(0.0, key=_key(self.run_id, "progress"),
                                                    description=f"steps done of {config.train.max_steps}")

    def started(self, step: int) -> None:
        self.ui.start(self.run_id, self.config.train.max_steps, step)

    def eval(self, label: str, result: dict) -> None:
        self.ui.eval(label, result)

    def step(self, metrics: dict, fleet: dict, actor_lines: list[str], cost_so_far: float) -> None:
        self.ui.step(metrics, fleet)
        for line in actor_lines:
            self.log.info(line)
        step, max_steps = metrics["step"], self.config.train.max_steps
        update_progress_artifact(self.progress_id, 100.0 * step / max_steps,
                                 description=f"step {step} of {max_steps}")
        self.rows.append({"step": step, "reward": round(metrics["reward"], 4), "eval_accuracy": None,
                          "lag_mean": round(metrics["lag_mean"], 2), "lag_max": metrics["lag_max"],
                          "actors_alive": fleet.get("actors_alive"), "usd_so_far": round(cost_so_far, 4),
                          "step_seconds": round(metrics["seconds"], 1), **_publish_columns(metrics)})
        if step % self.table_every == 0 or step == max_steps:
            self._table()

    def _table(self) -> None:
        if self.table_id is None:
            self.table_id = create_table_artifact(self.rows, key=_key(self.run_id, "metrics"),
                                                  description=f"training metrics of {self.run_id}")
            return
        data = TableArtifact(table=self.rows).format(_sync=True)  # the JSON text create_table_artifact stores
        with get_client(sync_client=True) as client:
            client.update_artifact(self.table_id, ArtifactUpdate(data=data))

    def finished(self, summary: dict, curves_png: bytes | None, cost_md: str) -> None:
        self.ui.stop()
        if self.rows and summary.get("eval_after") is not None:
            self.rows[-1]["eval_accuracy"] = summary["eval_after"]
            self._table()
        chart = ""
        if curves_png:
            png = base64.b64encode(curves_png).decode()
            chart = f"\n![reward, held-out metric and lag](data:image/png;base64,{png})\n"
        create_markdown_artifact(
            f"# {self.run_id}\n\nheld-out {_metric_name(summary)} "
            f"**{summary['eval_before']} -> {summary['eval_after']}** "
            f"in {summary['steps']} steps, {summary['wall_seconds']:.0f} s\n\n{cost_md}\n{chart}",
            key=_key(self.run_id, "cost-report"), description="cost report and reward curve")
        self.log.info("run %s finished at %s", self.run_id, time.strftime("%H:%M:%S"))

    def stopped(self) -> None:
        self.ui.stop()
