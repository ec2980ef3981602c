"""Cost-aware activation (echo2/fleet/sizing/activation.py) and `echo2 bench cost`: optimality against brute
force, the reclaim over-provisioning, caps and budget, the baseline, the full catalog, the CLI contract."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys

import pytest
from conftest import REPO

from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import Offer, Profile, load_profiles
from echo2.fleet.prices.snapshot import SnapshotPrices
from echo2.fleet.sizing.activation import (
    Candidate,
    activate,
    baseline,
    candidates,
    cap_for,
    parse_overrides,
    reclaim_rate,
    reduce,
    target_groups_per_second,
)
from echo2.fleet.sizing.capacity import Workload, required_throughput
from echo2.fleet.sizing.cover import cover_search


def _offer(i: int, provider="p", gpu="G", count=1, memory=80.0) -> Offer:
    return Offer(provider, f"t{i}", gpu, count, memory, "r", 1.0, 1.0)


def _cand(i: int, price: float, throughput: float, cap: int, reclaim: float = 0.0, spot: bool = True,
          gpu_type: str = "G") -> Candidate:
    return Candidate(_offer(i, gpu=gpu_type), spot, price, throughput, "tokens/s", throughput, reclaim, 3600.0, cap,
                     "test", gpu_type)


def _brute_force(cands: list[Candidate], target: float, budget: float | None = None) -> float | None:
    best = None
    for counts in itertools.product(*(range(c.cap + 1) for c in cands)):
        cost = sum(n * c.usd_per_hour for n, c in zip(counts, cands))
        if sum(n * c.expected_throughput for n, c in zip(counts, cands)) >= target * (1 - 1e-9) and \
                (budget is None or cost <= budget * (1 + 1e-12)) and (best is None or cost < best):
            best = cost
    return best


def test_activation_matches_brute_force_on_small_instances():
    rng = random.Random(7)
    checked = feasible = 0
    for trial in range(250):
        n = rng.randint(1, 5)
        # small integers make equal and dominated offers common: the merging and dominance steps are exercised
        cands = [_cand(i, rng.choice([1, 2, 3, 4, 5, 6]), rng.choice([1, 2, 3, 5, 8]), rng.randint(0, 3),
                       reclaim=rng.choice([0.0, 0.0, 0.25, 1.0])) for i in range(n)]
        target = rng.choice([1, 2, 4, 7, 10, 15, 30])
        budget = rng.choice([None, None, 6.0, 12.0])
        expected = _brute_force(cands, target, budget)
        got = activate(cands, target, budget_usd_per_hour=budget)
        checked += 1
        if expected is None:
            assert got is None, (trial, cands, target, budget)
            continue
        feasible += 1
        assert got is not None and got.proven_optimal
        assert got.usd_per_hour == pytest.approx(expected), (trial, cands, target, budget)
        assert got.expected_throughput >= target * (1 - 1e-9)
        assert all(0 < count <= c.cap for c, count in got.fleet)
        assert budget is None or got.usd_per_hour <= budget + 1e-9
    assert checked == 250 and feasible > 100


def test_reduction_keeps_an_optimum_on_a_mid_size_instance():
    """Merging and dominance against the plain search over every candidate (both exact)."""
    rng = random.Random(3)
    for _ in range(20):
        cands = [_cand(i, round(rng.uniform(0.5, 5), 1), rng.choice([1, 2, 4, 8]), rng.randint(1, 4),
                       reclaim=rng.choice([0.0, 0.5])) for i in range(14)]
        target = rng.uniform(5, 40)
        order = sorted(cands, key=lambda c: c.usd_per_hour / c.expected_throughput)
        plain = cover_search([c.usd_per_hour for c in order], [([c.expected_throughput for c in order], target)],
                             [c.cap for c in order])
        got = activate(cands, target)
        assert (plain is None) == (got is None)
        if got is not None:
            assert got.usd_per_hour == pytest.approx(plain[1])
            assert got.types_searched <= len(cands)


def test_cover_search_with_two_covers_and_a_check_matches_brute_force():
    """The search's general form (several covers, an ``accept`` check on each covering fleet, a budget), which
    activation's one cover does not exercise, against every count vector."""
    rng = random.Random(11)
    feasible = 0
    for _ in range(60):
        n = 3
        prices = [round(rng.uniform(0.1, 3), 2) for _ in range(n)]
        covers = [([rng.uniform(0, 3) for _ in range(n)], rng.uniform(1, 6)) for _ in range(2)]
        caps = [rng.randint(1, 4) for _ in range(n)]
        budget = rng.choice([None, rng.uniform(2, 10)])
        veto = rng.randint(0, 7)

        def accept(counts):  # refuses some covering fleets, as the capacity model's check may
            return None if sum(counts) % 8 == veto else tuple(counts)

        best = None
        for counts in itertools.product(*(range(c + 1) for c in caps)):
            cost = sum(p * c for p, c in zip(prices, counts))
            covered = all(sum(g * c for g, c in zip(gains, counts)) >= need for gains, need in covers)
            if covered and (budget is None or cost <= budget + 1e-9) and accept(counts) is not None \
                    and (best is None or cost < best - 1e-9):
                best = cost
        found = cover_search(prices, covers, caps, budget=budget, accept=accept)
        assert (found is None) == (best is None), (prices, covers, caps, budget, veto)
        if found is not None:
            feasible += 1
            counts, cost, accepted, cut = found
            assert cost == pytest.approx(best) and not cut and accepted == tuple(counts)
    assert feasible >= 15  # the instances are not all trivially infeasible


def test_expected_throughput_over_provisions_for_each_offers_reclaim_rate():
    # one reclaim an hour, an hour out each time: up half the time
    flaky = _cand(0, 1.0, 10.0, 10, reclaim=1.0)
    assert flaky.availability == pytest.approx(0.5) and flaky.expected_throughput == pytest.approx(5.0)
    fleet = activate([flaky], 20.0)
    assert fleet.instances == 4 and fleet.nominal_throughput == 40.0 and fleet.expected_throughput == 20.0
    # a steadier offer at a higher price wins once its expected throughput per dollar is better
    steady = _cand(1, 1.5, 10.0, 10, reclaim=0.0, spot=False)
    fleet = activate([flaky, steady], 20.0)
    assert [(c.name, n) for c, n in fleet.fleet] == [(steady.name, 2)] and fleet.usd_per_hour == 3.0


def test_caps_and_budget_bound_the_fleet():
    cheap = _cand(0, 1.0, 10.0, cap=2)
    dear = _cand(1, 3.0, 10.0, cap=10)
    fleet = activate([cheap, dear], 40.0)
    assert {c.name: n for c, n in fleet.fleet} == {cheap.name: 2, dear.name: 2} and fleet.usd_per_hour == 8.0
    assert activate([cheap, dear], 40.0, budget_usd_per_hour=7.99) is None
    assert activate([cheap], 40.0) is None  # its cap cannot reach the target
    with pytest.raises(Echo2InputError, match="target"):
        activate([cheap], 0.0)


def test_equal_offers_are_merged_and_spread_over_their_offers():
    twins = [_cand(i, 1.0, 10.0, cap=2) for i in range(3)]
    [(gain, [(price, cap, members)])] = reduce(twins, 50.0)
    assert (price, gain, cap, len(members)) == (1.0, 10.0, 6, 3)
    fleet = activate(twins, 50.0)
    assert sorted(n for _, n in fleet.fleet) == [1, 2, 2] and fleet.usd_per_hour == 5.0
    # equal throughput, different prices: one type whose units are bought cheapest first
    regions = [_cand(0, 3.0, 10.0, cap=2), _cand(1, 1.0, 10.0, cap=2), _cand(2, 2.0, 10.0, cap=2)]
    [(gain, segments)] = reduce(regions, 50.0)
    assert gain == 10.0 and [(p, cap) for p, cap, _ in segments] == [(1.0, 2), (2.0, 2), (3.0, 2)]
    fleet = activate(regions, 50.0)
    assert {c.usd_per_hour: n for c, n in fleet.fleet} == {1.0: 2, 2.0: 2, 3.0: 1} and fleet.usd_per_hour == 9.0


def test_reclaim_rates_and_caps_have_defaults_and_overrides():
    aws = Offer("aws", "g6.xlarge", "L4", 1, 22.4, "us-west-2", 0.8, 0.28)
    vast = Offer("vast", "1x-RTX_3090", "RTX3090", 1, 24.0, "X", 0.2, None)
    assert reclaim_rate(aws, spot=False) == 0.0 and reclaim_rate(aws, spot=True) == 0.1
    assert reclaim_rate(aws, True, {"spot": 0.5}) == 0.5
    assert reclaim_rate(aws, True, {"aws:spot": 0.3, "spot": 0.5}) == 0.3
    assert reclaim_rate(aws, True, {f"{aws.name}:spot": 0.7, "aws": 0.3}) == 0.7
    assert reclaim_rate(aws, False, {"aws:spot": 0.3}) == 0.0
    assert cap_for(vast, False) == 2 and cap_for(aws, True) == 8 and cap_for(aws, True, {"aws": 20}) == 20
    assert parse_overrides(["aws:spot=0.3", "spot=1"], "--reclaim-rate") == {"aws:spot": 0.3, "spot": 1.0}
    for bad in (["aws"], ["aws=-1"], ["=1"], ["aws=x"]):
        with pytest.raises(Echo2InputError, match="KEY=NUMBER"):
            parse_overrides(bad, "--reclaim-rate")


def test_candidates_come_from_offers_profiles_and_the_model_size():
    offers = [Offer("aws", "small", "G", 1, 16.0, "r", 1.0, 0.3),      # 7B bf16 (13 GiB) does not fit 70% of 16 GiB
              Offer("aws", "big", "G", 2, 80.0, "r", 2.0, None),
              Offer("aws", "odd", "UNPROFILED", 1, 80.0, "r", 0.1, 0.1)]
    profiles = {"G": Profile("G", {1.0: 1000.0, 7.0: 100.0}, "test")}
    cands = candidates(offers, profiles, 7.0)
    assert [(c.offer.instance_type, c.market, c.throughput) for c in cands] == [("big", "on-demand", 200.0)]
    small = candidates(offers, profiles, 1.0)
    assert sorted((c.offer.instance_type, c.market) for c in small) == [
        ("big", "on-demand"), ("small", "on-demand"), ("small", "spot")]
    # a capacity-model target: groups/s of the workload, upload included as in reclaim_simulation.WorkerType
    w = Workload(train_seconds=10, groups_per_step=8, groups_per_batch=2, staleness=2, upload_seconds=1.0)
    [c] = candidates(offers[1:2], profiles, 1.0, unit="groups/s", workload=w, batch_tokens=2000.0)
    assert c.throughput == pytest.approx(2 / (2000.0 / 2000.0 + 1.0))
    assert target_groups_per_second(w, 0.5) == pytest.approx(0.5 * required_throughput(w))
    with pytest.raises(Echo2InputError, match="groups/s target needs"):
        candidates(offers, profiles, 1.0, unit="groups/s")


def test_baseline_is_one_gpu_type_on_demand_and_never_cheaper_than_activation():
    cands = [_cand(0, 1.0, 10.0, 10, reclaim=0.1, spot=True, gpu_type="A"),
             _cand(1, 4.0, 10.0, 10, spot=False, gpu_type="A"),
             _cand(2, 3.0, 10.0, 1, spot=False, gpu_type="B"),
             _cand(3, 5.0, 10.0, 10, spot=False, gpu_type="B")]
    base = baseline(cands, 30.0)
    assert {c.gpu_type for c, _ in base.fleet} == {"A"} and not any(c.spot for c, _ in base.fleet)
    assert base.usd_per_hour == 12.0  # B would cost 3 + 5 + 5 = 13
    assert activate(cands, 30.0).usd_per_hour < base.usd_per_hour


def test_full_catalog_activation_is_exact_and_beats_the_baseline():
    offers = SnapshotPrices().offers()
    cands = candidates(offers, load_profiles(), 4.0)
    assert len(cands) > 500
    for rollouts_per_second in (8, 64, 256):
        target = rollouts_per_second * 512.0
        fleet = activate(cands, target)
        base = baseline(cands, target)
        assert fleet.proven_optimal and base.proven_optimal
        assert fleet.expected_throughput >= target * (1 - 1e-9) and base.nominal_throughput >= target * (1 - 1e-9)
        assert fleet.usd_per_hour <= base.usd_per_hour + 1e-9
        assert fleet.types_searched < len(cands) / 5  # merging and dominance leave a few dozen types


@pytest.mark.e2e
def test_cli_bench_cost_json_has_the_documented_keys():
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "bench", "cost", "--rollouts-per-second", "64", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["activation_usd_per_hour"] == pytest.approx(out["activation"]["usd_per_hour"])
    assert out["baseline_usd_per_hour"] == pytest.approx(out["baseline"]["usd_per_hour"])
    assert out["ratio"] == pytest.approx(out["activation_usd_per_hour"] / out["baseline_usd_per_hour"])
    assert out["activation_usd_per_hour"] <= out["baseline_usd_per_hour"] + 1e-9
    assert out["target"]["tokens_per_second"] == 64 * 512 and "interpolated log-log" in out["target"]["interpolation"]
    assert out["prices"]["source"] == "snapshot" and out["prices"]["date"] == "2026-11-30"
    for fleet in (out["activation"], out["baseline"]):
        assert fleet["fleet"] and all({"offer", "market", "count", "usd_per_hour", "availability"} <= set(r)
                                      for r in fleet["fleet"])
    assert {r["market"] for r in out["baseline"]["fleet"]} == {"on-demand"}
    assert len({r["gpu_type"] for r in out["baseline"]["fleet"]}) == 1
    assert out["reclaim"]["source"] and out["caps"]["source"]
    assert [r["rollouts_per_second"] for r in out["sweep"]] == [8, 32, 128, 512, 1024]
    assert all(r["activation_usd_per_hour"] <= r["baseline_usd_per_hour"] + 1e-9 for r in out["sweep"])
    assert not math.isnan(out["seconds"])


@pytest.mark.e2e
def test_cli_bench_cost_table_prints_both_figures_and_the_ratio():
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "bench", "cost", "--reclaim-rate", "spot=0.5"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "activation $" in proc.stdout and "vs baseline $" in proc.stdout and "ratio" in proc.stdout
    assert "snapshot 2026-11-30" in proc.stdout and "the same at other rollout rates" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "echo2.cli", "bench", "cost", "--cap", "aws=many"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--cap" in bad.stderr
