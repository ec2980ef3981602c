"""`echo2 plan` on a hand-made catalog (the CLI's contract, its known answer), the catalog's reader, and the reclaim
simulation (echo2/fleet/planner/reclaim_simulation.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from echo2.errors import Echo2InputError
from echo2.fleet.planner.reclaim_simulation import WorkerType, simulate_reclaims
from echo2.fleet.prices.catalog import DEFAULT_CATALOG, Offer, load_catalog, load_profiles, profile_for
from echo2.fleet.sizing.capacity import Workload

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


def _cheapest_spot_fleet() -> list[tuple[WorkerType, int]]:
    """The known cheapest spot fleet of CATALOG for WORKLOAD: four SLOW at $0.20/h, 4 s a batch (250 tok/s)."""
    slow = WorkerType(Offer("cloud", "slow.1", "SLOW", 1, 24, "r1", 0.50, 0.20), 0.20, 4.0, 250.0, "test")
    return [(slow, 4)]


def test_reclaim_simulation_is_seeded_and_over_provisions():
    mix = _cheapest_spot_fleet()
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
    # --machine: the same run predicted from its config and a machine profile alone, beside what it measured
    config = json.loads((run / "run.json").read_text())["config"]
    profile = {"model": config["model"]["name"], "config": "overlap", "load_seconds": 1.0, "prompt_tokens": 8,
               "decode": {"actors": 2, "seconds_per_position_alone": 0.001, "seconds_per_position_contended": None},
               "eval_decode": {"rows": 8, "seconds_per_position": 0.001},
               "learner": {"fixed_seconds_alone": 0.3, "seconds_per_token_alone": 0.0,
                           "fixed_seconds_contended": 0.3, "seconds_per_token_contended": 0.0}}
    (tmp_path / "machine.yaml").write_text(json.dumps(profile))  # JSON is YAML
    proc = _cli("--from-run", str(run), "--machine", str(tmp_path / "machine.yaml"), "--json", "--draws", "20")
    assert proc.returncode == 0, proc.stderr
    rows = {r["quantity"]: r for r in json.loads(proc.stdout)["check"]["rows"]}
    assert rows["utilization"]["measured"] == pytest.approx(r["measured_utilization"])
    assert rows["hours"]["p10"] <= rows["hours"]["p50"] <= rows["hours"]["p90"]
    table = _cli("--from-run", str(run), "--machine", str(tmp_path / "machine.yaml"), "--draws", "20")
    assert table.returncode == 0 and "inside P10-P90" in table.stdout, table.stderr
    refused = _cli("--machine", str(tmp_path / "machine.yaml"))
    assert refused.returncode == 2 and "--from-run" in refused.stderr
    # calibrated on this run (the learner's measured busy time over the bare step's), the profile refuses to be
    # checked against it: the one run the prediction has seen is no check
    calibrated = tmp_path / "calibrated.yaml"
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "bench", "machine", "--profile",
                           str(tmp_path / "machine.yaml"), "--calibrate-run", str(run), "--out", str(calibrated)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    calibration = yaml.safe_load(calibrated.read_text())["calibration"]
    assert calibration["run_id"] == r["run_id"]
    assert calibration["learner_overhead"] == pytest.approx(
        calibration["measured_train_seconds"] / calibration["bare_train_seconds"])
    assert calibration["measured_train_seconds"] == pytest.approx(json.loads(
        _cli("--from-run", str(run), "--json").stdout)["fit"]["workload"]["train_seconds"])
    seen = _cli("--from-run", str(run), "--machine", str(calibrated))
    assert seen.returncode == 2 and "calibrated on" in seen.stderr


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
