"""Key names of the run layout (DESIGN.md, "Object store layout"). Keys are relative to the run root."""

from __future__ import annotations

import re

RUN_JSON = "run.json"
LATEST = "policy/LATEST"
MANIFEST = "manifest.json"
SUMMARY = "reports/summary.json"

_VERSION_RE = re.compile(r"^v(\d{6,})$")
_STEP_RE = re.compile(r"^step-(\d{6,})$")


def version_name(version: int) -> str:
    return f"v{version:06d}"


def policy_dir(version: int) -> str:
    return f"policy/{version_name(version)}"


def rollout_key(version: int, actor_id: str, seq: int) -> str:
    return f"rollouts/{version_name(version)}/{actor_id}-{seq:06d}.arrow"


def version_of_rollout_key(key: str) -> int | None:
    """``rollouts/v000042/a-000001.arrow`` -> 42 (None for keys outside the layout)."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "rollouts" or not parts[2].endswith(".arrow"):
        return None
    m = _VERSION_RE.match(parts[1])
    return int(m.group(1)) if m else None


def parse_version_dir(name: str) -> int | None:
    m = _VERSION_RE.match(name)
    return int(m.group(1)) if m else None


def consumed_key(step: int) -> str:
    return f"ledger/consumed/step-{step:06d}.json"


def checkpoint_dir(step: int) -> str:
    return f"checkpoints/step-{step:06d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def quarantine_key(key: str) -> str:
    return f"quarantine/{key}"


def peer_key(actor_id: str) -> str:
    return f"peers/{actor_id}.json"
