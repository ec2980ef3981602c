"""Fleet backends: where actors run. ``make_backend`` builds the one ``fleet.backend`` names.

* ``base.py``: the ``FleetBackend`` interface (the offers its actors may run on, one actor's launch spec,
  launch it, poll it, terminate it), what it is given (``LaunchContext``: what the run gives every backend, the
  actors' relay secrets issued by a ``RelaySecrets``, no closure: a backend builds its own launch spec from the
  context alone; ``ActorLaunch``, ``ActorOffer``) and tells (``ActorState``, ``ActorStatus``), its errors
  (``CapacityError``, ``FleetApiError``). How many actors, on which offer, and replacing the reclaimed are the manager's
  (``echo2/fleet/manager.py``), the same for every backend; ``make_fleet`` (``echo2/fleet/make.py``) names no backend.
* ``local.py`` (``fleet.backend: local``): OS processes on this machine, with a reclaim injector.
* ``skypilot.py`` (``fleet.backend: skypilot``): one SkyPilot cluster per actor, spot GPUs across clouds.

Beside them, modules that are not backends: ``offers.py`` (the offers each backend launches on, from the price
source and the sizing candidates), ``reclaims.py`` (a reclaim or a crash, from the provider's own record), and the
SkyPilot backend's ``skypilot_api.py`` (every call into SkyPilot's SDK, behind ``SkyApi`` so tests put a double
there), ``sky_bridge.py`` (the script SkyPilot's own environment runs for each of those calls: echo2 never imports
SkyPilot), ``skypilot_task.py`` (an actor's task as data) and ``skypilot_trust.py`` (the actor trust boundary:
what an actor VM may be given and what it uploads; ``docs/security.md`` and ``infra/`` point reviewers at it).

Adding a backend is three steps, as for tasks, engines and price sources:

1. its config class in ``echo2/config/fleet.py``: a subclass of ``FleetConfigBase`` with its own
   ``backend: Literal["name"]`` and its own fields, added to the ``FleetConfig`` union (and to
   ``FleetConfigBase.backend``'s names);
2. one file here, ``echo2/fleet/backends/<name>.py``, a ``FleetBackend`` that imports the interface from
   ``base.py``, never from here: its ``launch``, ``poll`` and ``terminate``, its ``offers`` and
   ``launch_spec``, and where it needs them ``manager_options`` and ``start`` (its constructor starts
   nothing: ``make_fleet`` asks for the offers before ``start``);
3. one branch in ``make_backend`` below, from its config class to its backend.
"""

from __future__ import annotations

from pathlib import Path

from echo2.config import FleetConfig, LocalFleetConfig, SkyPilotFleetConfig
from echo2.fleet.backends.base import (
    ActorLaunch,
    ActorOffer,
    ActorState,
    ActorStatus,
    AdoptError,
    CapacityError,
    FleetApiError,
    FleetBackend,
    LaunchContext,
)


def make_backend(config: FleetConfig, *, run_id: str, log_dir: Path, seed: int = 0) -> FleetBackend:
    """The backend of a ``fleet`` config: ``run_id`` labels a cloud backend's machines, ``log_dir`` holds local
    actors' logs, ``seed`` (the run's) plus ``fleet.seed`` seeds the local reclaim injector."""
    if isinstance(config, LocalFleetConfig):
        from echo2.fleet.backends.local import LocalBackend

        return LocalBackend(config, log_dir, seed=seed + config.seed)
    if isinstance(config, SkyPilotFleetConfig):
        from echo2.fleet.backends.skypilot import SkyPilotBackend

        return SkyPilotBackend(config, run_id=run_id)
    raise ValueError(f"no fleet backend for config {type(config).__name__}")


__all__ = ["ActorLaunch", "ActorState", "ActorStatus", "AdoptError", "CapacityError", "FleetApiError", "FleetBackend",
           "LaunchContext", "ActorOffer", "make_backend"]
