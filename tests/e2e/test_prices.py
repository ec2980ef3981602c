"""Price sources (echo2/fleet/prices/: the factory, snapshot.py, aws.py, skypilot.py), measured worker
speeds (echo2/fleet/sizing/measured.py) and `echo2 prices`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO, sky_python_or_skip
from prices_shared import _synthetic_run

from echo2.config import load_config
from echo2.errors import Echo2InputError
from echo2.fleet.prices import PriceSourceUnavailable, make_price_source
from echo2.fleet.prices.aws import AwsSpotPrices, parse_price_history
from echo2.fleet.prices.catalog import Profile, load_profiles
from echo2.fleet.prices.skypilot import offers_from_listing
from echo2.fleet.prices.snapshot import SnapshotPrices

HEADER = ("provider,instance_type,gpu,gpu_count,gpu_memory_gib,vcpus,memory_gib,region,on_demand_usd_per_hour,"
          "spot_usd_per_hour\n")
AWS_CATALOG = HEADER + """\
aws,g5.xlarge,A10G,1,22.4,4,16,us-east-1,1.006,0.45
aws,g5.xlarge,A10G,1,22.4,4,16,us-west-2,1.006,0.40
aws,g4dn.xlarge,T4,1,16,4,16,us-east-1,0.526,0.20
aws,p4d.24xlarge,A100,8,40,96,1152,us-east-1,32.77,
lambda,gpu_1x_a10,A10,1,24,30,200,us-east-1,1.29,
"""


def _cli(*args, env=None, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "echo2.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


# --- the snapshot ----------------------------------------------------------------------------------

def test_snapshot_source_filters_by_gpu_alias_and_market_and_says_where_prices_come_from():
    src = make_price_source(load_config(None).fleet.prices)  # the default config: the shipped snapshot
    assert isinstance(src, SnapshotPrices)
    everything = src.offers()
    spot = src.offers(spot=True)
    on_demand = src.offers(spot=False)
    assert spot and on_demand and len(everything) >= max(len(spot), len(on_demand))
    assert all(o.spot_usd_per_hour for o in spot) and all(o.on_demand_usd_per_hour for o in on_demand)
    assert len({o.provider for o in everything}) >= 4
    h100 = src.offers(gpus=["h100"])
    assert {o.gpu for o in h100} >= {"H100", "H100-MEGA"}  # the profile's alias counts as H100
    info = src.describe()
    assert info["source"] == "snapshot" and info["date"] == "2026-11-30"
    assert info["origin"] == "skypilot-org/skypilot-catalog" and "gpu-offers-2026-11.csv" in info["detail"]


def test_a_source_is_chosen_by_config_or_name_and_an_unknown_one_is_one_clear_line(tmp_path):
    (tmp_path / "offers.csv").write_text(AWS_CATALOG)
    cfg = load_config(None, [f"fleet.prices={{source: snapshot, catalog: {tmp_path / 'offers.csv'}}}"])
    assert len(make_price_source(cfg.fleet.prices).offers()) == 5
    assert make_price_source("aws", regions=["us-east-1"]).regions == ["us-east-1"]
    with pytest.raises(Echo2InputError, match="unknown price source 'azure'; choose one of snapshot, aws, skypilot"):
        make_price_source("azure")
    with pytest.raises(Echo2InputError, match="fleet.prices"):
        load_config(None, ["fleet.prices={source: azure}"])


# --- live AWS spot prices (moto) ------------------------------------------------------------------------

def test_price_history_keeps_each_zones_newest_price_and_the_regions_minimum():
    rows = [
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1a", "SpotPrice": "0.50",
         "ProductDescription": "Linux/UNIX", "Timestamp": "2026-11-30T10:00:00Z"},
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1a", "SpotPrice": "0.30",  # older: not in force
         "ProductDescription": "Linux/UNIX", "Timestamp": "2026-11-29T10:00:00Z"},
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1b", "SpotPrice": "0.42",
         "ProductDescription": "Linux/UNIX (Amazon VPC)", "Timestamp": "2026-11-30T09:00:00Z"},
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1c", "SpotPrice": "0.10",
         "ProductDescription": "Windows", "Timestamp": "2026-11-30T09:00:00Z"},  # not what actors run
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1d", "SpotPrice": "n/a"},
        {"InstanceType": "g4dn.xlarge", "AvailabilityZone": "us-east-1a", "SpotPrice": "0"},
    ]
    assert parse_price_history(rows) == {"g5.xlarge": (0.42, "us-east-1b")}


def test_aws_source_parses_moto_spot_prices_and_joins_the_snapshot(tmp_path, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    (tmp_path / "offers.csv").write_text(AWS_CATALOG)
    catalog = tmp_path / "offers.csv"
    cfg = load_config(None, [f"fleet.prices={{source: aws, endpoint_url: '{s3_server}', catalog: {catalog}}}"])
    src = make_price_source(cfg.fleet.prices)
    assert isinstance(src, AwsSpotPrices)
    offers = {o.name: o for o in src.offers()}
    # moto's spot price is a stub (0.00001 for every type and zone): what is checked is that it was
    # parsed and joined with the snapshot's GPUs and on-demand prices, region by region
    g5 = offers["aws/g5.xlarge@us-east-1"]
    assert (g5.gpu, g5.gpu_count, g5.gpu_memory_gib) == ("A10G", 1, 22.4)
    assert g5.on_demand_usd_per_hour == 1.006 and g5.spot_usd_per_hour == pytest.approx(1e-5)
    assert offers["aws/g5.xlarge@us-west-2"].spot_usd_per_hour == pytest.approx(1e-5)
    assert offers["aws/g4dn.xlarge@us-east-1"].on_demand_usd_per_hour == 0.526
    # a (type, region) the snapshot has no row for gets the live spot price and no on-demand price
    assert offers["aws/g4dn.xlarge@us-west-2"].on_demand_usd_per_hour is None
    assert not any(o.provider != "aws" for o in offers.values())  # lambda rows are not AWS's to price
    assert all(o.name in src.zones for o in offers.values() if o.spot_usd_per_hour)
    only_t4 = src.offers(gpus=["T4"], spot=True)
    assert {o.instance_type for o in only_t4} == {"g4dn.xlarge"} and all(o.spot_usd_per_hour for o in only_t4)
    assert src.describe()["source"] == "aws" and s3_server in src.describe()["detail"]


@pytest.mark.e2e
def test_aws_failures_are_one_line_naming_the_region(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    (tmp_path / "offers.csv").write_text(AWS_CATALOG)
    src = AwsSpotPrices(regions=["us-east-1"], endpoint_url="http://127.0.0.1:9", catalog=tmp_path / "offers.csv")
    with pytest.raises(Echo2InputError, match="aws spot prices in us-east-1: ") as err:
        src.offers()
    assert "\n" not in str(err.value)


# --- SkyPilot's catalog ------------------------------------------------------------------------------------

def Info(cloud, instance_type, accelerator_name, accelerator_count, cpu_count, device_memory, memory, price,
         spot_price, region):
    """One row of sky_bridge.py's ``accelerators`` listing (``InstanceTypeInfo``'s fields, NaN as None)."""
    nan = None if device_memory is not None and math.isnan(device_memory) else device_memory
    return {"cloud": cloud, "instance_type": instance_type, "accelerator_name": accelerator_name,
            "accelerator_count": accelerator_count, "device_memory": nan, "region": region, "price": price,
            "spot_price": None if spot_price is not None and math.isnan(spot_price) else spot_price}


def test_skypilot_listing_becomes_offers_like_the_snapshot_keeps_them():
    listing = {"L4": [Info("AWS", "g6.xlarge", "L4", 1.0, 4, 22.4, 16, 0.805, 0.28, "us-west-2"),
                      Info("GCP", None, "L4", 1.0, None, math.nan, None, 0.56, 0.18, "us-central1"),  # GPU without host
                      Info("AWS", "g6f.large", "L4", 0.125, 2, 2.8, 8, 0.2, 0.1, "us-east-1"),  # a GPU fraction
                      Info("AWS", "g6.2xlarge", "L4", 1.0, 8, 22.4, 32, 0.98, math.nan, "us-east-1")],
               "H100": [Info("Lambda", "gpu_1x_h100_pcie", "H100", 1.0, 26, 80, 200, 2.49, None, "us-east-1")]}
    offers = {o.name: o for o in offers_from_listing(listing)}
    assert set(offers) == {"aws/g6.xlarge@us-west-2", "aws/g6.2xlarge@us-east-1", "lambda/gpu_1x_h100_pcie@us-east-1"}
    g6 = offers["aws/g6.xlarge@us-west-2"]
    assert (g6.gpu, g6.gpu_count, g6.gpu_memory_gib, g6.on_demand_usd_per_hour, g6.spot_usd_per_hour) == \
        ("L4", 1, 22.4, 0.805, 0.28)
    assert offers["aws/g6.2xlarge@us-east-1"].spot_usd_per_hour is None  # NaN: no spot quoted


def test_skypilot_source_without_skypilot_says_how_to_install_it(tmp_path):
    env = {**os.environ, "ECHO2_SKY_PYTHON": str(tmp_path / "no-python")}  # SkyPilot's environment not there
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ECHO2_SKY_PYTHON", env["ECHO2_SKY_PYTHON"])
        with pytest.raises(PriceSourceUnavailable, match=r"make setup.* builds \.venv-sky"):
            make_price_source("skypilot").offers()
    proc = _cli("prices", "--source", "skypilot", env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and ".venv-sky" in proc.stderr


@pytest.mark.e2e
def test_skypilot_source_lists_a_seeded_catalog(tmp_path):
    sky_python_or_skip()  # SkyPilot's own environment lists it (sky_bridge.py)
    home = tmp_path / "home"
    catalogs = home / ".sky" / "catalogs" / "v8"
    (catalogs / "aws").mkdir(parents=True)
    (catalogs / "common").mkdir(parents=True)
    gpu_info = "\"{'Gpus': [{'Name': 'L4', 'Manufacturer': 'NVIDIA', 'Count': 1, " \
               "'MemoryInfo': {'SizeInMiB': 22888}}], " \
               "'TotalGpuMemoryInMiB': 22888}\""
    (catalogs / "aws" / "vms.csv").write_text(
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone,Arch\n"
        f"g6.xlarge,L4,1,4,16,{gpu_info},0.805,0.28,us-west-2,usw2-az1,x86_64\n"
        f"g6.xlarge,L4,1,4,16,{gpu_info},0.805,0.31,us-west-2,usw2-az2,x86_64\n")
    (catalogs / "common" / "accelerators.csv").write_text("AcceleratorName,Clouds\nL4,\"['AWS']\"\n")
    (catalogs / "common" / "metadata.csv").write_text("GPU,MemoryGB,Manufacturer\nL4,24,NVIDIA\n")
    code = ("import json; from echo2.fleet.prices.skypilot import SkyPilotPrices; "
            "print(json.dumps([o.as_dict() for o in SkyPilotPrices(clouds=['aws']).offers()]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(home), "SKY_RUNTIME_DIR": str(home),
                               "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    offers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(o["name"], o["gpu"], o["on_demand_usd_per_hour"], o["spot_usd_per_hour"]) for o in offers] == \
        [("aws/g6.xlarge@us-west-2", "L4", 0.805, 0.28)]


# --- `echo2 prices` ----------------------------------------------------------------------------------------

def test_cli_prices_json_is_a_list_of_offers_cheapest_first():
    proc = _cli("prices", "--gpu", "H100", "--spot", "--json")
    assert proc.returncode == 0, proc.stderr
    offers = json.loads(proc.stdout)
    assert offers and all(o["gpu"].startswith("H100") and o["spot_usd_per_hour"] for o in offers)
    assert [o["spot_usd_per_hour"] for o in offers] == sorted(o["spot_usd_per_hour"] for o in offers)
    assert set(offers[0]) >= {"provider", "instance_type", "gpu", "gpu_count", "region", "on_demand_usd_per_hour",
                              "spot_usd_per_hour", "name"}


def test_cli_prices_table_names_the_snapshot_and_its_date():
    proc = _cli("prices", "--gpu", "L4", "--limit", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "snapshot 2026-11-30" in out and "skypilot-org/skypilot-catalog" in out
    for col in ("provider", "instance", "GPU x count", "region", "spot $/h", "on-demand $/h", "spot discount"):
        assert col in out
    assert "L4 x1" in out and "more (--limit 0 shows all)" in out


def test_cli_prices_from_aws_reads_moto(s3_server):
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_ENDPOINT_URL": s3_server}
    proc = _cli("prices", "--source", "aws", "--region", "us-east-1", "--gpu", "T4", "--spot", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    offers = json.loads(proc.stdout)
    assert offers and {o["region"] for o in offers} == {"us-east-1"} and {o["gpu"] for o in offers} == {"T4"}
    assert all(o["spot_usd_per_hour"] == pytest.approx(1e-5) for o in offers)


@pytest.mark.parametrize("args, words", [(["--source", "azure"], "unknown price source 'azure'"),
                                          (["--region", "us-east-1"], "the snapshot price source takes no regions")])
def test_cli_prices_bad_input_is_one_line_and_exit_2(args, words):
    proc = _cli("prices", *args)
    assert proc.returncode == 2 and words in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


# --- worker profiles overridden by measurement -------------------------------------------------------------

"""When the synthetic runs' fleets asked for their actors; each file is committed 10 s after the one before."""


def test_measured_speed_replaces_the_profile_figure(tmp_path):
    from echo2.fleet.sizing.measured import measure_run, speed_for, with_measurements

    store = _synthetic_run(tmp_path / "run", [
        ("a0", 0, 100, 100.0),   # version 0: the engine's warm-up, left out
        ("a0", 1, 250, 1.0),     # 4 x 250 tokens in 1 s on 2 GPUs -> 500 tok/s/GPU
        ("a0", 2, 250, 1.0),
        ("a1", 1, 100, 1.0),     # a local process priced as an L4: it never ran on one
        ("a2", 1, 100, 1.0),     # no event names its GPU
    ], [{"kind": "requested", "actor_id": "a0", "gpu": "L4", "gpu_count": 2, "model_params_b": 4.0},
        {"kind": "running", "actor_id": "a1", "gpu": "L4", "gpu_count": 1, "simulated_price": True}])
    [m] = measure_run(store)
    assert (m.gpu, m.model_params_b, m.files, m.tokens, m.gpu_seconds) == ("L4", 4.0, 2, 2000, 4.0)
    assert m.tokens_per_second == 500.0

    profiles = load_profiles()
    estimate = profiles["L4"].speed(4.0)
    assert estimate != 500.0
    speed, source = speed_for(profiles, "L4", 4.0, [m])
    assert speed == 500.0 and source.startswith("measured")
    assert speed_for(profiles, "T4", 4.0, [m]) == (profiles["T4"].speed(4.0), profiles["T4"].source)  # not measured
    updated = with_measurements(profiles, [m])
    assert updated["L4"].speed(4.0) == 500.0 and "measured 500 tok/s/GPU at 4B" in updated["L4"].source
    assert updated["L4"].tokens_per_second[1.5] == profiles["L4"].tokens_per_second[1.5]  # other sizes kept
    assert profiles["L4"].speed(4.0) == estimate  # the caller's profiles are not changed


def test_a_measurement_of_unknown_size_is_reported_but_not_applied(tmp_path):
    from echo2.fleet.sizing.measured import measure_run, with_measurements

    store = _synthetic_run(tmp_path / "run", [("a0", 1, 10, 2.0)],
                           [{"kind": "launch", "actor_id": "a0"},
                            {"kind": "running", "actor_id": "a0", "gpu": "NEWGPU", "gpu_count": 1}])
    [m] = measure_run(store)
    assert m.model_params_b is None and m.tokens_per_second == 20.0
    profiles = {"L4": Profile("L4", {1.0: 10.0}, "test")}
    assert with_measurements(profiles, [m]) == profiles
    [sized] = measure_run(store, model_params_b=1.0)  # the caller says what the run trained
    assert with_measurements(profiles, [sized])["NEWGPU"].speed(1.0) == 20.0
