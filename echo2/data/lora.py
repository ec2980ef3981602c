"""LoRA adapters as policy versions: only the adapter travels; receivers merge it into the base.

An adapter version's manifest says ``"weights": "lora"`` with its ``base_version``, ``lora_rank``
and ``lora_alpha``; its shards hold peft's adapter state dict (``...q_proj.lora_A.weight``).
The merged weight is W = W_base + (alpha / rank) * B @ A.
"""

from __future__ import annotations

import torch

_PREFIX = "base_model.model."


def merge_lora(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], *, rank: int, alpha: float,
               strict: bool = True):
    """Full weights with the adapter folded in; ``base`` is left untouched.

    With ``strict=False`` (merging one shard at a time) modules whose base weight is elsewhere are
    skipped and the pair (merged, number of modules merged) is returned.
    """
    scale = alpha / rank
    merged = dict(base)
    count = 0
    for key, a in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        target = module.removeprefix(_PREFIX) + ".weight"
        if target not in base:
            if strict:
                raise KeyError(f"adapter module {module} has no base weight {target}")
            continue
        b = adapter[f"{module}.lora_B.weight"]
        w = base[target]
        merged[target] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        count += 1
    return merged if strict else (merged, count)


def check_mergeable(peft_config) -> None:
    """Refuse, before any step, an adapter that ``merge_lora`` could not fold in: one on a parameter rather than
    a module's 2-D weight (peft's ``target_parameters``). peft 0.21 puts one there by itself when its targets
    (``all-linear`` included) reach a transformers 5 mixture-of-experts layer, whose experts are fused 3-D
    tensors (``mlp.experts.gate_up_proj``) and whose router is a bare parameter (``mlp.gate.weight``); without
    this check the run would fail at its first adapter version."""
    fused = sorted(getattr(peft_config, "target_parameters", None) or [])
    if fused:
        raise ValueError(f"train.lora_rank > 0 adapts {', '.join(fused)} (parameters, not modules: a "
                         "mixture-of-experts model's fused experts and router), which echo2's LoRA merge cannot "
                         "fold in: name the modules to adapt in train.lora_target_modules (e.g. [q_proj, k_proj, "
                         "v_proj, o_proj]) or train in full (lora_rank 0)")
