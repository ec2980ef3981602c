"""SkyPilot as the SkyPilot backend (``backends/skypilot.py``) reaches it: ``SkyApi``, the calls that go to
SkyPilot's API server (and through it, the clouds), and ``SkySdk``, those calls through SkyPilot's client SDK.

SkyPilot runs in an environment of its own (it pins click<8.2, which would hold the learner's transformers and
huggingface-hub back): ``make setup`` builds ``.venv-sky``. echo2 never imports it; every call runs
``sky_bridge.py`` (SkyPilot and the standard library only) with that environment's Python (``sky_python``), one
JSON request in and one answer out (``bridge``). The tests put a test double in ``SkySdk``'s place (no cloud is
reachable from here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

SKY_PYTHON_ENV = "ECHO2_SKY_PYTHON"
"""The Python of the environment SkyPilot is installed in (``.venv-sky/bin/python`` of the checkout by default)."""
BRIDGE = Path(__file__).with_name("sky_bridge.py")
CHECKOUT_SKY_VENV = Path(__file__).resolve().parents[3] / ".venv-sky"
INSTALL = ("`make setup` builds .venv-sky beside the checkout (SkyPilot in an environment of its own), or set "
           f"${SKY_PYTHON_ENV} to the Python of an environment with `pip install 'skypilot[aws,gcp]'`")


class SkyPilotUnavailable(RuntimeError):
    """SkyPilot's environment is not found (``make setup`` builds it; ``$ECHO2_SKY_PYTHON`` names another)."""


class SkyError(RuntimeError):
    """An error SkyPilot raised in its own environment; each is raised as a subclass named as SkyPilot's class
    (``sky_error``), so a caller tells them apart by name as it would in process. ``sky_mro``: its bases' names."""

    sky_mro: tuple[str, ...] = ()


_SKY_ERRORS: dict[str, type[SkyError]] = {}


def sky_error(name: str, message: str, mro: list[str] | tuple[str, ...] = ()) -> SkyError:
    """SkyPilot's exception ``name`` (bases ``mro``) as raised here."""
    cls = _SKY_ERRORS.get(name)
    if cls is None:
        cls = _SKY_ERRORS[name] = type(name, (SkyError,), {"__module__": "sky.exceptions"})
    exc = cls(message)
    exc.sky_mro = tuple(mro)
    return exc


def sky_python() -> str:
    """The Python SkyPilot is installed under: ``$ECHO2_SKY_PYTHON``, else the checkout's ``.venv-sky``, else the
    interpreter behind a ``sky`` command on PATH; ``SkyPilotUnavailable`` saying how to install it otherwise."""
    named = os.environ.get(SKY_PYTHON_ENV)
    if named:
        if not os.access(named, os.X_OK):
            raise SkyPilotUnavailable(f"${SKY_PYTHON_ENV}={named} is not an executable Python: {INSTALL}")
        return named
    venv = CHECKOUT_SKY_VENV / "bin" / "python"
    if venv.exists():
        return str(venv)
    command = shutil.which("sky")
    if command:
        try:
            first = Path(command).read_text(errors="replace").split("\n", 1)[0]
        except OSError:
            first = ""
        interpreter = first[2:].strip().split(" ")[0] if first.startswith("#!") else ""
        if interpreter and os.access(interpreter, os.X_OK):
            return interpreter
    raise SkyPilotUnavailable(f"SkyPilot's environment is not found: {INSTALL}")


def bridge(op: str, request: dict | None = None, *, timeout: float | None = None, env: dict | None = None) -> Any:
    """``op`` of ``sky_bridge.py`` run by SkyPilot's Python: its result, or SkyPilot's error raised as a
    ``SkyError`` of the same name. ``env``: the bridge process's environment (this one's by default)."""
    python = sky_python()
    try:
        proc = subprocess.run([python, str(BRIDGE), op], input=json.dumps(request or {}), capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"SkyPilot {op} did not answer in {timeout:g} s") from None
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[-500:]
        raise SkyPilotUnavailable(f"SkyPilot's bridge ({python}) gave no answer to {op} (exit {proc.returncode}): "
                                  f"{tail or 'no output'}; {INSTALL}") from None
    error = answer.get("error")
    if error:
        if error["type"] in ("ImportError", "ModuleNotFoundError"):
            raise SkyPilotUnavailable(f"{python} cannot import SkyPilot ({error['message']}): {INSTALL}")
        raise sky_error(error["type"], error["message"], error.get("mro", ()))
    return answer.get("result")


# -- the boundary -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launched:
    """What a finished launch bought."""

    job_id: int | None
    cloud: str
    region: str
    instance_type: str
    spot: bool
    name_on_cloud: str | None = None


@dataclass(frozen=True)
class Cluster:
    """One cluster as SkyPilot knows it now."""

    name: str
    status: str
    """``UP``, ``INIT`` or ``STOPPED`` (SkyPilot's ClusterStatus)."""
    labels: dict[str, str] = field(default_factory=dict)
    name_on_cloud: str | None = None


class SkyApi(Protocol):
    """The calls that reach SkyPilot's API server (and through it, the clouds)."""

    def launch(self, task: dict, cluster_name: str, *, idle_minutes: int) -> Launched:
        """Provision the cluster and submit the task's job (``skypilot_task.build_task``); blocks until both are
        done."""

    def clusters(self, names: list[str] | None) -> list[Cluster]:
        """The clusters named (every cluster of every user with None), refreshed from the clouds."""

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        """The job's status (``RUNNING``, ``SUCCEEDED``, ``FAILED`` ...), None if SkyPilot has none."""

    def down(self, cluster_name: str) -> None:
        """Tear the cluster down (billing stops); a cluster that no longer exists is not an error."""

    def cancel_launch(self, cluster_name: str) -> None:
        """Abort the launch request of ``cluster_name`` in the API server, if one is under way; returns at once."""

    def enabled_clouds(self) -> list[str]:
        """The clouds this SkyPilot's credentials reach (``sky check``), by SkyPilot's lowercase names."""


class LaunchCancelled(RuntimeError):
    """The actor was terminated while its launch was under way: the launch is not sent (again)."""


class SkySdk:
    """``SkyApi`` through SkyPilot's client SDK, in SkyPilot's environment (``bridge``): every call is a request to
    its API server (started locally on first use unless ``SKYPILOT_API_SERVER_ENDPOINT`` names a remote one)."""

    def __init__(self, aws_node_profile: str | None = None):
        sky_python()  # SkyPilot's environment missing is one line now, not at the first launch
        self.aws_node_profile = aws_node_profile
        self._launches: dict[str, str] = {}
        """Each cluster's launch request id, while its launch is under way (``cancel_launch``)."""

    def launch(self, task: dict, cluster_name: str, *, idle_minutes: int) -> Launched:
        # the bridge sends it with remote_identity: NO_UPLOAD for every cloud (skypilot_trust.py says why)
        sent = bridge("launch", {"task": task, "cluster_name": cluster_name, "idle_minutes": idle_minutes,
                                 "aws_node_profile": self.aws_node_profile})
        self._launches[cluster_name] = sent["request_id"]
        try:
            r = bridge("wait", {"request_id": sent["request_id"]})
        finally:
            self._launches.pop(cluster_name, None)
        return Launched(r["job_id"], r["cloud"], r["region"], r["instance_type"], bool(r["spot"]), r["name_on_cloud"])

    def clusters(self, names: list[str] | None) -> list[Cluster]:
        return [Cluster(c["name"], c["status"], dict(c["labels"]), c["name_on_cloud"])
                for c in bridge("status", {"names": names})]

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        return bridge("job_status", {"cluster_name": cluster_name, "job_id": job_id})

    def down(self, cluster_name: str) -> None:
        bridge("down", {"cluster_name": cluster_name})

    def enabled_clouds(self) -> list[str]:
        return bridge("enabled_clouds")

    def cancel_launch(self, cluster_name: str) -> None:
        request_id = self._launches.get(cluster_name)
        if request_id is not None:
            bridge("cancel", {"request_id": request_id})
