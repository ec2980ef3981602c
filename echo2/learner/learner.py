"""The learner: policy, optimizer, one GRPO step over a selection of rollout files, publishing.

Version semantics: ``self.version`` = optimizer steps taken. The weights after step N are
policy version N; version 0 is the initial model.
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
from echo2.data import layout
from echo2.data.store import ObjectStore
from echo2.data.lora import merge_lora
from echo2.data.weights import model_files, publish_version, published_versions, unique_state_dict
from echo2.learner.loss import group_advantages, policy_loss, token_logprobs

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
        self.model.train()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.999)
        )
        self.reference = None
        if config.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            self.reference.requires_grad_(False)
        self.extra_files = model_files(model_dir)
        self.version = 0

    # -- training --------------------------------------------------------------------------
    def train_step(self, tables: list[pa.Table]) -> dict:
        """One optimizer step on whole rollout files; returns metrics."""
        t0 = time.time()
        cfg = self.config
        table = pa.concat_tables(tables)
        rows = table.select(["group_id", "prompt_token_ids", "completion_token_ids", "completion_mask",
                             "behavior_logprobs", "reward", "policy_version"]).to_pylist()
        group_ids = {g: i for i, g in enumerate(dict.fromkeys(r["group_id"] for r in rows))}
        rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
        group_index = torch.tensor([group_ids[r["group_id"]] for r in rows])
        advantages = group_advantages(rewards, group_index, scale=cfg.scale_rewards)
        lags = [self.version - r["policy_version"] for r in rows]
        metrics = {
            "step": self.version + 1, "reward": rewards.mean().item(), "rollouts": len(rows),
            "groups": len(group_ids), "lag_mean": sum(lags) / len(lags), "lag_max": max(lags),
            "completion_tokens": sum(len(r["completion_token_ids"]) for r in rows),
        }
        # groups with equal rewards have A = 0 everywhere: no gradient, so no forward pass either
        keep = [i for i in range(len(rows)) if advantages[i] != 0]
        metrics["groups_with_signal"] = len({int(group_index[i]) for i in keep})
        n_tokens = sum(sum(rows[i]["completion_mask"]) for i in keep)
        totals = {"loss": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "kl_behavior": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        if keep:
            keep.sort(key=lambda i: len(rows[i]["prompt_token_ids"]) + len(rows[i]["completion_token_ids"]))
            mb = cfg.micro_batch_size
            for start in range(0, len(keep), mb):
                idx = keep[start : start + mb]
                terms = self._micro_batch([rows[i] for i in idx], advantages[idx], n_tokens)
                terms.loss.backward()
                weight = sum(sum(rows[i]["completion_mask"]) for i in idx) / n_tokens
                totals["loss"] += terms.loss.item()
                for k in ("clip_fraction", "ratio_mean", "kl_behavior"):
                    totals[k] += getattr(terms, k).item() * weight
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm).item()
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"non-finite gradient norm at step {self.version + 1}; weights left unchanged")
            self.optimizer.step()
        else:
            grad_norm = 0.0
        self.version += 1
        metrics.update(totals, grad_norm=grad_norm, train_tokens=n_tokens, step_seconds=time.time() - t0)
        return metrics

    def _micro_batch(self, rows: list[dict], advantages: torch.Tensor, n_tokens: int):
        lengths = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        # per-token tensors aligned to "predict position j+1 from position j"
        targets = torch.zeros((len(rows), width - 1), dtype=torch.long)
        mask = torch.zeros((len(rows), width - 1))
        behavior = torch.zeros((len(rows), width - 1))
        for i, r in enumerate(rows):  # right padding: positions match the actor's generation
            p, c = r["prompt_token_ids"], r["completion_token_ids"]
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            attn[i, : len(p) + len(c)] = 1
            span = slice(len(p) - 1, len(p) - 1 + len(c))
            targets[i, span] = torch.tensor(c)
            mask[i, span] = torch.tensor(r["completion_mask"], dtype=torch.float32)
            behavior[i, span] = torch.tensor(r["behavior_logprobs"], dtype=torch.float32)
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logprobs = token_logprobs(logits, targets, self.temperature)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference(input_ids=ids, attention_mask=attn).logits[:, :-1], targets,
                                     self.temperature)
        cfg = self.config
        return policy_loss(logprobs, behavior, advantages, mask, n_tokens=n_tokens, clip_low=cfg.clip_low,
                           clip_high=cfg.clip_high, is_cap=cfg.is_cap, ref_logprobs=ref, kl_coef=cfg.kl_coef)

    # -- publishing ------------------------------------------------------------------------
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

    def publish(self, store: ObjectStore, *, key: bytes, chunk_size: int, relay: dict) -> dict:
        """Commit the current weights as policy version ``self.version`` (signed) and move LATEST to it.

        With LoRA, version 0 is the full base and every later version only the adapter.
        """
        dtype = _DTYPES[self.config.publish_dtype]
        meta: dict = {"relay": relay, "weights": "full"}
        if self.lora and self.version > 0:
            tensors = {k: v.to(dtype) for k, v in self.adapter_tensors().items()}
            meta.update(weights="lora", base_version=0, lora_rank=self.config.lora_rank,
                        lora_alpha=self.config.lora_alpha)
        else:
            tensors = {k: v.to(dtype) for k, v in self.base_tensors.items()} if self.lora else unique_state_dict(
                self.model, dtype)
        manifest = publish_version(store, self.version, tensors, extra_files=self.extra_files,
                                   shard_mb=self.config.shard_mb, chunk_size=chunk_size, key=key, meta=meta)
        self._collect_garbage(store)
        return manifest

    def _collect_garbage(self, store: ObjectStore) -> None:
        """Delete versions no actor can still use (older than t - S) beyond the newest ``keep_versions``."""
        versions = published_versions(store)
        keep = set(versions[-self.config.keep_versions :])
        oldest_useful = self.version - self.config.staleness
        for v in versions:
            if self.lora and v == 0:
                continue  # the base every adapter version applies to
            if v not in keep and v < oldest_useful:
                prefix = layout.policy_dir(v)
                # the manifest goes first, so a half-deleted folder is never taken for a committed one
                store.delete(f"{prefix}/{layout.MANIFEST}")
                store.delete_prefix(prefix + "/")
