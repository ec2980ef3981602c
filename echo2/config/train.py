"""The learner's sections of the config: ``train`` (the loss, the optimizer, memory and the loop), ``publish`` (what
a policy version is) and ``trust`` (what the learner accepts from actors); ``learner.py`` holds the fourth,
``learner`` (its processes, machine, market and preemption).

They were one flat ``train`` section. ``MOVED`` names where each field that left it went: the old key in a file,
a ``--set`` or an ``ECHO2_SET__`` variable is refused in one line naming its place now (``TrainConfig._renamed``),
and a run created before the split still resumes: its ``run.json`` config is read through the same table
(``upgraded``).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import Field, model_validator

from echo2.config._base import _Section

_TRUST = ("max_rollout_file_mb", "max_invalid_files_per_actor", "max_ungradable_files_per_actor",
          "max_ungradable_fraction", "max_prompt_tokens")
_LEARNER = ("nproc", "nnodes", "dist_backend", "device", "num_threads", "market", "preemption_source",
            "preemption_poll_s", "sigterm_notice_s")

MOVED: dict[str, str] = {
    "train.publish_every": "publish.every", "train.publish_dtype": "publish.dtype",
    "train.publish_delta": "publish.delta",
    **{f"train.{name}": f"publish.{name}" for name in ("keyframe_every", "shard_mb", "keep_versions")},
    **{f"train.{name}": f"trust.{name}" for name in _TRUST},
    "train.audit_fraction": "trust.spot_check_fraction", "train.audit_max_gap": "trust.spot_check_max_gap",
    **{f"train.{name}": f"learner.{name}" for name in _LEARNER},
}
"""Where each field of the old flat ``train`` section that left it lives now (old dotted key: new)."""


def moved_keys(train: Any) -> list[str]:
    """The keys of a ``train`` mapping that left the section (none when ``train`` is not a mapping)."""
    return [key for key in train if f"train.{key}" in MOVED] if isinstance(train, dict) else []


def moved_to(key: str) -> str:
    """What is said of an old ``train`` key: where it lives now."""
    return f"train.{key} moved to {MOVED[f'train.{key}']}"


def upgraded(config: dict) -> dict:
    """A config mapping with the fields of the old flat ``train`` section moved to their sections (a copy): how a
    ``run.json`` written before the split is read. A mapping in today's layout comes back equal."""
    out = copy.deepcopy(config)
    train = out.get("train")
    if not isinstance(train, dict):
        return out
    for old, new in MOVED.items():
        field = old.partition(".")[2]
        if field not in train:
            continue
        section, _, name = new.partition(".")
        target = out.setdefault(section, {})
        if isinstance(target, dict) and name not in target:  # else left in train, to be refused in one line
            target[name] = train.pop(field)
    return out


class TrainConfig(_Section):
    """The loss, the optimizer, the learner's memory and its loop."""

    max_steps: int = Field(16, ge=1)
    """Optimizer steps of the run; policy version v = optimizer steps taken."""
    groups_per_step: int = Field(8, ge=1)
    """Prompt groups per optimizer step (whole rollout files are taken until this many are in)."""
    staleness: int = Field(2, ge=0)
    """S: a rollout of version v is used at learner version t only if t - v <= S (0 = synchronous)."""
    checkpoint_every: int = Field(5, ge=1)
    """Write a resumable checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted after a newer one is committed."""
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
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the learner's forward and backward (and of its evaluation and spot check). bfloat16: bf16
    matmuls with fp32 master weights and fp32 AdamW state (sharded, as on any GPU: FSDP2's MixedPrecisionPolicy, bf16
    parameters in compute, fp32 gradient reduction; one process on a CPU: torch.autocast around the forward); the
    log-softmax of the head stays fp32 either way. float32 on a GPU uses TF32 matmuls. auto: bfloat16 on a GPU,
    float32 on a CPU. What is published is ``publish.dtype``, unchanged by this."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (torch's
    non-reentrant checkpoint, per layer): activation memory of one layer instead of all, for about one more
    forward pass of compute. Parameter names, published weights and checkpoints are unchanged."""
    logprob_chunk_tokens: int = Field(1024, ge=1)
    """Tokens whose logits (tokens x vocabulary, fp32) exist at once when the learner computes log-probabilities
    (``learner/logprobs.py``): the head's memory is about 3 x this x vocabulary x 4 bytes, whatever the batch."""
    lora_rank: int = Field(0, ge=0)
    """Train a LoRA adapter of this rank instead of all weights (0 = full fine-tuning); only the adapter is
    published."""
    lora_alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator: the update is (lora_alpha / lora_rank) * B @ A."""
    lora_target_modules: str | list[str] = "all-linear"
    """Modules that get adapters (peft's target_modules)."""
    rollout_timeout_s: float = Field(900.0, gt=0)
    """Fail the run when no usable rollout arrives for this long."""
    poll_seconds: float = Field(0.25, gt=0)
    """How often a learner waiting for rollouts lists the store again (each list is a store request)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "micro_batch_size" in data:
            raise ValueError("train.micro_batch_size (rows per micro-batch) was replaced by train.micro_batch_tokens "
                             "(tokens per packed micro-batch; default 8192): remove micro_batch_size and set "
                             "micro_batch_tokens instead")
        moved = moved_keys(data)
        if moved:
            raise ValueError("; ".join(moved_to(key) for key in moved))
        return data


class PublishConfig(_Section):
    """What a policy version is: how often one is published, in which dtype, whole or as a delta, how many are kept."""

    every: int = Field(1, ge=1)
    """kappa: publish a policy version every this many steps."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of published weights. bfloat16 halves transfer size; the clipped ratio absorbs the mismatch."""
    delta: bool = False
    """Publish each version as a sparse delta against the previous one: only the elements whose bits
    changed travel, bit-exact, with the sha256 of every rebuilt tensor in the signed manifest
    (``echo2/data/delta.py``). Pays with ``publish.dtype: bfloat16``, where an RL step leaves most
    elements' bits as they were; a float32 copy changes almost everywhere and ends up in keyframes.
    No effect with ``train.lora_rank > 0``: adapter versions are small already."""
    keyframe_every: int = Field(16, ge=1)
    """With ``publish.delta``: a full version (keyframe) at version 0, at the first publish after a resume,
    once this many versions have passed since the last keyframe, and whenever the deltas since it would
    outgrow one full version. An actor that joins late downloads the newest keyframe and the deltas
    after it; garbage collection keeps every version such a chain needs."""
    shard_mb: int = Field(256, ge=1)
    """Largest safetensors shard of a published version (delta shards too), and largest file of a rank's
    checkpoint shard (``learner/checkpoint_files.py``: a file is built in memory before its upload, so a checkpoint
    adds about this much to a rank's host memory; one tensor shard larger than it gets a file of its own)."""
    keep_versions: int = Field(1, ge=1)
    """Newest published versions always kept; older ones are deleted once no rollout of them can be used (v < t - S)."""


class TrustConfig(_Section):
    """What the learner accepts from actors: the bounds a rollout file must keep, the spot check of its behavior
    logprobs, and when an actor is banned."""

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
    spot_check_fraction: float = Field(0.1, ge=0, le=1)
    """Share of each actor's rollout files (besides its first, always) whose behavior logprobs the learner
    recomputes under the claimed version (``learner/spot_check.py``); 0 = no spot check, and no copies of
    recent versions kept (each is a copy of the model in memory: S + 1 of them)."""
    spot_check_max_gap: float = Field(0.15, gt=0)
    """Mean |claimed - recomputed| behavior logprob per policy token above which an actor is banned (honest
    fp32 actors differ by ~1e-6, bf16 ones by a few hundredths)."""
