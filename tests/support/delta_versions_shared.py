"""Shared by the tests: moved out of test_delta_versions.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

import torch
from delta_shared import nudged
from relay_helpers import KEY

from echo2.config import BroadcastConfig, PublishConfig, TrainConfig
from echo2.learner.publisher import Publisher

MODEL_FILES = {"config.json": b'{"model_type": "llama"}'}


def make_publisher(store, **fields):
    """A delta publisher; ``fields``: of the ``publish`` section, else of ``train``."""
    publish = {k: v for k, v in fields.items() if k in PublishConfig.model_fields}
    train = {k: v for k, v in fields.items() if k not in publish}
    publish = PublishConfig(**{"delta": True, "keyframe_every": 4, "keep_versions": 100, **publish})
    return Publisher(store, train=TrainConfig(**{"staleness": 2, **train}), publish=publish,
                     broadcast=BroadcastConfig(mode="store", chunk_mb=0.01), key=KEY, extra_files=MODEL_FILES)


def versions(n, seed=0, share=0.03):
    """n versions of a small bf16 model, each a few ulps from the one before at ``share`` of the elements."""
    gen = torch.Generator().manual_seed(seed)
    v = {"embed": torch.randn(200, 16, generator=gen).to(torch.bfloat16),
         "layer.w": torch.randn(16, 48, generator=gen).to(torch.bfloat16), "norm": torch.ones(16, dtype=torch.bfloat16)}
    out = [v]
    for _ in range(n - 1):
        out.append({k: nudged(t, share, gen) for k, t in out[-1].items()})
    return out


def publish_all(pub, vs):
    return [pub.publish(i, {k: t.clone() for k, t in v.items()}, {"weights": "full"}) for i, v in enumerate(vs)]
