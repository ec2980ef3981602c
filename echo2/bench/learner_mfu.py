"""MFU of the learner bench's echo2 step: 6 x active parameters x the tokens the model ran on, and with causal
attention's own FLOPs too (``learner_steps.py`` counts both), against the device's dense peak: a GPU's datasheet
bf16 figure, or on a CPU the rate of a dense matmul measured in the compute dtype. Imports torch and echo2's
devices and bench modules only, when called (the GPU machine's path stays torch + transformers).
"""

from __future__ import annotations

import time


def flops_figures(learner, case, opts, result: dict) -> dict:
    """MFU of a measured echo2 step (``case``, ``opts``: the bench's ``Case`` and ``Options``; ``result``: what
    ``measure`` returned): 6 x active parameters x tokens, and with attention's FLOPs too, at the median and at the
    fastest step, against the device's dense peak (``peak_of``)."""
    from echo2.bench.learner_steps import active_parameters, attention_flops, computed_tokens, make_columns

    lm = learner.policy_lm(learner.model)
    active = active_parameters(lm)
    columns = make_columns(case.prompt_tokens, case.completion_lengths, case.group_size,
                           opts.model_config["vocab_size"], opts.seed)
    tokens = computed_tokens(learner, columns)  # what the model ran on: a group's shared prompt once
    dense = 6.0 * active * tokens
    attention = attention_flops(columns, lm.config, share_prompts=learner.shares_prompts)
    peak, source, name = peak_of(learner.device, learner.dtype)
    out = {"device_name": name, "peak_tflops": peak, "peak_source": source, "active_params": active,
           "computed_tokens": tokens, "attention_flops_share": attention / (dense + attention)}
    for suffix, seconds in (("", result["seconds"]), ("_best", result["seconds_min"])):
        out[f"mfu{suffix}"] = dense / seconds / (peak * 1e12) if peak else None
        out[f"mfu_attention{suffix}"] = (dense + attention) / seconds / (peak * 1e12) if peak else None
    return out


def peak_of(device, dtype) -> tuple[float | None, str, str]:
    """(TFLOP/s, its source, the device's name): a GPU's datasheet bf16 peak (``echo2.devices``), else the rate of
    a dense matmul in the compute dtype measured here, so a CPU's MFU is against what its cores do."""
    import torch

    from echo2.devices import device_name, peak_tflops_of_device

    name = device_name(device)
    if device.type == "cuda":
        peak = peak_tflops_of_device(name)
        return peak, "datasheet (dense bf16)" if peak else "unknown", name
    n = 1024
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    rate = 5 * 2 * n**3 / (time.perf_counter() - start) / 1e12
    return rate, f"measured {str(dtype).removeprefix('torch.')} matmul", name
