"""The one chooser (echo2/fleet/sizing/choose.py): activation's exact solver on the capacity model's
groups/s target, checked with capacity.predict and raised until the learner is busy enough."""

from __future__ import annotations

import pytest

from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import Offer, Profile
from echo2.fleet.sizing.activation import activate, candidates, target_groups_per_second
from echo2.fleet.sizing.capacity import Workload, predict
from echo2.fleet.sizing.choose import batch_seconds_of, choose_fleet

PROFILES = {"A": Profile("A", {1.0: 100.0}, "test"), "B": Profile("B", {1.0: 300.0}, "test")}
OFFERS = [Offer("p", "a1", "A", 1, 80.0, "r1", 2.0, 1.0), Offer("p", "b1", "B", 1, 80.0, "r1", 6.0, 2.5),
          Offer("q", "a1", "A", 1, 80.0, "r2", 2.0, 1.2)]
BATCH_TOKENS = 1000.0  # one batch: 10 s on A, 3.33 s on B


def _workload(**kw) -> Workload:
    return Workload(**{"train_seconds": 5.0, "groups_per_step": 8, "groups_per_batch": 2, "staleness": 2,
                       "dissemination_seconds": 1.0, "upload_seconds": 0.5, **kw})


def _choose(w: Workload, **kw):
    return choose_fleet(w, OFFERS, PROFILES, model_params_b=1.0, batch_tokens=BATCH_TOKENS, **kw)


def test_the_chosen_fleet_keeps_the_learner_busy_as_predicted():
    w = _workload()
    chosen = _choose(w)
    assert chosen is not None and chosen.prediction.utilization >= 0.95
    # the check is capacity.predict on the fleet's instances, each at its expected throughput
    again = predict(w, batch_seconds_of(chosen.fleet, w, BATCH_TOKENS), steps=200)
    assert again.utilization == pytest.approx(chosen.prediction.utilization)
    # the throughput target alone is necessary: the chooser never buys less than activation on it
    cands = candidates(OFFERS, PROFILES, 1.0, unit="groups/s", workload=w, batch_tokens=BATCH_TOKENS,
                       markets=("spot",))
    floor = activate(cands, target_groups_per_second(w))
    assert chosen.usd_per_hour >= floor.usd_per_hour - 1e-9
    assert chosen.expected_throughput >= target_groups_per_second(w) * (1 - 1e-9)


def test_a_freshness_bound_workload_raises_the_target_until_predict_meets_it():
    # S=2 with R/T worth of throughput: the fill time F_R plus D exceed what S steps hide, so the
    # learner waits for fresh rollouts; the chooser buys more than the throughput target until predict says 80%
    w = _workload(staleness=2, dissemination_seconds=1.0)
    chosen = _choose(w, target_utilization=0.8)
    assert chosen is not None and chosen.rounds > 1
    assert chosen.prediction.utilization >= 0.8
    assert chosen.expected_throughput > target_groups_per_second(w, 0.8)


def test_out_of_reach_staleness_and_budget_answer_none_or_the_best_effort():
    # a version takes 60 s to reach an actor, the learner trains 5 s with S=1: no fleet keeps it busy
    assert _choose(_workload(staleness=1, dissemination_seconds=60.0)) is None
    assert _choose(_workload(), budget_usd_per_hour=0.5) is None
    best = _choose(_workload(staleness=1, dissemination_seconds=60.0), best_effort=True)
    assert best is not None and best.prediction.utilization < 0.95
    # a budget below any fleet that meets the target: the most throughput it buys, for the live fleet
    poor = _choose(_workload(), budget_usd_per_hour=3.0, best_effort=True)
    assert poor is not None and poor.usd_per_hour <= 3.0 and poor.prediction.utilization < 0.95
    richer = _choose(_workload(), budget_usd_per_hour=5.0, best_effort=True)
    assert richer.expected_throughput > poor.expected_throughput
    assert _choose(_workload(), budget_usd_per_hour=0.5, best_effort=True) is None  # not one instance


def test_markets_gpus_and_reclaim_overrides_steer_the_choice():
    w = _workload(train_seconds=20.0)
    only_a = _choose(w, gpus=["A"])
    assert only_a is not None and {c.offer.gpu for c, _ in only_a.fleet} == {"A"}
    on_demand = _choose(w, markets=("on-demand",))
    assert all(not c.spot for c, _ in on_demand.fleet)
    # provider p's spot reclaimed every few minutes: its availability collapses and q is preferred
    base = _choose(w, gpus=["A"])
    assert any(c.offer.provider == "p" for c, _ in base.fleet)
    away = _choose(w, gpus=["A"], reclaim={"p": 30.0})
    assert away is not None and all(c.offer.provider == "q" for c, _ in away.fleet)


def test_the_live_chooser_keeps_within_max_and_min_actors():
    from echo2.config import LocalFleetConfig
    from echo2.fleet.backends.base import ActorOffer
    from echo2.fleet.sizing.autosize import FleetChooser

    offers = [ActorOffer.from_catalog(o, True) for o in OFFERS]
    w = _workload()
    free = FleetChooser.for_offers(offers, LocalFleetConfig(actors="auto", max_actors=64), 1.0)
    free.profiles = PROFILES
    wanted = free.choose(w, BATCH_TOKENS)
    assert wanted.actors >= 3 and "capped" not in wanted.reason
    capped = FleetChooser.for_offers(offers, LocalFleetConfig(actors="auto", max_actors=2), 1.0)
    capped.profiles = PROFILES
    two = capped.choose(w, BATCH_TOKENS)
    assert two.actors == 2 and "fleet.max_actors=2" in two.reason
    # the instances kept are the cheapest per expected throughput of the chosen fleet
    value = {c.name: c.usd_per_hour / c.expected_throughput for c, _ in two.activation.fleet}
    assert max(value[o.name] for o, _ in two.counts) <= min(value.values()) + 1e-12 or len(value) == 1
    many = FleetChooser.for_offers(offers, LocalFleetConfig(actors="auto", min_actors=9, max_actors=64), 1.0)
    many.profiles = PROFILES
    assert many.choose(w, BATCH_TOKENS).actors == 9
    assert FleetChooser.for_offers(offers, LocalFleetConfig(actors=2), 1.0) is None  # a fixed count
    assert FleetChooser.for_offers([ActorOffer()], LocalFleetConfig(actors="auto"), 1.0) is None  # unpriced


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(Echo2InputError, match="target utilization"):
        _choose(_workload(), target_utilization=1.5)
    with pytest.raises(Echo2InputError, match="tokens per batch"):
        choose_fleet(_workload(), OFFERS, PROFILES, model_params_b=1.0, batch_tokens=0)


# --- the live fleet buys what the plan buys -----------------------------------------------------------------------

CHEAP_L4 = "aws/g6.xlarge@eu-south-2"
A10G = "aws/g5.xlarge@us-east-1"
LEARNER = "aws/p5.48xlarge@us-east-1"


def _catalog_offers(names):
    from echo2.fleet.prices.catalog import load_catalog

    rows = {o.name: o for o in load_catalog(spot=None)}
    return [rows[n] for n in names]


def _live_fleet(tmp_path, backend, names=(CHEAP_L4, A10G), **config):
    """A manager over catalog offers (spot) with the chooser, as make_fleet builds it for fleet.actors: auto."""
    from echo2.config import LocalFleetConfig
    from echo2.data.store.fsspec_store import FsspecStore
    from echo2.fleet.backends.base import ActorLaunch, ActorOffer
    from echo2.fleet.manager import FleetManager
    from echo2.fleet.sizing.autosize import FleetChooser

    offers = [ActorOffer.from_catalog(o, True) for o in _catalog_offers(names)]
    fleet_config = LocalFleetConfig(actors="auto", max_actors=16, **config)
    store = FsspecStore(str(tmp_path / "run"), {})
    chooser = FleetChooser.for_offers(offers, fleet_config, 1.5)
    spec = lambda actor_id, offer: ActorLaunch(actor_id, store.url, ["echo2", "actor"], offer=offer)  # noqa: E731
    return FleetManager(backend, fleet_config, store, launch_spec=spec, offers=offers, chooser=chooser,
                        plan_from=_sized()), store


def _sized():
    from echo2.fleet.sizing.autosize import FleetSize

    w = Workload(train_seconds=40.0, groups_per_step=64, groups_per_batch=4, staleness=2, dissemination_seconds=2.0,
                 upload_seconds=0.5)
    return FleetSize(0, "test workload", w, 4 * 8 * 512.0)


def _on(fleet) -> dict[str, int]:
    out: dict[str, int] = {}
    for slot in fleet.slots:
        out[slot.offer.name] = out.get(slot.offer.name, 0) + 1
    return out


def test_an_offer_reclaimed_far_more_often_than_assumed_is_planned_away_from(tmp_path):
    from fleet_shared import FakeCloud

    from echo2.data.ledger import read_events
    from echo2.fleet.backends.base import ActorState, ActorStatus

    cloud = FakeCloud()
    fleet, store = _live_fleet(tmp_path, cloud)
    fleet.start()
    assert _on(fleet) == {f"{CHEAP_L4}:spot": 5}  # the chooser's fleet: five of the cheap L4
    for _ in range(3):  # the cheap L4 is taken again and again, within seconds (0.1/h assumed)
        cloud.states[fleet.slots[0].actor_id] = ActorStatus(ActorState.RECLAIMED, "Server.SpotInstanceTermination")
        fleet.reconcile()
    assert _on(fleet) == {f"{CHEAP_L4}:spot": 5}  # replaced in kind until the next sizing
    fleet.autosize(4, _sized)
    # measured: 3 reclaims in a few instance-seconds; the chooser plans with that rate and leaves the offer
    assert f"{CHEAP_L4}:spot" in fleet.reclaim_overrides and fleet.reclaim_overrides[f"{CHEAP_L4}:spot"] > 100
    assert _on(fleet) == {f"{A10G}:spot": 3}
    resize = [e for e in read_events(store) if e["kind"] == "resize"][-1]
    assert [m["offer"] for m in resize["mix"]] == [f"{A10G}:spot"] and f"{CHEAP_L4}:spot" in resize["reclaim_overrides"]
    # a rate the ledger cannot tell from the assumed one changes nothing: A10G's few seconds without a reclaim
    assert f"{A10G}:spot" not in fleet.reclaim_overrides
    fleet.stop()


def test_an_offer_without_capacity_is_planned_around(tmp_path):
    from fleet_shared import FakeCloud

    from echo2.data.ledger import read_events

    fleet, store = _live_fleet(tmp_path, FakeCloud(no_capacity={"g6.xlarge"}))
    fleet.start()
    assert _on(fleet) == {f"{A10G}:spot": 3} and fleet.desired == 3
    events = sorted(read_events(store), key=lambda e: e["ts"])
    assert [e["kind"] for e in events].count("unavailable") == 1  # asked once, then planned around
    assert [[m["offer"] for m in e["mix"]] for e in events if e["kind"] == "resize"] == [
        [f"{CHEAP_L4}:spot"], [f"{A10G}:spot"]]
    fleet.stop()


def test_reclaim_rates_from_the_ledger_and_the_test_of_difference():
    from echo2.fleet.sizing.autosize import measured_reclaim_rates, rate_differs

    offer = {"provider": "aws", "instance_type": "g6.xlarge", "region": "us-east-1", "spot": True}
    events = [{"ts": 0.0, "kind": "launch", "actor_id": "a", **offer},
              {"ts": 1800.0, "kind": "reclaimed", "actor_id": "a", **offer},
              {"ts": 1800.0, "kind": "launch", "actor_id": "b", **offer},
              {"ts": 1900.0, "kind": "running", "actor_id": "b", **{**offer, "region": "us-west-2"}},
              {"ts": 0.0, "kind": "launch", "actor_id": "c"}]  # no offer named: not counted
    rates = measured_reclaim_rates(events, now=5400.0)
    assert rates == {"aws/g6.xlarge@us-east-1:spot": (1, 0.5), "aws/g6.xlarge@us-west-2:spot": (0, 1.0)}
    assert not rate_differs(1, 0.5, 0.1)       # one reclaim in half an hour: chance at 0.1/h (p ~ 0.05)
    assert rate_differs(5, 0.5, 0.1)           # five: not chance
    assert rate_differs(0, 100.0, 0.1)         # none in 100 instance-hours: 0.1/h is too pessimistic
    assert not rate_differs(0, 10.0, 0.1) and not rate_differs(3, 0.0, 0.1)


@pytest.mark.e2e
def test_echo2_plan_and_the_runs_first_launches_buy_the_same_fleet(tmp_path, monkeypatch):
    """The same inputs (a workload file and a price catalog) through `echo2 plan --workload --json` and through a run's
    fleet (fleet.actors: auto, the local backend priced as the catalog's actor offers, fleet.workload): the run's
    first launches are the plan's fleet, offer by offer."""
    import collections
    import json
    import subprocess
    import sys

    from conftest import REPO

    from echo2.config import LocalFleetConfig
    from echo2.data.ledger import read_events
    from echo2.data.run_key import run_key
    from echo2.data.store.fsspec_store import FsspecStore
    from echo2.fleet.make import make_fleet

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    actors = [CHEAP_L4, A10G, "aws/g6.xlarge@us-east-1", "aws/g6.xlarge@us-west-2"]
    shipped = (REPO / "infra" / "prices" / "gpu-offers-2026-11.csv").read_text().splitlines()
    wanted = {n.replace("/", ",", 1).split("@")[0] + "@" + n.split("@")[1] for n in [*actors, LEARNER]}
    rows = [line for line in shipped[1:]
            if f"{line.split(',')[0]},{line.split(',')[1]}@{line.split(',')[7]}" in wanted]
    assert len(rows) == 5
    catalog = tmp_path / "catalog.csv"
    catalog.write_text("\n".join([shipped[0], *rows]) + "\n")
    workload = tmp_path / "workload.yaml"
    workload.write_text(
        "name: same-inputs\nmodel: {total_params_b: 1.5}\ndata: {prompts: 6400, epochs: 1}\n"
        "rollout: {group_size: 8, groups_per_batch: 4, completion_tokens_mean: 512}\n"
        "train: {groups_per_step: 64, staleness: 2, train_seconds: 20}\n"
        "learner: {gpu: H100, gpus: 8, market: on-demand}\n"
        "actors: {market: spot, gpus: [L4, A10G]}\nnetwork: {dissemination_seconds: 2.0}\n")
    cli = subprocess.run([sys.executable, "-m", "echo2.cli", "plan", "--workload", str(workload), "--catalog",
                          str(catalog), "--point", "--json"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    planned = {f"{r['offer']['name']}:{r['market']}": r["count"] for r in json.loads(cli.stdout)["fleet"]}
    assert len(planned) >= 2, planned  # a mix, not one offer: the comparison means something

    store = FsspecStore(str(tmp_path / "run"), {})
    config = LocalFleetConfig(actors="auto", max_actors=32, price_as=actors, workload=str(workload),
                              prices={"source": "snapshot", "catalog": str(catalog)})
    fleet = make_fleet(config, store, store_options={}, log_dir=tmp_path / "logs", run_key=run_key("r", create=True),
                       actor_command=["true"], model_params_b=1.5)
    fleet.start()
    fleet.stop()
    launches = [e for e in read_events(store) if e["kind"] == "launch"]
    bought = collections.Counter(f"{e['provider']}/{e['instance_type']}@{e['region']}:"
                                 f"{'spot' if e['spot'] else 'on-demand'}" for e in launches)
    assert dict(bought) == planned
    assert all(e["simulated_price"] for e in launches)


def test_fleet_workload_is_refused_where_it_would_plan_nothing():
    from echo2.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="fleet.workload plans the first fleet of fleet.actors: auto"):
        load_config(None, ["fleet.workload=small-dense-example"])
    with pytest.raises(ConfigError, match="a local fleet needs fleet.price_as"):
        load_config(None, ["fleet.actors=auto", "fleet.workload=small-dense-example"])
    config = load_config(None, ["fleet.actors=auto", "fleet.workload=small-dense-example",
                                f"fleet.price_as=[{CHEAP_L4},{A10G}]"])
    assert config.fleet.price_as == [CHEAP_L4, A10G]
