"""The learner: policy, optimizer, one GRPO step over a selection of rollout files, on the learner's device.

Version semantics: ``self.version`` = optimizer steps taken. The weights after step N are
policy version N; version 0 is the initial model. A step whose loss or gradient is non-finite
anyway (validation bounds every input, so this means a diverged policy) changes no weight and is
reported (``metrics["nonfinite"]``) so that its files are quarantined; it still counts as a step.

Device and precision (``echo2/devices.py``). ``learner.device`` (auto: this rank's GPU where CUDA is available)
holds the model, the KL reference, the spot check's copy, every pack, the loss's inputs and the step's running sums;
the rollout columns arrive on the CPU and each pack is laid out there and moved over (a few tensors of its
tokens). The step's numbers are read back once, after the gradient is clipped: one host sync a step, not one a
pack. ``train.dtype`` (auto: bf16 on a GPU, fp32 on a CPU) is the compute dtype; master weights and AdamW state are
fp32 either way. The learner shards with FSDP2 (``sharded``) when it runs on several ranks or on a GPU at all
(``process_group.py`` says why one GPU shards too): every unit computes in bf16 through its
``MixedPrecisionPolicy``; a process that does not shard (the CPU, LoRA) autocasts instead.

Signals (``notice.py``, "Safe points"). A step runs with SIGTERM and SIGINT deferred: they reach their handlers
only between packs and before the optimizer step (``_safe_point``), where no weight has changed, or once the version
has moved; the clip, the optimizer step and the version bump are never interrupted by one. ``torn`` says that
something escaped from inside the update anyway, so the weights in memory are no step's: never checkpointed.

Models (``model_load.py``): a sharded learner builds its model on ``meta`` and receives its shards from rank 0,
which alone reads the checkpoint, once, in the file's dtype; ``fsdp_units.py`` checkpoints its layers' activations
and makes them FSDP2 units. Packed attention (``attention.py``): with
``train.attention`` varlen (auto) each sequence of a pack attends to itself without an N x N mask.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import torch
from transformers import AutoTokenizer

from echo2.data.lora import check_mergeable, merge_lora
from echo2.devices import DTYPES, prepare_device, resolve_device, resolve_dtype
from echo2.learner.columns import step_columns
from echo2.learner.fsdp_units import prepare_units
from echo2.learner.logprobs import PolicyLogprobs
from echo2.learner.loss import group_advantages, groups_with_signal, policy_loss
from echo2.learner.model_load import broadcast_weights, load_whole, materialize, read_checkpoint, skeleton
from echo2.learner.notice import deliver_deferred, signals_deferred
from echo2.learner.packing import PackedBatch, StepColumns, assemble_packed, pack_rows
from echo2.learner.process_group import one_rank_group, world

if TYPE_CHECKING:  # the learner reads its settings by name: the GPU check builds it without pydantic
    from echo2.config import TrainConfig

log = logging.getLogger("echo2.learner")

_TOTALS = ("loss", "clip_fraction", "ratio_mean", "kl_behavior")
"""The step's sums over packs (``loss`` summed; the others weighted by each pack's share of the step's tokens)."""


def attention_implementation(setting: str, device: torch.device) -> str:
    """transformers' attention for the learner's packed forwards: ``train.attention`` (auto: varlen, whose CPU form,
    sdpa sequence by sequence, is exact and does no pack x pack work)."""
    if setting in ("auto", "varlen"):
        from echo2.learner.attention import register

        return register()
    return "sdpa"


def unique_names(model: torch.nn.Module) -> list[str]:
    """State dict names without tied duplicates (a tied head is its embedding), on any device, ``meta`` too."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return names


class Learner:
    def __init__(self, model_dir: Path, config: "TrainConfig", *, temperature: float, device: str = "auto",
                 publish_dtype: str = "float32", shard_mb: int = 256, sharded: bool | None = None):
        """``config``: the run's ``train`` section; ``device`` is ``learner.device``, ``publish_dtype`` and ``shard_mb``
        are ``publish.dtype`` and ``publish.shard_mb`` (``distributed.learner_options`` reads the three from a run's
        config; the defaults here are the config's). ``sharded`` forces FSDP2 on (one process makes a one-rank
        group) or off; None: on several ranks or a GPU."""
        self.config = config
        self.temperature = temperature
        self.model_dir = model_dir
        self.publish_dtype, self.shard_mb = publish_dtype, shard_mb
        self.device = resolve_device(device, what="learner.device")
        self.dtype = resolve_dtype(config.dtype, self.device)
        prepare_device(self.device, self.dtype)
        self.attention = attention_implementation(config.attention, self.device)
        self.lora = config.lora_rank > 0
        self.rank, self.world_size = world()
        self.sharded = (self.world_size > 1 or (self.device.type == "cuda" and not self.lora)) if sharded is None \
            else sharded
        if self.sharded and self.lora:
            raise ValueError("LoRA runs in one process without sharding")
        if self.sharded:
            one_rank_group(self.device)
            self.rank, self.world_size = world()
        buffers = None
        if self.sharded:
            model, buffers = skeleton(model_dir, dtype=torch.float32, attention=self.attention)
        else:
            model = load_whole(model_dir, device=self.device, dtype=torch.float32, attention=self.attention)
        self._plain_names = set(model.state_dict())
        """The transformers model's own tensor names (a tied head's too): what a version's or a spot check's
        weights name."""
        self.base_tensors: dict[str, torch.Tensor] = {}
        """LoRA: the frozen base, as plain HF names (shares storage with the model: no copy)."""
        if self.lora:
            from peft import LoraConfig, get_peft_model

            base = set(unique_names(model))
            self.base_tensors = {k: v.detach() for k, v in model.state_dict().items() if k in base}
            model = get_peft_model(model, LoraConfig(
                r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=config.lora_target_modules,
                lora_dropout=0.0))
            check_mergeable(model.peft_config["default"])  # before any step: MoE experts are not modules
        # eval mode: dropout off. The loss is a ratio against the behavior policy, which sampled with
        # dropout off; dropout in the learner's forward would bias every ratio (gradients still flow)
        self.model = model.eval()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.published_names = unique_names(self.policy_lm(self.model))
        """The weights a version or checkpoint holds (tied duplicates left out), under HF names."""
        self.policy = PolicyLogprobs(self.model, temperature=temperature, chunk_tokens=config.logprob_chunk_tokens)
        """Token log-probabilities of the policy (``_logprobs``); when sharded it is FSDP2's root unit, called instead
        of ``self.model``, whose parameter names (state dicts, the optimizer's) are unchanged."""
        prepare_units(self.policy, trainable=True, activation_checkpointing=config.activation_checkpointing,
                      sharded=self.sharded, dtype=self.dtype)
        if self.sharded:
            self._fill(self.policy, buffers, lambda: read_checkpoint(model_dir))
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay,
            betas=(0.9, 0.999)
        )
        self.reference_policy: PolicyLogprobs | None = None
        """The frozen KL reference's log-probabilities (None when kl_coef is 0), stored in the compute dtype."""
        if config.kl_coef > 0:
            self.reference_policy = self._frozen_copy()
        self._spot_check_policy: PolicyLogprobs | None = None
        self._spot_check_version: int | None = None
        self.version = 0
        self.torn = False
        """Something escaped from inside an optimizer update: the weights and moments in memory are partly updated,
        no step's, and must never be checkpointed (``LearnerRun.checkpoint``)."""

    @functools.cached_property
    def tokenizer(self):
        """The model's tokenizer (evaluation's; read when first asked, so a bench of the step needs none)."""
        return AutoTokenizer.from_pretrained(self.model_dir)

    @functools.cached_property
    def extra_files(self) -> dict[str, bytes]:
        """The model's config and tokenizer files, published with every full version and checkpoint."""
        from echo2.data.weights import model_files  # (the data plane's signing: not needed to take a step)

        return model_files(self.model_dir)

    @staticmethod
    def policy_lm(model: torch.nn.Module) -> torch.nn.Module:
        """The transformers model under a peft wrapper."""
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    # -- building ----------------------------------------------------------------------------
    def _fill(self, policy: PolicyLogprobs, buffers: dict, read) -> None:
        """A sharded model's shards on the device, its weights from rank 0's ``read()`` (nothing to read on meta)."""
        materialize(policy.causal_lm, buffers, self.device)
        if self.device.type != "meta":
            broadcast_weights(policy.causal_lm, read, rank=self.rank)

    def _frozen_copy(self, weights=None) -> PolicyLogprobs:
        """A frozen model in the compute dtype on the device (sharded like the policy): the checkpoint's weights, or
        ``weights()`` (read on rank 0 only) when given."""
        if self.sharded:
            model, buffers = skeleton(self.model_dir, dtype=self.dtype, attention=self.attention)
        else:
            model = load_whole(self.model_dir, device=self.device, dtype=self.dtype, attention=self.attention)
        model.requires_grad_(False)
        copy = PolicyLogprobs(model, temperature=self.temperature, chunk_tokens=self.config.logprob_chunk_tokens)
        prepare_units(copy, trainable=False, activation_checkpointing=False, sharded=self.sharded, dtype=self.dtype)
        if self.sharded:
            self._fill(copy, buffers, weights or (lambda: read_checkpoint(self.model_dir)))
        elif weights is not None:
            self._load_frozen(copy, weights)
        return copy

    # -- forward -------------------------------------------------------------------------------
    def _logprobs(self, policy: PolicyLogprobs, batch: PackedBatch) -> torch.Tensor:
        """(1, N) fp32: each pack position's target's log-probability under ``policy`` (the policy or a frozen copy),
        computed only where the loss weighs it (0 elsewhere)."""
        with self._compute_dtype():
            return policy(batch.input_ids, batch.targets, position_ids=batch.position_ids, where=batch.weighed,
                          **self._attention_kwargs(batch))

    @property
    def shares_prompts(self) -> bool:
        """Whether rows that share a prompt share its tokens in a pack: only the learner's own attention knows a
        shared prefix (transformers' masked sdpa reads a pack from restarting positions)."""
        return self.attention != "sdpa"

    def _attention_kwargs(self, batch: PackedBatch) -> dict:
        if self.attention == "sdpa":
            return {}
        from echo2.learner.attention import pack_attention

        return pack_attention(batch.layout, self.device)

    def _compute_dtype(self):
        """bf16 autocast around a forward whose parameters are fp32 (one process that does not shard); a sharded
        model computes in bf16 through its MixedPrecisionPolicy already."""
        if self.dtype == torch.float32 or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def _pack(self, columns: StepColumns, rows: list[int], advantages: torch.Tensor) -> PackedBatch:
        """A pack laid out on the CPU, then moved to the device."""
        return assemble_packed(columns, rows, advantages, share_prompts=self.shares_prompts).to(self.device)

    # -- training --------------------------------------------------------------------------
    def train_step(self, tables: list[pa.Table]) -> dict:
        """One optimizer step on whole rollout files; returns metrics."""
        return self.step_on_columns(step_columns(tables))

    def step_on_columns(self, columns: StepColumns) -> dict:
        """One optimizer step on the rows of a step's rollout files (``columns.step_columns``, on the CPU); signals
        reach their handlers only at the step's safe points or after it (see the module docstring)."""
        with signals_deferred():
            try:
                return self._step_on_columns(columns)
            except BaseException:
                if not self.torn:  # abandoned before its update: it leaves no gradient behind (see below)
                    self.optimizer.zero_grad(set_to_none=True)
                raise

    # Why an abandoned step drops its gradients on every rank: a checkpoint's optimizer state is gathered by DCP's
    # get_state_dict, which gives an optimizer that has no state yet (no step with a signal so far) zero moments, but
    # only on a rank that holds no gradient; a rank left with the abandoned step's gradients would save none, and
    # the ranks' plans would not fit together (DCP: "Failed to validate global plan").

    def _safe_point(self) -> None:
        """Where a step may be abandoned: no weight or moment has changed yet. A handler that abandons it raises."""
        deliver_deferred()

    def _step_on_columns(self, columns: StepColumns) -> dict:
        t0 = time.time()
        cfg = self.config
        rewards, group_index = columns.reward.float(), columns.group_index
        n_groups = int(group_index.max()) + 1
        advantages = group_advantages(rewards, group_index, scale=cfg.scale_rewards)
        lags = self.version - columns.policy_version
        metrics = {
            "step": self.version + 1, "reward": rewards.mean().item(), "rollouts": columns.num_rows,
            "groups": n_groups, "lag_mean": lags.double().mean().item(), "lag_max": int(lags.max()),
            "completion_tokens": int(columns.completion.offsets[-1]), "nonfinite": False,
        }
        # a group whose rewards are all equal has A = 0 everywhere: no signal, so its rows skip the
        # forward pass. Whole groups are dropped; a row of a group with signal stays even if its own A is 0
        with_signal = groups_with_signal(rewards, group_index)
        keep = with_signal[group_index].nonzero().squeeze(1)
        metrics["groups_with_signal"] = int(with_signal.sum())
        n_tokens = int(columns.policy_tokens()[keep].sum())
        totals = dict.fromkeys(_TOTALS, 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        grad_norm, torn = 0.0, self.torn
        if len(keep):
            packs = pack_rows(columns, keep.tolist(), self._pack_budget, share_prompts=self.shares_prompts)
            sums = self._accumulate(columns, packs, advantages, n_tokens)
            self._safe_point()  # the last one: from here to the version bump, signals wait
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            # the step's one read back: its sums (over every rank) and the clipped gradient's norm
            totals, grad_norm = self._read_totals(sums, norm)
            if math.isfinite(grad_norm) and math.isfinite(totals["loss"]):
                self.torn = True  # until the version has moved: an escape from in between leaves it set
                self.optimizer.step()
            else:
                log.error("step %d: non-finite loss %s / gradient norm %s; weights left unchanged",
                          self.version + 1, totals["loss"], grad_norm)
                self.optimizer.zero_grad(set_to_none=True)
                metrics["nonfinite"] = True
                totals = dict.fromkeys(_TOTALS, 0.0)
                grad_norm = 0.0
        self.version += 1
        self.torn = torn  # (once torn, always: later steps start from those weights)
        metrics.update(totals, grad_norm=grad_norm, train_tokens=n_tokens, step_seconds=time.time() - t0)
        return metrics

    def _pack_budget(self, step_tokens: int) -> int:
        """The most tokens one pack of this step holds."""
        return self.config.micro_batch_tokens

    def _accumulate(self, columns: StepColumns, packs: list[list[int]], advantages: torch.Tensor,
                    n_tokens: int) -> torch.Tensor:
        """Forward and backward over the packs (row indices), gradients summed; the step's sums (``_TOTALS``) as one
        tensor on the device, this rank's share."""
        sums = torch.zeros(len(_TOTALS), dtype=torch.float32, device=self.device)
        for pack in packs:
            self._safe_point()
            self._backward(self._pack(columns, pack, advantages), n_tokens, sums)
        return sums

    def _read_totals(self, sums: torch.Tensor, grad_norm: torch.Tensor) -> tuple[dict, float]:
        """The step's sums and gradient norm as numbers, in one read back (a distributed learner adds every rank's)."""
        if hasattr(grad_norm, "full_tensor"):  # sharded parameters: the norm is a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        values = torch.cat([sums, grad_norm.detach().float().reshape(1)]).tolist()
        return dict(zip(_TOTALS, values[:-1])), values[-1]

    def _backward(self, batch: PackedBatch, n_tokens: int, sums: torch.Tensor, weight: float = 1.0) -> None:
        """Forward and backward of one pack; its loss terms added to ``sums`` (``weight`` 0: a filler pass)."""
        terms = self._micro_batch(batch, n_tokens)
        (terms.loss * weight if weight != 1.0 else terms.loss).backward()
        if weight:
            share = batch.policy_tokens / n_tokens
            sums += torch.stack([terms.loss.detach(), terms.clip_fraction * share, terms.ratio_mean * share,
                                 terms.kl_behavior * share]).float()

    def _micro_batch(self, batch: PackedBatch, n_tokens: int):
        """The loss terms of one pack (``n_tokens``: the step's policy tokens, over every pack and rank)."""
        # only the tokens the loss weighs go through the head: prompt positions' logits are never computed
        logprobs = self._logprobs(self.policy, batch)
        ref = None
        if self.reference_policy is not None:
            with torch.no_grad():
                ref = self._logprobs(self.reference_policy, batch)
        cfg = self.config
        return policy_loss(logprobs, batch.behavior_logprobs, batch.advantages, batch.mask, n_tokens=n_tokens,
                           clip_low=cfg.clip_low, clip_high=cfg.clip_high, is_cap=cfg.is_cap, ref_logprobs=ref,
                           kl_coef=cfg.kl_coef)

    # -- the spot check's arithmetic ----------------------------------------------------------------
    @torch.no_grad()
    def behavior_gap(self, version: int, weights: dict[str, torch.Tensor], columns: StepColumns,
                     micro_batch_tokens: int) -> tuple[float, int]:
        """(sum over policy tokens of |claimed - recomputed| behavior log-probability, policy tokens) of ``columns``
        (one rollout file's rows) under ``weights``, what version ``version`` published: on the device, in the
        compute dtype, with a frozen copy of the model that holds one version at a time."""
        policy = self._spot_check_copy(version, weights)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        no_advantages = torch.zeros(columns.num_rows)
        for pack in pack_rows(columns, range(columns.num_rows), lambda _: micro_batch_tokens,
                              share_prompts=self.shares_prompts):
            total += self._gap_of(policy, self._pack(columns, pack, no_advantages))
        gap, count = total.tolist()
        return gap, int(count)

    def _gap_of(self, policy: PolicyLogprobs, batch: PackedBatch) -> torch.Tensor:
        recomputed = self._logprobs(policy, batch)
        gaps = ((recomputed - batch.behavior_logprobs).abs() * batch.mask).sum()
        return torch.stack([gaps, batch.mask.sum()]).double()

    def _spot_check_copy(self, version: int, weights: dict[str, torch.Tensor]) -> PolicyLogprobs:
        """The spot check's frozen copy holding ``weights`` (loaded when its version changes)."""
        if self._spot_check_version != version:
            self._spot_check_version = None  # until the load has ended: a failed one leaves no version claimed
            if self._spot_check_policy is None:
                self._spot_check_policy = self._frozen_copy(lambda: weights)
            else:
                self._load_frozen(self._spot_check_policy, lambda: weights)
            self._spot_check_version = version
        return self._spot_check_policy

    def _load_frozen(self, copy: PolicyLogprobs, weights) -> None:
        """Replace a frozen copy's weights with ``weights()`` (read on rank 0 only)."""
        if self.device.type == "meta":
            return
        if self.sharded:
            if self.world_size == 1:
                self.check_weights(weights())
            broadcast_weights(copy.causal_lm, weights, rank=self.rank)
            return
        weights = weights()
        self.check_weights(weights)
        copy.causal_lm.load_state_dict(weights, strict=False)  # a tied head may be left out
        copy.causal_lm.tie_weights()

    def check_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Refuse weights with a tensor the model does not have (a LoRA adapter's, say), before anything is copied:
        skipped silently, the spot check would run against other weights."""
        unknown = [k for k in weights if k not in self._plain_names]
        if unknown:
            raise ValueError(f"the weights given are not the model's: {len(unknown)} unknown tensors such as "
                             f"{unknown[0]!r} (a LoRA adapter must be merged first)")

    # -- state -----------------------------------------------------------------------------
    def sharded_state(self) -> dict:
        """What a checkpoint keeps of this process's training state, for DCP (``checkpoint_files.py``): the trainable
        weights (tied duplicates left out; with LoRA the adapter alone) and the optimizer state, both keyed by
        parameter name; when sharded each tensor is a DTensor of this rank's shard, never gathered."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {"model": {k: v for k, v in model.items() if k in trainable}, "optim": optim}

    def save_sharded(self, store, prefix: str) -> list[dict]:
        """Write this process's shard of a checkpoint under ``prefix`` (every rank runs it); returns the
        manifest entries of the files written, every rank's (``checkpoint.save_checkpoint``)."""
        from echo2.learner.checkpoint_files import save_sharded

        return save_sharded(store, prefix, self.sharded_state(), file_mb=self.shard_mb)

    def load_sharded(self, store, prefix: str, entries: dict[str, dict]) -> None:
        """Restore the weights and optimizer state of the checkpoint at ``prefix`` (every rank runs it), each
        file checked against ``entries``, the signed manifest's: ``CorruptWeights`` before any weight changed."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from echo2.learner.checkpoint_files import load_sharded

        fresh = not self.optimizer.state
        state = self.sharded_state()  # (a fresh optimizer gets zero moments to load into: one step at lr 0)
        try:
            load_sharded(store, prefix, entries, state)  # in place, into this rank's shards
        except Exception:
            if fresh:  # refused: leave the optimizer as fresh as it was, should resume start over
                self.optimizer.state.clear()
            raise
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=False))

    # -- evaluation ------------------------------------------------------------------------------
    def eval_model(self):
        """What evaluation generates with: the policy itself, on the device, in the compute dtype (no copy)."""
        from echo2.learner.evaluate import Generating  # (evaluation's, with the tasks: not needed to take a step)

        return Generating(self)

    def generate(self, kwargs: dict) -> torch.Tensor:
        """``generate`` of the policy's transformers model on the learner's device (on every rank, when sharded:
        ``synced_gpus`` keeps the ranks stepping together until every one has finished)."""
        from echo2.learner.attention import masked_attention

        lm = self.policy_lm(self.model)
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with torch.no_grad(), self._compute_dtype(), masked_attention(lm):
            if not self.sharded:
                return lm.generate(**kwargs)
            self.policy.unshard()
            try:
                return lm.generate(**kwargs, synced_gpus=self.world_size > 1)
            finally:
                self.policy.reshard()

    # -- weights ---------------------------------------------------------------------------
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(self.model).items()}

    def gathered(self, names: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Copies of the named weights, whole, in ``dtype`` (None: as stored), on the CPU, never the live tensors: a
        sharded tensor is gathered on the device and cast there, one tensor at a time, so host memory only ever holds
        the result (rank 0's; the other ranks take part in the gathers and keep nothing)."""
        state = self.policy_lm(self.model).state_dict()
        out = {}
        for name in names:
            tensor = state[name].detach()
            live = True
            if hasattr(tensor, "full_tensor"):  # a DTensor shard: every rank takes part in the gather
                tensor, live = tensor.full_tensor(), False
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor, live = tensor.to(dtype), False
            if tensor.device.type != "cpu":
                tensor, live = tensor.cpu(), False
            out[name] = tensor.clone() if live else tensor.contiguous()
        return out

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Current weights under plain Hugging Face names, fp32 on the CPU (a LoRA adapter merged into the base)."""
        if not self.lora:
            return self.gathered(self.published_names, None)
        base = {k: v.cpu() for k, v in self.base_tensors.items()}
        return merge_lora(base, self.adapter_tensors(), rank=self.config.lora_rank, alpha=self.config.lora_alpha)

    def policy_version_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What version ``self.version`` publishes, in ``publish.dtype`` on the CPU, and its manifest metadata.

        With LoRA, version 0 is the full base and every later version only the adapter.
        """
        dtype = DTYPES[self.publish_dtype]
        if self.lora and self.version > 0:
            tensors = {k: v.to(dtype) for k, v in self.adapter_tensors().items()}
            return tensors, {"weights": "lora", "base_version": 0, "lora_rank": self.config.lora_rank,
                             "lora_alpha": self.config.lora_alpha}
        if self.lora:
            return {k: v.to(dtype).cpu() for k, v in self.base_tensors.items()}, {"weights": "full"}
        return self.gathered(self.published_names, dtype), {"weights": "full"}
