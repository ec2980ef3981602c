"""How the learner splits a policy for training: activation checkpointing per decoder layer, then FSDP2 units.

Every decoder layer is its own FSDP2 unit (``fully_shard``), then the ``PolicyLogprobs`` wrapper as the root unit:
its forward runs the chunked head, so the head's weight is unsharded there. Each unit reduces its own gradients
and must sum them, not average: the loss is already normalized by the step's tokens over all ranks.

Imports torch only (the GPU check runs it where nothing else is installed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from echo2.learner.logprobs import PolicyLogprobs


def prepare_units(policy: "PolicyLogprobs", *, trainable: bool, activation_checkpointing: bool, sharded: bool,
                  dtype: torch.dtype) -> None:
    """Activation checkpointing per layer (trainable models), then FSDP2 units when sharded."""
    if trainable and activation_checkpointing:
        checkpoint_layers(policy)
    if sharded:
        units = shard_units(policy, dtype)
        for unit in units:  # each unit reduces its own gradients: every one must sum, not average
            unit.set_gradient_divide_factor(1.0)  # the loss is normalized by the step's tokens over all ranks
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        if not trainable:  # no backward: the root reshards after its forward too
            units[-1].set_reshard_after_forward(True)


def checkpoint_layers(policy: "PolicyLogprobs") -> None:
    """Recompute each decoder layer's activations in backward (torch's non-reentrant checkpoint).

    The composable ``checkpoint`` works by forward hooks on the layer, so no wrapper module is inserted
    and every parameter keeps its name (published weights, checkpoints, optimizer state); it records the
    autocast state and the RNG state of the forward and replays them in the recomputation.
    """
    from torch.distributed._composable import checkpoint

    for layer in policy.causal_lm.get_decoder().layers:
        checkpoint(layer)


def shard_units(policy: "PolicyLogprobs", dtype: torch.dtype) -> list[torch.nn.Module]:
    """FSDP2 units of a ``PolicyLogprobs``: each decoder layer, then the wrapper as the root (its forward runs the
    chunked head, so the head's weight is unsharded there); bf16 compute where the compute dtype ``dtype`` is bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = getattr(policy.causal_lm.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(policy.causal_lm).__name__} has no decoder .layers to shard one by one")
    precision = MixedPrecisionPolicy()
    if dtype != torch.float32:
        precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    units = [*layers, policy]
    for unit in units:
        fully_shard(unit, mp_policy=precision)
    return units
