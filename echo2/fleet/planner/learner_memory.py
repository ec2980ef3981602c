"""What echo2's learner holds per rank, on the GPU and in host memory, and whether an instance can hold it.

Stated from the learner's code as it is (``learner/model_load.py``, ``learner/checkpoint_files.py``, ``learner/run.py``,
``learner/publisher.py``, ``learner/spot_check.py``; docs/learner.md "Memory at 8B-32B"), with N ranks (one per
GPU, FSDP2 over all of them) and P parameters:

GPU, every rank, at a step:
  * fp32 master weights, fp32 gradients and AdamW's two fp32 moments, sharded: 16 P / N;
  * the spot check's frozen copy (``trust.spot_check_fraction`` > 0) in the compute dtype, sharded: 2 P / N;
  * the KL reference (``train.kl_coef`` > 0; the workload assumes echo2's default 0): 2 P / N, not counted;
  * a layer's gathered bf16 parameters, a pack's activations, the head's chunks: ``ACTIVATIONS_GIB``.
Host, rank 0:
  * at load: the checkpoint in its file's dtype, once (2 P for a bf16 checkpoint), broadcast tensor by tensor;
  * at publish: the version in the publish dtype (bf16: 2 P), and the versions it keeps: with spot checks on the
    S + 1 newest (the delta base among them), else the delta base with ``publish.delta``;
Host, every other rank: one tensor in flight at load (the largest: ``LARGEST_TENSOR_SHARE`` of P, an embedding);
Host, every rank, at a checkpoint: one file of its shard (``publish.shard_mb``, 256 MB by default).
Every rank's process also holds its runtime (CUDA context, torch, the rollout columns): ``RUNTIME_GIB``.

An instance holds the learner when each GPU holds a rank's GPU need and the host RAM holds the sum of its ranks'
largest moment (load, publish or checkpoint, whichever is largest for rank 0; the others' together with it).
``check`` says which number refused an offer.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
ACTIVATIONS_GIB = 8.0
"""A rank's working set beyond its shards: two layers' gathered bf16 parameters, a pack's checkpointed activations,
the head's chunks (an assumption for packs of ``train.micro_batch_tokens``; measure with ``echo2 bench learner``)."""
RUNTIME_GIB = 6.0
"""Host memory of one rank's process beyond the model: python, torch, CUDA context, the step's columns (an
assumption)."""
LARGEST_TENSOR_SHARE = 0.02
"""The largest single tensor a follower receives at load, as a share of the parameters (Qwen3-30B-A3B's LM head:
151,936 x 2,048 = 1% of 30.5B; a small model's embedding up to ~15%, where the whole load is small anyway)."""
SHARD_FILE_GIB = 256 / 1024
"""``publish.shard_mb``'s default: the checkpoint file a rank builds before uploading it."""
SOURCE = ("stated from the learner's code (docs/learner.md, Memory at 8B-32B): GPU 16 P/N (+2 P/N with spot checks) "
          f"+ {ACTIVATIONS_GIB:g} GiB working set; host rank 0: 2 P at load, 2 P x versions held at publish; "
          f"{RUNTIME_GIB:g} GiB of runtime per rank (assumptions)")


@dataclass(frozen=True)
class LearnerNeeds:
    """Bytes per rank at each moment of a run (module docstring), in GiB."""

    ranks: int
    gpu_per_rank: float
    host_rank0_load: float
    host_rank0_publish: float
    host_other_rank: float
    host_checkpoint: float
    versions_held: int

    @property
    def host_total(self) -> float:
        """The instance's host RAM at its worst moment: rank 0's largest plus every other rank's."""
        rank0 = max(self.host_rank0_load, self.host_rank0_publish, self.host_checkpoint)
        return rank0 + (self.ranks - 1) * max(self.host_other_rank, self.host_checkpoint)

    def as_dict(self) -> dict:
        return {"ranks": self.ranks, "gpu_per_rank_gib": self.gpu_per_rank, "host_total_gib": self.host_total,
                "host_rank0_load_gib": self.host_rank0_load, "host_rank0_publish_gib": self.host_rank0_publish,
                "host_other_rank_gib": self.host_other_rank, "host_checkpoint_gib": self.host_checkpoint,
                "versions_held_at_publish": self.versions_held, "source": SOURCE}


def learner_needs(total_params_b: float, ranks: int, *, staleness: int, spot_check: bool, publish_delta: bool,
                  checkpoint_dtype_bytes: float = 2.0) -> LearnerNeeds:
    """What each of ``ranks`` learner ranks needs for a model of ``total_params_b`` billion parameters."""
    p = total_params_b * 1e9
    n = max(1, ranks)
    gpu = (16.0 + (2.0 if spot_check else 0.0)) * p / n / GIB + ACTIVATIONS_GIB
    held = (staleness + 1) if spot_check else (1 if publish_delta else 0)
    version = 2.0 * p / GIB  # a bf16 version
    return LearnerNeeds(
        ranks=n, gpu_per_rank=gpu, host_rank0_load=checkpoint_dtype_bytes * p / GIB + RUNTIME_GIB,
        host_rank0_publish=version * (1 + held) + RUNTIME_GIB,
        host_other_rank=LARGEST_TENSOR_SHARE * checkpoint_dtype_bytes * p / GIB + RUNTIME_GIB,
        host_checkpoint=SHARD_FILE_GIB + RUNTIME_GIB, versions_held=1 + held)


def check(needs: LearnerNeeds, gpu_memory_gib: float | None, host_memory_gib: float | None) -> str | None:
    """None when an instance with these memories holds the learner (unknown sizes get the benefit of the doubt),
    else the number that refused it."""
    if gpu_memory_gib is not None and gpu_memory_gib < needs.gpu_per_rank:
        return (f"GPU memory {gpu_memory_gib:g} GiB < {needs.gpu_per_rank:.0f} GiB a rank needs (training state "
                "16 B/param sharded, the spot check's copy, the working set)")
    if host_memory_gib is not None and host_memory_gib < needs.host_total:
        worst = ("a publish" if needs.host_rank0_publish >= needs.host_rank0_load else "the load")
        return (f"host RAM {host_memory_gib:g} GiB < {needs.host_total:.0f} GiB the ranks need at {worst} (rank 0 "
                f"holds {needs.versions_held} bf16 version(s) of {needs.host_rank0_load - RUNTIME_GIB:.0f} GiB "
                "at a publish)")
    return None
