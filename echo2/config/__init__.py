"""The one config model tree of echo2, loaded from YAML (with ``base:`` files), ``ECHO2_SET__...`` variables and
``--set key=value`` overrides (``loading.py``).

Every field is documented in place (the docstring under it). Unknown keys are errors, so a typo
never silently falls back to a default. ``load_config`` turns any problem into a single
``ConfigError`` line that names the field. The sections of the task, engine and fleet planes live
in ``tasks.py``, ``engines.py`` and ``fleet.py``; everything is importable from ``echo2.config``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from echo2.config import loading
from echo2.config._base import ConfigError, _Section, check_device_name
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
from echo2.data.site import store_site

__all__ = [
    "ArithmeticTaskConfig", "AwsPricesConfig", "BroadcastConfig", "CallStationOpponentConfig",
    "CheckpointOpponentConfig", "CodeColumnsConfig", "CodeLimitsConfig", "CodeTaskConfig", "Config", "ConfigError",
    "EngineConfig", "EquityOpponentConfig", "EvalConfig",
    "FleetConfig", "FleetConfigBase", "LocalFleetConfig", "MathColumnsConfig", "MathTaskConfig", "ModelConfig",
    "OpponentConfig", "PluginTaskConfig", "PokerTaskConfig",
    "PriceSourceConfig", "RandomOpponentConfig", "RewardFnColumnsConfig", "RewardFnTaskConfig", "RolloutConfig",
    "RunConfig", "SkyPilotFleetConfig",
    "SkyPilotPricesConfig", "SnapshotPricesConfig", "StoreConfig", "TaskConfig", "TrainConfig",
    "TransformersEngineConfig", "VllmEngineConfig", "apply_overrides", "config_from_dict", "config_schema",
    "dump_config", "environment_overrides", "format_validation_error", "frozen_changes", "load_config",
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
    micro_batch_tokens: int = Field(8192, ge=1)
    """Tokens per forward/backward: a step's sequences (prompt + completion - 1 tokens each) are packed
    first-fit decreasing into micro-batches of at most this many tokens, several sequences to a row with no
    padding; gradients accumulate over the step (``learner/packing.py``). A sequence longer than this is
    never split: it gets a micro-batch of its own (so peak memory follows the longest sequence, not this).
    With ``attention: varlen`` (the default) attention runs per sequence; with ``sdpa`` a pack's attention is one
    dense masked product over all its tokens, so its cost grows with the square of the pack's size. Replaces
    ``micro_batch_size`` (a count of rows)."""
    attention: Literal["auto", "sdpa", "varlen"] = "auto"
    """Attention in the learner's packed forwards (``learner/attention.py``). varlen: each sequence of a pack
    attends to itself alone, with no pack x pack mask (torch's variable-length flash attention on a GPU in bf16;
    sdpa sequence by sequence elsewhere, exact). sdpa: transformers' own, a dense block-diagonal mask over the pack,
    whose work grows with the square of the pack. auto: varlen."""
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
    device: str = "auto"
    """Where the learner computes (``echo2/devices.py``): ``auto`` (each rank's GPU where CUDA is available, else the
    CPU), ``cpu``, ``cuda`` or ``cuda:N``. The model, the KL reference, the audit's copy, evaluation and every pack
    live there. ``cuda`` where CUDA is not available is refused in one line."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the learner's forward and backward (and of its evaluation and audit). bfloat16: bf16 matmuls
    with fp32 master weights and fp32 AdamW state (sharded, as on any GPU: FSDP2's MixedPrecisionPolicy, bf16
    parameters in compute, fp32 gradient reduction; one process on a CPU: torch.autocast around the forward); the
    log-softmax of the head stays fp32 either way. float32 on a GPU uses TF32 matmuls. auto: bfloat16 on a GPU,
    float32 on a CPU. What is published is ``publish_dtype``, unchanged by this."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (torch's
    non-reentrant checkpoint, per layer): activation memory of one layer instead of all, for about one more
    forward pass of compute. Parameter names, published weights and checkpoints are unchanged."""
    logprob_chunk_tokens: int = Field(1024, ge=1)
    """Tokens whose logits (tokens x vocabulary, fp32) exist at once when the learner computes log-probabilities
    (``learner/logprobs.py``): the head's memory is about 3 x this x vocabulary x 4 bytes, whatever the batch."""
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
    """Train a LoRA adapter of this rank instead of all weights (0 = full fine-tuning); only the adapter is
    published."""
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
    """Largest safetensors shard of a published version (delta shards too), and largest file of a rank's
    checkpoint shard (``learner/sharded.py``: a file is built in memory before its upload, so a checkpoint
    adds about this much to a rank's host memory; one tensor shard larger than it gets a file of its own)."""
    max_rollout_file_mb: float = Field(64.0, gt=0)
    """A rollout file larger than this is quarantined before it is downloaded or decoded."""
    max_invalid_files_per_actor: int = Field(3, ge=1)
    """An actor with this many rollout files that are malformed (unreadable, over the size limit, failing
    validation, more groups than rollout.groups_per_batch) or from a version the learner has not published
    is banned: expelled from the fleet, its relay token revoked, its later files quarantined unread. No
    honest actor writes such a file; a file the task could not grade the same way everywhere (a grading
    timeout) does not count here (see ``max_ungradable_files_per_actor``)."""
    max_ungradable_files_per_actor: int = Field(5, ge=0)
    """An actor with more than this many rollout files the task could not grade the same way everywhere
    (a reply that timed out on the learner's grader, a poker replay parting at a near tie), when they are
    also more than ``max_ungradable_fraction`` of its files the learner judged, is banned like one with
    malformed files. Each such file costs the learner up to ``task.grade_file_max_timeouts`` x
    ``task.grade_timeout_s`` of grading, so files of one hanging reply each would otherwise cost that for
    ever, unbanned; an honest actor's are rare accidents (a timeout on a reply that grades in about 2 ms,
    a replay parting after a near tie), far below both bounds (``learner/collector.py``)."""
    max_ungradable_fraction: float = Field(0.25, ge=0, le=1)
    """The share of an actor's judged files that its ungradable files must also exceed for a ban
    (``max_ungradable_files_per_actor``): a long honest run's few accidents never add up to a ban."""
    max_prompt_tokens: int = Field(4096, ge=1)
    """Longest prompt a rollout may carry (prompts are also re-derived from the task and compared)."""
    audit_fraction: float = Field(0.1, ge=0, le=1)
    """Share of each actor's rollout files (besides its first, always) whose behavior logprobs the learner
    recomputes under the claimed version (``learner/behavior_audit.py``); 0 = no audit, and no copies of
    recent versions kept (each is a copy of the model in memory: S + 1 of them)."""
    audit_max_gap: float = Field(0.15, gt=0)
    """Mean |claimed - recomputed| behavior logprob per policy token above which an actor is banned (honest
    fp32 actors differ by ~1e-6, bf16 ones by a few hundredths)."""
    nproc: int = Field(1, ge=1)
    """Learner processes (torchrun on one node): the policy is sharded over them with FSDP, each takes
    a token-balanced share of the packed micro-batches, rank 0 runs the flow, reads rollouts and publishes
    (``learner/distributed.py``)."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of FSDP's collectives in a learner with nproc > 1 (auto: nccl on GPUs, gloo on
    CPUs; gloo with the learner on GPUs is refused). Announcements and metric sums always go over a gloo group of
    their own (``learner/process_group.py``)."""
    market: Literal["on-demand", "spot"] = "on-demand"
    """The learner's machine. ``spot``: a preemption notice (SIGTERM, or the metadata notice of
    ``train.preemption_source``) checkpoints at once and leaves the actors running, waiting for the relaunched
    learner (a SkyPilot managed job, or a retried Prefect flow run, resuming the same run id) to adopt them;
    the cost report bills the learner at spot prices and counts the gap (``docs/reliability.md``).
    ``on-demand``: SIGTERM stops the run and its fleet, as a user's Ctrl-C does."""
    preemption_source: Literal["off", "aws", "gcp", "auto"] = "off"
    """Poll the learner machine's instance metadata for a spot notice (as ``rollout.preemption_source`` does
    for actors); only read with ``train.market: spot``. ``$ECHO2_PREEMPTION_SOURCE`` overrides it."""
    preemption_poll_s: float = Field(5.0, gt=0)
    """How often the learner's preemption watcher asks the metadata."""
    sigterm_notice_s: float = Field(30.0, gt=0)
    """Seconds a SIGTERM gives a spot learner before its machine goes (SkyPilot's, Kubernetes' and Prefect's usual
    grace is 30 s; the learner-reclaim scenario sends 2): it finishes the step under way only if the step and a
    checkpoint fit in them (``echo2/learner/notice.py``). Only read with ``train.market: spot``."""
    nnodes: int = Field(1, ge=1)
    """Nodes of the learner, each running ``nproc`` processes: every node runs ``echo2 learner CONFIG --nnodes N
    --node-rank R --rdzv-endpoint HOST:PORT`` (torchrun's static rendezvous at node 0, ``learner/torchrun.py``);
    node 0 resolves the run and runs the flow, the others only take their share of the arithmetic. ``echo2 run``
    starts one node and refuses more."""

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device_name(value)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "micro_batch_size" in data:
            raise ValueError("train.micro_batch_size (rows per micro-batch) was replaced by train.micro_batch_tokens "
                             "(tokens per packed micro-batch; default 8192): remove micro_batch_size and set "
                             "micro_batch_tokens instead")
        return data


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
    """Learner: GRPO, staleness, publishing, checkpoints."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out greedy evaluation."""
    fleet: FleetConfig = Field(default_factory=LocalFleetConfig)
    """Actor fleet: ``{backend: local, ...}`` (the default) or ``{backend: skypilot, ...}``, the shared fields and
    the backend's own side by side."""
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
        if self.fleet.backend == "skypilot" and not self.store.url.startswith(("s3://", "gs://", "gcs://")):
            raise ValueError(f"fleet.backend skypilot needs a store every actor can reach (s3:// or gs://), "
                             f"got store.url {self.store.url!r}")
        if self.fleet.backend == "skypilot" and self.fleet.credentials_role_arn and not self.store.url.startswith("s3://"):
            raise ValueError(f"fleet.credentials_role_arn mints S3 credentials, but store.url is "
                             f"{self.store.url!r} (GCS: see infra/iam/README.md)")
        if self.train.nproc * self.train.nnodes > 1 and self.train.lora_rank > 0:
            raise ValueError("train.nproc > 1 or train.nnodes > 1 shards full fine-tuning only: LoRA "
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
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, positions)) from None


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
