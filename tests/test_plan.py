"""The cost-aware planner (echo2/fleet/sizing/plan.py, prices.py) and `echo2 plan`: known answers on a
hand-made catalog, optimality against brute force, the reclaim simulation, the CLI's contract."""

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
from echo2.fleet.prices.catalog import DEFAULT_CATALOG, Offer, load_catalog, load_profiles, profile_for
from echo2.fleet.sizing.capacity import Workload
from echo2.fleet.sizing.plan import (
    WorkerType,
    cheapest_mix,
    meets,
    plan,
    simulate_reclaims,
    tokens_per_batch,
    worker_types,
)

HEADER = ("provider,instance_type,gpu,gpu_count,gpu_memory_gib,vcpus,memory_gib,region,"
          "on_demand_usd_per_hour,spot_usd_per_hour\n")
# FAST makes 1000 tok/s, SLOW 250: with 1 group x 4 completions x 250 tokens per batch, FAST takes 1 s
# a batch (1 group/s), SLOW 4 s (0.25 group/s). The workload needs 8 groups / 10 s = 0.8 group/s, so
# at spot prices four SLOW ($0.80, 1 group/s) beat one FAST ($1.00); three SLOW are too slow.
CATALOG = HEADER + """\
cloud,fast.1,FAST,1,80,8,64,r1,0.70,1.00
cloud,slow.1,SLOW,1,24,4,16,r1,0.50,0.20
cloud,slow.1,SLOW,1,24,4,16,r2,0.55,0.30
cloud,slow.nospot,SLOW,1,24,4,16,r3,0.40,
gcp,gpu-only:SLOWx1,SLOW,1,24,,,r1,0.01,0.01
cloud,odd.1,UNPROFILED,1,80,8,64,r1,0.01,0.01
cloud,tiny.1,FAST,1,1,8,64,r1,0.01,0.01
"""
PROFILES = """\
workers:
  FAST:
    tokens_per_second: {1: 1000}
    source: "test"
  SLOW:
    aliases: [SLOW-2]
    tokens_per_second: {1: 250}
    source: "test"
"""
WORKLOAD = Workload(train_seconds=10, groups_per_step=8, groups_per_batch=1, staleness=4, max_pending_batches=8)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "offers.csv").write_text(CATALOG)
    (tmp_path / "profiles.yaml").write_text(PROFILES)
    return tmp_path / "offers.csv", tmp_path / "profiles.yaml"


def _types(files, spot=True, **kw):
    catalog, profiles = files
    return worker_types(load_catalog(catalog, spot=spot), load_profiles(profiles), model_params_b=1,
                        batch_tokens=tokens_per_batch(1, 4, 250), spot=spot, **kw)


def test_catalog_rows_become_the_cheapest_worker_of_each_kind(files):
    types = _types(files)
    # one FAST, one SLOW (r1, the cheaper spot region): no gpu-only, no unprofiled, no spot-less row,
    # and the 1 GiB FAST does not hold a 1B model in bf16
    assert sorted((t.offer.gpu, t.offer.region, t.usd_per_hour, t.batch_seconds) for t in types) == [
        ("FAST", "r1", 1.00, 1.0), ("SLOW", "r1", 0.20, 4.0)]
    on_demand = _types(files, spot=False)
    assert sorted((t.offer.gpu, t.offer.region, t.usd_per_hour) for t in on_demand) == [
        ("FAST", "r1", 0.70), ("SLOW", "r3", 0.40)]
    assert [t.offer.gpu for t in _types(files, gpus=["slow-2"])] == ["SLOW"]  # an alias, any case


def test_planner_picks_the_known_cheapest_mix(files):
    spot = plan(WORKLOAD, _types(files))
    assert spot["feasible"] and spot["usd_per_hour"] == pytest.approx(0.80)
    assert [(r["offer"]["gpu"], r["count"]) for r in spot["fleet"]] == [("SLOW", 4)]
    assert spot["predicted_utilization"] >= 0.95 and spot["required_throughput"] == pytest.approx(0.8)
    assert spot["min_staleness"] is not None and spot["min_staleness"] <= WORKLOAD.staleness
    assert [n["staleness"] for n in spot["neighbours"]] == [3, 5, 6]
    # on-demand, one FAST ($0.70) beats four SLOW ($1.60)
    on_demand = plan(WORKLOAD, _types(files, spot=False))
    assert [(r["offer"]["gpu"], r["count"]) for r in on_demand["fleet"]] == [("FAST", 1)]
    # synchronous (S = 0): the learner waits for every batch, no fleet reaches 95%
    sync = plan(Workload(**{**WORKLOAD.__dict__, "staleness": 0}), _types(files))
    assert not sync["feasible"] and sync["fleet"] == [] and "S=0" in sync["reason"]
    assert [n["staleness"] for n in sync["neighbours"]] == [1, 2]
    # under a budget below the cheapest, the reason names the cheapest price
    poor = plan(WORKLOAD, _types(files), budget_usd_per_hour=0.5)
    assert not poor["feasible"] and "$0.80/h" in poor["reason"]


def _random_instance(rng: random.Random) -> tuple[Workload, list[WorkerType], float]:
    b = rng.choice([1, 2, 4])
    R = b * rng.choice([1, 2, 3, 4])
    k = rng.choice([1, 1, 2])
    w = Workload(train_seconds=rng.uniform(10, 60), groups_per_step=R, groups_per_batch=b,
                 staleness=rng.randint(k - 1, k + 2), dissemination_seconds=rng.uniform(0, 40),
                 upload_seconds=rng.uniform(0, 3), publish_every=k, max_pending_batches=math.ceil(R / b))
    types = [WorkerType(Offer("p", f"t{i}", "X", 1, None, "r", None, None), round(rng.uniform(0.1, 3), 2),
                        rng.uniform(3, 120), 1.0, "test") for i in range(3)]
    return w, types, rng.choice([0.8, 0.9, 0.95])


def test_cheapest_mix_matches_brute_force_on_small_instances():
    rng = random.Random(11)
    feasible = 0
    for _ in range(8):
        w, types, u = _random_instance(rng)
        best = None
        for counts in itertools.product(range(4), repeat=len(types)):
            batch = [t.batch_seconds for t, c in zip(types, counts) for _ in range(c)]
            cost = sum(t.usd_per_hour * c for t, c in zip(types, counts))
            if batch and (best is None or cost < best - 1e-9) and meets(w, batch, u):
                best = cost
        mix = cheapest_mix(w, types, u, max_per_type=3)
        assert (mix is None) == (best is None), (w, u, best)
        if mix is not None:
            feasible += 1
            assert mix.usd_per_hour == pytest.approx(best) and mix.proven_optimal
            assert mix.prediction.utilization >= u
    assert feasible >= 3  # the instances are not all trivially infeasible


def test_reclaim_simulation_is_seeded_and_over_provisions(files):
    mix = cheapest_mix(WORKLOAD, _types(files))
    calm = simulate_reclaims(mix, 24, 0.0, 600, seed=3, workload=WORKLOAD, trials=50)
    assert calm["extra_workers"] == 0 and calm["share_of_time_at_target"] == 1.0 and calm["expected_reclaims"] == 0
    assert calm["expected_usd"] == pytest.approx(0.80 * 24)
    stormy = [simulate_reclaims(mix, 24, 1.0, 600, seed=3, workload=WORKLOAD, trials=50) for _ in range(2)]
    assert stormy[0] == stormy[1]  # same seed, same answer
    r = stormy[0]
    assert r["expected_reclaims"] > 0 and r["share_of_time_at_target"] < r["hold"]
    assert r["extra_workers"] >= 1 and r["share_with_extra"] >= r["hold"]
    assert r["usd_per_hour_with_extra"] > calm["usd_per_hour_with_extra"]
    assert r["mean_throughput"] < calm["mean_throughput"]
    other = simulate_reclaims(mix, 24, 1.0, 600, seed=4, workload=WORKLOAD, trials=50)
    assert other["share_of_time_at_target"] != r["share_of_time_at_target"]  # the seed matters


def test_shipped_catalog_and_profiles_cover_each_other():
    profiles = load_profiles()
    offers = load_catalog(DEFAULT_CATALOG, spot=False)
    assert {o.gpu for o in offers if profile_for(profiles, o.gpu) is None} == set()
    assert all(p.source for p in profiles.values())


def test_bad_catalog_is_one_clear_error(tmp_path):
    with pytest.raises(Echo2InputError, match="price catalog .*missing.csv"):
        load_catalog(tmp_path / "missing.csv")
    (tmp_path / "bad.csv").write_text(HEADER + "c,i,FAST,1,80,8,64,r1,abc,1\n")
    with pytest.raises(Echo2InputError, match="line 2: price 'abc'"):
        load_catalog(tmp_path / "bad.csv")
    (tmp_path / "cols.csv").write_text("provider,gpu\nc,FAST\n")
    with pytest.raises(Echo2InputError, match="lacks the column"):
        load_catalog(tmp_path / "cols.csv")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "echo2.cli", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_cli_json_has_the_documented_keys(files):
    catalog, profiles = files
    workload = ["--model-params", "1", "--catalog", str(catalog), "--profiles", str(profiles),
                "--train-seconds", "10", "--groups-per-step", "8", "--groups-per-batch", "1", "--group-size", "4",
                "--completion-tokens", "250", "--staleness", "4", "--dissemination-seconds", "0",
                "--upload-seconds", "0", "--max-pending-batches", "8"]
    proc = _cli(*workload, "--hours", "4", "--reclaim-rate", "0.5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # exactly one JSON object
    for key in ("fleet", "required_throughput", "min_staleness", "predicted_utilization", "usd_per_hour",
                "step_seconds", "neighbours", "reclaims"):
        assert key in out, key
    assert out["usd_per_hour"] == pytest.approx(0.80)
    assert [(r["offer"]["gpu"], r["count"]) for r in out["fleet"]] == [("SLOW", 4)]
    table = _cli(*workload)
    assert table.returncode == 0 and "neighbouring S" in table.stdout, table.stderr


@pytest.mark.parametrize("args, words", [
    (["--model-params", "1", "--catalog", "nowhere.csv"], "nowhere.csv"),
    (["--model-params", "1", "--gpu", "NOPE"], "unknown GPU NOPE"),
    (["--train-seconds", "10"], "--model-params"),
    (["--model-params", "1", "--train-seconds", "-1"], "train_seconds"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, words):
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr


@pytest.mark.e2e
def test_cli_from_run_compares_predicted_with_measured(tmp_path, files):
    """A real tiny run (the overlap benchmark's timing workload: real learner loop and actor
    processes), then `echo2 plan --from-run` on its folder: the fit's numbers, and a plan."""
    pytest.importorskip("echo2.fleet.sizing.fit")
    overlap = pytest.importorskip("echo2.bench.overlap")
    settings = overlap.Settings(train_seconds=0.3, batch_seconds=0.1, ballast_mb=0.5, warmup_steps=2, measured_steps=3)
    [r] = overlap.run_overlap_bench(settings=settings, points=[overlap.Point(1, 2, "small")], plan=False,
                                    keep=tmp_path / "bench")
    run = tmp_path / "bench" / "store" / "runs" / r["run_id"]
    proc = _cli("--from-run", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    fit = json.loads(proc.stdout)["fit"]
    assert fit["steps"] == r["steps"] and fit["workload"]["staleness"] == 1
    assert fit["measured_utilization"] == pytest.approx(r["measured_utilization"])
    assert fit["predicted_utilization"] == pytest.approx(r["predicted_utilization"])
    assert len(fit["batch_seconds"]) == 2
    # with a model size the fitted workload is planned (R, b, S, T from the run), here on the small catalog
    # (a 0.3 s learner step is met by one GPU of any kind: on the full catalog the search takes a minute)
    catalog, profiles = files
    proc = _cli("--from-run", str(run), "--model-params", "0.5", "--catalog", str(catalog), "--profiles", str(profiles),
                "--json")
    assert proc.returncode in (0, 1), proc.stderr
    out = json.loads(proc.stdout)
    assert out["workload"]["groups_per_step"] == settings.groups_per_step and "fleet" in out
    table = _cli("--from-run", str(run))
    assert table.returncode == 0 and "predicted" in table.stdout and "measured" in table.stdout, table.stderr


def test_cli_flags_with_steps_give_run_totals(files):
    """The flags build the same workload object a file does, so with --steps they get hours and dollars too."""
    catalog, profiles = files
    proc = _cli("--model-params", "1", "--catalog", str(catalog), "--profiles", str(profiles), "--train-seconds", "10",
                "--groups-per-step", "8", "--groups-per-batch", "1", "--group-size", "4", "--completion-tokens", "250",
                "--staleness", "4", "--dissemination-seconds", "0", "--upload-seconds", "0",
                "--max-pending-batches", "8", "--steps", "360", "--learner-gpu", "FAST", "--point", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["steps"] == 360 and out["hours"] == pytest.approx((360 * out["step_seconds"] + out["startup_seconds"]
                                                                  + out["checkpoints"]["seconds"]) / 3600
                                                                 + out["bursts"]["hours"])
    assert out["learner"]["offer"]["gpu"] == "FAST" and out["learner"]["usd_per_hour"] == 0.70  # on-demand
    assert out["usd_total"] == pytest.approx(out["usd_learner"] + out["usd_actors"] + out["usd_traffic"])
    assert any(a["name"] == "train.train_seconds" and a["value"] == 10 for a in out["assumptions"])
