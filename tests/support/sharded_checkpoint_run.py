"""A learner that checkpoints or resumes, in one process or as rank r of a torchrun group (run by
tests/e2e/test_sharded_checkpoint.py). Usage: [torchrun --nproc-per-node N] sharded_checkpoint_run.py SPEC.json

SPEC: model, store (URL), options (store options), key (the run key, hex), out (folder), and either
``save_at`` (train that many steps, checkpoint) or ``resume`` (restore the newest checkpoint that loads, then
checkpoint the restored state again into ``resave`` (URL) at its step); then one more step. Rank 0 writes
``out/result.json`` and the weights at the checkpoint and after the next step; every rank writes
``out/handed-R.json``: the shape of each tensor it handed to ``dcp.save``, local and global."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed.checkpoint as dcp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import step_files  # noqa: E402

from echo2.config import LearnerConfig, TrainConfig  # noqa: E402
from echo2.data.store import open_store  # noqa: E402
from echo2.learner.checkpoint import newest_checkpoint, save_checkpoint  # noqa: E402
from echo2.learner.distributed import init_process_group, make_learner, release_followers, world  # noqa: E402
from echo2.learner.process_group import leave  # noqa: E402

handed: list[dict] = []
_save = dcp.save


def recording_save(state_dict, **kwargs):  # (installed by main: importing this module changes nothing)
    """What this rank hands to DCP: every tensor's local shape (a DTensor's shard) and global shape."""
    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            handed.append({"key": prefix, "local": list(local.shape), "global": list(value.shape),
                           "dtensor": hasattr(value, "to_local")})

    walk("", state_dict)
    return _save(state_dict, **kwargs)


def tables(step: int) -> list[pa.Table]:
    """The rollout files of step ``step``: the same in every run, so a resumed run trains on what the saving one did."""
    return step_files(completion=lambda f, i: [4 + (i + k + step) % 200 for k in range(3 + i % 5)],
                      behavior=lambda k: -1.0 - 0.1 * k, reward=lambda f, g, s: float((g + s + f + step) % 3 == 0),
                      salt=f"-{step}")


def main(spec: dict) -> None:
    dcp.save = recording_save
    nproc = int(os.environ.get("WORLD_SIZE", "1"))
    config = TrainConfig(lr=1e-2)
    if nproc > 1:
        init_process_group(LearnerConfig(nproc=nproc))
    torch.manual_seed(0)
    learner = make_learner(Path(spec["model"]), config, temperature=1.0, shard_mb=1)
    rank, size = world()
    out = Path(spec["out"])
    if rank != 0:
        learner.follow()
        (out / f"handed-{rank}.json").write_text(json.dumps(handed))
        return
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(spec["key"]))
    store = open_store(spec["store"], spec.get("options"))
    state = {"history": [], "evals": {}, "wall_seconds": 0.0}
    result: dict = {"world": size}
    if spec.get("resume"):
        ckpt = newest_checkpoint(store, key.public_key(), lambda c: learner.load_sharded(store, c.prefix, c.entries))
        result["resumed_from"] = ckpt.step if ckpt else None
        learner.version = ckpt.step
        save_checkpoint(open_store(spec["resave"], spec.get("options")), ckpt.step, learner.save_sharded, state,
                        key=key, extra_files={})
    else:
        while learner.version < spec["save_at"]:
            learner.train_step(tables(learner.version + 1))
        save_checkpoint(store, learner.version, learner.save_sharded, state, key=key, extra_files=learner.extra_files)
    save_file({k: v.contiguous() for k, v in learner.full_tensors().items()}, str(out / "at_checkpoint.safetensors"))
    metrics = learner.train_step(tables(learner.version + 1))
    result.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"], step=learner.version)
    save_file({k: v.contiguous() for k, v in learner.full_tensors().items()}, str(out / "after.safetensors"))
    release_followers()
    (out / "handed-0.json").write_text(json.dumps(handed))
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
    leave()  # the groups down before exit, as a process of `echo2 learner` (process_group.leave)
