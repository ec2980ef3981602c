"""What `make setup` installs from: the constraints let any torch build bring its own CUDA packages, and the torch
floor is what the code imports."""

from __future__ import annotations

import re

from conftest import REPO

TORCH_OWN = re.compile(r"^(torch|nvidia-[\w-]+|cuda-[\w-]+|triton|setuptools)==", re.I)
"""What each torch build pins for itself (its CUDA libraries, triton, the setuptools range of its own metadata):
a constraint on any of them makes another build (``make setup TORCH=torch==2.11.0 ...``) unresolvable. Checked with
pip's resolver on 2026-12-07: torch 2.11.0 (CUDA 13.0) needs cuda-toolkit 13.0.2 and setuptools<82, which the
constraints pinned at 13.0.3.0 and 84.2.1."""


def test_the_constraints_leave_torch_and_its_cuda_packages_to_the_torch_build():
    lines = (REPO / "requirements-constraints.txt").read_text().splitlines()
    pinned = [line for line in lines if TORCH_OWN.match(line)]
    assert not pinned, f"constraints pin what a torch build brings itself: {pinned}"
    makefile = (REPO / "Makefile").read_text()
    own = re.search(r"^TORCH_OWN := '(.+)'$", makefile, re.M).group(1)
    for name in ("torch==", "nvidia-", "cuda-", "triton==", "setuptools=="):  # `make lock` leaves them out too
        assert name in own, name


def test_the_torch_floor_has_what_the_learner_imports():
    import tomllib

    floor = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                 if d.startswith("torch"))
    assert floor == "torch>=2.8"  # FSDP2's set_force_sum_reduction_for_comms, DCP's broadcast_from_rank0
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401

    assert hasattr(FSDPModule, "set_force_sum_reduction_for_comms")
