"""SkyPilot as the SkyPilot backend (``backends/skypilot.py``) reaches it: ``SkyApi``, the calls that go to
SkyPilot's API server (and through it, the clouds), and ``SkySdk``, those calls through SkyPilot's client SDK.
The tests put a test double in ``SkySdk``'s place (no cloud is reachable from here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from echo2.fleet.backends import skypilot_trust
from echo2.fleet.prices import skypilot as prices_skypilot


class SkyPilotUnavailable(RuntimeError):
    """SkyPilot is not installed here (the ``cloud`` extra)."""


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

    def launch(self, task: Any, cluster_name: str, *, idle_minutes: int) -> Launched:
        """Provision the cluster and submit the task's job; blocks until both are done."""

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


def import_sky():
    """SkyPilot's ``sky`` module, or ``SkyPilotUnavailable`` saying how to install it."""
    return prices_skypilot.import_sky("fleet.backend skypilot", SkyPilotUnavailable, catalog=False)


class SkySdk:
    """``SkyApi`` through SkyPilot's client SDK: every call is a request to its API server (started
    locally on first use unless ``SKYPILOT_API_SERVER_ENDPOINT`` names a remote one)."""

    def __init__(self, aws_node_profile: str | None = None):
        self.sky = import_sky()
        self.aws_node_profile = aws_node_profile
        self._launches: dict[str, Any] = {}
        """Each cluster's launch request id, while its launch is under way (``cancel_launch``)."""

    def launch(self, task, cluster_name: str, *, idle_minutes: int) -> Launched:
        sky = self.sky
        with skypilot_trust.launch_config(self.aws_node_profile):  # remote_identity: NO_UPLOAD for every cloud
            request = sky.launch(task, cluster_name=cluster_name, down=True, idle_minutes_to_autostop=idle_minutes,
                                 retry_until_up=False)
        self._launches[cluster_name] = request
        try:
            job_id, handle = sky.get(request)
        finally:
            self._launches.pop(cluster_name, None)
        r = handle.launched_resources
        return Launched(job_id, str(r.cloud).lower(), r.region or "?", r.instance_type or "?", bool(r.use_spot),
                        getattr(handle, "cluster_name_on_cloud", None))

    def clusters(self, names: list[str] | None) -> list[Cluster]:
        sky = self.sky
        records = sky.get(sky.status(names, refresh=sky.StatusRefreshMode.FORCE, all_users=names is None))
        return [Cluster(r.name, getattr(r.status, "value", str(r.status)), dict(r.labels or {}),
                        r.cluster_name_on_cloud) for r in records]

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        sky = self.sky
        try:
            statuses = sky.get(sky.job_status(cluster_name, [job_id] if job_id is not None else None))
        except (sky.exceptions.ClusterNotUpError, sky.exceptions.ClusterDoesNotExist):
            return None
        status = statuses.get(job_id) if job_id is not None else next(iter(statuses.values()), None)
        return None if status is None else getattr(status, "value", str(status))

    def down(self, cluster_name: str) -> None:
        sky = self.sky
        try:
            sky.get(sky.down(cluster_name))
        except sky.exceptions.ClusterDoesNotExist:
            pass

    def enabled_clouds(self) -> list[str]:
        # sky.client.sdk.enabled_clouds (0.14; not re-exported as sky.enabled_clouds): a request to the API
        # server, answered from its cache of `sky check` with each cloud's canonical_name() ("aws", "gcp")
        from sky.client import sdk

        return [str(name).lower() for name in self.sky.get(sdk.enabled_clouds())]

    def cancel_launch(self, cluster_name: str) -> None:
        request = self._launches.get(cluster_name)
        if request is not None:  # the POST is the cancel; its answer (what was cancelled) is not waited for
            self.sky.api_cancel(request, silent=True)
