"""The one config model tree of echo2, loaded from YAML with ``--set key=value`` overrides.

Every field is documented in place (the docstring under it). Unknown keys are errors, so a typo
never silently falls back to a default. ``load_config`` turns any problem into a single
``ConfigError`` line that names the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo2.errors import Echo2InputError


class ConfigError(Echo2InputError):
    """The config file or an override is invalid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunConfig(_Section):
    id: str | None = None
    """Run id: the folder ``{store}/runs/{id}``. Generated from the name and time when empty."""
    name: str = "run"
    """Human-readable name; the prefix of generated run ids."""
    seed: int = 0
    """Seed of the learner and (offset by actor index) of every actor."""


class StoreConfig(_Section):
    url: str = "."
    """Object store root: a path or ``file://``, ``memory://``, ``s3://bucket/prefix``. Runs live under ``{url}/runs/``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """fsspec storage options (for S3: ``endpoint_url``, ``client_kwargs``...). Credentials come from the environment."""


class ModelConfig(_Section):
    name: str = "smollm2-135m-instruct"
    """The policy to train: a local Hugging Face directory, a Hugging Face id, or the embedded ``smollm2-135m-instruct``."""


class TaskConfig(_Section):
    name: Literal["arithmetic"] = "arithmetic"
    """Which task (``echo2/tasks/``) supplies prompts and rewards."""
    digits: int = Field(1, ge=1, le=9)
    """Operands have at most this many decimal digits."""
    eval_size: int = Field(50, ge=1)
    """Held-out problems for greedy evaluation; never used for training."""


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
    num_threads: int | None = Field(1, ge=1)
    """torch threads per actor process (None = torch's default)."""
    engine: Literal["transformers"] = "transformers"
    """Inference engine of the actors (``echo2/rollout/``)."""
    preemption_source: Literal["off", "aws", "gcp"] = "off"
    """Poll this cloud's instance metadata for a spot preemption notice (AWS IMDSv2 spot/instance-action,
    GCP instance/preempted) and stop cleanly on one; ``$ECHO2_PREEMPTION_SOURCE`` on the actor's machine
    overrides it (the SkyPilot backend sets it per cloud). Off: no metadata request is ever made; SIGTERM
    is a notice either way (``echo2/rollout/preemption.py``)."""
    preemption_endpoint: str | None = None
    """Base URL of the metadata service (None: the cloud's own, 169.254.169.254 or metadata.google.internal);
    ``$ECHO2_PREEMPTION_ENDPOINT`` overrides it."""
    preemption_poll_s: float = Field(5.0, gt=0)
    """How often the preemption watcher asks the metadata (AWS warns ~120 s ahead, GCP ~30 s)."""


class TrainConfig(_Section):
    max_steps: int = Field(16, ge=1)
    """Optimizer steps of the run; policy version v = optimizer steps taken."""
    groups_per_step: int = Field(8, ge=1)
    """Prompt groups per optimizer step (whole rollout files are taken until this many are in)."""
    staleness: int = Field(2, ge=0)
    """S: a rollout of version v is used at learner version t only if t - v <= S (0 = synchronous)."""
    publish_every: int = Field(1, ge=1)
    """kappa: publish a policy version every this many steps."""
    checkpoint_every: int = Field(5, ge=1)
    """Write a resumable checkpoint every this many steps (and at the end)."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward; gradients accumulate over the step."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """epsilon_low: the ratio pi/mu is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """epsilon_high: the ratio pi/mu is clipped above at 1 + clip_high (DAPO's clip-higher)."""
    is_cap: float = Field(3.0, gt=1)
    """C: truncation of the importance ratio for negative advantages (dual clip); bounds stale-rollout variance."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the initial policy (0 = no reference model is loaded)."""
    scale_rewards: bool = True
    """Divide group-centered rewards by the group std (GRPO); False keeps only the centering (Dr. GRPO)."""
    num_threads: int | None = Field(None, ge=1)
    """torch threads of the learner (None = torch's default)."""
    rollout_timeout_s: float = Field(900.0, gt=0)
    """Fail the run when no usable rollout arrives for this long."""
    poll_seconds: float = Field(0.25, gt=0)
    """How often a learner waiting for rollouts lists the store again (each list is a store request)."""
    keep_versions: int = Field(1, ge=1)
    """Newest published versions always kept; older ones are deleted once no rollout of them can be used (v < t - S)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted after a newer one is committed."""
    lora_rank: int = Field(0, ge=0)
    """Train a LoRA adapter of this rank instead of all weights (0 = full fine-tuning); only the adapter is published."""
    lora_alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator: the update is (lora_alpha / lora_rank) * B @ A."""
    lora_target_modules: str | list[str] = "all-linear"
    """Modules that get adapters (peft's target_modules)."""
    publish_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of published weights. bfloat16 halves transfer size; the clipped ratio absorbs the mismatch."""
    publish_delta: bool = False
    """Publish each version as a sparse delta against the previous one: only the elements whose bits
    changed travel, bit-exact, with the sha256 of every rebuilt tensor in the signed manifest
    (``echo2/data/delta.py``). Pays with ``publish_dtype: bfloat16``, where an RL step leaves most
    elements' bits as they were; a float32 copy changes almost everywhere and ends up in keyframes.
    No effect with ``lora_rank > 0``: adapter versions are small already."""
    keyframe_every: int = Field(16, ge=1)
    """With publish_delta: a full version (keyframe) at version 0, at the first publish after a resume,
    once this many versions have passed since the last keyframe, and whenever the deltas since it would
    outgrow one full version. An actor that joins late downloads the newest keyframe and the deltas
    after it; garbage collection keeps every version such a chain needs."""
    shard_mb: int = Field(256, ge=1)
    """Largest safetensors shard of a published version (delta shards too)."""
    max_rollout_file_mb: float = Field(64.0, gt=0)
    """A rollout file larger than this is quarantined before it is downloaded or decoded."""
    max_prompt_tokens: int = Field(4096, ge=1)
    """Longest prompt a rollout may carry (prompts are also re-derived from the task and compared)."""


class EvalConfig(_Section):
    before: bool = True
    """Greedy accuracy on the held-out set before training."""
    after: bool = True
    """Greedy accuracy on the held-out set after training."""
    max_new_tokens: int = Field(24, ge=1)
    """Longest greedy completion in evaluation."""
    batch_size: int = Field(50, ge=1)
    """Problems per greedy generation batch."""


class SnapshotPricesConfig(_Section):
    source: Literal["snapshot"] = "snapshot"
    """The dated catalog shipped under ``infra/prices/`` (offline, reproducible)."""
    catalog: str | None = None
    """Price catalog CSV (None = the shipped ``infra/prices/gpu-offers-2026-11.csv``)."""


class AwsPricesConfig(_Section):
    source: Literal["aws"]
    """Live spot prices from EC2 (``describe_spot_price_history``, boto3), joined with the snapshot."""
    regions: list[str] | None = None
    """Regions to ask for spot prices (None = every AWS region of the snapshot catalog)."""
    endpoint_url: str | None = None
    """EC2 endpoint (None = AWS's own; tests point it at moto). Credentials come from the environment."""
    catalog: str | None = None
    """Snapshot that supplies each instance type's GPUs and on-demand price (None = the shipped one)."""


class SkyPilotPricesConfig(_Section):
    source: Literal["skypilot"]
    """SkyPilot's catalog (``sky.catalog.list_accelerators``); needs the ``cloud`` extra."""
    clouds: list[str] | None = None
    """SkyPilot clouds to list (None = every cloud of its catalog). Needs the ``cloud`` extra."""


PriceSourceConfig = Annotated[SnapshotPricesConfig | AwsPricesConfig | SkyPilotPricesConfig, Field(discriminator="source")]
"""Where offers and prices come from (``echo2/fleet/price_sources.py``): ``snapshot`` (the dated
catalog under ``infra/prices/``), ``aws`` (live spot prices, boto3) or ``skypilot`` (its catalog)."""


class BroadcastConfig(_Section):
    mode: Literal["relay", "store"] = "relay"
    """``relay``: actors pass chunks along a relay tree, roots read the store; ``store``: every actor reads the store."""
    chunk_mb: float = Field(8.0, gt=0)
    """Chunk size: the unit of verification (sha256 in the manifest), transfer and pipelining."""
    fanout: int = Field(1, ge=1)
    """Children per relay node (1 = a chain: every node uploads each chunk once)."""
    roots: int = Field(1, ge=1)
    """Relay nodes that read from the store."""
    expected_mbit: float = Field(200.0, gt=0)
    """Link rate a healthy parent should sustain."""
    min_rate_fraction: float = Field(0.2, gt=0, le=1)
    """A parent slower than this fraction of expected_mbit on a chunk is left for the next source."""
    pipeline_wait_s: float = Field(30.0, gt=0)
    """How long a relay holds a request for a chunk it is still receiving."""
    window: int = Field(4, ge=1)
    """Chunk requests in flight to the store (from a peer, chunks come one at a time)."""
    host: str = "127.0.0.1"
    """Address the relay server binds (0.0.0.0 on cloud VMs)."""
    advertise_host: str | None = None
    """Address peers use to reach this relay (default: host)."""
    port: int = Field(0, ge=0, le=65535)
    """Relay port (0 = any free port)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """How often an actor refreshes its record under peers/."""
    peer_timeout_s: float = Field(10.0, gt=0)
    """A peer whose heartbeat is older than this is not given children."""


class LocalFleetConfig(_Section):
    reclaim_rate: float = Field(0.0, ge=0)
    """Reclaim injector: expected reclaims per actor per minute (Poisson), as a spot market would
    take machines away; 0 = never. Each reclaimed actor is replaced by the fleet manager."""
    reclaim_burst: float = Field(0.0, ge=0, le=1)
    """Probability that a reclaim takes every running actor at once (spot pools are reclaimed in bursts)."""
    notice_s: float = Field(2.0, ge=0)
    """Notice a reclaimed actor gets: SIGTERM, then SIGKILL this many seconds later if it is still there."""
    seed: int = 0
    """Seed of the reclaim injector, so a chaos run can be repeated."""


class FleetConfig(_Section):
    backend: Literal["local"] = "local"
    """Where actors run: ``local`` = OS processes on this machine."""
    local: LocalFleetConfig = Field(default_factory=LocalFleetConfig)
    """The local backend: processes on this machine, and its reclaim injector."""
    actors: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    """Number of actors, or ``auto``: start ``min_actors``, measure the learner step and the actors'
    batch time over the first steps, and grow to the smallest fleet the capacity model
    (``echo2/fleet/capacity.py``) predicts keeps the learner busy ``target_utilization`` of the time,
    within ``max_actors`` and ``max_usd_per_hour``."""
    min_actors: int = Field(1, ge=1)
    """With ``actors: auto``: the fleet the run starts with, before anything is measured."""
    max_actors: int = Field(4, ge=1)
    """With ``actors: auto``: never more actors than this (on one machine, actors share its cores)."""
    target_utilization: float = Field(0.95, gt=0, le=1)
    """With ``actors: auto``: the learner utilization the fleet is sized for."""
    max_restarts: int = Field(3, ge=0)
    """A crashed actor is replaced up to this many times per slot (a reclaimed one always is)."""
    max_usd_per_hour: float | None = Field(None, gt=0)
    """Budget: the fleet never runs workers costing more than this per hour (None = no cap; local actors cost 0)."""
    prices: PriceSourceConfig = Field(default_factory=SnapshotPricesConfig)
    """Price source for activation and cost figures: ``{source: snapshot|aws|skypilot, ...}``."""


class Config(_Section):
    """A whole echo2 run."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Identity and seed of the run."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """Object store that holds the run: the only channel between planes."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy model."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """Prompts, rewards and the held-out set."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Actors: sampling and flow control."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Learner: GRPO, staleness, publishing, checkpoints."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out greedy evaluation."""
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    """Actor fleet."""
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    """How policy versions reach the actors."""

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.rollout.groups_per_batch > self.train.groups_per_step:
            raise ValueError(
                f"rollout.groups_per_batch ({self.rollout.groups_per_batch}) must not exceed "
                f"train.groups_per_step ({self.train.groups_per_step})"
            )
        if self.train.staleness < self.train.publish_every - 1:
            raise ValueError(
                f"train.staleness ({self.train.staleness}) must be at least train.publish_every - 1 "
                f"({self.train.publish_every - 1}): a step needs rollouts of a version that is never published"
            )
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


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> (``a.b``, value parsed as a YAML scalar/list/mapping)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply ``key.path=value`` overrides to a raw config mapping, in place."""
    for text in overrides:
        key, value = parse_override(text)
        _set_path(data, key, value)
    return data


def format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif "input" in err and err["type"] != "missing" and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}")
    return f"invalid config {source}: " + "; ".join(parts)


def config_from_dict(data: dict, source: str = "(dict)") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load YAML ``path`` (None = all defaults) and apply ``key=value`` overrides."""
    data: dict = {}
    source = "(defaults)"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {source} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {source} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {source} must hold a mapping at the top level")
        data = loaded or {}
    apply_overrides(data, overrides)
    return config_from_dict(data, source)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
