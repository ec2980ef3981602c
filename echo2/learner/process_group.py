"""The learner's process groups: NCCL (or gloo on CPUs) for FSDP's collectives, gloo for everything else.

    the default group     torchrun's ranks; ``nccl`` on GPUs, ``gloo`` on CPUs. On GPUs it carries FSDP's
                          all-gathers and reduce-scatters only, all inside a step, a publish's gather of a bucket
                          or a synchronized generation: work every rank does at once, never one rank waiting while
                          another works alone. Its timeout bounds a stuck collective (NCCL's watchdog ends the
                          processes past it: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``).
    the control group     gloo over the same ranks, on CPU tensors: rank 0's announcements (``distributed.py``),
                          the step's metric sums, DCP's planning, the gathering of checkpoint entries. Followers
                          wait here while rank 0 works alone (waits for rollouts, validates and spot-checks them on the
                          CPU, writes to the store), for as long as that takes: its timeout is a week, and a rank
                          that dies ends the group anyway (torchrun stops the others).

One process on a GPU also shards (FSDP2 over a one-rank group, ``one_rank_group``): its ``MixedPrecisionPolicy``
computes in bf16 everywhere, mixture-of-experts experts included (autocast cannot reach them: ``grouped_mm`` is not
autocast-aware and transformers casts the experts' inputs to the weights' dtype, fp32), while the master weights,
gradients and AdamW stay fp32.

Imports torch and the standard library only (besides ``echo2.errors``).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from echo2.errors import Echo2InputError

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""The default group's: one collective of a step (NCCL's watchdog ends the processes past it)."""
CONTROL_TIMEOUT = timedelta(days=7)
"""The control group's: a follower may wait this long for rank 0's next announcement."""

_control = None


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def backend_for(device: torch.device, asked: str) -> str:
    """The default group's backend for ``device`` (``learner.dist_backend``: auto, gloo or nccl), or one line why
    not."""
    if asked == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if asked == "gloo" and device.type == "cuda":
        raise Echo2InputError("learner.dist_backend gloo with the learner on CUDA devices: FSDP's collectives of GPU "
                              "tensors need nccl (set learner.dist_backend to auto or nccl)")
    if asked == "nccl" and device.type != "cuda":
        raise Echo2InputError(f"learner.dist_backend nccl needs the learner on CUDA devices, not {device.type} "
                              "(set learner.device to auto or cuda, or learner.dist_backend to auto or gloo)")
    return asked


def init_process_group(device: torch.device, backend: str) -> tuple[int, int]:
    """Join the group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR in the environment; LOCAL_RANK picks the
    GPU) with ``backend`` (``backend_for``), and make the control group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=device if backend == "nccl" else None)
    control_group()
    return world()


def one_rank_group(device: torch.device) -> None:
    """A group of this process alone (no torchrun): what FSDP2 needs to shard one process (module docstring)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "gloo":  # one rank talks to nobody: loopback suits any machine, a sandbox without network too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback())
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT)
    control_group()


def leave() -> None:
    """Take this process's groups down (the control group with the default one), as its last act in them: a process
    that exits with them still up can abort in the C++ teardown of gloo's threads ("terminate called without an
    active exception", SIGABRT). Its torchrun then reports the node failed, and the other nodes' torchruns wait
    for it at their exit barrier for minutes. Local: it waits on no other rank."""
    global _control
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _control = None


def _loopback() -> str:
    import socket

    names = [name for _, name in socket.if_nameindex()]
    return "lo" if "lo" in names else names[0]


def control_group():
    """The gloo group of every rank, with the long timeout (module docstring); a new group even where the default
    one is gloo, whose timeout bounds a step's collectives."""
    global _control
    import torch.distributed as dist

    if _control is None:
        _control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return _control
