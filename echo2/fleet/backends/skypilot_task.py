"""What SkyPilot is asked to run for one actor: its names and labels, the task file, and the task with its
candidate offers (``build_task``), as data that ``sky_bridge.py`` builds into SkyPilot's ``sky.Task`` in SkyPilot's
own environment. The backend that launches, watches and downs these tasks is ``skypilot.py``."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml

from echo2 import shipped
from echo2.config import SkyPilotFleetConfig
from echo2.fleet.backends.base import ActorLaunch, ActorOffer

DEFAULT_TASK_FILE = shipped.path("skypilot", "actor.yaml")
RUN_LABEL = "echo2-run"
ACTOR_LABEL = "echo2-actor"


# -- names and labels ---------------------------------------------------------------------------
def _fold(text: str, limit: int) -> str:
    """``text`` as a GCP label value / cluster name part: lowercase ``[a-z0-9-]``; a hash keeps two
    different texts that fold alike apart."""
    folded = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "x"
    if folded == text and len(folded) <= limit:
        return folded
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    return f"{folded[: limit - 7].rstrip('-')}-{digest}"


def run_label(run_id: str) -> str:
    return _fold(run_id, 63)


def cluster_name(run_id: str, actor_id: str) -> str:
    """``e2-<run>-<actor>``: starts with a letter, fits SkyPilot's and the clouds' name rules."""
    return f"e2-{_fold(run_id, 24)}-{_fold(actor_id, 20)}"


# -- the task ----------------------------------------------------------------------------------
def load_task_config(path: str | Path | None) -> dict:
    path = Path(path) if path else DEFAULT_TASK_FILE
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"SkyPilot task file {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"SkyPilot task file {path} must hold a mapping")
    return config


def actor_envs(spec: ActorLaunch, relay_port: int) -> dict[str, str]:
    """The plain environment of one actor on a cloud VM (nothing secret). Which cloud it landed on, and
    so where its preemption notices and public address come from, the actor reads from SkyPilot's own
    job environment (the task file's ``auto``s, ``echo2/preemption.py``)."""
    return {"ECHO2_RUN_URL": spec.run_url, "ECHO2_ACTOR_ID": spec.actor_id, **spec.env,
            "ECHO2_RELAY_HOST": "0.0.0.0", "ECHO2_RELAY_PORT": str(relay_port)}


def build_task(spec: ActorLaunch, config: SkyPilotFleetConfig, *, run_id: str, workdir: Path,
               task_config: dict | None = None) -> dict:
    """The actor's task, as ``sky_bridge.py`` takes it: the task file, its envs and secrets, the any_of candidates
    (``sky.Resources`` keyword arguments), and ``workdir`` (echo2's staged source,
    ``skypilot_trust.stage_actor_source``) as all it uploads."""
    base = dict(task_config if task_config is not None else load_task_config(config.task_file))
    refuse_uploads(base)
    base["workdir"] = str(workdir)
    resources_config = base.pop("resources", None) or {}
    offers = (spec.offer, *spec.alternatives)
    labels = {RUN_LABEL: run_label(run_id), ACTOR_LABEL: _fold(spec.actor_id, 63)}
    ceiling = price_ceiling(offers)
    candidates = []
    for offer in offers:
        overrides = {"infra": f"{offer.provider}/{offer.region}", "instance_type": offer.instance_type,
                     "use_spot": offer.spot, "ports": config.relay_port, "labels": labels}
        if ceiling is not None:
            overrides["max_hourly_cost"] = ceiling
        if offer.gpu_count:
            overrides["accelerators"] = {offer.gpu: offer.gpu_count}
        candidate = {**_plain_resources(resources_config), **overrides}
        if candidate not in candidates:  # any_of is a set of resources
            candidates.append(candidate)
    return {"config": base, "envs": actor_envs(spec, config.relay_port), "secrets": dict(spec.secrets),
            "candidates": candidates}


def price_ceiling(offers: tuple[ActorOffer, ...]) -> float | None:
    """The most one instance of a launch may cost per hour: the dearest of its offer and alternatives (the manager
    names only alternatives within the budget, and with ``actors: auto`` none dearer than the chooser's offer, so
    this is the price the plan bought). Given to SkyPilot as ``Resources(max_hourly_cost=...)``: SkyPilot 0.14
    filters its catalog by it (spot price for spot) where it chooses an instance type itself
    (``sky/catalog/common.py``); with the instance type named, as here, it is the launch's stated ceiling. None
    where no offer has a price (SkyPilot wants a positive number)."""
    prices = [o.usd_per_hour for o in offers if o.usd_per_hour > 0]
    return max(prices) if prices else None


def refuse_uploads(config: dict) -> None:
    """A task file names no local files to upload: the backend sets ``workdir`` to echo2's staged source, and
    a local ``file_mounts`` source would copy the learner's files to machines we do not own."""
    if config.get("workdir") is not None:
        raise ValueError("SkyPilot task file: remove `workdir`: the backend uploads echo2's source alone "
                         "(echo2/fleet/backends/skypilot_trust.py), never a folder of the learner's machine")
    local = [f"{dst}: {src}" for dst, src in (config.get("file_mounts") or {}).items()
             if not (isinstance(src, str) and "://" in src)]
    if local:
        raise ValueError(f"SkyPilot task file: file_mounts may name buckets (s3://, gs://) only, not "
                         f"{'; '.join(local)}: local files would be copied to machines we do not own")


def _plain_resources(config: dict) -> dict:
    """The task file's resources, as keyword arguments the candidates are laid over."""
    allowed = ("disk_size", "disk_tier", "image_id", "cpus", "memory", "network_tier", "autostop")
    unknown = sorted(set(config) - set(allowed) - {"use_spot", "ports", "labels", "accelerators", "infra",
                                                   "instance_type", "any_of"})
    if unknown:
        raise ValueError(f"SkyPilot task file resources: {', '.join(unknown)} cannot be combined with the "
                         f"candidate offers (allowed: {', '.join(allowed)})")
    return {k: v for k, v in config.items() if k in allowed}
