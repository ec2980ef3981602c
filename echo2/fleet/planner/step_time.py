"""The learner's step time T from a FLOP model, for ``echo2 plan`` when nobody measured it.

Model. One GRPO step trains on ``tokens`` = R x G x (prompt + mean completion) tokens. Training costs
6 x N_active FLOPs per token (forward 2N, backward 4N: the usual dense-transformer count, on the ACTIVE
parameters for a mixture of experts, since each token runs only its experts; attention's context term is
left out, as in the MFU the learner bench reports). The spot check recomputes the logprobs of a share
``audit_fraction`` of the rollout files under the claimed version: a forward pass, 2 x N_active per token
of that share. Groups whose completions all scored alike carry no signal: the learner drops them before the
forward pass (``learner/learner.py``), so training runs on the ``signal_share`` of the tokens that remain. So

    FLOPs per step = (6 x signal_share + 2 x audit_fraction) x N_active x tokens
    T = FLOPs / (gpus x bf16 peak x MFU)

MFU (model FLOPs utilization, the same definition as ``echo2 bench learner``: 6 x active x tokens/s over
the dense bf16 peak) is the one measured number this needs: ``mfu_from_bench`` reads it from
``echo2 bench learner --json`` output (``--mfu-from FILE``); else the workload's ``learner.mfu``; else
``DEFAULT_MFU``. ``--train-seconds`` (``train.train_seconds``) wins over all of it.

Assumptions: no pipeline bubbles or communication beyond what MFU already absorbs (MFU measured on one GPU
does not see FSDP's all-gathers across 4 GPUs: a multi-GPU learner is slower than this says by that
share); the publish, checkpoint and optimizer step are inside MFU's time; the peak is the datasheet's
dense bf16 figure (no sparsity), ``echo2.devices.PEAK_BF16_TFLOPS`` (the one table, also the learner bench's).
"""

from __future__ import annotations

import json
from pathlib import Path

from echo2.devices import PEAK_BF16_TFLOPS
from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import gpu_key

PEAK_SOURCE = ("NVIDIA datasheets, dense bf16 tensor-core TFLOP/s without sparsity (SXM parts; H100 PCIe "
               "apart): echo2/devices.py")
DEFAULT_MFU = 0.25
DEFAULT_MFU_SOURCE = ("assumption: 25% MFU for the learner step, dense or MoE (the learner bench's target is 40% "
                      "for a dense 1.7B step at 8k tokens; MoE steps reach less: routing, uneven expert loads, small "
                      "expert matmuls); not measured here on a GPU. Measure it with `echo2 bench learner --device "
                      "cuda --json` and pass --mfu-from")
MOE_MFU = 0.15
MOE_MFU_SOURCE = ("assumption: 10-25%, likely 15% for an MoE on echo2's learner (transformers + FSDP2, no expert "
                  "parallelism): 25% is the best published pretraining figure for a 30B-A3B MoE on tuned Megatron/TE; "
                  "users report ~10% on Megatron and an RL framework's logs show 4%; not measured here on a GPU "
                  "(`echo2 bench learner --device cuda --json`, then --mfu-from)")


def peak_tflops(gpu: str) -> float:
    """Dense bf16 peak of a GPU by catalog name (spelling-insensitive)."""
    table = {gpu_key(k): v for k, v in PEAK_BF16_TFLOPS.items() if v is not None}
    peak = table.get(gpu_key(gpu))
    if peak is None:
        raise Echo2InputError(f"no bf16 peak known for learner GPU {gpu!r} (known: "
                              f"{', '.join(sorted(PEAK_BF16_TFLOPS))}); give --train-seconds")
    return peak


def flops_per_step(active_params_b: float, tokens: float, audit_fraction: float = 0.0,
                   signal_share: float = 1.0) -> float:
    """(6 x signal_share + 2 x audit_fraction) x active parameters x tokens (module docstring)."""
    if active_params_b <= 0 or tokens <= 0 or not 0 <= audit_fraction <= 1 or not 0 < signal_share <= 1:
        raise Echo2InputError("FLOP model needs active parameters > 0, tokens > 0, a spot check share in [0, 1] and "
                              "a signal share in (0, 1]")
    return (6.0 * signal_share + 2.0 * audit_fraction) * active_params_b * 1e9 * tokens


def train_seconds(active_params_b: float, tokens: float, *, gpu: str, gpus: int, mfu: float,
                  audit_fraction: float = 0.0, signal_share: float = 1.0) -> float:
    """T: seconds of one learner step (module docstring)."""
    if gpus < 1 or not 0 < mfu <= 1:
        raise Echo2InputError(f"learner needs gpus >= 1 and 0 < MFU <= 1 (got {gpus}, {mfu})")
    return (flops_per_step(active_params_b, tokens, audit_fraction, signal_share)
            / (gpus * peak_tflops(gpu) * 1e12 * mfu))


def mfu_from_bench(path: str | Path) -> tuple[float, str]:
    """(MFU, source) from ``echo2 bench learner --json`` output: one JSON object per case, a line each (or a list of
    them). A GPU's measurement only (a CPU's MFU says nothing of a GPU learner): the mixed case, the one whose
    lengths look like RL, with attention's FLOPs counted where the bench gave them; else the case with the most
    tokens."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise Echo2InputError(f"--mfu-from {path}: {exc.strerror or exc}") from None
    rows: list = []
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except ValueError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError:
            raise Echo2InputError(f"--mfu-from {path}: not the JSON `echo2 bench learner --json` prints") from None

    def mfu_of(r: dict):
        value = r.get("mfu_attention", r.get("mfu"))
        return value if isinstance(value, (int, float)) and 0 < value <= 1 else None

    cases = [r for r in rows if isinstance(r, dict) and mfu_of(r) is not None and r.get("device", "cuda") == "cuda"]
    if not cases:
        raise Echo2InputError(f"--mfu-from {path}: no GPU case with an MFU (run the bench with --device cuda)")
    best = next((r for r in cases if r.get("case") == "mixed"), None) or max(cases, key=lambda r: r.get("tokens") or 0)
    what = "6N + attention" if "mfu_attention" in best else "6N"
    return float(mfu_of(best)), (f"measured: {path.name}, case {best.get('case', '?')} ({best.get('tokens', '?')} "
                                 f"tokens, {what}, {best.get('device_name', 'GPU')})")
