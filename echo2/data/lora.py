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
