"""``make_fleet``: the configured backend behind a ``FleetManager`` (``manager.py``), for the flow and the benchmarks.

It builds the ``LaunchContext`` every backend is given (the run's store, its options, the relay secrets, the
learner's market: a ``learner.market: spot`` learner's local actors must outlive it), asks the backend for its
offers before anything of it runs (a fleet that fits none stops here, with nothing to undo), and with
``fleet.actors: auto`` over catalog offers the chooser's first plan. It names no backend.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.config import FleetConfig
from echo2.data.run_folder import RunInfo
from echo2.data.store import ObjectStore
from echo2.fleet.backends import LaunchContext, make_backend
from echo2.fleet.backends.base import RelaySecrets
from echo2.fleet.manager import FleetManager
from echo2.fleet.sizing.autosize import FleetChooser, FleetSize


def make_fleet(config: FleetConfig, store: ObjectStore, *, store_options: dict, log_dir: Path,
               run_key: Ed25519PrivateKey, seed: int = 0, actor_command: list[str] | None = None,
               run_id: str | None = None, model_params_b: float | None = None, active_params_b: float | None = None,
               plan_from: FleetSize | None = None, market: str | None = None) -> FleetManager:
    """The configured backend behind a manager. ``actor_command`` replaces ``python -m echo2.cli
    actor`` (the overlap benchmark's timing workload); ``--run``, ``--actor-id`` and
    ``--parent-pid`` are appended to it. ``run_id`` and ``model_params_b`` (the policy's size, which
    decides the GPUs it fits and their speed; ``active_params_b`` for a mixture of experts) are what a cloud
    backend needs beside. The backend answers for its offers, its actors' launches (from the ``LaunchContext``
    given here: the run's store, options and relay secrets) and its manager options (``FleetBackend``): nothing
    here names one. With ``fleet.actors: auto`` over catalog offers the fleet is the chooser's
    (``autosize.FleetChooser``), first for ``plan_from`` where given. ``market``: the learner's own
    (``learner.market``; default: what the run's ``run.json`` says, else on-demand): a spot learner's actors outlive
    it (``LaunchContext.outlive_learner``)."""
    run_id = run_id or store.url.rstrip("/").rsplit("/", 1)[-1]
    market = market or RunInfo.read(store).learner_market
    launch = LaunchContext(store_url=store.url, store_options=store_options,
                           relay_secrets=RelaySecrets(run_key, run_id), run_id=run_id, actor_command=actor_command,
                           outlive_learner=market == "spot")
    backend = make_backend(config, run_id=run_id, log_dir=log_dir, seed=seed)
    # the offers before the backend starts: a fleet that fits no offer stops here, before a backend has started
    # its threads (the reclaim injector) or staged a workdir (SkyPilot); both wait for FleetManager.start
    offers = backend.offers(model_params_b, active_params_b)
    chooser = FleetChooser.for_offers(offers, config, model_params_b, active_params_b)
    if chooser is not None and plan_from is None and config.workload:
        from echo2.fleet.prices import make_price_source

        plan_from = chooser.first_plan(config.workload, make_price_source(config.prices).offers())
    return FleetManager(backend, config, store, launch=launch, offers=offers, chooser=chooser, plan_from=plan_from,
                        **backend.manager_options())

