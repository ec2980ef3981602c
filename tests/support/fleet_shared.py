"""Shared by the tests: moved out of test_fleet.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

from echo2.config import LocalFleetConfig
from echo2.data.store.fsspec_store import FsspecStore
from echo2.fleet.backends.base import ActorLaunch, ActorOffer, ActorState, ActorStatus, CapacityError, FleetBackend
from echo2.fleet.manager import FleetManager


class FakeCloud(FleetBackend):
    """Test double at the provisioning boundary (a cloud's launch API, unreachable from here):
    offers listed in ``no_capacity`` raise CapacityError; the test sets actors' states by hand."""

    name = "fake-cloud"

    def __init__(self, no_capacity=()):
        self.no_capacity = set(no_capacity)
        self.states: dict[str, ActorStatus] = {}
        self.launched: list[ActorLaunch] = []
        self.terminated: list[str] = []

    def launch(self, spec):
        if spec.offer.instance_type in self.no_capacity:
            raise CapacityError(f"InsufficientInstanceCapacity for {spec.offer.instance_type}")
        self.launched.append(spec)
        self.states[spec.actor_id] = ActorStatus(ActorState.RUNNING)
        return {"cluster": f"echo2-{spec.actor_id}"}

    def poll(self, actor_id):
        return self.states[actor_id]

    def terminate(self, actor_id, grace_s=10.0):
        self.terminated.append(actor_id)


OFFERS = [ActorOffer(provider="aws", instance_type="g6.xlarge", gpu="L4", gpu_count=1, region="us-east-1", spot=True,
                     usd_per_hour=0.30, on_demand_usd_per_hour=0.80),
          ActorOffer(provider="gcp", instance_type="g2-standard-4", gpu="L4", gpu_count=1, region="us-central1",
                     spot=True, usd_per_hour=0.22, on_demand_usd_per_hour=0.71)]


def manager(tmp_path, backend, **fleet):
    store = FsspecStore(str(tmp_path / "run"), {})
    spec = lambda actor_id, offer: ActorLaunch(actor_id, store.url, ["echo2", "actor"], offer=offer)  # noqa: E731
    return FleetManager(backend, LocalFleetConfig(**fleet), store, launch_spec=spec, offers=OFFERS), store
