"""An actor's decode speed at its batch size, and how long a whole batch takes as it drains.

Why a model and not the profile's figure alone: the profile (``infra/profiles/rollout-throughput.yaml``) lists
dense speeds by model size at one batch. A mixture of experts, a long completion or a batch whose stragglers decode
alone move the speed by factors the profile cannot know; a decode step's cost can be counted from the model's
shape instead.

One decode step of ``n`` sequences (the roofline of a step):

* bytes read: the weights every token reads (attention, router, LM head; a dense model's MLP too), the experts the
  step's tokens route to, and the KV cache of every sequence's context so far. With ``E`` experts per layer and
  top-``k`` routing, ``n`` tokens routed independently and uniformly touch ``E x (1 - (1 - k/E)^n)`` distinct
  experts per layer in expectation (every expert at n = 256, top-8 of 128; 29 at n = 4). Uniform routing is an
  upper bound on the distinct experts (real routers are skewed), so the bytes are too.
* FLOPs: 2 x active parameters per token, plus attention's 4 x layers x query heads x head_dim per token and
  context token.
* seconds = max(bytes / (efficiency x memory bandwidth), FLOPs / (COMPUTE_EFFICIENCY x bf16 peak)) + overhead.

Calibration. ``efficiency`` is read off the profile: its largest listed dense size at ``REFERENCE_BATCH``
sequences of ``REFERENCE_CONTEXT`` tokens (a GQA decoder's ``REFERENCE_KV_BYTES_PER_TOKEN``) must decode at the
profile's figure (``calibrated_efficiency``), so a dense model at that batch plans as before and everything else
moves by the bytes it reads. ``overhead`` (kernel launches, scheduling, sampling) is what is left of one sequence
decoding alone: ``1 / single_stream_tokens_per_second`` minus the roofline of a one-sequence step, the workload's
figure for this model.

The batch (``batch_seconds``): echo2's actor generates one whole batch, then the next (``rollout/actor.py``), and
every sequence of a batch advances one token per step. The batch's lengths are drawn from the workload's length
distribution (``LengthDistribution``: deterministic quantiles, so no sampling noise); the step's batch shrinks as
sequences finish, and the batch lasts as many steps as its longest completion. ``refill`` is the other actor
(``rollout.refill``): a prompt group's slot takes the next group as soon as its G completions are done, so the
engine is never left with a batch's stragglers alone; a slot still waits for its own group's longest, so on
average G x E[L] / E[max of G] of its sequences decode, at the mean context of a sequence in progress
(length-biased: prompt + E[L^2] / 2E[L]).

Not modelled: KV-cache capacity (a batch whose contexts outgrow the GPU's free memory is preempted by the engine),
prefill time (prompts are short beside the completions this matters for), speculative decoding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from echo2.errors import Echo2InputError

REFERENCE_BATCH = 64
REFERENCE_CONTEXT = 1024
REFERENCE_KV_BYTES_PER_TOKEN = 131072
"""A GQA 7-8B decoder's bf16 KV cache per token: 32 layers x 8 KV heads x 128 x (K and V) x 2 bytes."""
CALIBRATION_SOURCE = (f"calibrated: the profile's largest dense size decodes at its listed figure at batch "
                      f"{REFERENCE_BATCH}, {REFERENCE_CONTEXT}-token contexts and "
                      f"{REFERENCE_KV_BYTES_PER_TOKEN // 1024} KiB of KV per token (an assumption about how the "
                      "figure was taken)")
COMPUTE_EFFICIENCY = 0.5
"""Share of the bf16 peak a decode step's matmuls reach where compute binds (an assumption: decode matmuls are
skinny)."""
MAX_EFFICIENCY = 0.95
GAMMA_SHAPE = 2.0
"""The shape of the completion lengths below the cap: a gamma of shape 2 (an assumption: a mode below the mean
and a long right tail, as reasoning traces have)."""


@dataclass(frozen=True)
class ModelShape:
    """What a decode step reads and computes, counted from an HF-style config (``shape_from_config``)."""

    dense_params: float
    """Parameters every token reads (attention, router, LM head, a dense MLP); the input embedding is a lookup."""
    expert_params: float
    """Parameters of one expert of one layer (0: dense)."""
    layers: int
    experts: int
    top_k: int
    kv_bytes_per_token: float
    attention_flops_per_context_token: float
    """Per generated token and context token: 4 x layers x query heads x head_dim."""

    @property
    def active_params(self) -> float:
        return self.dense_params + self.layers * self.top_k * self.expert_params

    def touched_experts(self, n: float) -> float:
        """Distinct experts per layer that ``n`` tokens touch in expectation (module docstring)."""
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** max(0.0, n))

    def weight_bytes(self, n: float) -> float:
        """bf16 weight bytes one step of ``n`` sequences reads."""
        return 2.0 * (self.dense_params + self.layers * self.touched_experts(n) * self.expert_params)


def shape_from_config(c: dict, where: str = "model config") -> ModelShape:
    """The decode shape of a Qwen/Llama-style decoder config (dense or MoE; ``num_experts`` and
    ``num_experts_per_tok`` from the config)."""
    try:
        h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        n_q = c["num_attention_heads"]
        n_kv = c.get("num_key_value_heads") or n_q
        d = c.get("head_dim") or h // n_q
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
        attn = h * n_q * d + 2 * h * n_kv * d + n_q * d * h
        if experts:
            k = c["num_experts_per_tok"]
            expert, mlp = 3 * h * c["moe_intermediate_size"], h * experts  # the router is dense
        else:
            k, expert, mlp = 0, 0, 3 * h * c["intermediate_size"]
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise Echo2InputError(f"{where}: not an HF-style decoder config ({exc!r})") from None
    return ModelShape(dense_params=layers * (attn + mlp) + vocab * h, expert_params=expert, layers=layers,
                      experts=experts, top_k=k, kv_bytes_per_token=2 * layers * n_kv * d * 2,
                      attention_flops_per_context_token=4 * layers * n_q * d)


def dense_shape(params_b: float, kv_bytes_per_token: float = REFERENCE_KV_BYTES_PER_TOKEN) -> ModelShape:
    """A dense decoder of ``params_b`` billion parameters (the calibration's reference)."""
    return ModelShape(params_b * 1e9, 0.0, 1, 0, 0, kv_bytes_per_token, 0.0)


@dataclass(frozen=True)
class Gpu:
    """What bounds a decode step on one GPU."""

    bandwidth_bytes_s: float
    peak_flops: float
    efficiency: float
    """Achieved share of the memory bandwidth (``calibrated_efficiency``)."""


def roofline_seconds(shape: ModelShape, gpu: Gpu, n: float, context_tokens: float) -> float:
    """One step of ``n`` sequences whose contexts sum to ``context_tokens``, without the fixed overhead."""
    read = shape.weight_bytes(n) + context_tokens * shape.kv_bytes_per_token
    flops = 2.0 * shape.active_params * n + shape.attention_flops_per_context_token * context_tokens
    return max(read / (gpu.efficiency * gpu.bandwidth_bytes_s), flops / (COMPUTE_EFFICIENCY * gpu.peak_flops))


def calibrated_efficiency(profile_tokens_per_second: dict[float, float], bandwidth_tb_s: float) -> float:
    """The bandwidth share at which the profile's largest dense size decodes at its figure (module docstring)."""
    size = max(profile_tokens_per_second)
    step = REFERENCE_BATCH / profile_tokens_per_second[size]
    read = 2.0 * size * 1e9 + REFERENCE_BATCH * REFERENCE_CONTEXT * REFERENCE_KV_BYTES_PER_TOKEN
    return min(MAX_EFFICIENCY, read / (step * bandwidth_tb_s * 1e12))


def overhead_seconds(shape: ModelShape, gpu: Gpu, single_stream_tokens_per_second: float,
                     context_tokens: float) -> float:
    """Per-step overhead: one sequence's step time at ``single_stream_tokens_per_second`` less its roofline."""
    return max(0.0, 1.0 / single_stream_tokens_per_second - roofline_seconds(shape, gpu, 1, context_tokens))


@dataclass(frozen=True)
class LengthDistribution:
    """Completion lengths: a share ``at_cap`` stops at ``cap`` (max_new_tokens), the rest follow a gamma of shape
    ``GAMMA_SHAPE`` whose mean makes the whole ``mean``; no cap: every completion at the mean."""

    mean: float
    cap: float | None = None
    at_cap: float = 0.0

    def __post_init__(self):
        if self.mean <= 0 or (self.cap is not None and self.cap < self.mean) or not 0 <= self.at_cap < 1:
            raise Echo2InputError(f"completion lengths: mean {self.mean:g} must be > 0 and <= the cap "
                                  f"{self.cap}, the share at the cap in [0, 1)")
        if self.cap is not None and self.at_cap * self.cap > self.mean:
            raise Echo2InputError(f"completion lengths: {self.at_cap:.0%} at the {self.cap:g}-token cap alone "
                                  f"exceed the mean {self.mean:g}")

    def body_mean(self) -> float:
        if self.cap is None:
            return self.mean
        return max(1.0, (self.mean - self.at_cap * self.cap) / (1.0 - self.at_cap))

    def lengths(self, n: int) -> list[float]:
        """``n`` lengths at evenly spaced quantiles, longest last (deterministic: the same batch every time)."""
        if self.cap is None:
            return [self.mean] * n
        capped = min(n, round(self.at_cap * n))
        body = n - capped
        scale = self.body_mean() / GAMMA_SHAPE
        out = [min(self.cap, q * scale) for q in _unit_quantiles(body)]
        return out + [self.cap] * capped

    def second_moment(self, n: int = 512) -> float:
        xs = self.lengths(n)
        return sum(x * x for x in xs) / len(xs)

    def cdf(self, x: float) -> float:
        if self.cap is None:
            return 1.0 if x >= self.mean else 0.0
        if x >= self.cap:
            return 1.0
        u = x / (self.body_mean() / GAMMA_SHAPE)
        return (1.0 - self.at_cap) * (1.0 - math.exp(-u) * (1.0 + u))

    def expected_max(self, g: int, points: int = 400) -> float:
        """E[the longest of g completions] = the integral of 1 - F(x)^g up to the cap (the mean without a cap)."""
        if self.cap is None or g <= 1:
            return self.mean
        dx = self.cap / points
        return sum((1.0 - self.cdf((i + 0.5) * dx) ** g) * dx for i in range(points))


@functools.lru_cache(maxsize=2048)
def _unit_quantiles(n: int) -> tuple[float, ...]:
    """The unit-scale gamma's quantiles at (i + 0.5) / n, ascending (the same for every mean: cached)."""
    return tuple(_gamma2_quantile((i + 0.5) / n) for i in range(n))


def _gamma2_quantile(q: float) -> float:
    """The q-quantile of a unit-scale gamma of shape 2: F(x) = 1 - e^-x (1 + x), by bisection."""
    lo, hi = 0.0, 60.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1.0 - math.exp(-mid) * (1.0 + mid) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def batch_seconds(shape: ModelShape, gpu: Gpu, *, sequences: int, lengths: LengthDistribution, prompt_tokens: float,
                  overhead: float, refill: bool = False, group_size: int = 1) -> float:
    """Seconds one GPU takes to decode a batch of ``sequences`` completions (module docstring); ``group_size``:
    the completions a refilled slot holds until its longest is done (echo2 refills a prompt group at a time)."""
    if sequences < 1:
        raise Echo2InputError("a batch needs at least one sequence")
    if refill:
        # a group slot holds its G sequences until the longest is done, so on average G x E[L] / E[max of G]
        # of them are decoding; each alive sequence's context is length-biased (longer ones are alive longer)
        group = max(1, min(group_size, sequences))
        alive = sequences * lengths.mean / lengths.expected_max(group)
        context = prompt_tokens + lengths.second_moment() / (2.0 * lengths.mean)
        step = roofline_seconds(shape, gpu, alive, alive * context) + overhead
        return step * sequences * lengths.mean / alive  # the batch's tokens at `alive` tokens a step
    xs = lengths.lengths(sequences)
    total, done, alive = 0.0, 0.0, sequences
    # between two finishing lengths the batch is constant and every context grows by one a step: the step
    # time is linear in the context sum, so a segment's time is its steps x the step at the segment's midpoint
    for x in xs:
        steps = x - done
        if steps > 0:
            context = alive * (prompt_tokens + (done + x) / 2.0)
            total += steps * (roofline_seconds(shape, gpu, alive, context) + overhead)
            done = x
        alive -= 1
    return total


def tokens_per_second(shape: ModelShape, gpu: Gpu, *, sequences: int, lengths: LengthDistribution,
                      prompt_tokens: float, overhead: float, refill: bool = False, group_size: int = 1) -> float:
    """Output tokens per second of one GPU over a whole batch (``batch_seconds``)."""
    seconds = batch_seconds(shape, gpu, sequences=sequences, lengths=lengths, prompt_tokens=prompt_tokens,
                            overhead=overhead, refill=refill, group_size=group_size)
    return sequences * lengths.mean / seconds
