"""A spot learner priced against an on-demand one (echo2/fleet/planner/spot_learner.py, through run_plan and
`echo2 plan`): the arithmetic by hand, the lost-work expectation against a direct count, the break-even rate, and
the paper's workload end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

from echo2.errors import Echo2InputError
from echo2.fleet.planner import spot_learner
from echo2.fleet.planner.run_plan import plan_run
from echo2.fleet.planner.workload_file import load_workload, parse_workload
from echo2.fleet.prices.catalog import load_catalog, load_profiles

BASE = dict(hours=10.0, step_seconds=600.0, spot_usd_per_hour=4.0, on_demand_usd_per_hour=10.0,
            actors_usd_per_hour=5.0, traffic_usd=10.0, reclaims_per_hour=0.1, recovery_seconds=600.0,
            resume_seconds=300.0, checkpoint_every=4, notice_probability=1.0, notice_seconds=120.0,
            checkpoint_seconds=60.0)


def test_the_arithmetic_by_hand():
    s = spot_learner.price_spot_learner(**BASE)
    # a notice with 60 s of slack after the checkpoint write: the step is lost unless it ends within the slack
    lost = (600 - 60) ** 2 / (2 * 600)
    gap_h = (600 + 300 + lost) / 3600
    n = 0.1 * 10 / (1 - 0.1 * gap_h)  # reclaims over the run's hours, its gaps included
    burn = 4 + 5 + 10 / 10
    assert s["lost_seconds"] == pytest.approx(lost) and s["gap_seconds"] == pytest.approx(3600 * gap_h)
    assert s["expected_reclaims"] == pytest.approx(n) and s["hours"] == pytest.approx(10 + n * gap_h)
    assert s["usd_reclaims"] == pytest.approx(n * gap_h * burn)
    assert s["usd_total"] == pytest.approx(4 * 10 + 5 * 10 + 10 + n * gap_h * burn)
    assert s["on_demand_usd_total"] == pytest.approx(10 * 10 + 5 * 10 + 10)
    assert s["premium_usd"] == pytest.approx(60)
    assert s["saving_usd"] == pytest.approx(60 - n * gap_h * burn) and s["cheaper"] == "spot"
    assert s["lost"]["worst_steps_with_notice"] == 1 and s["lost"]["worst_steps_without_notice"] == 4
    assert "the spot learner is cheaper by $" in spot_learner.verdict(s, rate_source="test")


def test_at_the_break_even_rate_the_two_learners_cost_the_same():
    s = spot_learner.price_spot_learner(**BASE)
    turn = s["break_even_reclaims_per_hour"]
    at_turn = spot_learner.price_spot_learner(**{**BASE, "reclaims_per_hour": turn})
    assert at_turn["saving_usd"] == pytest.approx(0, abs=1e-9)
    above = spot_learner.price_spot_learner(**{**BASE, "reclaims_per_hour": turn * 1.1})
    assert above["cheaper"] == "on-demand" and above["saving_usd"] < 0
    assert "the on-demand learner is cheaper by $" in spot_learner.verdict(above, rate_source="test")
    # traffic that costs more from the on-demand learner's place moves the turn up, and it still balances there
    dearer = {**BASE, "on_demand_traffic_usd": 25.0}
    turn2 = spot_learner.price_spot_learner(**dearer)["break_even_reclaims_per_hour"]
    assert turn2 > turn
    assert spot_learner.price_spot_learner(**{**dearer, "reclaims_per_hour": turn2})["saving_usd"] == pytest.approx(
        0, abs=1e-9)


def test_without_a_notice_or_with_one_too_short_for_the_checkpoint_the_interval_is_lost():
    none = spot_learner.price_spot_learner(**{**BASE, "notice_probability": 0.0})
    assert none["lost_seconds"] == pytest.approx(4 * 600 / 2)  # half of checkpoint_every steps
    short = spot_learner.price_spot_learner(**{**BASE, "notice_seconds": 30.0})  # 60 s to write, 30 s given
    assert not short["lost"]["notice_fits_checkpoint"] and short["lost"]["worst_steps_with_notice"] == 4
    assert short["lost_seconds"] == pytest.approx(none["lost_seconds"])
    half = spot_learner.price_spot_learner(**{**BASE, "notice_probability": 0.5})
    assert half["lost_seconds"] == pytest.approx((none["lost_seconds"] + spot_learner.price_spot_learner(
        **BASE)["lost_seconds"]) / 2)


def test_the_expected_loss_with_a_notice_counts_the_same_as_a_direct_tally():
    """The notice lands at an even spread of points within a step: the step is lost (its elapsed part) unless
    what is left of it fits in the slack the checkpoint write leaves."""
    t, slack, n = 600.0, 60.0, 60000
    tally = sum(u if t - u > slack else 0.0 for u in (t * (i + 0.5) / n for i in range(n))) / n
    got = spot_learner.lost_seconds(t, 4, 1.0, 120.0, 60.0)["with_notice_seconds"]
    assert got == pytest.approx(tally, rel=1e-3)
    assert spot_learner.lost_seconds(t, 4, 1.0, 700.0, 60.0)["with_notice_seconds"] == 0  # every step ends in time


def test_a_rate_that_outruns_the_recovery_never_finishes():
    s = spot_learner.price_spot_learner(**{**BASE, "reclaims_per_hour": 5.0})  # a reclaim every 12 min, gaps ~20
    assert not s["finishes"] and s["cheaper"] == "on-demand" and "never finishes" in spot_learner.verdict(
        s, rate_source="test")


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(spot=None), load_profiles()


def _with(wf, section, **fields):
    data = wf.model_dump(exclude={"base_dir"}, exclude_unset=True)
    data.setdefault(section, {}).update(fields)
    return parse_workload(data, base_dir=wf.base_dir)


def test_the_paper_workload_prices_a_spot_learner(catalog):
    offers, profiles = catalog
    wf = load_workload("echo2-paper-30b")
    out = plan_run(wf, offers, profiles)
    s = out["spot_learner"]
    assert s["on_demand_usd_total"] == pytest.approx(out["usd_total"])  # the plan's own (on-demand) row
    assert s["usd_total"] == pytest.approx(out["usd_total"] - s["saving_usd"])
    assert s["expected_reclaims"] > 0 and s["usd_reclaims"] > 0 and s["hours"] > out["hours"]
    assert s["reclaims_per_hour"] == 0.1 and "providers.py" in s["rate_source"]  # the spot offer's provider rate
    assert s["recovery_seconds"] == 600 and s["checkpoint_every"] == 5  # from the workload file
    assert s["verdict"].startswith("spot learner:") and f"${abs(s['saving_usd']):,.2f}" in s["verdict"]
    # a learner reclaimed far more often than the provider's rate: the answer turns
    stormy = plan_run(_with(wf, "learner", reclaims_per_hour=s["break_even_reclaims_per_hour"] * 1.2), offers,
                      profiles)["spot_learner"]
    assert stormy["cheaper"] == "on-demand" and stormy["saving_usd"] < 0
    # the learner itself at spot: the plan's own totals carry the reclaims, and its hours the gaps
    spot = plan_run(_with(wf, "learner", market="spot"), offers, profiles)
    assert spot["usd_learner_reclaims"] > 0
    assert spot["usd_learner_reclaims"] == pytest.approx(spot["spot_learner"]["usd_reclaims"])
    assert spot["usd_total"] == pytest.approx(spot["usd_learner"] + spot["usd_actors"] + spot["usd_traffic"]
                                              + spot["usd_learner_reclaims"])
    assert spot["usd_total"] == pytest.approx(s["usd_total"]) and spot["hours"] == pytest.approx(s["hours"])


def test_bad_learner_fields_are_one_line():
    with pytest.raises(Echo2InputError, match="learner.notice_probability"):
        parse_workload({"model": {"total_params_b": 1.0}, "learner": {"notice_probability": 1.5}})
    with pytest.raises(Echo2InputError, match="train.checkpoint_every"):
        parse_workload({"model": {"total_params_b": 1.0}, "train": {"checkpoint_every": 0}})


def test_echo2_plan_prints_the_saving():
    run = [sys.executable, "-m", "echo2.cli", "plan", "--workload", "echo2-paper-30b", "--point"]
    table = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr
    text = " ".join(table.stdout.split())
    assert "echo2, spot learner" in text and "spot learner: " in text and "cheaper by $" in text
    got = json.loads(subprocess.run([*run, "--json"], cwd=REPO, capture_output=True, text=True, timeout=300).stdout)
    for key in ("saving_usd", "cheaper", "expected_reclaims", "usd_reclaims", "break_even_reclaims_per_hour"):
        assert key in got["spot_learner"], key
