"""The one config model tree of echo2, loaded from YAML (with ``base:`` files), ``ECHO2_SET__...`` variables and
``--set key=value`` overrides (``loading.py``).

Every field is documented in place (the docstring under it). Unknown keys are errors, so a typo
never silently falls back to a default. ``load_config`` turns any problem into a single
``ConfigError`` line that names the field. The sections of the task, engine and fleet planes live
in ``tasks.py``, ``engines.py`` and ``fleet.py``; the learner's in ``train.py`` (``train``, ``publish``, ``trust``,
and ``MOVED``: where each field of the old flat ``train`` section went) and ``learner.py`` (``learner``); the
experiment trackers' in ``tracking.py`` (``logging``); everything is importable from ``echo2.config``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from echo2.config import loading
from echo2.config._base import ConfigError, _Section
from echo2.config.broadcast import BroadcastConfig
from echo2.config.engines import EngineConfig, TransformersEngineConfig, VllmEngineConfig
from echo2.config.fleet import (
    AwsPricesConfig,
    FleetConfig,
    FleetConfigBase,
    LocalFleetConfig,
    PriceSourceConfig,
    SkyPilotFleetConfig,
    SkyPilotPricesConfig,
    SnapshotPricesConfig,
)
from echo2.config.learner import LearnerConfig
from echo2.config.loading import Positions, environment_overrides, parse_override, set_path
from echo2.config.plugin_tasks import PluginTaskConfig, RewardFnColumnsConfig, RewardFnTaskConfig
from echo2.config.tasks import (
    ArithmeticTaskConfig,
    CallStationOpponentConfig,
    CheckpointOpponentConfig,
    CodeColumnsConfig,
    CodeLimitsConfig,
    CodeTaskConfig,
    EquityOpponentConfig,
    MathColumnsConfig,
    MathTaskConfig,
    OpponentConfig,
    PokerTaskConfig,
    RandomOpponentConfig,
    TaskConfig,
)
from echo2.config.tracking import LoggingConfig
from echo2.config.train import MOVED, PublishConfig, TrainConfig, TrustConfig, moved_keys, moved_to, upgraded
from echo2.data.site import store_site

__all__ = [
    "ArithmeticTaskConfig", "AwsPricesConfig", "BroadcastConfig", "CallStationOpponentConfig",
    "CheckpointOpponentConfig", "CodeColumnsConfig", "CodeLimitsConfig", "CodeTaskConfig", "Config", "ConfigError",
    "EngineConfig", "EquityOpponentConfig", "EvalConfig", "LearnerConfig", "LoggingConfig", "MOVED",
    "FleetConfig", "FleetConfigBase", "LocalFleetConfig", "MathColumnsConfig", "MathTaskConfig", "ModelConfig",
    "OpponentConfig", "PluginTaskConfig", "PokerTaskConfig", "PublishConfig",
    "PriceSourceConfig", "RandomOpponentConfig", "RewardFnColumnsConfig", "RewardFnTaskConfig", "RolloutConfig",
    "RunConfig", "SkyPilotFleetConfig",
    "SkyPilotPricesConfig", "SnapshotPricesConfig", "StoreConfig", "TaskConfig", "TrainConfig", "TrustConfig",
    "TransformersEngineConfig", "VllmEngineConfig", "apply_overrides", "config_from_dict", "config_schema",
    "config_from_run", "dump_config", "environment_overrides", "format_validation_error", "frozen_changes",
    "load_config",
    "overridden_config", "parse_override",
]


class RunConfig(_Section):
    id: str | None = None
    """Run id: the folder ``{store}/runs/{id}``. Generated from the name and time when empty."""
    name: str = "run"
    """Human-readable name; the prefix of generated run ids."""
    seed: int = 0
    """Seed of the learner and (offset by actor index) of every actor."""


class StoreConfig(_Section):
    url: str = "."
    """Object store root: a path or ``file://``, ``memory://``, ``s3://bucket/prefix``. Runs live under
    ``{url}/runs/``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """fsspec storage options (for S3: ``endpoint_url``, ``client_kwargs``...). Credentials come from the
    environment."""
    retry_s: float = Field(120.0, gt=0)
    """How long a store operation retries transient errors (connection lost, 503 SlowDown, 500) before it
    fails: the learner and every actor ride out an outage of the store this long."""
    provider: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Where the store lives, for traffic: the provider as the price catalog names it (``aws``, ``gcp``...,
    ``echo2 prices --json``). The cost report prices what actors read from the store with
    ``fleet/providers.py``'s egress table from here to each actor's placement, and the relay plan gives every
    other (provider, region) one root that reads the store. None: unknown (store reads unpriced, and every
    (provider, region) of the fleet gets ``broadcast.roots`` roots)."""
    region: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """The store's region as the catalog names it (``us-east-1``, ``us-central1``); needs ``store.provider``."""

    @model_validator(mode="after")
    def _region_needs_provider(self) -> "StoreConfig":
        if self.region is not None and self.provider is None:
            raise ValueError("store.region needs store.provider (where the store lives: provider and region)")
        return self

    @property
    def site(self) -> tuple[str, str] | None:
        """(provider, region) of the store, lower-case provider; region "?" when only the provider is known."""
        return store_site(self.provider, self.region)


class ModelConfig(_Section):
    name: str = "smollm2-135m-instruct"
    """The policy to train: a local Hugging Face directory, a Hugging Face id, or the embedded
    ``smollm2-135m-instruct``. A Hugging Face id is downloaded as published (``echo2/models.py``: every file a
    loader reads, other frameworks' formats left out) into the Hugging Face cache of the learner's machine;
    ``$HF_TOKEN`` there for a gated or private repo. Actors never reach the hub: the model's config and tokenizer
    files travel with every policy version."""
    revision: str | None = None
    """With a Hugging Face id: the branch, tag or commit to load (None = ``main``). The learner resolves it to a
    commit once, when the run is created, and writes that commit here in ``run.json``: a resume and the learner's
    other processes load that commit even if the branch has moved since (a resume keeps it whatever it is told).
    ``echo2 eval`` of the same id reads it from its ``--config`` or ``--set model.revision=...``."""


class RolloutConfig(_Section):
    group_size: int = Field(8, ge=2)
    """G: completions sampled per prompt; GRPO normalizes rewards within each group."""
    groups_per_batch: int = Field(8, ge=1)
    """Prompts per rollout file: each actor batch writes groups_per_batch x group_size rows."""
    max_new_tokens: int = Field(24, ge=1)
    """Longest completion; longer ones are cut (finish_reason "length")."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the behavior logprobs are those of this tempered distribution."""
    max_pending_batches: int = Field(2, ge=1)
    """Flow control: actors pause while this many usable, unconsumed batches wait in the store (never
    fewer than one learner step needs: ceil(train.groups_per_step / groups_per_batch))."""
    poll_seconds: float = Field(0.5, gt=0)
    """How often an idle actor looks for a new policy version or free capacity."""
    refill: bool = False
    """Keep the engine full across batches: a new prompt group starts as soon as an earlier one finishes,
    instead of each batch waiting for its slowest completion (``echo2/rollout/refill.py``). Single-turn tasks
    only (a multi-turn task's episodes keep batch by batch); a new policy version is swapped in once the
    groups in flight finish on the weights they started with. Off by default: it changes which groups share a
    file, and only the transformers engine's form of it is tested here (docs/benchmarks.md)."""
    num_threads: int | None = Field(1, ge=1)
    """torch threads per actor process (None = torch's default)."""
    engine: EngineConfig = Field(default_factory=TransformersEngineConfig)
    """Inference engine of the actors (``echo2/rollout/``, built by ``make_engine``): ``{kind: transformers, ...}``
    or ``{kind: vllm, ...}``; a bare name (``engine: vllm``) is that engine with its defaults."""
    preemption_source: Literal["off", "aws", "gcp", "auto"] = "off"
    """Poll this cloud's instance metadata for a spot preemption notice (AWS IMDSv2 spot/instance-action,
    GCP instance/preempted) and stop cleanly on one; ``$ECHO2_PREEMPTION_SOURCE`` on the actor's machine
    overrides it (the SkyPilot task sets ``auto``: the cloud SkyPilot launched the machine on). Off: no
    metadata request is ever made; SIGTERM is a notice either way (``echo2/preemption.py``)."""
    preemption_endpoint: str | None = None
    """Base URL of the metadata service (None: the cloud's own, 169.254.169.254 or metadata.google.internal);
    ``$ECHO2_PREEMPTION_ENDPOINT`` overrides it."""
    preemption_poll_s: float = Field(5.0, gt=0)
    """How often the preemption watcher asks the metadata (AWS warns ~120 s ahead, GCP ~30 s)."""

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_shorthand(cls, value: Any) -> Any:
        """``engine: vllm`` means ``{kind: vllm}``; a mapping without ``kind`` is the transformers engine's."""
        if isinstance(value, str):
            return {"kind": value}
        if isinstance(value, dict) and "kind" not in value:
            return {"kind": "transformers", **value}
        return value


def backlog_bound(max_pending_batches: int, groups_per_step: int, groups_per_batch: int) -> int:
    """Batches the fleet may have waiting unconsumed (Q): ``rollout.max_pending_batches``, but never fewer than
    one step needs (``ceil(train.groups_per_step / rollout.groups_per_batch)``), or the learner would wait forever
    for a step the fleet stopped short of. Actors hold to it, the learner tells them with it, and the capacity model
    simulates it, so all three call this one function."""
    return max(max_pending_batches, -(-groups_per_step // groups_per_batch))


class EvalConfig(_Section):
    before: bool = True
    """Evaluate on the held-out set before training (greedy accuracy; poker: bb/100 and illegal-action rate)."""
    after: bool = True
    """Evaluate on the held-out set after training."""
    every: int = Field(0, ge=0)
    """Also evaluate every this many steps (0 = only before and after)."""
    max_new_tokens: int = Field(24, ge=1)
    """Longest greedy completion in evaluation (multi-turn tasks: the policy's tokens in one episode,
    like rollout.max_new_tokens)."""
    batch_size: int = Field(50, ge=1)
    """Sequences per generation batch."""
    k: int = Field(1, ge=1)
    """pass@k: sampled replies per held-out problem (1 = greedy pass@1 only)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the pass@k replies."""


class Config(_Section):
    """A whole echo2 run."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Identity and seed of the run."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """Object store that holds the run: the only channel between planes."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy model."""
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    """Prompts, rewards and the held-out set."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Actors: sampling and flow control."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Learner: the loss, the optimizer, memory, staleness and checkpoints."""
    publish: PublishConfig = Field(default_factory=PublishConfig)
    """What a policy version is: how often, in which dtype, whole or as deltas, how many are kept."""
    trust: TrustConfig = Field(default_factory=TrustConfig)
    """What the learner accepts from actors: rollout file bounds, spot checks, bans."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """The learner's processes, nodes, device, market and preemption."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out greedy evaluation."""
    fleet: FleetConfig = Field(default_factory=LocalFleetConfig)
    """Actor fleet: ``{backend: local, ...}`` (the default) or ``{backend: skypilot, ...}``, the shared fields and
    the backend's own side by side."""
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    """How policy versions reach the actors."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Experiment trackers (TensorBoard, W&B, MLflow) and the completions tables the learner writes."""

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.rollout.groups_per_batch > self.train.groups_per_step:
            raise ValueError(
                f"rollout.groups_per_batch ({self.rollout.groups_per_batch}) must not exceed "
                f"train.groups_per_step ({self.train.groups_per_step})"
            )
        if self.train.staleness < self.publish.every - 1:
            raise ValueError(
                f"train.staleness ({self.train.staleness}) must be at least publish.every - 1 "
                f"({self.publish.every - 1}): a step needs rollouts of a version that is never published"
            )
        if self.fleet.backend == "skypilot" and not self.store.url.startswith(("s3://", "gs://", "gcs://")):
            raise ValueError(f"fleet.backend skypilot needs a store every actor can reach (s3:// or gs://), "
                             f"got store.url {self.store.url!r}")
        if self.fleet.backend == "skypilot" and self.fleet.credentials_role_arn and not self.store.url.startswith("s3://"):
            raise ValueError(f"fleet.credentials_role_arn mints S3 credentials, but store.url is "
                             f"{self.store.url!r} (GCS: see infra/iam/README.md)")
        if self.learner.nproc * self.learner.nnodes > 1 and self.train.lora_rank > 0:
            raise ValueError("learner.nproc > 1 or learner.nnodes > 1 shards full fine-tuning only: LoRA "
                             "(train.lora_rank > 0) runs in one process")
        if self.fleet.backend == "skypilot" and self.broadcast.tls == "off":
            raise ValueError("broadcast.tls off is refused with fleet.backend skypilot: its relays listen on a port "
                             "open to the internet (use auto or on)")
        if self.fleet.backend == "skypilot" and not self.fleet.credentials_role_arn:
            raise ValueError("fleet.backend skypilot needs fleet.credentials_role_arn: actors run on "
                             "machines we do not own and get only scoped, expiring store credentials "
                             "(infra/iam/README.md)")
        if self.fleet.backend == "skypilot" and (broad := self.fleet.broad_vm_identity()):
            raise ValueError(broad)
        if self.fleet.min_actors > self.fleet.max_actors:
            raise ValueError(f"fleet.min_actors ({self.fleet.min_actors}) must not exceed fleet.max_actors "
                             f"({self.fleet.max_actors})")
        return self


FROZEN_ON_RESUME = ("run.", "model.", "task.", "rollout.", "broadcast.", "train.staleness", "train.lora_")
"""Fields that actors read from ``run.json`` (or that the checkpoint depends on). ``run.json`` is
written once, so a resumed run cannot change them: the learner and its actors would disagree."""


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return out


def frozen_changes(original: Config, resumed: Config) -> list[str]:
    """Dotted fields a resume would change although actors read them (see ``FROZEN_ON_RESUME``)."""
    before = _flatten(original.model_dump(mode="json"))
    after = _flatten(resumed.model_dump(mode="json"))
    return sorted(k for k in after if k.startswith(FROZEN_ON_RESUME) and before.get(k) != after[k])


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply ``key.path=value`` overrides to a raw config mapping, in place."""
    for text in overrides:
        key, value = parse_override(text)
        set_path(data, key, value)
    return data


def format_validation_error(exc: ValidationError, source: str, positions: Positions | None = None) -> str:
    return loading.format_validation_error(exc, source, Config, positions)


def config_from_dict(data: dict, source: str = "(dict)", positions: Positions | None = None) -> Config:
    moved = moved_keys(data.get("train"))
    if moved:  # said here, not by TrainConfig._renamed, to name where each old key was written
        at = positions or {}
        raise ConfigError("invalid config " + "; ".join(f"{at.get(('train', key), source)}: {moved_to(key)}"
                                                        for key in moved))
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, positions)) from None


def config_from_run(data: dict, source: str) -> Config:
    """The config a ``run.json`` records, validated; a run created before ``train`` was split into its sections
    (``train.py``'s ``MOVED``) reads as it would have been written now."""
    return config_from_dict(upgraded(data), source)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """Load YAML ``path`` (None = all defaults) with its ``base:`` files, then the ``ECHO2_SET__...`` variables of
    ``environ`` (default: this process's), then the ``key=value`` overrides: a problem is one ``ConfigError`` line
    that says where the key was written (``file:line:column``, the variable, or ``--set``)."""
    data: dict = {}
    positions: Positions = {}
    source = "(defaults)"
    if path is not None:
        source = str(path)
        data, positions = loading.compose(Path(path), Config, source)
    return overridden_config(data, overrides, source, environ, positions)


def overridden_config(data: dict, overrides: list[str] | tuple[str, ...], source: str,
                      environ: Mapping[str, str] | None = None, positions: Positions | None = None) -> Config:
    """A raw config mapping (changed in place) with the ``ECHO2_SET__...`` variables of ``environ`` (default: this
    process's), then the ``key=value`` overrides applied: what ``load_config`` does after the file, and a resumed
    run after its ``run.json``."""
    positions = {} if positions is None else positions
    for key, value, origin in environment_overrides(environ):
        loading.apply_located(data, positions, key, value, origin)
    for text in overrides:
        key, value = parse_override(text)
        loading.apply_located(data, positions, key, value, "--set")
    return config_from_dict(data, source, positions)


def config_schema() -> dict:
    """The JSON schema of a config file, for an editor's YAML language server: the models' own, plus ``base``."""
    schema = Config.model_json_schema()
    schema["properties"] = {loading.BASE_KEY: {
        "title": "Base", "description": "Config files this one builds on (relative to it): merged in order, then "
                                        "this file over them.",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}, **schema["properties"]}
    return schema


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
