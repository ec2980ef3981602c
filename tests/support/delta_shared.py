"""Shared by the tests: moved out of test_delta.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and bits(a[k]) == bits(b[k]) for k in a)


def nudged(t: torch.Tensor, share: float, gen: torch.Generator, ulps=(1, -1)) -> torch.Tensor:
    """``t`` with ``share`` of its elements moved by a few ulps (what an AdamW step does to bf16 weights)."""
    out = t.clone()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    flat = out.reshape(-1).view(width)
    mask = torch.rand(flat.shape, generator=gen) < share
    steps = torch.tensor(ulps, dtype=width)[torch.randint(len(ulps), flat.shape, generator=gen)]
    flat[mask] += steps[mask]
    return out
