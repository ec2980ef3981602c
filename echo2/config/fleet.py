"""Fleet and price sections (``fleet.*``; ``echo2/fleet/``).

``fleet`` is a union on ``backend``, as ``rollout.engine`` is on ``kind`` and ``task`` on ``name``: the fields
every backend shares (``FleetConfigBase``: actors, budgets, prices, the learner's silence) and the backend's own
(``LocalFleetConfig``: the reclaim injector...; ``SkyPilotFleetConfig``: offers, ports, credentials...) side by
side under ``fleet:``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, field_validator, model_validator

from echo2.config._base import _Section

LOCAL_PACKAGE_SUFFIXES = (".whl", ".tar.gz", ".zip")


def is_local_package(item: str) -> bool:
    """Whether a ``fleet.extra_packages`` entry names a local path (a project folder or an archive) rather than
    a pip requirement: a path is written with a ``/``, or starts with ``.`` or ``~``, or is an archive's name."""
    item = item.strip()
    if item.startswith((".", "~", "/")) or item.endswith(LOCAL_PACKAGE_SUFFIXES):
        return True
    return "/" in item and "@" not in item and "://" not in item  # "pkg @ https://..." is a requirement


class SnapshotPricesConfig(_Section):
    source: Literal["snapshot"] = "snapshot"
    """The dated catalog shipped under ``infra/prices/`` (offline, reproducible)."""
    catalog: str | None = None
    """Price catalog CSV (None = the shipped ``infra/prices/gpu-offers-2026-11.csv``)."""


class AwsPricesConfig(_Section):
    source: Literal["aws"]
    """Live spot prices from EC2 (``describe_spot_price_history``, boto3), joined with the snapshot."""
    regions: list[str] | None = None
    """Regions to ask for spot prices (None = every AWS region of the snapshot catalog)."""
    endpoint_url: str | None = None
    """EC2 endpoint (None = AWS's own; tests point it at moto). Credentials come from the environment."""
    catalog: str | None = None
    """Snapshot that supplies each instance type's GPUs and on-demand price (None = the shipped one)."""


class SkyPilotPricesConfig(_Section):
    source: Literal["skypilot"]
    """SkyPilot's catalog (``sky.catalog.list_accelerators``); needs the ``cloud`` extra."""
    clouds: list[str] | None = None
    """SkyPilot clouds to list (None = every cloud of its catalog). Needs the ``cloud`` extra."""


PriceSourceConfig = Annotated[SnapshotPricesConfig | AwsPricesConfig | SkyPilotPricesConfig,
                              Field(discriminator="source")]
"""Where offers and prices come from (``echo2/fleet/prices/``): ``snapshot`` (the dated
catalog under ``infra/prices/``), ``aws`` (live spot prices, boto3) or ``skypilot`` (its catalog)."""


class FleetConfigBase(_Section):
    """What every fleet backend shares: how many actors, their budget and prices, when actors give up."""

    backend: Literal["local", "skypilot"]
    """Where actors run: ``local`` = OS processes on this machine; ``skypilot`` = one SkyPilot cluster per
    actor on spot GPUs across clouds (``pip install -e '.[cloud]'``, cloud credentials, an s3:// or gs://
    store; see ``echo2/fleet/backends/skypilot.py``). Each has its own fields beside the shared ones."""
    actors: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    """Number of actors, or ``auto``: start ``min_actors``, measure the learner step and the actors'
    batch time over the first steps, and grow to the smallest fleet the capacity model
    (``echo2/fleet/sizing/capacity.py``) predicts keeps the learner busy ``target_utilization`` of the time,
    within ``max_actors`` and ``max_usd_per_hour``."""
    min_actors: int = Field(1, ge=1)
    """With ``actors: auto``: the fleet the run starts with, before anything is measured."""
    max_actors: int = Field(4, ge=1)
    """With ``actors: auto``: never more actors than this (on one machine, actors share its cores)."""
    target_utilization: float = Field(0.95, gt=0, le=1)
    """With ``actors: auto``: the learner utilization the fleet is sized for."""
    workload: str | None = None
    """With ``actors: auto`` over catalog offers (SkyPilot, or ``price_as``): the workload the first fleet is
    planned from, before the run has measured anything: NAME of ``infra/workloads/NAME.yaml`` or a file, as
    ``echo2 plan --workload`` takes it. The run's first launches are then the fleet ``echo2 plan --workload``
    prints over the same price catalog; None: ``min_actors`` until the first sizing."""
    max_restarts: int = Field(3, ge=0)
    """A crashed actor is replaced up to this many times per slot (a reclaimed one always is)."""
    max_usd_per_hour: float | None = Field(None, gt=0)
    """Budget: the fleet never runs workers costing more than this per hour (None = no cap; local actors cost 0)."""
    prices: PriceSourceConfig = Field(default_factory=SnapshotPricesConfig)
    """Price source for activation and cost figures: ``{source: snapshot|aws|skypilot, ...}``."""
    learner_usd_per_hour: float | None = Field(None, ge=0)
    """What the learner's machine costs per hour, for the cost report (None: the report lists the learner
    unpriced rather than guess)."""
    learner_silence_s: float = Field(1800.0, gt=0)
    """An actor stops (exit 0) after this long without a sign of its learner: no new ``policy/LATEST`` and no
    new ledger entry. A learner that died cannot down its actors, so this is how a SkyPilot actor stops
    billing (its cluster then downs itself, ``fleet.idle_minutes_to_autodown``); keep it well above the
    longest gap between two steps (an evaluation included)."""
    adopt_on_resume: bool = True
    """On ``--resume``, the new learner adopts the run's actors that are still running (the ledger's launches
    that never ended, reached through the backend: a live local process of this run and actor, an UP SkyPilot
    cluster) instead of stopping them and launching new ones (``echo2/fleet/adoption.py``); those it cannot
    reach are stopped and replaced as before. False: stop them all (the behaviour before adoption)."""
    extra_packages: list[str] = Field(default_factory=list)
    """Packages every actor needs beside echo2, such as the one holding a ``plugin`` task or a ``reward_fn``
    function: local paths (a project folder with ``pyproject.toml`` or ``setup.py``, or a ``.whl`` / ``.tar.gz``;
    written with a ``/`` or starting with ``.`` or ``~``) or pip requirements (``my-rewards==1.2``). SkyPilot
    actors install them in their setup, a local path staged beside echo2's source (no credential-looking file
    travels: ``echo2/fleet/extra_packages.py``); local actors run the learner's interpreter (or
    ``fleet.actor_python``), so there each must already be installed: checked before the run starts."""

    @field_validator("extra_packages")
    @classmethod
    def _paths_or_requirements(cls, items: list[str]) -> list[str]:
        from packaging.requirements import InvalidRequirement, Requirement

        for item in items:
            if not item.strip():
                raise ValueError("an empty entry")
            if is_local_package(item):
                continue
            try:  # also keeps pip's options (-e, --index-url ...) out of the actors' requirements file
                Requirement(item)
            except InvalidRequirement as exc:
                raise ValueError(f"{item!r} is neither a local path (./my_pkg) nor a pip requirement: "
                                 f"{str(exc).splitlines()[0]}") from None
        return items


    @model_validator(mode="after")
    def _workload_plans_an_auto_fleet(self):
        if self.workload is not None and self.actors != "auto":
            raise ValueError(f"fleet.workload plans the first fleet of fleet.actors: auto; fleet.actors is "
                             f"{self.actors}: set it to auto or leave fleet.workload out")
        if self.workload is not None and self.backend == "local" and not getattr(self, "price_as", None):
            raise ValueError("fleet.workload plans a fleet of catalog offers: a local fleet needs fleet.price_as "
                             "(the offers its actors are priced as)")
        return self


class LocalFleetConfig(FleetConfigBase):
    """``fleet.backend: local`` (the default): actors are processes on this machine, with a reclaim injector."""

    backend: Literal["local"] = "local"
    """OS processes on this machine (``echo2/fleet/backends/local.py``)."""
    reclaim_rate: float = Field(0.0, ge=0)
    """Reclaim injector: expected reclaims per actor per minute (Poisson), as a spot market would
    take machines away; 0 = never. Each reclaimed actor is replaced by the fleet manager."""
    reclaim_burst: float = Field(0.0, ge=0, le=1)
    """Probability that a reclaim takes every running actor at once (spot pools are reclaimed in bursts)."""
    notice_s: float = Field(2.0, ge=0)
    """Notice a reclaimed actor gets: SIGTERM, then SIGKILL this many seconds later if it is still there."""
    seed: int = 0
    """Seed of the reclaim injector, so a chaos run can be repeated."""
    price_as: str | list[str] | None = None
    """Price every local actor as this catalog offer (``provider/instance_type@region``, as ``echo2 prices
    --json`` names them, from ``fleet.prices``): the run's cost report then shows what the same hours would
    have cost there, and its title says "simulated prices". None: local actors cost $0. A list: each actor is
    priced as one of them, as if it ran there (its speed the worker profile's); with ``actors: auto`` the
    chooser (``echo2/fleet/sizing/choose.py``) picks the mix, as ``echo2 plan`` would, else the cheapest per
    expected token/s first."""
    price_as_spot: bool = True
    """With ``price_as``: bill the offer's spot price (True) or its on-demand price."""
    actor_python: str | None = None
    """Python interpreter that runs the local actors (``PY -m echo2.cli actor``); None: the learner's own.
    Point it at an actor-only environment for an engine that cannot live beside Prefect, e.g.
    ``.venv-vllm/bin/python`` with ``rollout.engine.kind: vllm`` (docs/vllm.md)."""




class SkyPilotFleetConfig(FleetConfigBase):
    """``fleet.backend: skypilot``: one SkyPilot cluster per actor; which offers, ports, autodown, credentials."""

    backend: Literal["skypilot"] = "skypilot"
    """One SkyPilot cluster per actor (``echo2/fleet/backends/skypilot.py``)."""
    task_file: str | None = None
    """SkyPilot task YAML of one actor (None = the shipped ``infra/skypilot/actor.yaml``: setup installs
    echo2's actor environment, run starts ``echo2 actor``). Its ``resources`` are the base every candidate
    offer is laid over (disk, image); the candidates themselves come from the price source."""
    gpus: list[str] | None = None
    """GPU types an actor may run on, e.g. ``[L4, A10G]`` (None = every profiled GPU the model fits)."""
    providers: list[str] | None = None
    """Providers (SkyPilot clouds) an actor may run on, e.g. ``[aws, gcp]`` (None = every provider of the
    price source that SkyPilot can launch on)."""
    spot: bool = True
    """Buy spot capacity (reclaimed without warning, replaced by the manager) rather than on-demand."""
    any_of: int = Field(8, ge=1)
    """Each launch names up to this many interchangeable offers (same GPU type and count, other regions or
    clouds) as SkyPilot ``any_of``; SkyPilot takes the cheapest that has capacity."""
    relay_port: int = Field(8443, ge=1, le=65535)
    """Port of each actor's relay, opened through SkyPilot's ``ports`` (reachable from anywhere)."""
    idle_minutes_to_autodown: int = Field(10, ge=1)
    """A cluster tears itself down this long after its actor's job ended (SkyPilot's autodown waits for the
    job): the learner downs its clusters itself; where it died, each actor ends its job after
    ``fleet.learner_silence_s`` without a sign of it, and its cluster goes this long after."""
    status_poll_s: float = Field(30.0, ge=0)
    """How often the backend asks SkyPilot for its clusters' states (one request for all of them; 0 = at every poll)."""
    exit_hold_s: float = Field(180.0, ge=0)
    """An actor whose job ended cleanly (exit 0) while its cluster is still up is recorded as exited only
    after this long: an actor leaves on a spot notice with exit 0 a minute or two before the cloud takes its
    machine (AWS gives 2 minutes, GCP 30 s), and a cluster that vanishes within it is a reclaim."""
    unavailable_retry_s: float = Field(300.0, ge=0)
    """An offer that had no capacity is not asked again for this long."""
    credentials_role_arn: str | None = None
    """AWS role each actor's scoped, expiring S3 credentials are minted from (STS with the session policy of
    ``echo2/fleet/credentials.py``; ``infra/iam/``). Required with ``fleet.backend: skypilot``: an actor VM
    gets these and nothing else of the operator's (SkyPilot is told ``remote_identity: NO_UPLOAD`` for every
    cloud), so without them it could not reach the store."""
    aws_node_profile: str | None = None
    """IAM instance profile an actor VM on AWS runs under (SkyPilot's ``aws.remote_identity``): the node profile
    of ``infra/iam/README.md``, which may do no more than the node's own autodown needs (no S3 at all). None:
    SkyPilot attaches its own ``skypilot-v1`` profile (AmazonEC2FullAccess, AmazonS3FullAccess), through
    whose instance metadata an actor reaches the whole bucket and account whatever its scoped credentials
    say, so AWS is refused without it (unless ``allow_broad_vm_identity``)."""
    allow_broad_vm_identity: bool = False
    """Launch anyway where the VM itself holds a broad cloud identity: AWS without ``aws_node_profile``, and GCP,
    whose VMs SkyPilot 0.14 always gives its ``skypilot-v1`` service account (storage.admin, compute.admin).
    True VOIDS THE ACTOR TRUST BOUNDARY: any actor can then read and overwrite the whole bucket (other actors'
    rollouts, policy versions, checkpoints, the ledger) and act on the cloud account through its machine's
    metadata server, whatever its scoped credentials say. Only for actors you trust as much as the learner."""
    credentials_hours: float = Field(6.0, ge=0.25, le=12)
    """Lifetime of an actor's scoped credentials and relay token; an actor is replaced before they expire."""
    sts_endpoint_url: str | None = None
    """STS endpoint (None = AWS's own; tests point it at moto)."""

    def broad_vm_identity(self) -> str | None:
        """Why actor VMs would hold a broad cloud identity (one line), or None; ``allow_broad_vm_identity`` opts out."""
        if self.allow_broad_vm_identity:
            return None
        providers = {p.lower() for p in self.providers} if self.providers else None  # None: every provider
        named = "fleet.providers " + ("includes {0}" if providers else "(unset: every provider) includes {0}")
        void = "or set fleet.allow_broad_vm_identity: true, which voids the actor trust boundary"
        if providers is None or "gcp" in providers:
            return (f"{named.format('gcp')}: SkyPilot gives every GCP VM its skypilot-v1 service account "
                    f"(storage.admin, compute.admin), so an actor there is not held to its scoped credentials: "
                    f"list providers without gcp (e.g. [aws]), {void}")
        if "aws" in providers and not self.aws_node_profile:
            return ("fleet.aws_node_profile is not set: every AWS VM would run under SkyPilot's skypilot-v1 "
                    "instance profile (AmazonS3FullAccess, AmazonEC2FullAccess), so an actor there is not held to "
                    "its scoped credentials: create the node profile of infra/iam/README.md and name it, leave aws "
                    f"out of fleet.providers, {void}")
        return None


_SECTIONS_MOVED = {"local": LocalFleetConfig, "skypilot": SkyPilotFleetConfig}


def _no_backend_sections(value: Any) -> Any:
    """A config of before the union (``fleet.local:`` / ``fleet.skypilot:`` subsections) is refused in one line that
    says where its fields went, rather than as an unknown key."""
    if isinstance(value, dict):
        for name, cls in _SECTIONS_MOVED.items():
            if name in value:
                given = value[name]
                fields = sorted(given) if isinstance(given, dict) and given else sorted(
                    set(cls.model_fields) - set(FleetConfigBase.model_fields))
                raise ValueError(f"fleet.{name} is no longer a subsection: write its fields ({', '.join(fields)}) "
                                 f"directly under fleet, beside fleet.backend: {name} (e.g. fleet.{fields[0]})")
    return value


def _fleet_backend(value: Any) -> str | None:
    """The backend of a fleet mapping: ``local`` when absent (the default fleet)."""
    if isinstance(value, dict):
        return value.get("backend", "local")
    return getattr(value, "backend", None)


FleetConfig = Annotated[
    Annotated[LocalFleetConfig, Tag("local")] | Annotated[SkyPilotFleetConfig, Tag("skypilot")],
    Discriminator(_fleet_backend, custom_error_type="fleet_backend",
                  custom_error_message="fleet.backend must be one of local, skypilot"),
    BeforeValidator(_no_backend_sections),
]
"""Where actors run (``echo2/fleet/backends/``, built by ``make_backend``), chosen by ``fleet.backend``:
``local`` or ``skypilot``; the shared fields of ``FleetConfigBase`` and each backend's own, all under ``fleet:``."""
