"""The learner: policy, optimizer, one GRPO step over a selection of rollout files.

Version semantics: ``self.version`` = optimizer steps taken. The weights after step N are
policy version N; version 0 is the initial model. A step whose loss or gradient is non-finite
anyway (validation bounds every input, so this means a diverged policy) changes no weight and is
reported (``metrics["nonfinite"]``) so that its files are quarantined; it still counts as a step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo2.config import TrainConfig
from echo2.data.lora import check_mergeable, merge_lora
from echo2.data.weights import model_files, unique_state_dict
from echo2.learner.columns import step_columns
from echo2.learner.logprobs import PolicyLogprobs
from echo2.learner.loss import group_advantages, groups_with_signal, policy_loss
from echo2.learner.packing import PackedBatch, StepColumns, assemble_packed, pack_by_tokens

log = logging.getLogger("echo2.learner")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Learner:
    def __init__(self, model_dir: Path, config: TrainConfig, *, temperature: float):
        self.config = config
        self.temperature = temperature
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # the frozen base, as plain HF names (shares storage with the model: no copy)
        self.base_tensors = unique_state_dict(self.model)
        self.lora = config.lora_rank > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(
                r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=config.lora_target_modules,
                lora_dropout=0.0))
            check_mergeable(self.model.peft_config["default"])  # before any step: MoE experts are not modules
        # eval mode: dropout off. The loss is a ratio against the behavior policy, which sampled with
        # dropout off; dropout in the learner's forward would bias every ratio (gradients still flow)
        self.model.eval()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.published_names = list(unique_state_dict(self.model))
        """The weights a version or checkpoint holds (tied duplicates left out), under HF names."""
        self.policy = PolicyLogprobs(self.model, temperature=temperature, chunk_tokens=config.logprob_chunk_tokens)
        """Token log-probabilities of the policy (``_logprobs``); under FSDP2 it is the root unit, called instead
        of ``self.model``, whose parameter names (state dicts, the optimizer's) are unchanged."""
        self._prepare_model()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay,
            betas=(0.9, 0.999)
        )
        self.reference = None
        self.reference_policy: PolicyLogprobs | None = None
        """The frozen KL reference's log-probabilities (None when kl_coef is 0); fp32 weights, not sharded."""
        if config.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            self.reference.requires_grad_(False)
            self.reference_policy = PolicyLogprobs(self.reference, temperature=temperature,
                                                   chunk_tokens=config.logprob_chunk_tokens)
            self._prepare_reference()
        self.extra_files = model_files(model_dir)
        self.version = 0

    def _prepare_model(self) -> None:
        """What happens to the model before the optimizer sees its parameters (sharding, in distributed.py)."""
        if self.config.activation_checkpointing:
            self._checkpoint_layers()

    def _prepare_reference(self) -> None:
        """What happens to the frozen KL reference once loaded (sharding, in distributed.py)."""

    def _checkpoint_layers(self) -> None:
        """Recompute each decoder layer's activations in backward (torch's non-reentrant checkpoint).

        The composable ``checkpoint`` works by forward hooks on the layer, so no wrapper module is inserted
        and every parameter keeps its name (published weights, checkpoints, optimizer state); it records the
        autocast state and the RNG state of the forward and replays them in the recomputation.
        """
        from torch.distributed._composable import checkpoint

        for layer in self.policy.causal_lm.get_decoder().layers:
            checkpoint(layer)

    def _logprobs(self, policy: PolicyLogprobs, input_ids: torch.Tensor, targets: torch.Tensor,
                  position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                  where: torch.Tensor | None = None) -> torch.Tensor:
        """(B, W) fp32: log p(targets[b, j] | input_ids[b, :j+1]) under ``policy`` (``self.policy`` or the
        reference's), in the configured compute dtype; with ``where`` (bool), only there (0 elsewhere)."""
        with self._compute_dtype(policy):
            return policy(input_ids, targets, position_ids=position_ids, attention_mask=attention_mask, where=where)

    def _compute_dtype(self, policy: torch.nn.Module):
        """bf16 autocast around a forward whose parameters are fp32; a module FSDP2 shards with its
        MixedPrecisionPolicy already computes in bf16 (distributed.py), so it runs as it is."""
        from torch.distributed.fsdp import FSDPModule

        if self.config.dtype == "float32" or isinstance(policy, FSDPModule):
            return contextlib.nullcontext()
        device = next(policy.parameters()).device.type
        return torch.autocast(device_type=device, dtype=_DTYPES[self.config.dtype])

    # -- training --------------------------------------------------------------------------
    def train_step(self, tables: list[pa.Table]) -> dict:
        """One optimizer step on whole rollout files; returns metrics."""
        return self.step_on_columns(step_columns(tables))

    def step_on_columns(self, columns: StepColumns) -> dict:
        """One optimizer step on the rows of a step's rollout files (``columns.step_columns``)."""
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
        totals = {"loss": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "kl_behavior": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        grad_norm = 0.0
        if len(keep):
            keep = keep.tolist()
            lengths = columns.sequence_lengths()[keep].tolist()
            packs = [[keep[i] for i in pack] for pack in pack_by_tokens(lengths, self._pack_budget(sum(lengths)))]
            totals = self._accumulate(columns, packs, advantages, n_tokens, totals)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm).item()
            if math.isfinite(grad_norm) and math.isfinite(totals["loss"]):
                self.optimizer.step()
            else:
                log.error("step %d: non-finite loss %s / gradient norm %s; weights left unchanged",
                          self.version + 1, totals["loss"], grad_norm)
                self.optimizer.zero_grad(set_to_none=True)
                metrics["nonfinite"] = True
                totals = {k: 0.0 for k in totals}
                grad_norm = 0.0
        self.version += 1
        metrics.update(totals, grad_norm=grad_norm, train_tokens=n_tokens, step_seconds=time.time() - t0)
        return metrics

    def _pack_budget(self, step_tokens: int) -> int:
        """The most tokens one pack of this step holds."""
        return self.config.micro_batch_tokens

    def _accumulate(self, columns: StepColumns, packs: list[list[int]], advantages: torch.Tensor,
                    n_tokens: int, totals: dict) -> dict:
        """Forward and backward over the packs (row indices), gradients summed; the step's totals."""
        for pack in packs:
            self._backward(columns, pack, advantages, n_tokens, totals)
        return totals

    def _backward(self, columns: StepColumns, pack: list[int], advantages: torch.Tensor, n_tokens: int,
                  totals: dict) -> None:
        batch = assemble_packed(columns, pack, advantages)
        terms = self._micro_batch(batch, n_tokens)
        terms.loss.backward()
        weight = batch.policy_tokens / n_tokens
        totals["loss"] += terms.loss.item()
        for k in ("clip_fraction", "ratio_mean", "kl_behavior"):
            totals[k] += getattr(terms, k).item() * weight

    def _micro_batch(self, batch: PackedBatch, n_tokens: int):
        """The loss terms of one pack (``n_tokens``: the step's policy tokens, over every pack and rank)."""
        # only the tokens the loss weighs go through the head: prompt positions' logits are never computed
        inputs = dict(input_ids=batch.input_ids, targets=batch.targets, position_ids=batch.position_ids,
                      where=batch.mask > 0)
        logprobs = self._logprobs(self.policy, **inputs)
        ref = None
        if self.reference_policy is not None:
            with torch.no_grad():
                ref = self._logprobs(self.reference_policy, **inputs)
        cfg = self.config
        return policy_loss(logprobs, batch.behavior_logprobs, batch.advantages, batch.mask, n_tokens=n_tokens,
                           clip_low=cfg.clip_low, clip_high=cfg.clip_high, is_cap=cfg.is_cap, ref_logprobs=ref,
                           kl_coef=cfg.kl_coef)

    # -- state -----------------------------------------------------------------------------
    def sharded_state(self) -> dict:
        """What a checkpoint keeps of this process's training state, for DCP (``sharded.py``): the trainable
        weights (tied duplicates left out; with LoRA the adapter alone) and the optimizer state, both keyed by
        parameter name; under FSDP2 each tensor is a DTensor of this rank's shard, never gathered."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {"model": {k: v for k, v in model.items() if k in trainable}, "optim": optim}

    def save_sharded(self, store, prefix: str) -> list[dict]:
        """Write this process's shard of a checkpoint under ``prefix`` (every rank runs it); returns the
        manifest entries of the files written, every rank's (``checkpoint.save_checkpoint``)."""
        from echo2.learner.sharded import save_sharded

        return save_sharded(store, prefix, self.sharded_state(), file_mb=self.config.shard_mb)

    def load_sharded(self, store, prefix: str, entries: dict[str, dict]) -> None:
        """Restore the weights and optimizer state of the checkpoint at ``prefix`` (every rank runs it), each
        file checked against ``entries``, the signed manifest's: ``CorruptWeights`` before any weight changed."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from echo2.learner.sharded import load_sharded

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

    def eval_model(self) -> torch.nn.Module:
        """A model with the current weights that can generate on this process alone."""
        return self.model

    # -- weights ---------------------------------------------------------------------------
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(self.model).items()}

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Current weights under plain Hugging Face names (a LoRA adapter merged into the base)."""
        if not self.lora:
            return unique_state_dict(self.model)
        return merge_lora(self.base_tensors, self.adapter_tensors(), rank=self.config.lora_rank,
                          alpha=self.config.lora_alpha)

    def policy_version_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What version ``self.version`` publishes, in ``publish_dtype``, and its manifest metadata.

        With LoRA, version 0 is the full base and every later version only the adapter.
        """
        dtype = _DTYPES[self.config.publish_dtype]
        if self.lora and self.version > 0:
            tensors = {k: v.to(dtype) for k, v in self.adapter_tensors().items()}
            return tensors, {"weights": "lora", "base_version": 0, "lora_rank": self.config.lora_rank,
                             "lora_alpha": self.config.lora_alpha}
        if self.lora:
            return {k: v.to(dtype) for k, v in self.base_tensors.items()}, {"weights": "full"}
        return unique_state_dict(self.model, dtype), {"weights": "full"}

