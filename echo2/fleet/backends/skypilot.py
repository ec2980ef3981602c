"""SkyPilot backend: one SkyPilot cluster per actor, spot GPUs across clouds, through SkyPilot's Python SDK.

    offers(model_params_b)  the catalog offers on the clouds SkyPilot has enabled here (``sky.enabled_clouds()``)
                            that fit the model, each with its expected tokens/s (``echo2/fleet/backends/offers.py``);
                            the manager names up to ``any_of - 1`` interchangeable ones beside each launch's
                            (``manager_options``)
    launch_spec(actor)      ``echo2 actor``, the store options without anything secret-looking
                            (``skypilot_trust.public_store_options``), and as secrets the actor's relay token
                            and certificate and, with ``fleet.credentials_role_arn``, its scoped store
                            credentials (``fleet/credentials.py``): all expire together, and the manager
                            replaces the actor before
    start()                 stages echo2's source as the actors' workdir, with ``fleet.extra_packages`` beside it
                            (``echo2/fleet/extra_packages.py``; nothing is staged before: a fleet that fits no
                            offer stops with nothing to remove)
    launch(spec)            returns at once; provisioning (minutes) runs in a worker thread
        task      = the actor's task file (infra/skypilot/actor.yaml): setup installs echo2's actor
                    environment, run starts `echo2 actor`
        workdir   = echo2's source staged alone (``echo2/fleet/backends/skypilot_trust.py``), never the folder the
                    learner runs in
        config    = remote_identity: NO_UPLOAD for every cloud: no operator credentials on the VM
        envs      = run URL, actor id, store options (never credentials), relay bind/advertise, and the
                    preemption source of the cloud (AWS/GCP metadata)
        secrets   = the relay secret and the actor's scoped, expiring store credentials: SkyPilot's secrets
                    (redacted in its dashboard, but kept in plain text in its API server's request log, so
                    only short-lived, narrowly scoped ones are ever sent)
        resources = any_of over the launch's offer and its interchangeable alternatives (same GPU type and
                    count elsewhere), each spot or not, with the relay port opened, the run's labels and
                    the price the plan bought as max_hourly_cost (``price_ceiling``)
        sky.launch(task, cluster_name, down=True, idle_minutes_to_autostop=...)
    poll(actor)             one sky.status request for every cluster, at most every status_poll_s
        launch under way                      -> STARTING
        launch failed for want of capacity    -> UNAVAILABLE (the manager tries the next offer)
        launch request dropped                -> retried (bounded, logged); then UNAVAILABLE too: the
                                                 offers are asked again after unavailable_retry_s
        launch failed otherwise               -> CRASHED
        cluster UP, job running or pending    -> RUNNING, with the offer SkyPilot took among any_of
        cluster UP, job ended                 -> CRASHED (FAILED, CANCELLED ...); SUCCEEDED is EXITED once
                                                 the cluster stayed up exit_hold_s after it
        cluster gone, or no longer UP         -> ask the cloud why (``reclaims.py``): RECLAIMED or CRASHED;
                                                 after a clean exit (a spot notice, then the machine
                                                 taken) RECLAIMED where the cloud says so, else EXITED
        a status request that fails           -> retried (bounded, logged); then FleetApiError, and the
                                                 manager skips that reconcile pass
    adopt(actor, launched)  --resume: take over the previous learner's actor when its cluster (by name) is UP,
                            labelled with this run, and its job still live; else AdoptError (the manager downs it)
    release_leftovers(ids)  --resume: down every cluster of the run this learner did not launch or adopt
    terminate(actor)        sky.down sent at once, in a thread of its own (never queued behind launches);
                            a launch still in flight is cancelled in the API server, and its cluster gets
                            one more down when the launch returns (a down that came before the launch
                            made the cluster found nothing to down)
    close()                 waits for the downs sent, at most CLOSE_WAIT_S, then names those still going:
                            a cancelled flow run has Prefect's 30 s grace for its checkpoint and teardown
    `echo2 fleet down RUN`  downs every cluster labelled with the run: teardown after a learner crash

Everything SkyPilot is reached through ``SkyApi`` (``skypilot_api.py``: launch, clusters, job status,
down, cancel a launch): ``SkySdk`` is the real one, SkyPilot's SDK run in SkyPilot's own environment
(``sky_bridge.py``). The tests put a test double there (no cloud is reachable from
here) and exercise
SkyPilot's real ``Task`` and ``Resources`` objects, its YAML schema and its optimizer on a fixture
catalog. Nothing in this file has run against a real cloud account.

Labels: GCP's rules (lowercase letters, digits, ``-`` and ``_``, at most 63) hold for every cloud,
so a run id is folded into ``run_label`` and the same fold finds the clusters again at teardown.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import tenacity

from echo2.config import SkyPilotFleetConfig
from echo2.fleet.backends import skypilot_trust
from echo2.fleet.backends.base import (
    ActorLaunch,
    ActorOffer,
    ActorState,
    ActorStatus,
    AdoptError,
    FleetApiError,
    FleetBackend,
    LaunchContext,
)
from echo2.fleet.backends.offers import skypilot_offers
from echo2.fleet.backends.reclaims import cloud_end_reason
from echo2.fleet.backends.skypilot_api import Cluster, LaunchCancelled, Launched, SkyApi, SkySdk
from echo2.fleet.backends.skypilot_task import (
    RUN_LABEL,
    build_task,
    cluster_name,
    load_task_config,
    refuse_uploads,
    run_label,
)
from echo2.fleet.extra_packages import REQUIREMENTS_FILE, stage_extra_packages

log = logging.getLogger("echo2.fleet")

JOB_ENDED = {"SUCCEEDED": ActorState.EXITED}
JOB_LIVE = ("INIT", "PENDING", "SETTING_UP", "RUNNING")
CAPACITY_ERRORS = ("ResourcesUnavailableError", "ResourcesMismatchError")
TRANSIENT_SKY_ERRORS = ("ApiServerConnectionError", "ServerTemporarilyUnavailableError", "ClusterStatusFetchingError",
                        "FetchClusterInfoError", "NetworkError", "RequestInterruptedError", "CloudError",
                        "SkyletUnavailableError", "ConcurrentWorkerExhaustedError")
"""SkyPilot's errors of a request that may well work when asked again (its API server or a cloud's API
did not answer, or answered "later"); anything else is not retried."""
API_ATTEMPTS = 3
"""Tries of one status request within a reconcile pass, before the pass is skipped."""
CLOSE_WAIT_S = 15.0
"""How long ``close`` waits for the downs it sent: inside Prefect's 30 s grace beside the checkpoint. A down
still going after that runs on in SkyPilot's API server, where it was sent (named in the log)."""


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` from SkyPilot's SDK (or the clouds' and STS's clients under it) is worth asking again."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if any(name in TRANSIENT_SKY_ERRORS for name in (*(c.__name__ for c in type(exc).__mro__),
                                                      *getattr(exc, "sky_mro", ()))):
        return True  # SkyPilot's errors reach here by name, from its own environment (skypilot_api.bridge)
    try:
        import requests
        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return True
    except ImportError:
        pass
    from echo2.fleet.credentials import transient_aws_error

    return transient_aws_error(exc)


def offer_of(launched: Launched, candidates: tuple[ActorOffer, ...]) -> ActorOffer:
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
    clean_exit_at: float | None = None
    """When its job was first seen SUCCEEDED with the cluster still up (held for ``exit_hold_s``)."""
    down_requested: threading.Event = field(default_factory=threading.Event)
    """Set by ``terminate``: a launch not yet sent (or dropped, to be sent again) is not sent."""


EndReason = Callable[[Launched, str | None], tuple[str, str]]
"""(what a launch bought, its name on the cloud) -> ("reclaimed" | "crashed" | "terminated", detail)."""


class SkyPilotBackend(FleetBackend):
    name = "skypilot"

    def __init__(self, config: SkyPilotFleetConfig, *, run_id: str, api: SkyApi | None = None,
                 end_reason: EndReason | None = None, task_config: dict | None = None):
        self.config = config
        self.run_id = run_id
        if api is None:  # the real SDK: refuse VMs holding a broad cloud identity, and credentials that would travel
            broad = config.broad_vm_identity()
            if broad:
                raise ValueError(broad)
            if config.allow_broad_vm_identity:
                log.warning("fleet.allow_broad_vm_identity is set: actor VMs may hold SkyPilot's skypilot-v1 "
                            "identity, and an actor on one is not held to its scoped credentials")
            api = SkySdk(config.aws_node_profile)
            skypilot_trust.check_no_credentials_travel()
        self.api = api
        self.end_reason = end_reason or cloud_end_reason
        self.task_config = task_config if task_config is not None else load_task_config(config.task_file)
        refuse_uploads(self.task_config)
        if config.extra_packages and REQUIREMENTS_FILE not in str(self.task_config.get("setup") or ""):
            raise ValueError(f"fleet.extra_packages: the SkyPilot task file's setup never installs {REQUIREMENTS_FILE}"
                             f" (the shipped infra/skypilot/actor.yaml does), so the actors would go without them")
        self.workdir: Path | None = None
        """What every actor's ``workdir`` uploads: echo2's source, staged alone by ``start`` (removed by ``close``)."""
        self.retry_wait_s = 1.0
        """First wait between tries of a failed status request (doubling, at most 10 s)."""
        self.actors: dict[str, _Actor] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="echo2-skypilot")
        self._downs: list[tuple[str, Future, Future | None]] = []
        """(cluster, its down, the launch that down waits for or None): every down requested."""
        self._clusters: dict[str, Cluster] = {}
        self._jobs: dict[str, str | None] = {}
        self._refreshed_at = 0.0
        self._lock = threading.Lock()

    def offers(self, model_params_b: float | None, active_params_b: float | None = None) -> list[ActorOffer]:
        """The catalog offers on the clouds SkyPilot has enabled here (``SkyApi.enabled_clouds``: one request to
        its API server, retried like every other). A model no offer fits stops first, before SkyPilot is asked
        (asking may start its local API server)."""
        size = model_params_b if model_params_b is not None else 1.0
        skypilot_offers(self.config, size, None, active_params_b=active_params_b)
        enabled = self._ask("sky.enabled_clouds", self.api.enabled_clouds)
        return skypilot_offers(self.config, size, enabled, active_params_b=active_params_b)

    def launch_spec(self, actor_id: str, offer: ActorOffer, launch: LaunchContext) -> ActorLaunch:
        from echo2.fleet.credentials import mint_actor_credentials

        config = self.config
        expires, secrets = time.time() + config.credentials_hours * 3600, {}
        if config.credentials_role_arn:
            creds = mint_actor_credentials(launch.store_url, launch.run_id, actor_id,
                                           role_arn=config.credentials_role_arn, hours=config.credentials_hours,
                                           sts_endpoint_url=config.sts_endpoint_url)
            secrets.update(creds.env)
            expires = min(expires, creds.expires_at.timestamp())
        # both stop working together: the actor is replaced before
        secrets.update(launch.relay_secrets(actor_id, expires))
        env = {"ECHO2_STORE_OPTIONS": json.dumps(skypilot_trust.public_store_options(launch.store_options))}
        return ActorLaunch(actor_id=actor_id, run_url=launch.store_url, command=["echo2", "actor"], env=env,
                           secrets=secrets, offer=offer, expires_at=expires)

    def manager_options(self) -> dict:
        return {"alternatives": self.config.any_of - 1, "unavailable_retry_s": self.config.unavailable_retry_s}

    def start(self) -> None:
        if self.workdir is None:
            workdir = skypilot_trust.stage_actor_source()
            try:  # the user's packages beside echo2's source, installed by the task file's setup
                stage_extra_packages(self.config.extra_packages, workdir)
            except BaseException:
                skypilot_trust.remove_staged(workdir)
                raise
            self.workdir = workdir

    def launch(self, spec: ActorLaunch) -> dict:
        self.start()
        task = build_task(spec, self.config, run_id=self.run_id, workdir=self.workdir, task_config=self.task_config)
        name = cluster_name(self.run_id, spec.actor_id)
        down_requested = threading.Event()

        def launch(task, name):  # tried again by _ask when its request was dropped (SkyPilot reuses the name)
            if down_requested.is_set():
                raise LaunchCancelled(f"cluster {name} was terminated before its launch was sent")
            return self.api.launch(task, name, idle_minutes=self.config.idle_minutes_to_autodown)

        actor = _Actor(spec, name, self._pool.submit(self._ask, "sky.launch", launch, task, name),
                       down_requested=down_requested)
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

    def _bought(self, a: _Actor) -> ActorOffer | None:
        return offer_of(a.launched, (a.spec.offer, *a.spec.alternatives)) if a.launched else None

    def _state(self, a: _Actor) -> ActorStatus | None:
        """The actor's final state once it has one, else None (still starting or running)."""
        if not a.future.done():
            return None
        exc = a.future.exception()
        if exc is not None:
            detail = f"launch failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            unavailable = type(exc).__name__ in CAPACITY_ERRORS or isinstance(exc, FleetApiError)
            kind = ActorState.UNAVAILABLE if unavailable else ActorState.CRASHED
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
            if JOB_ENDED.get(job) == ActorState.EXITED:  # a clean exit: a spot notice, if the machine goes next
                a.clean_exit_at = a.clean_exit_at or time.time()
                if time.time() - a.clean_exit_at < self.config.exit_hold_s:
                    return None
            return ActorStatus(JOB_ENDED.get(job, ActorState.CRASHED), f"job {job}", offer=self._bought(a))
        # gone, stopped, or back in INIT (a node lost): only the cloud knows whether it was taken
        reason, detail = self.end_reason(a.launched, a.name_on_cloud)
        where = f"cluster {a.cluster} {'gone' if cluster is None else cluster.status}"
        if a.clean_exit_at is not None:  # the actor left with exit 0 (on its notice), then the machine went
            state = ActorState.RECLAIMED if reason == "reclaimed" else ActorState.EXITED
            return ActorStatus(state, f"job SUCCEEDED, then {where}: {detail}", offer=self._bought(a))
        state = {"reclaimed": ActorState.RECLAIMED, "terminated": ActorState.EXITED}.get(reason, ActorState.CRASHED)
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
            clusters = {c.name: c for c in self._ask("sky.status", self.api.clusters, names)} if names else {}
            jobs = {}
            for a in self.actors.values():
                if a.cluster in clusters and clusters[a.cluster].status == "UP" and a.launched is not None:
                    jobs[a.cluster] = self._ask("job_status", self.api.job_status, a.cluster, a.launched.job_id)
            self._clusters, self._jobs, self._refreshed_at = clusters, jobs, started

    def _ask(self, what: str, call: Callable, *args):
        """``call(*args)``, tried ``API_ATTEMPTS`` times while it fails transiently (logged); then FleetApiError."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(transient), stop=tenacity.stop_after_attempt(API_ATTEMPTS),
            wait=tenacity.wait_exponential(multiplier=self.retry_wait_s, max=10), reraise=True,
            before_sleep=lambda s: log.warning("SkyPilot %s failed (%s); try %d of %d", what,
                                               s.outcome.exception(), s.attempt_number + 1, API_ATTEMPTS))
        try:
            return retrying(call, *args)
        except Exception as exc:
            if transient(exc):
                raise FleetApiError(f"SkyPilot {what} failed {API_ATTEMPTS} times: "
                                    f"{type(exc).__name__}: {exc}") from exc
            raise

    def terminate(self, actor_id: str, grace_s: float = 10.0) -> None:
        """Send the cluster's down now, never waiting for anything (also after a failed launch: SkyPilot keeps
        a cluster whose setup failed up, for debugging). A launch under way is cancelled in the API server,
        and SkyPilot's down itself kills the cluster's other requests; but a down that reaches the API server
        before the launch made the cluster finds none, so the cluster gets one more down when its launch
        returns, whatever it returned: no cluster is left without a down request."""
        a = self.actors[actor_id]
        a.down_requested.set()
        if not a.future.done():
            try:
                self.api.cancel_launch(a.cluster)
            except Exception as exc:  # the down below still goes; SkyPilot's down kills the launch request too
                log.warning("could not cancel the launch of SkyPilot cluster %s: %s", a.cluster, exc)
        self._send_down(a.cluster)
        if not a.future.done():
            after = Future()
            self._downs.append((a.cluster, after, a.future))
            a.future.add_done_callback(lambda _launch: self._send_down(a.cluster, after))

    def _send_down(self, name: str, future: Future | None = None) -> None:
        """``sky.down`` of ``name`` in a thread of its own, started now (a pool could queue it behind launches
        that take minutes). Not a daemon: a learner that exits normally waits for its downs."""
        if future is None:
            future = Future()
            self._downs.append((name, future, None))

        def down():
            try:
                self._ask("sky.down", self.api.down, name)
            except BaseException as exc:
                log.error("could not tear down SkyPilot cluster %s: %s; run `echo2 fleet down %s`", name, exc,
                          self.run_id)
                future.set_exception(exc)
            else:
                log.info("SkyPilot cluster %s is down", name)
                future.set_result(None)
        threading.Thread(target=down, name=f"echo2-down-{name}").start()

    def adopt(self, actor_id: str, launched: dict, launch: LaunchContext | None, offer: ActorOffer) -> str:
        """Take over ``actor_id`` (launched by the previous learner of this run): its cluster must be UP, carry
        this run's label and run a live job. Its relay token and scoped credentials are those it was launched
        with; the manager replaces it before they expire (``expires_at`` of its launch event)."""
        name = cluster_name(self.run_id, actor_id)
        found = {c.name: c for c in self._ask("sky.status", self.api.clusters, [name])}.get(name)
        if found is None or found.status != "UP":
            raise AdoptError(f"cluster {name} is {'gone' if found is None else found.status}")
        if found.labels.get(RUN_LABEL) != run_label(self.run_id):
            raise AdoptError(f"cluster {name} is not labelled with run {self.run_id}")
        job = self._ask("job_status", self.api.job_status, name, None)
        if job is not None and job not in JOB_LIVE:
            raise AdoptError(f"the actor's job on cluster {name} ended ({job})")
        bought = Launched(None, str(launched.get("provider", "")), str(launched.get("region", "")),
                          str(launched.get("instance_type", "")), bool(launched.get("spot", True)),
                          found.name_on_cloud)
        future: Future = Future()
        future.set_result(bought)
        actor = _Actor(ActorLaunch(actor_id=actor_id, run_url=launch.store_url if launch else "", command=[],
                                   offer=offer), name, future, launched=bought, done_at=time.time(), seen_up=True,
                       name_on_cloud=found.name_on_cloud)
        self.actors[actor_id] = actor
        log.info("adopted %s: SkyPilot cluster %s is UP", actor_id, name)
        return "cluster"

    def release_leftovers(self, actor_ids: list[str]) -> None:
        """``--resume``: down the clusters of ``actor_ids`` (the previous learner's, never seen ending) and any
        other cluster labelled with this run that this learner did not launch. Their relay tokens are revoked by
        the resume; their scoped credentials would let them commit files of the lost timeline for hours."""
        names = {cluster_name(self.run_id, actor_id) for actor_id in actor_ids}
        label = run_label(self.run_id)
        try:
            clusters = self._ask("sky.status", self.api.clusters, None)
            names |= {c.name for c in clusters if c.labels.get(RUN_LABEL) == label}
        except FleetApiError as exc:  # the ledger's names still go; `echo2 fleet down RUN` finds the rest
            log.warning("could not list the run's clusters (%s); downing the %d the ledger names", exc, len(names))
        names -= {a.cluster for a in self.actors.values()}
        for name in sorted(names):
            log.warning("downing SkyPilot cluster %s: launched by this run's previous learner", name)
            self._send_down(name)

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Wait at most ``timeout_s`` for the downs sent (each logs its own failure, naming `echo2 fleet down`),
        then name the clusters still going down, and those whose launch is still under way (their second
        down goes when it returns). The downs run on: the process waits for them at a normal exit, and a
        down already sent runs on in SkyPilot's API server if the process is killed."""
        sent = [f for _, f, launch in self._downs if launch is None or launch.done()]
        wait(sent, timeout=timeout_s)
        going = sorted({name for name, f, launch in self._downs if not f.done() and (launch is None or launch.done())})
        launching = sorted({name for name, f, launch in self._downs if launch is not None and not launch.done()})
        failed = sorted({name for name, f, _ in self._downs if f.done() and f.exception() is not None})
        if going:
            log.warning("SkyPilot clusters still going down (sent; SkyPilot's API server finishes them): %s",
                        ", ".join(going))
        if launching:
            log.warning("SkyPilot launches still under way, each cancelled and sent a down, and downed again when "
                        "it returns: %s", ", ".join(launching))
        if failed or going or launching:
            log.error("SkyPilot clusters may still be up (and billing): %s; `echo2 fleet down %s` downs every "
                      "cluster of the run", ", ".join(sorted({*failed, *going, *launching})), self.run_id)
        self._pool.shutdown(wait=False, cancel_futures=False)
        skypilot_trust.remove_staged(self.workdir)


def fleet_down(run_id: str, api: SkyApi | None = None) -> list[str]:
    """Tear down every cluster labelled with ``run_id`` (the learner may be dead); their names."""
    api = api or SkySdk()
    label = run_label(run_id)
    names = sorted(c.name for c in api.clusters(None) if c.labels.get(RUN_LABEL) == label)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(api.down, names))
    return names
