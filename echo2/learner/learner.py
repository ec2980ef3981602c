"""The learner: policy, optimizer, one GRPO step over a selection of rollout files.

Version semantics: ``self.version`` = optimizer steps taken. The weights after step N are
policy version N; version 0 is the initial model. A step whose loss or gradient is non-finite
anyway (validation bounds every input, so this means a diverged policy) changes no weight and is
reported (``metrics["nonfinite"]``) so that its files are quarantined; it still counts as a step.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo2.config import TrainConfig
from echo2.data.lora import merge_lora
from echo2.data.weights import model_files, unique_state_dict
from echo2.learner.batch import assemble, policy_logprobs
from echo2.learner.loss import group_advantages, policy_loss

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
        # eval mode: dropout off. The loss is a ratio against the behavior policy, which sampled with
        # dropout off; dropout in the learner's forward would bias every ratio (gradients still flow)
        self.model.eval()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.published_names = list(unique_state_dict(self.model))
        """The weights a version or checkpoint holds (tied duplicates left out), under HF names."""
        self._prepare_model()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.999)
        )
        self.reference = None
        if config.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            self.reference.requires_grad_(False)
        self.extra_files = model_files(model_dir)
        self.version = 0

    def _prepare_model(self) -> None:
        """What happens to the model before the optimizer sees its parameters (sharding, in distributed.py)."""

    # -- training --------------------------------------------------------------------------
    def train_step(self, tables: list[pa.Table]) -> dict:
        """One optimizer step on whole rollout files; returns metrics."""
        return self.step_on_rows(rows_of(tables))

    def step_on_rows(self, rows: list[dict]) -> dict:
        """One optimizer step on the rows of a step's rollout files (``rows_of``)."""
        t0 = time.time()
        cfg = self.config
        group_ids = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in rows))}
        rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
        group_index = torch.tensor([group_ids[r["group"]] for r in rows])
        advantages = group_advantages(rewards, group_index, scale=cfg.scale_rewards)
        lags = [self.version - r["policy_version"] for r in rows]
        metrics = {
            "step": self.version + 1, "reward": rewards.mean().item(), "rollouts": len(rows),
            "groups": len(group_ids), "lag_mean": sum(lags) / len(lags), "lag_max": max(lags),
            "completion_tokens": sum(len(r["completion_token_ids"]) for r in rows), "nonfinite": False,
        }
        # a group whose rewards are all equal has A = 0 everywhere: no signal, so its rows skip the
        # forward pass. Whole groups are dropped; a row of a group with signal stays even if its own A is 0
        n_groups = len(group_ids)
        high = torch.full((n_groups,), -math.inf).scatter_reduce(0, group_index, rewards, "amax")
        low = torch.full((n_groups,), math.inf).scatter_reduce(0, group_index, rewards, "amin")
        with_signal = high > low
        keep = [i for i in range(len(rows)) if with_signal[group_index[i]]]
        metrics["groups_with_signal"] = int(with_signal.sum())
        n_tokens = sum(sum(rows[i]["completion_mask"]) for i in keep)
        totals = {"loss": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "kl_behavior": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        grad_norm = 0.0
        if keep:
            keep.sort(key=lambda i: len(rows[i]["prompt_token_ids"]) + len(rows[i]["completion_token_ids"]))
            mb = cfg.micro_batch_size
            micro_batches = [keep[start : start + mb] for start in range(0, len(keep), mb)]
            totals = self._accumulate(rows, micro_batches, advantages, n_tokens, totals)
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

    def _accumulate(self, rows: list[dict], micro_batches: list[list[int]], advantages: torch.Tensor,
                    n_tokens: int, totals: dict) -> dict:
        """Forward and backward over the micro-batches (row indices), gradients summed; the step's totals."""
        for idx in micro_batches:
            self._backward(rows, idx, advantages, n_tokens, totals)
        return totals

    def _backward(self, rows: list[dict], idx: list[int], advantages: torch.Tensor, n_tokens: int,
                  totals: dict) -> None:
        terms = self._micro_batch([rows[i] for i in idx], advantages[idx], n_tokens)
        terms.loss.backward()
        weight = sum(sum(rows[i]["completion_mask"]) for i in idx) / n_tokens
        totals["loss"] += terms.loss.item()
        for k in ("clip_fraction", "ratio_mean", "kl_behavior"):
            totals[k] += getattr(terms, k).item() * weight

    def _micro_batch(self, rows: list[dict], advantages: torch.Tensor, n_tokens: int):
        batch = assemble(rows, self.pad_token_id)
        logprobs = policy_logprobs(self.model, batch, self.temperature)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = policy_logprobs(self.reference, batch, self.temperature)
        cfg = self.config
        return policy_loss(logprobs, batch.behavior_logprobs, advantages, batch.mask, n_tokens=n_tokens,
                           clip_low=cfg.clip_low, clip_high=cfg.clip_high, is_cap=cfg.is_cap, ref_logprobs=ref,
                           kl_coef=cfg.kl_coef)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    # -- state -----------------------------------------------------------------------------
    def optimizer_state(self) -> dict:
        """What a checkpoint keeps of the optimizer (its ``state_dict``)."""
        return self.optimizer.state_dict()

    def load_state(self, tensors: dict[str, torch.Tensor], optimizer_state: dict,
                   adapter: dict[str, torch.Tensor] | None = None) -> None:
        """Restore a checkpoint: full weights (or the LoRA adapter over the base) and the optimizer."""
        if adapter is not None:
            self.load_adapter(adapter)
        else:
            self.model.load_state_dict(tensors, strict=False)
            self.model.tie_weights()
        self.optimizer.load_state_dict(optimizer_state)

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

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, tensors)

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


def rows_of(tables: list[pa.Table]) -> list[dict]:
    """A step's training rows: the columns the loss needs, each row tagged with its group."""
    rows = []
    for file_index, table in enumerate(tables):
        for row in table.select(["group_id", "prompt_token_ids", "completion_token_ids", "completion_mask",
                                 "behavior_logprobs", "reward", "policy_version"]).to_pylist():
            # a group is one group_id of one file: two files never merge their groups of the same name
            row["group"] = (file_index, row["group_id"])
            rows.append(row)
    return rows
