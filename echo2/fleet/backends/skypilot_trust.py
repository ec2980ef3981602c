"""What a SkyPilot actor VM gets from the operator: echo2's source and the actor's own scoped secrets,
nothing else (docs/architecture.md, "Trust boundaries").

SkyPilot's defaults would hand an untrusted VM much more:

- ``workdir: .`` rsyncs whatever folder the learner was started from: started from ``$HOME`` that is
  ``~/.config/echo2/keys/`` (the run's signing and CA key), ``~/.aws`` and the rest. The actor's workdir
  is instead a folder staged here holding exactly what ``pip install`` of the actor needs:
  ``pyproject.toml``, ``setup.py``, ``README.md`` and ``LICENSE`` (its ``readme`` and ``license-files``),
  and the ``.py`` files of ``echo2/`` and ``infra/`` (installed as ``echo2._infra``: setup.py maps it).
- Every launch uploads the local credential files of every cloud SkyPilot knows, unless that cloud's
  ``remote_identity`` is ``NO_UPLOAD``. That key exists only in the config (a task's ``config:`` may
  override it for Kubernetes and Azure only, ``OVERRIDEABLE_CONFIG_KEYS_IN_TASK`` in 0.14), so every
  launch request carries a config override with ``NO_UPLOAD`` for every cloud that has the key
  (``launch_config`` of ``sky_bridge.py``, which sends every launch): the SDK sends the client's config with
  each request and the API server applies it.
- Clouds without the key (Lambda, RunPod ... in 0.14) and R2/CoreWeave storage keys are uploaded
  whenever their files exist on the API server's machine; with a local API server
  ``files_uploaded_anyway`` finds them and the backend refuses to start while there are any.

What NO_UPLOAD does not change: the identity SkyPilot gives the VM itself. On AWS that is its
``skypilot-v1`` instance profile (AmazonEC2FullAccess, AmazonS3FullAccess) unless
``fleet.aws_node_profile`` names another; on GCP its ``skypilot-v1`` service account
(storage.admin, compute.admin), which 0.14 cannot replace (GCP's ``remote_identity`` takes no name).
So AWS without the node profile (``infra/iam/actor-node-policy.json``) and GCP are refused
(``SkyPilotFleetConfig.broad_vm_identity``) unless ``allow_broad_vm_identity`` voids the boundary.

The store options an actor is sent leave out whatever looks like a credential (``public_store_options``):
it gets its own scoped, expiring ones.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import echo2
from echo2.fleet.backends.skypilot_api import bridge

PROJECT_ROOT = Path(echo2.__file__).resolve().parents[1]
"""The source checkout the learner runs from (a wheel install has no source to stage: ``ActorSourceMissing``)."""
PACKAGES = ("echo2", "infra")
"""The folders whose ``.py`` files the actor installs: infra/ is the package ``echo2._infra`` (setup.py), and
its ``__init__.py`` alone lets that build; its data files (prices, task files) are no actor's business."""
PROJECT_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")
"""Beside the packages, what the actor's ``pip install -e .`` reads: the package list, ``readme``, ``license-files``."""

class ActorSourceMissing(RuntimeError):
    """echo2 does not run from a source checkout, so there is no source to stage for the actors."""


def stage_actor_source(root: Path = PROJECT_ROOT) -> Path:
    """A fresh folder holding exactly the actor's install source: ``PROJECT_FILES`` and the packages'
    ``.py`` files (no caches, no stray files, nothing outside the packages). The caller removes it."""
    missing = [name for name in (*PROJECT_FILES, *PACKAGES) if not (root / name).exists()]
    if missing:
        raise ActorSourceMissing(f"fleet.backend skypilot installs echo2 on each actor from its source, but "
                                 f"{root} has no {', '.join(missing)}: run the learner from a source checkout")
    dest = Path(tempfile.mkdtemp(prefix="echo2-actor-source-"))
    for name in PROJECT_FILES:
        shutil.copy2(root / name, dest / name)
    for path in sorted(p for package in PACKAGES for p in (root / package).rglob("*.py")):
        if "__pycache__" in path.parts or path.is_symlink():
            continue  # a symlink could point anywhere: only the package's own files travel
        target = dest / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return dest


def allowed_source_file(relative: str) -> bool:
    """Whether ``relative`` (a path inside a staged source) is one ``stage_actor_source`` may copy."""
    parts = Path(relative).parts
    return relative in PROJECT_FILES or (len(parts) > 1 and parts[0] in PACKAGES and relative.endswith(".py"))


def files_uploaded_anyway() -> list[str]:
    """Local credential files SkyPilot would copy to every VM whatever ``remote_identity`` says (clouds
    without the key, storage-only clouds); only meaningful where the API server runs on this machine."""
    return bridge("credentials")["files"]


def api_server_is_local() -> bool:
    """Whether SkyPilot's API server runs here (started by the SDK on first use), so its files are ours."""
    return bridge("credentials")["local"]


def check_no_credentials_travel() -> None:
    """Refuse, in one line, a launch that would copy credential files no setting can keep home."""
    found = bridge("credentials")
    if not found["local"]:
        return  # a remote API server's files are its operator's to keep clean (docs/fleet.md, "Spot actors")
    leaked = found["files"]
    if leaked:
        raise RuntimeError(f"SkyPilot would copy {', '.join(leaked)} to every actor VM (its clouds have no "
                           f"remote_identity: NO_UPLOAD): move them off this machine, or launch through an API "
                           f"server without them (SKYPILOT_API_SERVER_ENDPOINT)")


def remove_staged(path: Path | None) -> None:
    if path is not None and path.name.startswith("echo2-actor-source-"):
        shutil.rmtree(path, ignore_errors=True)


CREDENTIAL_OPTION_NAMES = ("key", "secret", "token", "password", "credential", "access_key", "session")
"""Store options that look like credentials never travel to a remote actor (they get scoped ones)."""


def public_store_options(options: dict) -> dict:
    """``store.options`` without anything secret-looking, at any depth (``client_kwargs`` too)."""
    out = {}
    for k, v in options.items():
        if any(word in str(k).lower() for word in CREDENTIAL_OPTION_NAMES):
            continue
        out[k] = public_store_options(v) if isinstance(v, dict) else v
    return out
