"""The learner's models on their device: loaded whole in one process, or built on ``meta`` and filled shard by shard.

Two ways, by whether the learner shards (``Learner.sharded``: several ranks, or one GPU, ``process_group.py``):

    whole     ``from_pretrained`` straight onto the device (weights stream in tensor by tensor, converted to the
              storage dtype on the way): one process on the CPU, a LoRA run, a one-process placement check on meta
    sharded   every rank builds the model on the ``meta`` device (parameters without memory; buffers such as rotary
              frequencies are computed for real, on the CPU), FSDP2 shards it (the caller's ``shard``), each rank
              allocates only its own shards on the device (``to_empty``) and puts the buffers back; then rank 0 reads
              the checkpoint once, in the file's dtype, into host memory, and ``set_model_state_dict(...,
              broadcast_from_rank0=True)`` sends each tensor to every rank, which keeps its own shard of it. No rank
              but 0 ever holds the model in host memory, and rank 0 holds it once in the file's dtype (2 bytes a
              parameter for a bf16 checkpoint: 61 GB for Qwen3-30B-A3B), never a second copy in fp32

The master weights are fp32 either way (what AdamW updates and checkpoints hold); frozen copies (the KL reference,
the spot check's) are stored in the compute dtype, since nothing updates them.

Imports torch, transformers and accelerate only (the GPU check runs it where nothing else is installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch


def load_whole(model_dir: Path, *, device: torch.device, dtype: torch.dtype, attention: str) -> torch.nn.Module:
    """``from_pretrained`` onto ``device`` in ``dtype`` (weights left out on ``meta``), in eval mode."""
    from transformers import AutoModelForCausalLM

    # the CPU loads as transformers does by default: with device_map "cpu" the learner's steps ran slower on the
    # development machine (docs/benchmarks.md)
    placement = {} if device.type == "cpu" else {"device_map": str(device)}
    # use_kernels=False: transformers (5.2x) otherwise swaps layers for kernels it downloads from the Hub at load
    # time: code nobody reviewed, a network the learner may not have, and a refusal on ``meta``
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention,
                                                 use_kernels=False, **placement)
    return model.eval()


def skeleton(model_dir: Path, *, dtype: torch.dtype, attention: str) -> tuple[torch.nn.Module, dict]:
    """The model with its parameters on ``meta`` (no memory) and its buffers computed on the CPU, tied weights tied;
    and those buffers by name, to put back after ``to_empty`` (which would leave them uninitialized)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = attention
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    model.tie_weights()  # accelerate's empty init leaves a tied head untied
    return model.eval(), {name: buffer.clone() for name, buffer in model.named_buffers()}


def materialize(model: torch.nn.Module, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Allocate ``model``'s (sharded) parameters on ``device``, uninitialized, and put its buffers back there."""
    model.to_empty(device=device)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.to(device)


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in the file's dtype on the CPU, under the in-memory names transformers gives them
    (its load converts the Hub's layout, e.g. a mixture of experts' per-expert tensors into fused ones)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", device_map="cpu", use_kernels=False)
    return dict(model.state_dict())


def broadcast_weights(model: torch.nn.Module, read: Callable[[], dict[str, torch.Tensor]], *, rank: int) -> None:
    """Fill a sharded ``model`` from rank 0's full state dict (``read()``, called on rank 0 only): each tensor is sent
    to every rank, which keeps its own shard of it (DCP's ``broadcast_from_rank0``); a tied head may be left out.
    Whether ``read()``'s tensors are the model's is the caller's to check first (``Learner.check_weights``): a
    refusal here, on rank 0 alone, would leave the other ranks waiting in the broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = read() if rank == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                strict=False))
