"""The traffic model (echo2/fleet/planner/traffic.py) and the transfer prices (echo2/fleet/providers.py): what one
version costs to move with and without the relay, checked by hand; the relay reads the store once per region and
is cheaper whenever actors sit outside the store's region."""

from __future__ import annotations

import pytest

from echo2.errors import Echo2InputError
from echo2.fleet.planner.traffic import traffic_per_run, traffic_per_version
from echo2.fleet.providers import PROVIDERS, facts, transfer_usd_per_gb

STORE = ("aws", "us-east-1")
GB = 1e9


def test_two_clouds_by_hand():
    # 1 GB version in AWS us-east-1; 8 actors in GCP us-central1, 8 in GCP europe-west4, 2 beside the store
    actors = [("gcp", "us-central1", 8), ("gcp", "europe-west4", 8), ("aws", "us-east-1", 2)]
    store_only = traffic_per_version(GB, actors, STORE, relay=False)
    assert store_only["bytes_from_store"] == 18 * GB and store_only["bytes_between_peers"] == 0
    assert store_only["bytes_cross_provider"] == 16 * GB
    assert store_only["usd"] == pytest.approx(16 * 0.09)  # AWS internet egress; the 2 in-region reads are free
    relay = traffic_per_version(GB, actors, STORE, relay=True)
    assert relay["roots"] == 3 and relay["bytes_from_store"] == 3 * GB
    assert relay["bytes_between_peers"] == 15 * GB and relay["bytes_cross_provider"] == 2 * GB
    assert relay["usd"] == pytest.approx(2 * 0.09)  # one copy into each GCP region
    assert relay["by_provider"]["gcp"] == {"actors": 16, "bytes_from_store": 2 * GB, "bytes_from_peers": 14 * GB,
                                           "usd": pytest.approx(0.18)}
    assert relay["by_provider"]["aws"]["usd"] == 0


def test_one_store_read_per_region():
    actors = [("gcp", "us-central1", 5), ("GCP", "us-central1", 3), ("azure", "eastus", 4), ("lambda", "us-east-1", 1),
              ("aws", "us-west-2", 6), ("runpod", "EU-RO-1", 0)]
    relay = traffic_per_version(2 * GB, actors, STORE, relay=True)
    regions = {("gcp", "us-central1"), ("azure", "eastus"), ("lambda", "us-east-1"), ("aws", "us-west-2")}
    assert relay["roots"] == len(regions)  # gcp listed twice in two cases is one region; a group of 0 reads nothing
    assert relay["bytes_from_store"] == 2 * GB * len(regions)
    assert relay["bytes_from_store"] + relay["bytes_between_peers"] == 2 * GB * 19  # each actor gets one copy
    assert relay["bytes_cross_region"] == 2 * GB  # aws us-west-2: same provider, another region
    # store-only: gcp 8 x 0.09, azure 4 x 0.09, lambda 1 x 0.09, aws us-west-2 6 x 0.02, per 2 GB
    store_only = traffic_per_version(2 * GB, actors, STORE, relay=False)
    assert store_only["usd"] == pytest.approx(2 * (13 * 0.09 + 6 * 0.02))
    assert relay["usd"] == pytest.approx(2 * (3 * 0.09 + 0.02))


@pytest.mark.parametrize("store", [("aws", "us-east-1"), ("gcp", "us-central1"), ("azure", "westeurope")])
def test_the_relay_is_cheaper_across_clouds(store):
    actors = [("aws", "us-east-1", 4), ("gcp", "us-central1", 4), ("azure", "eastus", 4), ("vast", "France, FR, EU", 3)]
    relay = traffic_per_version(GB, actors, store, relay=True)["usd"]
    store_only = traffic_per_version(GB, actors, store, relay=False)["usd"]
    assert relay < store_only


def test_a_free_store_and_marketplace_actors_the_relay_costs_more():
    """The exception, said as such: a store that bills no egress (lambda) feeding vast hosts costs each actor only
    its own download ($0.02) store-only, where with the relay a peer's copy is billed at both hosts ($0.04)."""
    actors = [("vast", "France, FR, EU", 3)]
    store = ("lambda", "us-east-1")
    assert traffic_per_version(GB, actors, store, relay=False)["usd"] == pytest.approx(3 * 0.02)
    assert traffic_per_version(GB, actors, store, relay=True)["usd"] == pytest.approx(0.02 + 2 * 0.04)


def test_actors_beside_the_store_cost_nothing_either_way():
    actors = [("aws", "us-east-1", 16)]
    assert traffic_per_version(GB, actors, STORE, relay=False)["usd"] == 0
    assert traffic_per_version(GB, actors, STORE, relay=True)["usd"] == 0


def test_a_marketplace_bills_both_ends_and_host_to_host():
    # vast: each host bills $0.02/GB up and down (an assumption, providers.py); the store's AWS egress $0.09
    assert transfer_usd_per_gb("aws", "us-east-1", "vast", "X") == pytest.approx(0.11)
    assert transfer_usd_per_gb("vast", "X", "vast", "X") == pytest.approx(0.04)
    actors = [("vast", "France, FR, EU", 4)]
    assert traffic_per_version(GB, actors, STORE, relay=False)["usd"] == pytest.approx(4 * 0.11)
    assert traffic_per_version(GB, actors, STORE, relay=True)["usd"] == pytest.approx(0.11 + 3 * 0.04)


def test_transfer_prices():
    assert transfer_usd_per_gb("aws", "us-east-1", "aws", "us-east-1") == 0
    assert transfer_usd_per_gb("AWS", "us-east-1", "aws", "us-west-2") == 0.02
    assert transfer_usd_per_gb("gcp", "us-central1", "aws", "us-east-1") == 0.12
    assert transfer_usd_per_gb("azure", "eastus", "lambda", "x") == 0.087
    assert transfer_usd_per_gb("lambda", "x", "aws", "y") == 0 == transfer_usd_per_gb("runpod", "x", "gcp", "y")
    assert transfer_usd_per_gb("someprovider", "a", "aws", "b") == 0.09  # DEFAULT: AWS's price, said so
    assert "not checked" in facts("someprovider").source
    for p in PROVIDERS.values():
        assert "egress" in p.source or "bandwidth" in p.source, p.name


def test_per_run_scales_with_versions():
    actors = [("gcp", "us-central1", 8)]
    run = traffic_per_run(GB, 500, actors, STORE)
    assert run["versions"] == 500
    assert run["relay"]["usd"] == pytest.approx(500 * 0.09)
    assert run["store_only"]["usd"] == pytest.approx(500 * 8 * 0.09)
    assert run["relay"]["roots"] == 1 and run["relay"]["by_provider"]["gcp"]["actors"] == 8


@pytest.mark.parametrize("args", [(-1, [("aws", "r", 1)], STORE), (GB, [("aws", "r", -1)], STORE),
                                  (GB, [("aws", "r")], STORE), (GB, [("", "r", 1)], STORE),
                                  (GB, [("aws", "r", 1)], ("aws",)), (GB, [("aws", "r", True)], STORE)])
def test_bad_input(args):
    with pytest.raises(Echo2InputError):
        traffic_per_version(*args, relay=True)


def test_bench_cost_prices_each_fleets_traffic():
    from echo2.bench.cost import run_cost_bench
    from echo2.fleet.planner.dissemination import version_bytes

    result = run_cost_bench(rollouts_per_second=128, store="gcp:us-central1", run_versions=500, run_hours=5)
    tr = result["traffic"]
    vb = version_bytes(4e9, keyframe_every=16, changed_fraction=0.021)
    assert tr["version_bytes"] == vb and tr["store"] == {"provider": "gcp", "region": "us-central1"}
    assert "2026-12-02" in tr["changed_fraction_source"]
    for key in ("activation", "baseline"):
        rows = result[key]["fleet"]
        actors = [(r["offer"]["provider"], r["offer"]["region"], r["count"]) for r in rows]
        expect = traffic_per_run(vb["mean"], 500, actors, ("gcp", "us-central1"))
        t = tr[key]
        assert t["relay_usd"] == pytest.approx(expect["relay"]["usd"])
        assert t["store_only_usd"] == pytest.approx(expect["store_only"]["usd"])
        assert t["relay_store_reads_per_version"] == len({(p.lower(), r) for p, r, _ in actors})
        assert t["actors"] == sum(n for _, _, n in actors)
        assert t["gpu_usd"] == pytest.approx(result[key]["usd_per_hour"] * 5)
    assert tr["activation"]["relay_usd"] < tr["activation"]["store_only_usd"]  # several instances, outside GCP
    for point in result["sweep"]:
        if point["traffic"]:
            assert point["traffic"]["relay_usd"] <= point["traffic"]["store_only_usd"] + 1e-9


@pytest.mark.e2e
def test_bench_cost_traffic_options(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import REPO

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"config": {}}))
    (run / "reports").mkdir()
    (run / "reports" / "metrics.json").write_text(json.dumps([{"publish_full_bytes": 8, "publish_changed_fraction":
                                                                0.05}]))
    cli = [sys.executable, "-m", "echo2.cli", "bench", "cost", "--no-sweep"]
    ok = subprocess.run(cli + ["--from-run", str(run), "--store", "azure:eastus", "--json"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)["traffic"]
    assert out["changed_fraction"] == 0.05 and out["changed_fraction_source"] == "given"
    assert out["store"] == {"provider": "azure", "region": "eastus"} and out["run_versions"] == 1000
    table = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "traffic per run of 1000 versions in 10 h" in table.stdout
    assert "vs every actor reading the store" in table.stdout
    bad = subprocess.run(cli + ["--store", "aws"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "PROVIDER:REGION" in bad.stderr
