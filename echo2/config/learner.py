"""The ``learner`` section of the config: the learner's processes and nodes, its device and threads, the market of
its machine and how it hears of a preemption (``train.py`` holds the loss, publishing and trust sections)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from echo2.config._base import _Section, check_device_name


class LearnerConfig(_Section):
    """The learner's processes, machine, market and preemption."""

    nproc: int = Field(1, ge=1)
    """Learner processes (torchrun on one node): the policy is sharded over them with FSDP, each takes
    a token-balanced share of the packed micro-batches, rank 0 runs the flow, reads rollouts and publishes
    (``learner/distributed.py``)."""
    nnodes: int = Field(1, ge=1)
    """Nodes of the learner, each running ``nproc`` processes: every node runs ``echo2 learner CONFIG --nnodes N
    --node-rank R --rdzv-endpoint HOST:PORT`` (torchrun's static rendezvous at node 0, ``learner/torchrun.py``);
    node 0 resolves the run and runs the flow, the others only take their share of the arithmetic. ``echo2 run``
    starts one node and refuses more."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of FSDP's collectives in a learner with nproc > 1 (auto: nccl on GPUs, gloo on
    CPUs; gloo with the learner on GPUs is refused). Announcements and metric sums always go over a gloo group of
    their own (``learner/process_group.py``)."""
    device: str = "auto"
    """Where the learner computes (``echo2/devices.py``): ``auto`` (each rank's GPU where CUDA is available, else the
    CPU), ``cpu``, ``cuda`` or ``cuda:N``. The model, the KL reference, the spot check's copy, evaluation and every pack
    live there. ``cuda`` where CUDA is not available is refused in one line."""
    num_threads: int | None = Field(None, ge=1)
    """torch threads of the learner (None = torch's default)."""
    market: Literal["on-demand", "spot"] = "on-demand"
    """The learner's machine. ``spot``: a preemption notice (SIGTERM, or the metadata notice of
    ``learner.preemption_source``) checkpoints at once and leaves the actors running, waiting for the relaunched
    learner (a SkyPilot managed job, or a retried Prefect flow run, resuming the same run id) to adopt them;
    the cost report bills the learner at spot prices and counts the gap (``docs/reliability.md``).
    ``on-demand``: SIGTERM stops the run and its fleet, as a user's Ctrl-C does."""
    preemption_source: Literal["off", "aws", "gcp", "auto"] = "off"
    """Poll the learner machine's instance metadata for a spot notice (as ``rollout.preemption_source`` does
    for actors); only read with ``learner.market: spot``. ``$ECHO2_PREEMPTION_SOURCE`` overrides it."""
    preemption_poll_s: float = Field(5.0, gt=0)
    """How often the learner's preemption watcher asks the metadata."""
    sigterm_notice_s: float = Field(30.0, gt=0)
    """Seconds a SIGTERM gives a spot learner before its machine goes (SkyPilot's, Kubernetes' and Prefect's usual
    grace is 30 s; the learner-reclaim scenario sends 2): it finishes the step under way only if the step and a
    checkpoint fit in them (``echo2/learner/notice.py``). Only read with ``learner.market: spot``."""

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device_name(value)
