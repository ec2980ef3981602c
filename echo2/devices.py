"""Where tensors live and in what precision they compute: one answer for the learner, its evaluation and audit,
and the actors' transformers engine.

    device "auto"      cuda:LOCAL_RANK where CUDA is available (LOCAL_RANK: torchrun's, 0 in one process), else cpu
    device "cuda[:N]"  that GPU; refused in one line (``Echo2InputError``, exit 2) where CUDA is not available
    device "cpu"       the CPU, also on a GPU machine
    device "meta"      shapes without data: the tests' placement check (``tests/support/placement.py``), never a run's

    dtype "auto"       bfloat16 on a GPU (bf16 matmuls over fp32 master weights in the learner), float32 elsewhere
    dtype "float32"    on a GPU with TF32 matmuls (``set_float32_matmul_precision("high")``): fp32 storage and
                       accumulation, 10-bit mantissa inputs, ~8x the pure fp32 rate on an H100

Imports torch and the standard library only (besides ``echo2.errors``): the GPU check runs it where nothing
else is installed.
"""

from __future__ import annotations

import os

import torch

from echo2.errors import Echo2InputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N"


def resolve_device(spec: str, *, what: str = "learner.device") -> torch.device:
    """The device ``spec`` names (see the module docstring); ``what`` names the setting in the error."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise Echo2InputError(f"{what}: {spec!r} is not a device ({DEVICE_CHOICES})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise Echo2InputError(f"{what} is {spec!r} but CUDA is not available here (torch {torch.__version__}, "
                                  f"built for CUDA {torch.version.cuda or 'none'}): use auto or cpu")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        elif device.index >= torch.cuda.device_count():
            raise Echo2InputError(f"{what} is {spec!r} but this machine has {torch.cuda.device_count()} GPU(s)")
    elif device.type not in ("cpu", "meta"):
        raise Echo2InputError(f"{what}: {spec!r} is not a device echo2 runs on ({DEVICE_CHOICES})")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """The compute dtype ``spec`` names on ``device``: "auto" is bfloat16 on a GPU, float32 elsewhere."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[spec]


def prepare_device(device: torch.device, dtype: torch.dtype) -> None:
    """Make ``device`` current and let fp32 matmuls use TF32 on a GPU (bf16 compute is unaffected)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if dtype == torch.float32:
            torch.set_float32_matmul_precision("high")


def device_name(device: torch.device) -> str:
    """The card's name (``NVIDIA H100 80GB HBM3``), or the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


PEAK_BF16_TFLOPS: dict[str, float | None] = {
    "H200": 989.0, "GH200": 989.0, "H100 PCIe": 756.0, "H100-MEGA": 989.0, "H100": 989.0, "H20": 148.0,
    "B200": 2250.0, "A100-80GB": 312.0, "A100": 312.0, "A10G": None, "A10": 125.0, "L40S": 362.0, "L40": 181.0,
    "L4": 121.0,
}
"""Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, from NVIDIA's datasheets (SXM parts; the H100 PCIe apart),
by the GPU names of the price catalog. None: no figure known. In this order a name matches a device's own name
as a substring (``peak_tflops_of_device``), the more specific first: H200 before H20, H100 PCIe before H100, A10G
before A10, L40S before L40 before L4."""


def peak_tflops_of_device(name: str) -> float | None:
    """The dense bf16 peak of a device by its own name (``NVIDIA H100 80GB HBM3``), None if unknown."""
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key.lower() in name.lower():
            return tflops
    return None
