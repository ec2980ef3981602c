"""Egress (issue 21, item 8): actors count what they read, the learner folds it into its ledger, the cost
report prices it by where the store lives and where each actor runs, and the relay forest keeps copies
inside a (provider, region), with one root per site reading the store.

Real parts throughout: the learner's Publisher signs the plans, PolicyReceivers fetch over the relay,
the fleet's ledger events place the actors; the prices typed below are fleet/providers.py's table as of
2026-12-03 (gcp internet egress $0.12/GB, between its regions $0.02/GB), written out by hand so a change
of the table or of the pricing rule shows here."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import wait_until
from relay_helpers import KEY, PUBLIC, RUN_ID, TOKEN
from relay_helpers import poll_until as poll_until_version

from echo2.broadcast import topology
from echo2.broadcast.receiver import PolicyReceiver
from echo2.config import BroadcastConfig, PublishConfig, StoreConfig, TrainConfig
from echo2.data import layout
from echo2.data.ledger import write_event
from echo2.data.manifest import verify_signature
from echo2.data.store import open_store
from echo2.data.weights import published_versions
from echo2.fleet.bill import egress
from echo2.fleet.bill.render import cost_markdown
from echo2.fleet.bill.report import cost_report, write_cost_reports
from echo2.learner.publisher import Publisher

REPO = Path(__file__).resolve().parents[2]
EAST, CENTRAL = ("aws", "us-east-1"), ("gcp", "us-central1")


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


def place(store, actors, provider, region):
    for actor in actors:
        write_event(store, "launch", actor, backend="skypilot", provider=provider, region=region)
        topology.register(store, actor, f"http://127.0.0.1:{9000 + len(actor)}", None)


def forest(manifest):
    """actor -> its sources (parent first), derived by each actor from the signed manifest alone."""
    verify_signature(manifest, PUBLIC)
    relay = manifest["relay"]
    return {p["id"]: [peer for _, peer in topology.source_peers(relay, p["id"])] for p in relay["peers"]}


# -- the relay forest by site ---------------------------------------------------------------------------

@pytest.mark.parametrize("roots, store_site, want", [
    (1, EAST, {"aws/us-east-1": 1, "gcp/us-central1": 1}),
    (2, EAST, {"aws/us-east-1": 2, "gcp/us-central1": 1}),   # more roots only where reading the store is free
    (2, None, {"aws/us-east-1": 2, "gcp/us-central1": 2}),   # the store's place unknown: as before, per site
])
def test_a_forest_over_two_regions_has_one_store_root_per_region(store, roots, store_site, want):
    east = [f"e{i}" for i in range(5)]
    central = [f"c{i}" for i in range(4)]
    place(store, east, *EAST)
    place(store, central, *CENTRAL)
    broadcast = BroadcastConfig(mode="relay", fanout=2, roots=roots, peer_timeout_s=3600)
    publisher = Publisher(store, train=TrainConfig(), publish=PublishConfig(keep_versions=10), broadcast=broadcast,
                          key=KEY, extra_files={}, store_site=store_site)
    site = {**{a: "aws/us-east-1" for a in east}, **{a: "gcp/us-central1" for a in central}}
    parents_seen = set()
    for version in range(6):  # the hash order rotates roots and inner nodes from version to version
        manifest, _ = publisher.publish(version, {"w": torch.ones(8)}, {"weights": "full"})
        sources = forest(manifest)
        assert set(sources) == set(site)
        store_roots = Counter(site[a] for a, s in sources.items() if not s)
        assert dict(store_roots) == want, (version, sources)
        for actor, chain in sources.items():  # parent and every fallback ancestor in the child's own site
            assert all(site[p] == site[actor] for p in chain), (version, actor, chain)
        parents_seen |= {s[0] for s in sources.values() if s}
        assert forest(manifest) == sources  # deterministic: the same manifest, the same forest
    assert len(parents_seen) > 2  # the roles rotate: not the same parents at every version


def test_the_store_site_comes_from_the_runs_config_and_a_later_event_moves_an_actor(store):
    store.put_json(layout.RUN_JSON, {"run_id": "r", "config": {"store": {"provider": "GCP", "region": "us-central1"}}})
    place(store, ["e0", "e1", "e2"], *EAST)
    place(store, ["c0", "c1", "c2"], *CENTRAL)
    write_event(store, "running", "e2", provider="gcp", region="us-central1")  # the launch landed elsewhere
    broadcast = BroadcastConfig(mode="relay", fanout=1, roots=2, peer_timeout_s=3600)
    publisher = Publisher(store, train=TrainConfig(), broadcast=broadcast, key=KEY, extra_files={})
    manifest, _ = publisher.publish(0, {"w": torch.ones(8)}, {"weights": "full"})
    relay = manifest["relay"]
    assert relay["site_roots"] == {"aws/us-east-1": 1, "gcp/us-central1": 2}
    assert {p["id"]: p["site"] for p in relay["peers"]}["e2"] == "gcp/us-central1"
    roots = sorted(a for a, s in forest(manifest).items() if not s)
    assert len(roots) == 3 and sum(a in ("e0", "e1") for a in roots) == 1


def test_without_placement_the_plan_is_the_one_forest_of_before(store):
    for actor in ("a0", "a1", "a2"):
        write_event(store, "launch", actor)  # a fleet that says nothing about where
        topology.register(store, actor, "http://127.0.0.1:9", None)
    publisher = Publisher(store, train=TrainConfig(), broadcast=BroadcastConfig(mode="relay", peer_timeout_s=3600),
                          key=KEY, extra_files={})
    manifest, _ = publisher.publish(0, {"w": torch.ones(8)}, {"weights": "full"})
    assert "site_roots" not in manifest["relay"]
    order = topology.order(["a0", "a1", "a2"], 0)
    assert forest(manifest) == {order[0]: [], order[1]: [order[0]], order[2]: [order[1], order[0]]}


# -- actors count what they read ------------------------------------------------------------------------

def test_actors_count_store_and_peer_bytes_and_the_learner_folds_them(store):
    broadcast = BroadcastConfig(mode="relay", chunk_mb=0.01, fanout=1, roots=1, heartbeat_s=0.1,
                                peer_timeout_s=3600, pipeline_wait_s=5)
    for actor in ("c1", "c2"):
        write_event(store, "launch", actor, provider="aws", region="us-east-1")
    receivers = {a: PolicyReceiver(store, a, PUBLIC, TOKEN, broadcast, staleness=2, run_id=RUN_ID)
                 for a in ("c1", "c2")}
    try:
        publisher = Publisher(store, train=TrainConfig(), broadcast=broadcast, key=KEY, extra_files={},
                              store_site=CENTRAL)
        manifest, _ = publisher.publish(0, {"w": torch.arange(60_000, dtype=torch.float32)}, {"weights": "full"})
        store.put_pointer(layout.LATEST, json.dumps({"version": 0}).encode())
        root, child = (p["id"] for p in manifest["relay"]["peers"])
        version_bytes = sum(e["size"] for e in manifest["files"])
        poll_until_version(receivers[root], 0, timeout=60)  # the root holds it whole before the child asks
        buffer = poll_until_version(receivers[child], 0, timeout=60)
        assert set(buffer.sources) == {f"{root} at {receivers[root].url}"}
        assert receivers[root].read_bytes == {"store": version_bytes, "peers": {}}
        assert receivers[child].read_bytes == {"store": 0, "peers": {"aws/us-east-1": version_bytes}}
        # reported in the peer record at the next heartbeat, and folded into the ledger at the next publish
        for actor in (root, child):
            wait_until(lambda: store.get_json(layout.peer_key(actor))["read_bytes"] == receivers[actor].read_bytes,
                       10, f"{actor}'s heartbeat with its counters")
        publisher.publish(1, {"w": torch.arange(60_000, dtype=torch.float32)}, {"weights": "full"})
        assert egress.read_snapshots(store) == {root: egress.ReadBytes(version_bytes, {}),
                                                child: egress.ReadBytes(0, {"aws/us-east-1": version_bytes})}
    finally:
        for receiver in receivers.values():
            receiver.close()
    assert not store.list(layout.PEERS)  # records removed at close, as before


def test_a_store_mode_actor_reports_its_reads_too(store):
    broadcast = BroadcastConfig(mode="store", chunk_mb=0.01)
    write_event(store, "launch", "s1", provider="aws", region="us-east-1")
    receiver = PolicyReceiver(store, "s1", PUBLIC, TOKEN, broadcast, staleness=2, run_id=RUN_ID)
    try:
        assert not store.list(layout.PEERS)  # no heartbeat in store mode
        publisher = Publisher(store, train=TrainConfig(), broadcast=broadcast, key=KEY, extra_files={})
        manifest, _ = publisher.publish(0, {"w": torch.ones(30_000)}, {"weights": "full"})
        store.put_pointer(layout.LATEST, json.dumps({"version": 0}).encode())
        poll_until_version(receiver, 0)
        version_bytes = sum(e["size"] for e in manifest["files"])
        assert store.get_json(layout.peer_key("s1"))["read_bytes"] == {"store": version_bytes, "peers": {}}
        publisher.publish(1, {"w": torch.ones(30_000)}, {"weights": "full"})
        assert egress.read_snapshots(store) == {"s1": egress.ReadBytes(version_bytes, {})}
    finally:
        receiver.close()
    assert not store.list(layout.PEERS)


# -- counters are hostile input -------------------------------------------------------------------------

HOSTILE = {
    "negative": {"store": -5, "peers": {}},
    "huge": {"store": 2**60, "peers": {}},
    "boolean": {"store": True, "peers": {}},
    "float": {"store": 1.5e9, "peers": {}},
    "many-sites": {"store": 1, "peers": {f"aws/r{i}": 1 for i in range(egress.MAX_SITES + 1)}},
    "bad-site": {"store": 1, "peers": {"../../etc": 1}},
    "extra-key": {"store": 1, "peers": {}, "usd": -100},
    "list": [1, 2],
}


def test_malformed_counters_are_not_billed_never_raise_and_never_change_the_plan(store, caplog):
    actors = list(HOSTILE) + ["honest", "shrinking", "not-json", "oversized"]
    for actor in actors:
        write_event(store, "launch", actor, provider="aws", region="us-east-1")
    write_event(store, "launch", "other", provider="aws", region="us-east-1")
    for actor, value in HOSTILE.items():
        topology.register(store, actor, "http://127.0.0.1:9", None, read_bytes=value)
    topology.register(store, "honest", "http://127.0.0.1:9", None, read_bytes={"store": 10, "peers": {"": 3}})
    topology.register(store, "shrinking", "http://127.0.0.1:9", None, read_bytes={"store": 1000, "peers": {}})
    topology.register(store, "stranger", "http://127.0.0.1:9", None, read_bytes={"store": 10**12, "peers": {}})
    store.put_pointer(layout.peer_key("not-json"), b"\xff{")
    store.put_pointer(layout.peer_key("oversized"), json.dumps({"id": "oversized", "pad": "x" * 10_000}).encode())
    store.put_pointer(layout.peer_key("other"), json.dumps({"id": "honest", "read_bytes": {"store": 7}}).encode())
    broadcast = BroadcastConfig(mode="relay", peer_timeout_s=3600)
    publisher = Publisher(store, train=TrainConfig(), broadcast=broadcast, key=KEY, extra_files={})
    manifest, _ = publisher.publish(0, {"w": torch.ones(1000)}, {"weights": "full"})  # more than the claims below
    # the bill's field is not the plan's business: every record with a good url is planned as before
    assert {p["id"] for p in manifest["relay"]["peers"]} >= set(HOSTILE) | {"honest", "shrinking"}
    snapshots = egress.read_snapshots(store)
    assert snapshots == {"honest": egress.ReadBytes(10, {"": 3}), "shrinking": egress.ReadBytes(1000, {})}
    # an actor that reports less later cannot lower what the learner saw; one that reports more raises it
    topology.register(store, "shrinking", "http://127.0.0.1:9", None, read_bytes={"store": 1, "peers": {}})
    topology.register(store, "honest", "http://127.0.0.1:9", None, read_bytes={"store": 20, "peers": {"": 3}})
    publisher.publish(1, {"w": torch.ones(1000)}, {"weights": "full"})
    assert egress.read_snapshots(store) == {"honest": egress.ReadBytes(20, {"": 3}),
                                            "shrinking": egress.ReadBytes(1000, {})}
    assert all(isinstance(egress.parse_read_bytes(v), str) for v in HOSTILE.values())


# -- the cost report prices what was read ---------------------------------------------------------------

GB = 10**9


def priced_run(store, store_config):
    store.put_json(layout.RUN_JSON, {"run_id": "r", "created_at": 0.0, "config": {"store": store_config}})
    launches = {"same": ("gcp", "us-central1"), "other-region": ("gcp", "us-east4"),
                "other-cloud": ("aws", "us-east-1"), "local": ("local", "local")}
    for actor, (provider, region) in launches.items():
        write_event(store, "launch", actor, backend="test", provider=provider, region=region, price_usd_per_hour=1.0)
    reads = {"same": {"store": 3 * GB, "peers": {}},
             "other-region": {"store": 2 * GB, "peers": {"gcp/us-east4": 5 * GB}},
             "other-cloud": {"store": 1 * GB, "peers": {"gcp/us-central1": 4 * GB, "": GB}},
             "local": {"store": GB // 2, "peers": {}}}
    for actor, value in reads.items():
        topology.register(store, actor, "http://127.0.0.1:9", None, read_bytes=value)


def test_the_cost_report_prices_each_actors_reads_from_where_the_store_lives(store):
    priced_run(store, {"provider": "gcp", "region": "us-central1"})
    report = write_cost_reports(store)  # folds the records still there, as at the end of a run
    by_actor = {t["actor_id"]: t for t in report["traffic"]}
    want = {"same": 0.0,                        # within the store's region: free
            "other-region": 2 * 0.02 + 0.0,     # gcp between regions; peers in its own site: free
            "other-cloud": 1 * 0.12 + 4 * 0.12,  # gcp's internet egress, from the store and from a gcp parent
            "local": 0.5 * 0.12}                # a machine outside every cloud: internet egress
    assert {a: t["usd"] for a, t in by_actor.items()} == pytest.approx(want)
    assert report["traffic_usd"] == pytest.approx(sum(want.values()))
    assert report["total_usd"] == pytest.approx(report["gpu_usd"] + report["traffic_usd"])
    assert report["traffic_bytes_from_store"] == 6.5 * GB and report["traffic_bytes_from_peers"] == 10 * GB
    assert report["traffic_unpriced_bytes"] == 0
    md = cost_markdown(report)
    assert f"traffic ${report['traffic_usd']:,.6f}" in md and "gcp/us-central1" in md
    # recomputed later from the ledger alone, after every actor left
    for actor in by_actor:
        topology.unregister(store, actor)
    assert cost_report(store)["traffic_usd"] == pytest.approx(report["traffic_usd"])


def test_traffic_from_a_store_of_unknown_place_is_counted_and_said_unpriced(store):
    priced_run(store, {})
    report = write_cost_reports(store)
    assert report["store_site"] is None and report["traffic_unpriced_bytes"] == 6.5 * GB
    assert report["traffic_usd"] == pytest.approx(4 * 0.12)  # only what came from a gcp parent to aws
    md = cost_markdown(report)
    assert "set store.provider and store.region" in md and "unpriced" in md


def test_store_config_needs_a_provider_for_a_region():
    assert StoreConfig(provider="GCP", region="us-central1").site == ("gcp", "us-central1")
    assert StoreConfig(provider="aws").site == ("aws", "?")
    assert StoreConfig().site is None
    with pytest.raises(ValueError, match="store.region needs store.provider"):
        StoreConfig(region="us-east-1")


# -- a real local run priced as another provider than the store's --------------------------------------

@pytest.mark.e2e
def test_egress_of_a_real_local_run_is_bytes_times_price(tiny_model, tmp_path):
    """Two local actors priced as an AWS offer (fleet.price_as), the store said to be in GCP: every byte they
    read from the store crosses from GCP to AWS at GCP's internet egress, $0.12/GB; bytes between the two
    actors stay in their site ($0)."""
    from e2e_runs import TINY, sets

    args = [sys.executable, "-m", "echo2.cli", "run", str(REPO / "configs/quickstart.yaml"),
            *sets(f"model.name={tiny_model}", f"store.url={tmp_path}", "run.id=egress", *TINY, "fleet.actors=2",
                  "train.max_steps=3", "fleet.price_as=aws/g6.xlarge@us-east-1", "store.provider=gcp",
                  "store.region=us-central1", "eval.before=false", "eval.after=false")]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ECHO2_SECRETS": str(tmp_path / "secrets")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = open_store(str(tmp_path / "runs" / "egress"))
    cost = json.loads(run.get(layout.report_key("cost.json")))
    version0 = run.get_json(layout.manifest_key(layout.policy_dir(0))) if run.exists(
        layout.manifest_key(layout.policy_dir(0))) else None
    assert cost["store_site"] == "gcp/us-central1" and len(cost["traffic"]) >= 1, cost["traffic"]
    for t in cost["traffic"]:
        assert (t["provider"], t["region"], t["store_usd_per_gb"]) == ("aws", "us-east-1", 0.12)
        assert set(t["peers_by_site"]) <= {"aws/us-east-1"}
        assert t["usd"] == pytest.approx(t["bytes_from_store"] / 1e9 * 0.12)
    assert cost["traffic_usd"] == pytest.approx(cost["traffic_bytes_from_store"] / 1e9 * 0.12)
    assert cost["traffic_usd"] > 0 and cost["total_usd"] == pytest.approx(cost["gpu_usd"] + cost["traffic_usd"])
    # at least one whole version came from the store (the first root's), and no more than every version to all
    published = [layout.parse_version_dir(v) for v in run.list_folders(layout.POLICY)]
    assert version0 is None or cost["traffic_bytes_from_store"] >= sum(e["size"] for e in version0["files"])
    assert cost["traffic_bytes_from_store"] + cost["traffic_bytes_from_peers"] > 0 and published
    assert "traffic $" in run.get(layout.report_key("cost.md")).decode()


def test_counters_from_parents_of_many_sites_stay_a_valid_record(store):
    """More parent sites than a record may name: the rest count under "" and nothing is lost or refused."""
    receiver = PolicyReceiver(store, "s1", PUBLIC, TOKEN, BroadcastConfig(mode="store"), staleness=2, run_id=RUN_ID)
    try:
        sites = {f"p{i} at http://127.0.0.1:{9000 + i}": f"aws/r{i}" for i in range(12)}
        chunks = [SimpleNamespace(size=100 + i) for i in range(12)]
        receiver._count_peer_chunks(SimpleNamespace(chunks=chunks, sources=list(sites)), sites)
        counted = receiver.read_bytes
        assert len(counted["peers"]) == egress.MAX_SITES and "" in counted["peers"]
        assert sum(counted["peers"].values()) == sum(c.size for c in chunks)
        assert egress.parse_read_bytes(counted) == egress.ReadBytes(0, counted["peers"])
    finally:
        receiver.close()


def test_placement_comes_only_from_well_formed_fleet_events(store):
    write_event(store, "launch", "a0", provider="AWS", region="us-east-1")
    write_event(store, "launch", "a1", provider="aws/../gcp", region="us-east-1")  # would forge a site name
    write_event(store, "launch", "a2", provider="gcp", region=7)
    write_event(store, "exited", "a0", provider="gcp", region="us-central1")  # not an event that places
    launched = topology.LaunchedActors(store)
    assert launched() == {"a0", "a1", "a2"}
    assert launched.placement == {"a0": ("aws", "us-east-1")}


def test_a_counter_is_capped_by_what_the_actor_could_have_read(store, caplog):
    """A claim of a terabyte under the old bound (a petabyte) was billed in full; now each counter is cut to twice
    the bytes the run published, kept across collected versions and learners (``ledger/published-bytes.json``)."""
    write_event(store, "launch", "liar", provider="aws", region="us-east-1")
    write_event(store, "launch", "honest", provider="aws", region="us-east-1")
    publisher = Publisher(store, train=TrainConfig(staleness=0), publish=PublishConfig(keep_versions=1),
                          broadcast=BroadcastConfig(), key=KEY, extra_files={})
    manifest, _ = publisher.publish(0, {"w": torch.ones(1000)}, {"weights": "full"})
    v0 = sum(e["size"] for e in manifest["files"])
    topology.register(store, "liar", "http://127.0.0.1:9", None,
                      read_bytes={"store": 10**12, "peers": {"aws/us-east-1": 10**12}})
    topology.register(store, "honest", "http://127.0.0.1:9", None, read_bytes={"store": v0, "peers": {}})
    with caplog.at_level(logging.WARNING, logger="echo2.fleet"):
        manifest, _ = publisher.publish(1, {"w": torch.zeros(1000)}, {"weights": "full"})
    published = v0 + sum(e["size"] for e in manifest["files"])
    assert egress.read_snapshots(store) == {"liar": egress.ReadBytes(2 * published, {"aws/us-east-1": 2 * published}),
                                            "honest": egress.ReadBytes(v0, {})}
    assert sum("billing at most" in r.getMessage() and "liar" in r.getMessage() for r in caplog.records) == 1
    # versions are collected, yet what they weighed still counts: a later learner's fold caps no lower
    for version in (2, 3):
        publisher.publish(version, {"w": torch.full((1000,), float(version))}, {"weights": "full"})
    assert 0 not in published_versions(store) and 1 not in published_versions(store)
    cap = egress.EgressLedger(store).could_read()
    assert cap >= 2 * (published + 2 * v0) and store.get_json(layout.PUBLISHED_BYTES)["total"] == cap // 2
