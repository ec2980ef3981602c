"""``logging``: where the learner's numbers and sample completions go (``echo2/learner/tracking/``)."""

from __future__ import annotations

import difflib

from pydantic import Field, field_validator

from echo2.config._base import _Section

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The backends ``logging.backends`` may name (``echo2/learner/tracking/``: one module each)."""


class LoggingConfig(_Section):
    backends: list[str] = Field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers the learner writes to, any of ``tensorboard`` (event files in the run's local folder,
    copied into the store under ``tensorboard/`` at each checkpoint and at the end), ``wandb`` (Weights & Biases)
    and ``mlflow``; ``[]`` = none (``reports/`` is written either way). W&B and MLflow are the ``tracking`` extra
    (``pip install 'echo2[tracking]'``): a backend named here whose library is missing stops the run before it
    starts, in one line."""
    project: str = "echo2"
    """The W&B project, and the MLflow experiment the run goes in."""
    entity: str | None = None
    """The W&B entity (user or team) that owns the project (None = the API key's default)."""
    group: str | None = None
    """The W&B group of the run (runs of one sweep or ablation side by side); an MLflow tag ``group``."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run; MLflow tags of the same names (empty values)."""
    run_name: str | None = None
    """The run's display name in W&B and MLflow (None = the run id). Either way the W&B run's id is the run id and
    the MLflow run carries the tag ``echo2.run_id``, so ``--resume`` continues the same tracker run."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow records (a server URL, ``sqlite:///path.db``, ``databricks``); None = MLflow's own default
    (``$MLFLOW_TRACKING_URI``, else a store in the working directory)."""
    completions_every: int = Field(10, ge=0)
    """Every this many steps, a table of completions the step trained on (prompt, completion, reward, the policy
    version that wrote it, actor), decoded with the learner's tokenizer, goes to every tracker and to
    ``reports/completions/step-NNNNNN.jsonl`` in the run folder; 0 = never."""
    completions_rows: int = Field(8, ge=1, le=1000)
    """Rows of each completions table, spread evenly over the step's rows (several groups and actors)."""

    @field_validator("backends")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in TRACKERS:
                close = difflib.get_close_matches(name, TRACKERS, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"unknown backend {name!r}{hint}: the backends are {', '.join(TRACKERS)}")
        return list(dict.fromkeys(value))  # a name twice is one tracker
