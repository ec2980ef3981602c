"""The one config model tree of echo2, loaded from YAML with ``--set key=value`` overrides.

Every field is documented in place (the docstring under it). Unknown keys are errors, so a typo
never silently falls back to a default. ``load_config`` turns any problem into a single
``ConfigError`` line that names the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

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
    retry_s: float = Field(120.0, gt=0)
    """How long a store operation retries transient errors (connection lost, 503 SlowDown, 500) before it
    fails: the learner and every actor ride out an outage of the store this long."""


class ModelConfig(_Section):
    name: str = "smollm2-135m-instruct"
    """The policy to train: a local Hugging Face directory, a Hugging Face id, or the embedded ``smollm2-135m-instruct``."""


class ArithmeticTaskConfig(_Section):
    name: Literal["arithmetic"] = "arithmetic"
    """``arithmetic`` (``echo2/tasks/arithmetic.py``): a + b, reward 1 when the last integer of the reply is the sum."""
    digits: int = Field(1, ge=1, le=9)
    """Operands have at most this many decimal digits."""
    eval_size: int = Field(50, ge=1)
    """Held-out problems for greedy evaluation; never used for training."""


class MathColumnsConfig(_Section):
    question: str = "question"
    """Column holding the problem text (GSM8K: ``question``; DAPO-17k / MATH-style: ``prompt`` or ``problem``)."""
    answer: str = "answer"
    """Column holding the reference: a GSM8K solution ending in ``#### n``, a solution with ``\\boxed{}``
    (MATH: ``solution``), or a bare answer."""


class MathTaskConfig(_Section):
    name: Literal["math"]
    """``math`` (``echo2/tasks/math.py``): word or competition problems, answers checked with math-verify."""
    dataset: str = "generated"
    """Where the problems come from: ``generated`` (the offline, seeded multi-step word-problem generator,
    ``echo2/tasks/word_problems.py``), a local ``.jsonl`` / ``.parquet`` file, an fsspec URI of one
    (``s3://``, ``gs://``, ``memory://``, ``hf://datasets/ORG/NAME/FILE``), or a Hugging Face dataset id
    ``ORG/NAME`` (read through ``hf://`` when a hub is reachable; see ``hf_split``). Actors read it too:
    give a path or URI every actor can open."""
    columns: MathColumnsConfig = Field(default_factory=MathColumnsConfig)
    """Which columns hold the question and the reference answer."""
    answer_format: Literal["auto", "gsm8k", "boxed", "plain"] = "auto"
    """How the gold answer is taken from the answer column: ``gsm8k`` = after the last ``####``, ``boxed``
    = the last ``\\boxed{}``, ``plain`` = the whole cell; ``auto`` picks the first that applies."""
    hf_split: str = "train"
    """With a Hugging Face dataset id: the split whose Parquet files are read (``train``, ``test``)."""
    hf_subset: str | None = None
    """With a Hugging Face dataset id: the subset (config) folder, e.g. ``main`` for openai/gsm8k."""
    eval_dataset: str | None = None
    """Held-out problems from another file or URI (e.g. a test split); None = ``eval_size`` rows of
    ``dataset`` held out by a seeded shuffle."""
    eval_size: int = Field(50, ge=1)
    """Held-out problems for evaluation (taken from ``eval_dataset`` when set); never used for training."""
    limit: int | None = Field(None, ge=1)
    """Read at most this many rows of ``dataset`` (None = all)."""
    steps: int = Field(2, ge=1, le=6)
    """``generated``: arithmetic steps in each word problem (1 = one operation)."""
    max_number: int = Field(20, ge=2, le=10_000)
    """``generated``: largest number a problem states."""
    instruction: str = "Solve the problem step by step. Put the final answer in \\boxed{}."
    """Appended to every question (a new line apart): how the reply must state its answer."""
    format_reward: float = Field(0.0, ge=0, le=1)
    """Bonus added when the reply puts an answer in ``\\boxed{}`` (0 = correctness only)."""
    grade_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit for math-verify on one reply; a reply that takes longer scores 0 (the grader
    runs in a worker process that is killed and restarted, so no reply can hang an actor or the learner)."""


class RandomOpponentConfig(_Section):
    kind: Literal["random"]
    """Picks uniformly among the legal kinds of action (fold when facing a bet, check/call, raise) and a
    uniform raise size, from a generator seeded by the deal: the learner replays it exactly."""
    weight: float = Field(1.0, ge=0)
    """Share of training deals against this opponent (relative to the other opponents' weights)."""


class CallStationOpponentConfig(_Section):
    kind: Literal["call_station"]
    """Always checks or calls; never folds, never raises."""
    weight: float = Field(1.0, ge=0)
    """Share of training deals against this opponent (relative to the other opponents' weights)."""


class EquityOpponentConfig(_Section):
    kind: Literal["equity"]
    """Estimates its hand strength against a random hand (pokerkit's evaluator, seeded Monte Carlo): raises
    the minimum above ``raise_above``, calls when the strength beats the pot odds, else folds (checks when free)."""
    weight: float = Field(1.0, ge=0)
    """Share of training deals against this opponent (relative to the other opponents' weights)."""
    raise_above: float = Field(0.7, ge=0, le=1)
    """Hand strength above which it raises."""
    samples: int = Field(100, ge=10, le=5000)
    """Monte Carlo samples per strength estimate (about 1.3 ms each)."""


class CheckpointOpponentConfig(_Section):
    kind: Literal["checkpoint"]
    """A frozen earlier policy (self-play): a ``from_pretrained`` folder, such as a run's
    ``checkpoints/step-N`` on a local store or the output of ``echo2 export``. It sees the same text the
    policy sees from its own seat and plays greedily; the learner replays it with its own copy."""
    weight: float = Field(1.0, ge=0)
    """Share of training deals against this opponent (relative to the other opponents' weights)."""
    path: str
    """The frozen policy's folder (every actor and the learner must be able to read it)."""


OpponentConfig = Annotated[RandomOpponentConfig | CallStationOpponentConfig | EquityOpponentConfig
                           | CheckpointOpponentConfig, Field(discriminator="kind")]
"""One opponent of the poker task: ``random``, ``call_station``, ``equity`` or ``checkpoint`` (self-play)."""


def _default_opponents() -> list:
    return [RandomOpponentConfig(kind="random"), CallStationOpponentConfig(kind="call_station"),
            EquityOpponentConfig(kind="equity")]


class PokerTaskConfig(_Section):
    name: Literal["poker"]
    """``poker`` (``echo2/tasks/poker.py``): heads-up No-Limit Texas Hold'em on pokerkit, one hand per episode."""
    opponents: list[OpponentConfig] = Field(default_factory=_default_opponents, min_length=1)
    """Who the policy plays: ``{kind: random|call_station|equity|checkpoint, weight: ...}``; training deals
    pick one by weight, evaluation plays every one."""
    starting_stack: int = Field(200, ge=4)
    """Chips each player starts every hand with (200 = 100 big blinds at blinds 1/2)."""
    small_blind: int = Field(1, ge=1)
    """Small blind in chips."""
    big_blind: int = Field(2, ge=2)
    """Big blind in chips; rewards and bb/100 are counted in big blinds."""
    illegal_penalty: float = Field(1.0, ge=0)
    """Big blinds taken off the reward for each malformed or illegal answer (which plays the default
    action: check when free, else fold)."""
    max_action_tokens: int = Field(6, ge=1)
    """Tokens the policy may spend on one decision (rollout.max_new_tokens bounds the whole hand)."""
    max_decisions: int = Field(8, ge=1)
    """Policy decisions per hand; later ones play the default action (check when free, else fold) unpenalized."""
    answer_prefix: str = "My action:"
    """Text the environment writes at the start of each of the policy's replies, so that the next words
    are the action. Measured on SmolLM2-135M-Instruct at temperature 0.7, first decisions: "My action:"
    is followed by a legal action 22 times in 48 (greedy: 2 of 4 deals), "Action:" 12 in 48 (greedy: none),
    "My action is to" 38 in 48 (greedy: all)."""
    seed: int = 0
    """Seed of the deals: training deal n and evaluation deal i are drawn from it."""
    eval_deals: int = Field(16, ge=1)
    """Evaluation deals; each is played twice against every evaluated opponent, with the seats swapped
    (duplicate poker)."""
    eval_opponents: list[str] | None = None
    """Names of the opponents evaluation plays (``call_station``, ``random``, ``equity``, ``checkpoint``; a
    kind listed twice is ``equity-2``...); None = every opponent of ``opponents``."""


def _task_kind(value: Any) -> str | None:
    """The task of a config mapping: its ``name``, ``arithmetic`` when absent (configs written before tasks had names)."""
    if isinstance(value, dict):
        return value.get("name", "arithmetic")
    return getattr(value, "name", None)


TaskConfig = Annotated[
    Annotated[ArithmeticTaskConfig, Tag("arithmetic")] | Annotated[MathTaskConfig, Tag("math")]
    | Annotated[PokerTaskConfig, Tag("poker")],
    Discriminator(_task_kind, custom_error_type="task_name",
                  custom_error_message="task.name must be one of arithmetic, math, poker"),
]
"""Which task (``echo2/tasks/``) supplies prompts, episodes and rewards, chosen by ``task.name``:
``arithmetic``, ``math`` or ``poker``; each has its own fields."""
class TransformersEngineConfig(_Section):
    kind: Literal["transformers"] = "transformers"
    """Hugging Face ``generate`` inside the actor process (``echo2/rollout/transformers_engine.py``): CPU or
    one GPU, nothing to install beyond echo2."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and arithmetic of sampling. bfloat16 samples ~1.6x faster on this CPU and halves memory; the
    behavior logprobs are still taken in fp32 from its logits (they differ from the learner's fp32 ones by a
    few hundredths of a nat, which the clipped ratio and the behavior audit's threshold allow)."""
    batch_size: int = Field(64, ge=1)
    """Sequences per ``generate`` call: a batch's groups_per_batch x group_size completions are sampled this many
    at a time."""


class VllmEngineConfig(_Section):
    kind: Literal["vllm"]
    """vLLM (``echo2/rollout/vllm_engine.py``): install ``echo2[vllm]`` in an actor-only environment (vLLM and
    Prefect cannot share one). New versions are loaded into the running engine; LoRA versions become LoRA requests."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of vLLM's weights and activations ("auto": the model config's ``torch_dtype``; the embedded model's
    is fp32). Behavior logprobs are those of the distribution sampled in this dtype."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Share of the GPU's memory vLLM takes for weights and KV cache (ignored on CPU)."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """KV cache size, GiB (vLLM's ``kv_cache_memory_bytes``; on a GPU it replaces the share that
    gpu_memory_utilization leaves). None: vLLM's default (on its CPU build, 4 GiB or ``$VLLM_CPU_KVCACHE_SPACE``)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt plus completion (None: the model's ``max_position_embeddings``)."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Sequences vLLM schedules at once (None: vLLM's default)."""
    enforce_eager: bool = False
    """Run without CUDA graphs: faster start, slower decoding."""
    native_lora: bool = True
    """LoRA runs (``train.lora_rank > 0``): apply each adapter version as a vLLM LoRA request on the base weights
    (False: the actor merges the adapter and loads full weights, as for the transformers engine)."""
    extra_args: dict[str, Any] = Field(default_factory=dict)
    """More keyword arguments of ``vllm.LLM(...)``, passed as they are (e.g. ``tensor_parallel_size: 2``); they
    override echo2's own."""


EngineConfig = Annotated[TransformersEngineConfig | VllmEngineConfig, Field(discriminator="kind")]
"""Which inference engine the actors run (``echo2/rollout/engine.py: make_engine``), with its own settings."""


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
    engine: EngineConfig = Field(default_factory=TransformersEngineConfig)
    """Inference engine of the actors (``echo2/rollout/``, built by ``make_engine``): ``{kind: transformers, ...}``
    or ``{kind: vllm, ...}``; a bare name (``engine: vllm``) is that engine with its defaults."""
    preemption_source: Literal["off", "aws", "gcp", "auto"] = "off"
    """Poll this cloud's instance metadata for a spot preemption notice (AWS IMDSv2 spot/instance-action,
    GCP instance/preempted) and stop cleanly on one; ``$ECHO2_PREEMPTION_SOURCE`` on the actor's machine
    overrides it (the SkyPilot task sets ``auto``: the cloud SkyPilot launched the machine on). Off: no
    metadata request is ever made; SIGTERM is a notice either way (``echo2/rollout/preemption.py``)."""
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
    shard_mb: int = Field(256, ge=1)
    """Largest safetensors shard of a published version."""
    max_rollout_file_mb: float = Field(64.0, gt=0)
    """A rollout file larger than this is quarantined before it is downloaded or decoded."""
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
    every nproc-th micro-batch, rank 0 runs the flow, reads rollouts and publishes (``learner/distributed.py``)."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of a learner with nproc > 1 (auto: nccl on GPUs, gloo on CPUs)."""


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
    tls: Literal["auto", "on", "off"] = "auto"
    """Mutual TLS between relay peers, with certificates from the run's CA (``broadcast/relay_tls.py``):
    ``auto`` = on whenever the relay binds a non-loopback address (a cloud VM), off on 127.0.0.1;
    ``on``; ``off`` (refused with the SkyPilot backend, whose relay port is open to the internet).
    Only peer-to-peer traffic: the store keeps its own transport."""

    @field_validator("tls", mode="before")
    @classmethod
    def _yaml_booleans(cls, value):
        """YAML reads a bare ``on`` / ``off`` as a boolean: take it as the word the user wrote."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


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
    price_as: str | None = None
    """Price every local actor as this catalog offer (``provider/instance_type@region``, as ``echo2 prices
    --json`` names them, from ``fleet.prices``): the run's cost report then shows what the same hours would
    have cost there, and its title says "simulated prices". None: local actors cost $0."""
    price_as_spot: bool = True
    """With ``price_as``: bill the offer's spot price (True) or its on-demand price."""
    actor_python: str | None = None
    """Python interpreter that runs the local actors (``PY -m echo2.cli actor``); None: the learner's own.
    Point it at an actor-only environment for an engine that cannot live beside Prefect, e.g.
    ``.venv-vllm/bin/python`` with ``rollout.engine.kind: vllm`` (README "vLLM actors")."""


class SkyPilotFleetConfig(_Section):
    task_file: str | None = None
    """SkyPilot task YAML of one actor (None = the shipped ``infra/skypilot/actor.yaml``: setup installs
    echo2's actor environment, run starts ``echo2 actor``). Its ``resources`` are the base every candidate
    offer is laid over (disk, image); the candidates themselves come from the price source."""
    gpus: list[str] | None = None
    """GPU types an actor may run on, e.g. ``[L4, A10G]`` (None = every profiled GPU the model fits)."""
    providers: list[str] | None = None
    """Providers (SkyPilot clouds) an actor may run on, e.g. ``[aws, gcp]`` (None = every provider of the
    price source that SkyPilot can launch on)."""
    spot: bool = True
    """Buy spot capacity (reclaimed without warning, replaced by the manager) rather than on-demand."""
    any_of: int = Field(8, ge=1)
    """Each launch names up to this many interchangeable offers (same GPU type and count, other regions or
    clouds) as SkyPilot ``any_of``; SkyPilot takes the cheapest that has capacity."""
    relay_port: int = Field(8443, ge=1, le=65535)
    """Port of each actor's relay, opened through SkyPilot's ``ports`` (reachable from anywhere)."""
    idle_minutes_to_autodown: int = Field(10, ge=1)
    """A cluster tears itself down after its actor has been gone this long, also if the learner died."""
    status_poll_s: float = Field(30.0, ge=0)
    """How often the backend asks SkyPilot for its clusters' states (one request for all of them; 0 = at every poll)."""
    unavailable_retry_s: float = Field(300.0, ge=0)
    """An offer that had no capacity is not asked again for this long."""
    credentials_role_arn: str | None = None
    """AWS role each actor's scoped, expiring S3 credentials are minted from (STS with the session policy of
    ``echo2/fleet/credentials.py``; ``infra/iam/``). None: actors get no store credentials from echo2 (the
    store must be reachable with what the actor's machine has, e.g. an instance profile)."""
    credentials_hours: float = Field(6.0, ge=0.25, le=12)
    """Lifetime of an actor's scoped credentials and relay token; an actor is replaced before they expire."""
    sts_endpoint_url: str | None = None
    """STS endpoint (None = AWS's own; tests point it at moto)."""


class FleetConfig(_Section):
    backend: Literal["local", "skypilot"] = "local"
    """Where actors run: ``local`` = OS processes on this machine; ``skypilot`` = one SkyPilot cluster per
    actor on spot GPUs across clouds (``pip install -e '.[cloud]'``, cloud credentials, an s3:// or gs://
    store; see ``echo2/fleet/skypilot.py``)."""
    local: LocalFleetConfig = Field(default_factory=LocalFleetConfig)
    """The local backend: processes on this machine, and its reclaim injector."""
    skypilot: SkyPilotFleetConfig = Field(default_factory=SkyPilotFleetConfig)
    """The SkyPilot backend: which offers, ports, autodown, credentials."""
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
    learner_usd_per_hour: float | None = Field(None, ge=0)
    """What the learner's machine costs per hour, for the cost report (None: the report lists the learner
    unpriced rather than guess)."""


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
        if self.fleet.backend == "skypilot" and not self.store.url.startswith(("s3://", "gs://", "gcs://")):
            raise ValueError(f"fleet.backend skypilot needs a store every actor can reach (s3:// or gs://), "
                             f"got store.url {self.store.url!r}")
        if self.fleet.skypilot.credentials_role_arn and not self.store.url.startswith("s3://"):
            raise ValueError(f"fleet.skypilot.credentials_role_arn mints S3 credentials, but store.url is "
                             f"{self.store.url!r} (GCS: see infra/iam/README.md)")
        if self.train.nproc > 1 and self.train.lora_rank > 0:
            raise ValueError("train.nproc > 1 shards full fine-tuning only: LoRA (train.lora_rank > 0) runs in one process")
        if self.fleet.backend == "skypilot" and self.broadcast.tls == "off":
            raise ValueError("broadcast.tls off is refused with fleet.backend skypilot: its relays listen on a port "
                             "open to the internet (use auto or on)")
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
