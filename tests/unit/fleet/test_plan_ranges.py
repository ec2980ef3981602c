"""The plan as a range: the decode model at batch size, the draining batch, the learner's memory per rank, the
run's checkpoints and bursts, and `echo2 plan`'s P10/P50/P90 (seeded: the same answer every time)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

from echo2.errors import Echo2InputError
from echo2.fleet.planner import decode, learner_memory, run_costs
from echo2.fleet.planner.actor_speed import gpu_of
from echo2.fleet.planner.run_plan import learner_offer, plan_run
from echo2.fleet.planner.run_range import DEFAULT_SPREAD, plan_range
from echo2.fleet.planner.workload_file import UNCERTAIN, WORKLOADS, load_workload, parse_workload
from echo2.fleet.prices.catalog import Offer, load_catalog, load_profiles

CONFIGS = REPO / "echo2" / "bench" / "learner_configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


@pytest.fixture(scope="module")
def offers():
    return load_catalog(spot=None)


@pytest.fixture(scope="module")
def profiles():
    return load_profiles()


@pytest.fixture(scope="module")
def paper(offers, profiles):
    wf = load_workload("echo2-paper-30b")
    keep: dict = {}
    point = plan_run(wf, offers, profiles, keep=keep)
    return wf, keep, point, plan_range(wf, keep, point, profiles, offers, draws=120, seed=3)


# -- the decode model ------------------------------------------------------------------------------------------

def test_moe_shape_from_its_config():
    shape = decode.shape_from_config(_config("qwen3-30b-a3b.json"))
    assert (shape.experts, shape.top_k, shape.layers) == (128, 8, 48)
    assert shape.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2  # K and V, 4 KV heads of 128, bf16
    # the config's 3.35B active, less the input embedding: a lookup of one row per token, not read whole
    assert shape.active_params == pytest.approx(3.35e9 - 151936 * 2048, rel=0.01)
    assert shape.layers * shape.experts * shape.expert_params * 2 == pytest.approx(58e9, rel=0.03)  # all experts, bf16
    # a batch of 256 top-8 tokens touches every expert; one token its own 8
    assert shape.touched_experts(256) == pytest.approx(128, abs=0.01)
    assert shape.touched_experts(1) == pytest.approx(8)
    assert shape.weight_bytes(1) < shape.weight_bytes(16) < shape.weight_bytes(256)
    dense = decode.shape_from_config(_config("qwen3-1.7b.json"))
    assert dense.experts == 0 and dense.touched_experts(256) == 0 and dense.weight_bytes(1) == dense.weight_bytes(64)


def test_calibration_reproduces_the_profiles_dense_point(profiles):
    for name in ("H100", "H200", "L4"):
        profile = profiles[name]
        gpu = gpu_of(profile)
        size = max(profile.tokens_per_second)
        shape = decode.dense_shape(size)
        step = decode.roofline_seconds(shape, gpu, decode.REFERENCE_BATCH,
                                       decode.REFERENCE_BATCH * decode.REFERENCE_CONTEXT)
        assert decode.REFERENCE_BATCH / step == pytest.approx(profile.tokens_per_second[size], rel=1e-6)
    assert gpu_of(profiles["CPU"]) is None  # no bandwidth, no bf16 peak: the profile's figure stands


def test_a_draining_batch_is_slower_than_a_refilled_one(profiles):
    shape = decode.shape_from_config(_config("qwen3-30b-a3b.json"))
    gpu = gpu_of(profiles["H200"])
    tail = decode.LengthDistribution(3000, 8192, 0.08)
    kw = {"sequences": 256, "lengths": tail, "prompt_tokens": 200, "overhead": 0.004}
    whole = decode.tokens_per_second(shape, gpu, **kw)
    refill = decode.tokens_per_second(shape, gpu, refill=True, **kw)
    assert whole < 0.75 * refill  # stragglers hold the GPU at a small batch
    # echo2 refills a group of 16 at a time: a slot waits for its group's longest, so between the two
    by_group = decode.tokens_per_second(shape, gpu, refill=True, group_size=16, **kw)
    assert whole < by_group < refill
    assert tail.expected_max(16) > 0.7 * 8192 and tail.expected_max(1) == tail.mean
    # the batch lasts as many steps as its longest completion, each at least the overhead
    assert decode.batch_seconds(shape, gpu, **kw) >= 8192 * 0.004
    # equal lengths: nothing drains, the two actors are the same
    flat = {**kw, "lengths": decode.LengthDistribution(3000)}
    assert decode.tokens_per_second(shape, gpu, **flat) == pytest.approx(
        decode.tokens_per_second(shape, gpu, refill=True, **flat), rel=1e-9)
    lengths = tail.lengths(1000)
    assert sum(lengths) / 1000 == pytest.approx(3000, rel=0.02) and max(lengths) == 8192
    assert lengths.count(8192) >= 80  # the capped 8% and the body clipped at the cap
    with pytest.raises(Echo2InputError, match="exceed the mean"):
        decode.LengthDistribution(300, 8192, 0.5)


# -- the learner's memory ----------------------------------------------------------------------------------------

def test_learner_needs_per_rank_and_what_refuses_an_offer():
    needs = learner_memory.learner_needs(30.5, 4, staleness=4, spot_check=True, publish_delta=True)
    # 16 B/param of training state + 2 B/param of the spot check's copy, over 4 ranks, + the working set
    assert needs.gpu_per_rank == pytest.approx(18 * 30.5e9 / 4 / 2**30 + learner_memory.ACTIVATIONS_GIB)
    assert needs.versions_held == 6  # the version published and the S + 1 the spot check keeps
    assert needs.host_total > 300
    assert learner_memory.check(needs, 141, 1600) is None
    assert "host RAM 64 GiB" in learner_memory.check(needs, 140.4, 64)
    assert "GPU memory 80 GiB" in learner_memory.check(needs, 80, 2000)
    assert learner_memory.check(needs, None, None) is None  # unknown sizes: the benefit of the doubt
    without_spot_check = learner_memory.learner_needs(30.5, 4, staleness=4, spot_check=False, publish_delta=True)
    assert without_spot_check.versions_held == 2 and without_spot_check.host_total < needs.host_total


def test_learner_offer_skips_a_host_that_cannot_hold_the_learner():
    wf = parse_workload({"model": {"total_params_b": 30.5}, "learner": {"gpu": "H200", "gpus": 4}})
    small = Offer("vast", "4x-H200-small", "H200", 4, 140.4, "x", 10.0, None, host_memory_gib=64)
    big = Offer("nebius", "8x-H200-big", "H200", 8, 141, "y", 28.0, None, host_memory_gib=1600)
    assert learner_offer(wf, [small, big]).instance_type == "8x-H200-big"
    with pytest.raises(Echo2InputError, match=r"cheapest, vast/4x-H200-small@x, has host RAM 64 GiB"):
        learner_offer(wf, [small])


# -- checkpoints, bursts -------------------------------------------------------------------------------------------

def test_checkpoints_counted_timed_and_priced():
    assert run_costs.checkpoint_count(67, 5) == 14  # 13 periodic and the end
    assert run_costs.checkpoint_count(10, 5) == 2  # the end falls on a period: not twice
    c = run_costs.checkpoints(steps=67, every=5, total_params_b=30.5, ranks=4, store_gbit=10,
                              learner_place=("vast", "x"), store_place=("aws", "us-east-1"))
    assert c["gb_each"] == pytest.approx(12 * 30.5) and c["seconds_each"] == pytest.approx(366e9 / (4 * 1.25e9))
    assert c["usd_egress"] == pytest.approx(c["gb"] * 0.02)  # vast bills its uploads
    same = run_costs.checkpoints(steps=67, every=5, total_params_b=30.5, ranks=4, store_gbit=10,
                                 learner_place=("aws", "us-east-1"), store_place=("aws", "us-east-1"))
    assert same["usd_egress"] == 0


def test_a_burst_costs_the_learner_only_what_the_backlog_does_not_cover():
    pool = run_costs.BurstPool("aws", 10, 10.0, 20.0)
    # fleet-bound (10 groups/s made, 20 wanted): a burst of 40% for 600 s loses 40% of 600 s
    lost, usd = run_costs.burst_cost(pool, 10.0, 20.0, share=0.4, seconds=600, backlog_groups=1000)
    assert lost == pytest.approx(240) and usd == pytest.approx(4 * 2.0 * 600 / 3600)
    # a fleet twice as fast as the learner: a 40% burst leaves it enough
    assert run_costs.burst_cost(pool, 10.0, 5.0, share=0.4, seconds=600, backlog_groups=0)[0] == 0
    # just short, but the backlog covers the gap
    assert run_costs.burst_cost(pool, 10.0, 8.0, share=0.4, seconds=600, backlog_groups=1200)[0] == 0


# -- the range -----------------------------------------------------------------------------------------------------

def test_paper_range_is_ordered_seeded_and_names_what_moves_it(paper, offers, profiles):
    wf, keep, point, rng = paper
    for key in ("hours", "usd", "usd_learner", "usd_actors", "usd_traffic"):
        assert rng[key]["p10"] <= rng[key]["p50"] <= rng[key]["p90"], key
    again = plan_range(wf, keep, point, profiles, offers, draws=120, seed=3)
    assert again["hours"] == rng["hours"] and again["usd"] == rng["usd"]  # same seed, same answer
    names = {i["name"] for i in rng["inputs"]}
    assert {"learner.mfu", "train.signal_share", "rollout.at_cap_share", "actors.burst_share"} <= names
    assert all(i["low"] <= i["likely"] <= i["high"] and i["source"] for i in rng["inputs"])
    swings = [s["usd_swing"] for s in rng["sensitivity"]]
    assert swings == sorted(swings, reverse=True)
    assert rng["scenario"]["actors.burst_share"] == 0.4
    assert sum(r["count"] for r in rng["fleet"]) == point["workers"] + rng["extra_workers"]
    json.dumps(rng)


def test_paper_plan_holds_its_own_reliability_rule_and_counts_checkpoints(paper):
    _, _, point, _ = paper
    assert point["fleet_usd_per_hour"] >= point["usd_per_hour"]
    assert point["checkpoints"]["count"] == 14 and point["checkpoints"]["seconds"] > 0
    assert point["learner"]["offer"]["host_memory_gib"] >= point["learner"]["needs"]["host_total_gib"]
    assert all("host RAM" in r["refused"] or "GPU memory" in r["refused"] for r in point["learner"]["cheaper_refused"])
    assert point["tail"]["binds"]  # 8% of completions at the 8k cap: the batch drains
    speed = point["fleet"][0]["tokens_per_second_each"] / point["fleet"][0]["offer"]["gpu_count"]
    assert 2000 < speed < 8000  # the drained batch of an MoE that reads all its experts, not 12k


def test_workload_ranges_are_checked_and_documented():
    with pytest.raises(Echo2InputError, match="ranges name input"):
        parse_workload({"model": {"total_params_b": 1}, "ranges": {"rollout.group_size": {"low": 1, "high": 2}}})
    with pytest.raises(Echo2InputError, match="low <= high"):
        parse_workload({"model": {"total_params_b": 1}, "ranges": {"learner.mfu": {"low": 0.3, "high": 0.2}}})
    readme = (WORKLOADS / "README.md").read_text()
    for name in UNCERTAIN:
        assert f"| `{name}` |" in readme, name
        assert name in DEFAULT_SPREAD, name


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "echo2.cli", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_cli_prints_the_range_and_a_point_only_when_asked():
    got = _cli("--workload", "echo2-paper-30b", "--draws", "60", "--json")
    assert got.returncode == 0, got.stderr
    data = json.loads(got.stdout)
    assert set(data["hours"]) == {"p10", "p50", "p90"} and set(data["usd"]) == {"p10", "p50", "p90"}
    assert data["sensitivity"] and data["fleet"] and data["likely_plan"]["usd_total"] > 0
    table = _cli("--workload", "echo2-paper-30b", "--draws", "60")
    assert table.returncode == 0, table.stderr
    assert "P50" in table.stdout and "what moves the answer most" in table.stdout and "Tinker" in table.stdout
    point = _cli("--workload", "echo2-paper-30b", "--point")
    assert point.returncode == 0 and "assumptions" in point.stdout and "P50" not in point.stdout
