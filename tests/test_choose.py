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


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(Echo2InputError, match="target utilization"):
        _choose(_workload(), target_utilization=1.5)
    with pytest.raises(Echo2InputError, match="tokens per batch"):
        choose_fleet(_workload(), OFFERS, PROFILES, model_params_b=1.0, batch_tokens=0)
