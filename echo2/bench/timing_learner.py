"""The learner side of the overlap benchmark's *timing workload* (never used by ``echo2 run``).

``TimingLearner`` is the real ``Learner`` on the tiny model (``bench/tiny_model.py``): every step
validates, assembles and trains on the real rollout files, then sleeps until the step has taken
``train_seconds``, which plays T_train of the capacity model. Each published version carries a
ballast tensor, so that a version is ``ballast_mb`` bigger and dissemination moves real bytes
(the actors' timing engine accepts whatever arrives and loads nothing).
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import torch

from echo2.config import TrainConfig
from echo2.learner.learner import Learner

BALLAST = "echo2_bench.ballast"
"""Name of the ballast tensor in published versions (never in checkpoints: ``full_tensors`` has none)."""


class TimingLearner(Learner):
    def __init__(self, model_dir: Path, config: TrainConfig, *, temperature: float, train_seconds: float,
                 ballast_mb: float, **options):
        super().__init__(model_dir, config, temperature=temperature, **options)
        self.train_seconds = train_seconds
        # random bytes, not zeros: nothing on the way (hashing, a compressing transport) gets it cheaper
        self.ballast = torch.randint(-2**31, 2**31 - 1, (int(ballast_mb * 2**20) // 4,), dtype=torch.int32)

    def train_step(self, tables: list[pa.Table]) -> dict:
        t0 = time.time()
        metrics = super().train_step(tables)
        metrics["real_step_seconds"] = time.time() - t0
        time.sleep(max(0.0, self.train_seconds - (time.time() - t0)))
        metrics["step_seconds"] = time.time() - t0
        return metrics

    def policy_version_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, meta = super().policy_version_tensors()
        return {**tensors, BALLAST: self.ballast}, meta
