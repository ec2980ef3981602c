"""SkyPilot backend: one SkyPilot cluster per actor, spot GPUs across clouds, through SkyPilot's Python SDK.

    launch(spec)            returns at once; provisioning (minutes) runs in a worker thread
        task      = the actor's task file (infra/skypilot/actor.yaml): setup installs echo2's actor
                    environment, run starts `echo2 actor`
        envs      = run URL, actor id, store options (never credentials), relay bind/advertise, and the
                    preemption source of the cloud (AWS/GCP metadata)
        secrets   = the relay secret and the actor's scoped, expiring store credentials: SkyPilot's secrets
                    (redacted in its dashboard, but kept in plain text in its API server's request log, so
                    only short-lived, narrowly scoped ones are ever sent)
        resources = any_of over the launch's offer and its interchangeable alternatives (same GPU type and
                    count elsewhere), each spot or not, with the relay port opened and the run's labels
        sky.launch(task, cluster_name, down=True, idle_minutes_to_autostop=...)
    poll(actor)             one sky.status request for every cluster, at most every status_poll_s
        launch under way                      -> STARTING
        launch failed for want of capacity    -> UNAVAILABLE (the manager tries the next offer)
        launch failed otherwise               -> CRASHED
        cluster UP, job running or pending    -> RUNNING, with the offer SkyPilot took among any_of
        cluster UP, job ended                 -> EXITED (SUCCEEDED) or CRASHED (FAILED, CANCELLED ...)
        cluster gone, or no longer UP         -> ask the cloud why (reclaims.py): RECLAIMED or CRASHED
    terminate(actor)        sky.down in a worker thread; close() waits for every down
    `echo2 fleet down RUN`  downs every cluster labelled with the run: teardown after a learner crash

Everything SkyPilot is reached through ``SkyApi`` (launch, clusters, job status, down): ``SkySdk`` is
the real one. The tests put a test double there (no cloud is reachable from here) and exercise
SkyPilot's real ``Task`` and ``Resources`` objects, its YAML schema and its optimizer on a fixture
catalog. Nothing in this file has run against a real cloud account.

Labels: GCP's rules (lowercase letters, digits, ``-`` and ``_``, at most 63) hold for every cloud,
so a run id is folded into ``run_label`` and the same fold finds the clusters again at teardown.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

import yaml

from echo2.config import SkyPilotFleetConfig
from echo2.fleet.backend import ActorLaunch, ActorState, ActorStatus, FleetBackend, Offer

log = logging.getLogger("echo2.fleet")

DEFAULT_TASK_FILE = Path(__file__).resolve().parents[2] / "infra" / "skypilot" / "actor.yaml"
RUN_LABEL = "echo2-run"
ACTOR_LABEL = "echo2-actor"
INSTALL = "pip install -e '.[cloud]'"
JOB_ENDED = {"SUCCEEDED": ActorState.EXITED}
JOB_LIVE = ("INIT", "PENDING", "SETTING_UP", "RUNNING")
CAPACITY_ERRORS = ("ResourcesUnavailableError", "ResourcesMismatchError")


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


def import_sky():
    try:
        import sky  # noqa: F401  (the cloud extra)
    except ImportError as exc:
        raise SkyPilotUnavailable(f"fleet.backend skypilot needs SkyPilot, which is not installed here "
                                  f"({exc.name or exc}): {INSTALL}") from None
    return sky


class SkySdk:
    """``SkyApi`` through SkyPilot's client SDK: every call is a request to its API server (started
    locally on first use unless ``SKYPILOT_API_SERVER_ENDPOINT`` names a remote one)."""

    def __init__(self):
        self.sky = import_sky()

    def launch(self, task, cluster_name: str, *, idle_minutes: int) -> Launched:
        sky = self.sky
        job_id, handle = sky.get(sky.launch(task, cluster_name=cluster_name, down=True,
                                            idle_minutes_to_autostop=idle_minutes, retry_until_up=False))
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
    job environment (the task file's ``auto``s, ``rollout/preemption.py``)."""
    return {"ECHO2_RUN_URL": spec.run_url, "ECHO2_ACTOR_ID": spec.actor_id, **spec.env,
            "ECHO2_RELAY_HOST": "0.0.0.0", "ECHO2_RELAY_PORT": str(relay_port)}


def build_task(spec: ActorLaunch, config: SkyPilotFleetConfig, *, run_id: str, task_config: dict | None = None):
    """The actor's ``sky.Task``: the task file, its envs and secrets, and the any_of candidates."""
    sky = import_sky()
    base = dict(task_config if task_config is not None else load_task_config(config.task_file))
    resources_config = base.pop("resources", None) or {}
    offers = (spec.offer, *spec.alternatives)
    envs = actor_envs(spec, config.relay_port)
    task = sky.Task.from_yaml_config(base, env_overrides=list(envs.items()),
                                     secrets_overrides=list(spec.secrets.items()))
    labels = {RUN_LABEL: run_label(run_id), ACTOR_LABEL: _fold(spec.actor_id, 63)}
    candidates = set()
    for offer in offers:
        overrides = {"infra": f"{offer.provider}/{offer.region}", "instance_type": offer.instance_type,
                     "use_spot": offer.spot, "ports": config.relay_port, "labels": labels}
        if offer.gpu_count:
            overrides["accelerators"] = {offer.gpu: offer.gpu_count}
        candidates.add(sky.Resources(**{**_plain_resources(resources_config), **overrides}))
    task.set_resources(candidates)
    return task


def _plain_resources(config: dict) -> dict:
    """The task file's resources, as keyword arguments the candidates are laid over."""
    allowed = ("disk_size", "disk_tier", "image_id", "cpus", "memory", "network_tier", "autostop")
    unknown = sorted(set(config) - set(allowed) - {"use_spot", "ports", "labels", "accelerators", "infra",
                                                   "instance_type", "any_of"})
    if unknown:
        raise ValueError(f"SkyPilot task file resources: {', '.join(unknown)} cannot be combined with the "
                         f"candidate offers (allowed: {', '.join(allowed)})")
    return {k: v for k, v in config.items() if k in allowed}


def offer_of(launched: Launched, candidates: tuple[Offer, ...]) -> Offer:
    """The candidate SkyPilot bought (its price is what the ledger bills), or one built from what it says."""
    for o in candidates:
        if (o.provider, o.region, o.instance_type, o.spot) == (launched.cloud, launched.region,
                                                               launched.instance_type, launched.spot):
            return o
    base = candidates[0]
    log.warning("SkyPilot launched %s/%s in %s, which is not one of the candidates; billed at the first "
                "candidate's price", launched.cloud, launched.instance_type, launched.region)
    return replace(base, provider=launched.cloud, region=launched.region, instance_type=launched.instance_type,
                   spot=launched.spot)


# -- the backend --------------------------------------------------------------------------------
@dataclass
class _Actor:
    spec: ActorLaunch
    cluster: str
    future: Future
    launched: Launched | None = None
    done_at: float | None = None
    ended: ActorStatus | None = None
    seen_up: bool = False
    name_on_cloud: str | None = None


EndReason = Callable[[Launched, str | None], tuple[str, str]]
"""(what a launch bought, its name on the cloud) -> ("reclaimed" | "crashed" | "terminated", detail)."""


class SkyPilotBackend(FleetBackend):
    name = "skypilot"

    def __init__(self, config: SkyPilotFleetConfig, *, run_id: str, api: SkyApi | None = None,
                 end_reason: EndReason | None = None, task_config: dict | None = None):
        self.config = config
        self.run_id = run_id
        self.api = api or SkySdk()
        self.end_reason = end_reason or cloud_end_reason
        self.task_config = task_config if task_config is not None else load_task_config(config.task_file)
        self.actors: dict[str, _Actor] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="echo2-skypilot")
        self._downs: list[tuple[str, Future]] = []
        self._clusters: dict[str, Cluster] = {}
        self._jobs: dict[str, str | None] = {}
        self._refreshed_at = 0.0
        self._lock = threading.Lock()

    def launch(self, spec: ActorLaunch) -> dict:
        task = build_task(spec, self.config, run_id=self.run_id, task_config=self.task_config)
        name = cluster_name(self.run_id, spec.actor_id)
        actor = _Actor(spec, name, self._pool.submit(self.api.launch, task, name,
                                                     idle_minutes=self.config.idle_minutes_to_autodown))
        actor.future.add_done_callback(lambda f, a=actor: setattr(a, "done_at", time.time()))
        self.actors[spec.actor_id] = actor
        log.info("launching %s as SkyPilot cluster %s (%d candidate offers)", spec.actor_id, name,
                 1 + len(spec.alternatives))
        return {"cluster": name, "candidates": [o.provider + "/" + o.instance_type + "@" + o.region
                                                for o in (spec.offer, *spec.alternatives)]}

    def poll(self, actor_id: str) -> ActorStatus:
        a = self.actors[actor_id]
        if a.ended is None:
            a.ended = self._state(a)
        return a.ended or ActorStatus(ActorState.RUNNING if a.seen_up else ActorState.STARTING,
                                      offer=self._bought(a))

    def _bought(self, a: _Actor) -> Offer | None:
        return offer_of(a.launched, (a.spec.offer, *a.spec.alternatives)) if a.launched else None

    def _state(self, a: _Actor) -> ActorStatus | None:
        """The actor's final state once it has one, else None (still starting or running)."""
        if not a.future.done():
            return None
        exc = a.future.exception()
        if exc is not None:
            detail = f"launch failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            kind = ActorState.UNAVAILABLE if type(exc).__name__ in CAPACITY_ERRORS else ActorState.CRASHED
            return ActorStatus(kind, detail)
        # a launch that returned after the last status request is not in it: ask again now
        self._refresh(force=a.done_at is None or a.done_at >= self._refreshed_at)
        cluster = self._clusters.get(a.cluster)
        if cluster is not None and cluster.status == "UP":
            a.seen_up = True
            a.name_on_cloud = a.name_on_cloud or cluster.name_on_cloud
            job = self._jobs.get(a.cluster)
            if job is None or job in JOB_LIVE:
                return None
            return ActorStatus(JOB_ENDED.get(job, ActorState.CRASHED), f"job {job}", offer=self._bought(a))
        # gone, stopped, or back in INIT (a node lost): only the cloud knows whether it was taken
        reason, detail = self.end_reason(a.launched, a.name_on_cloud)
        state = {"reclaimed": ActorState.RECLAIMED, "terminated": ActorState.EXITED}.get(reason, ActorState.CRASHED)
        where = f"cluster {a.cluster} {'gone' if cluster is None else cluster.status}"
        return ActorStatus(state, f"{where}: {detail}", offer=self._bought(a))

    def _refresh(self, *, force: bool = False) -> None:
        """One status request for every launched cluster, then the job of each UP one; throttled."""
        with self._lock:
            if not force and time.time() - self._refreshed_at < self.config.status_poll_s:
                return
            started = time.time()  # before the harvest: a launch returning after it is asked about next time
            for a in self.actors.values():
                if a.launched is None and a.future.done() and a.future.exception() is None:
                    a.launched = a.future.result()
                    a.name_on_cloud = a.name_on_cloud or a.launched.name_on_cloud
            names = [a.cluster for a in self.actors.values() if a.launched is not None and a.ended is None]
            clusters = {c.name: c for c in self.api.clusters(names)} if names else {}
            jobs = {}
            for a in self.actors.values():
                if a.cluster in clusters and clusters[a.cluster].status == "UP" and a.launched is not None:
                    jobs[a.cluster] = self.api.job_status(a.cluster, a.launched.job_id)
            self._clusters, self._jobs, self._refreshed_at = clusters, jobs, started

    def terminate(self, actor_id: str, grace_s: float = 10.0) -> None:
        # also after a failed launch: SkyPilot keeps a cluster whose setup failed up, for debugging
        a = self.actors[actor_id]
        self._downs.append((a.cluster, self._pool.submit(self._down_after_launch, a)))

    def _down_after_launch(self, a: _Actor) -> None:
        wait([a.future])  # a down before the launch returns would race it; SkyPilot queues it otherwise
        self.api.down(a.cluster)
        log.info("SkyPilot cluster %s is down", a.cluster)

    def close(self, timeout_s: float = 900.0) -> None:
        """Wait for every down (a cluster left up keeps billing), and say how to finish the job if one fails."""
        done, pending = wait([f for _, f in self._downs], timeout=timeout_s)
        failed = [name for name, f in self._downs if f in pending or f.exception() is not None]
        for name, f in self._downs:
            if f in done and f.exception() is not None:
                log.error("could not tear down SkyPilot cluster %s: %s", name, f.exception())
        if failed:
            log.error("SkyPilot clusters may still be up (and billing): %s; run `echo2 fleet down %s`",
                      ", ".join(failed), self.run_id)
        self._pool.shutdown(wait=False, cancel_futures=False)


def fleet_down(run_id: str, api: SkyApi | None = None) -> list[str]:
    """Tear down every cluster labelled with ``run_id`` (the learner may be dead); their names."""
    api = api or SkySdk()
    label = run_label(run_id)
    names = sorted(c.name for c in api.clusters(None) if c.labels.get(RUN_LABEL) == label)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(api.down, names))
    return names


# -- why a cluster ended ------------------------------------------------------------------------
def cloud_end_reason(launched: Launched, name_on_cloud: str | None, *, ec2_client=None,
                     gcp_project: str | None = None, gcp_client=None) -> tuple[str, str]:
    """Ask the cloud why the instances behind a cluster ended (``reclaims.py``): AWS by the EC2 tag
    SkyPilot puts on them, GCP by its preemption operations; elsewhere a vanished spot cluster is
    taken for a reclaim (no reason API), a vanished on-demand one for a crash."""
    from echo2.fleet import reclaims

    try:
        if launched.cloud == "aws" and name_on_cloud:
            if ec2_client is None:
                import boto3

                ec2_client = boto3.client("ec2", region_name=launched.region)
            reply = ec2_client.describe_instances(
                Filters=[{"Name": "tag:skypilot-cluster-name", "Values": [name_on_cloud]}])
            ids = [i["InstanceId"] for r in reply.get("Reservations", []) for i in r.get("Instances", [])]
            reasons = {reclaims.aws_instance_end_reason(ec2_client, i) for i in ids} - {None}
            for reason in ("reclaimed", "crashed", "terminated"):
                if reason in reasons:
                    return reason, f"EC2 says {reason} ({len(ids)} instance(s) tagged {name_on_cloud})"
            return "crashed", f"EC2 has no ended instance tagged {name_on_cloud}"
        if launched.cloud == "gcp" and name_on_cloud:
            if gcp_project is None:
                import google.auth

                _, gcp_project = google.auth.default()
            preempted = reclaims.gcp_preempted_instances(gcp_project, None, gcp_client)
            if any(n.startswith(name_on_cloud) for n in preempted):
                return "reclaimed", "GCP preempted it (compute.instances.preempted)"
            return "crashed", "no GCP preemption operation names it"
    except Exception as exc:  # the question failed, not the actor: say so, and fall back on the market
        log.warning("could not ask %s why %s ended: %s", launched.cloud, name_on_cloud, exc)
    if launched.spot:
        return "reclaimed", f"spot instance gone ({launched.cloud} gives no reason here)"
    return "crashed", "on-demand instance gone"
