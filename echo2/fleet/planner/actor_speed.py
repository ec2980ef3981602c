"""An actor instance's rollout speed for a workload: the decode model (``decode.py``) where the model's shape and the
GPU's bandwidth are known, else the profile's figure (``Profile.speed``) as before.

The decode model needs the model's shape (``model.config``: layers, KV heads, experts and top-k) and the GPU's
memory bandwidth (the profile's ``memory_bandwidth_tb_s``) and bf16 peak (``echo2/devices.py``). An instance's
batch (b x G completions) is split over its GPUs, one engine per GPU; its speed is its GPUs' tokens over the
batch's seconds. Without the shape or the bandwidth the profile's figure stands, capped so that a batch lasts at
least its p95 completion decoded alone when ``completion_tokens_p95`` is given (the older tail rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo2.devices import PEAK_BF16_TFLOPS
from echo2.fleet.planner import decode
from echo2.fleet.planner.workload_file import WorkloadFile
from echo2.fleet.prices.catalog import Profile, gpu_key
from echo2.models import read_model_config

DRAIN_BINDS = 0.95
"""A batch whose drained speed is below this share of its full speed is said to be tail-bound."""


@dataclass(frozen=True)
class DecodeInputs:
    """The drawn values the decode model reads (the workload's own unless a range draw replaces them)."""

    completion_mean: float
    at_cap: float
    single_stream: float
    speed_factor: float


def inputs_of(wf: WorkloadFile) -> DecodeInputs:
    _, share = wf.length_cap()
    r = wf.rollout
    return DecodeInputs(r.completion_tokens_mean, share, r.single_stream_tokens_per_second, r.decode_speed_factor)


def model_shape(wf: WorkloadFile) -> decode.ModelShape | None:
    """The decode shape from ``model.config``; None without one."""
    path = wf.config_path()
    if path is None:
        return None
    return decode.shape_from_config(read_model_config(path), str(path))


def gpu_of(profile: Profile) -> decode.Gpu | None:
    """The profile's GPU as the decode model sees it; None without a bandwidth or a known bf16 peak."""
    peak = {gpu_key(k): v for k, v in PEAK_BF16_TFLOPS.items() if v}.get(gpu_key(profile.name))
    if profile.memory_bandwidth_tb_s is None or peak is None:
        return None
    efficiency = decode.calibrated_efficiency(profile.tokens_per_second, profile.memory_bandwidth_tb_s)
    return decode.Gpu(profile.memory_bandwidth_tb_s * 1e12, peak * 1e12, efficiency)


@dataclass(frozen=True)
class Speed:
    """Tokens/s per GPU of one (GPU, GPU count) and what it came from."""

    per_gpu: float
    source: str
    batch_seconds: float | None = None
    full_batch_per_gpu: float | None = None
    """The decode model's speed with the batch kept full (what the batch would do without its tail)."""


def speed(wf: WorkloadFile, profile: Profile, gpu_count: int, *, total_b: float, active_b: float | None,
          shape: decode.ModelShape | None, x: DecodeInputs | None = None) -> Speed:
    """The speed per GPU of an instance of ``gpu_count`` ``profile`` GPUs on ``wf`` (module docstring)."""
    x = x or inputs_of(wf)
    r = wf.rollout
    gpu = gpu_of(profile) if shape is not None else None
    if gpu is None:
        per_gpu = profile.speed(total_b, active_b)
        p95 = r.completion_tokens_p95
        batch_tokens = r.groups_per_batch * r.group_size * x.completion_mean
        if p95 is not None:
            cap = batch_tokens / (p95 / x.single_stream * gpu_count)
            if cap < per_gpu:
                return Speed(cap, profile.source + f"; capped at {cap:.0f} tok/s/GPU by the batch tail")
        return Speed(per_gpu, profile.source)
    cap, _ = wf.length_cap()
    lengths = decode.LengthDistribution(x.completion_mean, cap, min(x.at_cap, 0.9 * x.completion_mean / cap)
                                        if cap else 0.0)
    sequences = math.ceil(r.groups_per_batch * r.group_size / gpu_count)
    overhead = decode.overhead_seconds(shape, gpu, x.single_stream, r.prompt_tokens + x.completion_mean / 2)
    seconds = decode.batch_seconds(shape, gpu, sequences=sequences, lengths=lengths, prompt_tokens=r.prompt_tokens,
                                   overhead=overhead, refill=r.refill, group_size=r.group_size) / x.speed_factor
    full = decode.batch_seconds(shape, gpu, sequences=sequences, lengths=lengths, prompt_tokens=r.prompt_tokens,
                                overhead=overhead, refill=True) / x.speed_factor
    per_gpu = sequences * x.completion_mean / seconds
    full_per_gpu = sequences * x.completion_mean / full
    how = ("prompt groups refill the batch as they finish" if r.refill else
           f"one whole batch, then the next: the batch drains ({full_per_gpu:.0f} tok/s kept full)"
           if per_gpu < DRAIN_BINDS * full_per_gpu else "one whole batch, then the next")
    return Speed(per_gpu, f"decode model: {sequences} sequences per GPU, {how}, bandwidth share "
                          f"{gpu.efficiency:.2f} ({decode.CALIBRATION_SOURCE}), x{x.speed_factor:g} "
                          f"(rollout.decode_speed_factor)", seconds, full_per_gpu)
