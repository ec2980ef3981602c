"""The bandwidth-aware relay forest (issue 22, item 4) and the peer record's rates it plans with.

Real parts: records written with ``topology.register`` into a real local store and read back with
``read_peers``; plans made by ``topology.plan`` and resolved by ``topology.source_peers`` as every actor does."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from relay_helpers import KEY, PUBLIC

from echo2.broadcast import forest, topology
from echo2.config import BroadcastConfig, PublishConfig, TrainConfig
from echo2.data import layout
from echo2.data.ledger import write_event
from echo2.data.manifest import verify_signature
from echo2.data.store import StoreError, open_store
from echo2.learner.publisher import Publisher


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


# -- rates in the peer record --------------------------------------------------------------------------

def test_register_writes_rates_and_read_peers_returns_them(store):
    topology.register(store, "a0", "http://127.0.0.1:9", 3, up_mbit=250.5, down_mbit=1000)
    topology.register(store, "a1", "http://127.0.0.1:9", 3)  # not measured yet
    records = topology.read_peers(store, max_age_s=60)
    assert (records["a0"].up_mbit, records["a0"].down_mbit) == (250.5, 1000.0)
    assert (records["a1"].up_mbit, records["a1"].down_mbit) == (None, None)
    assert "up_mbit" not in json.loads(store.get(layout.peer_key("a1")))


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), True, "100", [1], None,
                                 topology.MAX_RATE_MBIT * 2])
def test_a_record_with_bad_rates_is_a_record_with_unknown_rates(store, bad):
    record = {"id": "a0", "url": "http://127.0.0.1:9", "version": 1, "heartbeat": 1.0, "failed_parents": {},
              "up_mbit": bad, "down_mbit": bad}
    raw = json.dumps(record).encode()  # Python's json writes Infinity/NaN, as a hostile writer may
    parsed = topology.parse_record("a0", raw)
    assert isinstance(parsed, topology.PeerRecord)
    assert (parsed.up_mbit, parsed.down_mbit) == (None, None)
    topology.register(store, "a0", "http://127.0.0.1:9", 1, up_mbit=bad, down_mbit=bad)  # never writes a bad one
    assert "up_mbit" not in json.loads(store.get(layout.peer_key("a0")))
    assert topology.read_peers(store, max_age_s=60)["a0"].up_mbit is None


def test_rate_bounds():
    assert topology.rate(topology.MAX_RATE_MBIT) == topology.MAX_RATE_MBIT
    assert topology.rate(0.001) == 0.001
    assert topology.rate(25) == 25.0 and isinstance(topology.rate(25), float)


# -- the forest ---------------------------------------------------------------------------------------------

MIX = (1000.0, 200.0, 100.0, 25.0)


def mixed(n=16):
    """n peers with uplinks 1000/200/100/25 Mbit/s cycled (the issue's mix)."""
    live = {f"p{i:02d}": f"http://10.0.0.{i}:8443" for i in range(n)}
    return live, {p: MIX[i % len(MIX)] for i, p in enumerate(live)}


def parents(relay):
    return {p["id"]: (ancestry[0] if (ancestry := [i for _, i in topology.source_peers(relay, p["id"])]) else None)
            for p in relay["peers"]}


def depth(relay):
    return {p["id"]: len(topology.source_peers(relay, p["id"])) for p in relay["peers"]}


def children(relay):
    out = {p["id"]: 0 for p in relay["peers"]}
    for parent in parents(relay).values():
        if parent is not None:
            out[parent] += 1
    return out


def pipelined_tail(relay, up, size_mbit=512.0):
    """A pipelined forest's tail: each peer receives at the slowest link on its path, a link carrying its
    parent's uplink split among the parent's children (what the module docstring models); roots read the
    store at 1000 Mbit/s."""
    kids, par = children(relay), parents(relay)

    def rate(p):
        return 1000.0 if par[p] is None else min(rate(par[p]), up[par[p]] / kids[par[p]])

    return max(size_mbit / rate(p) for p in par)


def test_fast_peers_near_the_roots_with_more_children_slow_ones_at_the_leaves():
    live, up = mixed(16)
    for version in range(5):
        relay = topology.plan(live, version, fanout=2, roots=1, rates=up)
        d, kids = depth(relay), children(relay)
        root = [p for p, k in d.items() if k == 0]
        assert len(root) == 1 and up[root[0]] == 1000.0
        by_rate = {r: [p for p in live if up[p] == r] for r in MIX}
        assert max(d[p] for p in by_rate[1000.0]) <= min(d[p] for p in by_rate[25.0])
        assert all(kids[p] == 0 for p in by_rate[25.0]) and all(kids[p] == 0 for p in by_rate[100.0])
        assert min(kids[p] for p in by_rate[1000.0] if d[p] <= 1) > 2  # more than the mean fan-out
        assert all(kids[p] <= max(2, forest.MAX_CHILDREN) for p in live)


def test_on_the_mixed_uplinks_the_rated_forest_beats_the_rotating_chain_by_far():
    """The planner alone, on the pipelined model above: today's rotating chain (hash order, fan-out 1) puts
    slow uplinks in the middle of the chain; the rated forest keeps every link fast."""
    live, up = mixed(16)
    for version in range(8):
        chain = topology.plan(live, version, fanout=1, roots=1)
        rated = topology.plan(live, version, fanout=1, roots=1, rates=up)
        assert pipelined_tail(chain, up) >= 3 * pipelined_tail(rated, up), version


def test_without_known_rates_the_forest_is_parent_index_node_for_node():
    live = {f"a{i}": f"http://10.0.0.{i}:1" for i in range(11)}
    place = {a: ("aws", "us-east-1") if i % 3 else ("gcp", "us-central1") for i, a in enumerate(live)}
    for fanout, roots in ((1, 1), (2, 1), (2, 2), (3, 2)):
        for version in range(4):
            for rates in ({}, {a: 200.0 for a in live}, {a: None for a in live}):
                for placement, store_site in ((None, None), (place, ("aws", "us-east-1"))):
                    old = topology.plan(live, version, fanout=fanout, roots=roots, placement=placement,
                                        store_site=store_site)
                    new = topology.plan(live, version, fanout=fanout, roots=roots, placement=placement,
                                        store_site=store_site, rates=rates)
                    assert new["shape"] == "parents" and "shape" not in old
                    assert [p["id"] for p in new["peers"]] == [p["id"] for p in old["peers"]]
                    assert {a: topology.source_peers(new, a) for a in live} == {
                        a: topology.source_peers(old, a) for a in live}


def test_the_plan_is_deterministic_and_every_actor_reads_it_from_the_signed_manifest():
    live, up = mixed(12)
    relay = topology.plan(live, 9, fanout=2, roots=1, rates=up)
    shuffled = topology.plan(dict(reversed(list(live.items()))), 9, fanout=2, roots=1,
                             rates=dict(reversed(list(up.items()))))
    assert relay == shuffled
    wire = json.loads(json.dumps(relay))  # what an actor reads: the parents are written out
    assert all("parent" in p for p in wire["peers"])
    assert {a: topology.source_peers(wire, a) for a in live} == {a: topology.source_peers(relay, a) for a in live}


def test_measurement_noise_within_a_half_octave_does_not_reorder_and_the_hash_order_still_rotates():
    live = {f"a{i}": f"http://10.0.0.{i}:1" for i in range(8)}
    noisy = {a: 190.0 + 3 * i for i, a in enumerate(live)}  # 190..211 Mbit/s: one half-octave (181..256)
    roots = {topology.plan(live, v, fanout=1, roots=1, rates=noisy)["peers"][0]["id"] for v in range(12)}
    assert len(roots) > 2
    assert forest.half_octave(190.0) == forest.half_octave(211.0)


def test_unknown_rates_count_as_the_median_and_claims_are_capped():
    live, up = mixed(8)
    up["new"] = None
    live["new"] = "http://10.0.0.99:1"
    rate, _ = forest.planning_rates(topology.order(list(live), 1), up, (), None, topology.MAX_RATE_MBIT)
    assert rate["new"] == statistics.median_low(sorted(forest.half_octave(r) for r in up.values() if r))
    up["liar"], live["liar"] = topology.MAX_RATE_MBIT, "http://10.0.0.98:1"
    rate, _ = forest.planning_rates(topology.order(list(live), 1), up, (), None, topology.MAX_RATE_MBIT)
    assert rate["liar"] == forest.RATE_SPREAD * statistics.median_low(
        sorted(forest.half_octave(r) for r in up.values() if r))
    relay = topology.plan(live, 1, fanout=2, roots=1, rates=up)
    assert depth(relay)["liar"] == 0 and children(relay)["liar"] <= forest.MAX_CHILDREN
    live, up = mixed(24)
    up["liar"], live["liar"] = topology.MAX_RATE_MBIT, "http://10.0.0.98:1"
    relay = topology.plan(live, 1, fanout=2, roots=1, rates=up)
    assert children(relay)["liar"] == forest.MAX_CHILDREN  # the most any parent gets, whatever it claims


# -- untrusted claims, reports, joining: through the learner's publisher -------------------------------------

def launch(store, rates):
    for actor, up in rates.items():
        write_event(store, "launch", actor)
        topology.register(store, actor, f"http://127.0.0.1:{9000 + int(actor[1:])}", None, up_mbit=up)


def publisher_of(store, fanout=2):
    broadcast = BroadcastConfig(mode="relay", fanout=fanout, roots=1, peer_timeout_s=3600)
    return Publisher(store, train=TrainConfig(), publish=PublishConfig(keep_versions=30), broadcast=broadcast, key=KEY,
                     extra_files={})


def publish(publisher, version):
    manifest, _ = publisher.publish(version, {"w": torch.full((8,), float(version))}, {"weights": "full"})
    verify_signature(manifest, PUBLIC)
    return manifest["relay"]


def report(store, actor, failed):
    """What a receiver writes when ``failed`` parents failed it (``failed_parents``: parent -> version)."""
    up = topology.read_peers(store, max_age_s=3600)[actor].up_mbit
    topology.register(store, actor, f"http://127.0.0.1:{9000 + int(actor[1:])}", None, failed, up_mbit=up)


def test_the_publisher_plans_by_the_rates_in_the_peer_records(store):
    live, up = mixed(8)
    launch(store, {f"a{i}": r for i, r in enumerate(up.values())})
    relay = publish(publisher_of(store), 1)
    d = depth(relay)
    assert relay["shape"] == "parents" and [a for a, k in d.items() if k == 0] in (["a0"], ["a4"])  # a 1000
    assert all(d[a] >= 1 and children(relay)[a] == 0 for a in ("a3", "a7"))  # the 25 Mbit/s ones: leaves


def test_a_liars_claim_cannot_put_a_failed_peer_at_the_root_twice(store):
    """``a9`` claims 100 Gbit/s: never put to the test, its claim cannot make it the root, but puts it right
    under the root with the rest hanging from it; it fails its children, who report it. One report (fan-out
    1: one child) demotes it to the leaves; two take it out; a report of a peer one never fetched from
    demotes nobody. Also across a resume: the new publisher reads the signed plans back from the store."""
    honest = {f"a{i}": 200.0 for i in range(5)}
    launch(store, {**honest, "a9": topology.MAX_RATE_MBIT})
    publisher = publisher_of(store, fanout=1)
    v1 = publish(publisher, 1)
    assert depth(v1)["a9"] == 1 and children(v1)["a9"] == 4
    child = next(a for a, p in parents(v1).items() if p == "a9")
    report(store, child, {"a9": 1})
    v2 = publish(publisher_of(store, fanout=1), 2)  # a resumed learner: v1's plan is read from the store
    assert depth(v2)["a9"] == max(depth(v2).values()) and children(v2)["a9"] == 0
    for version in range(3, 6):
        assert children(publish(publisher, version))["a9"] == 0
    other = next(a for a in honest if a != child)
    report(store, other, {"a9": 5})  # a second reporter: out of the plan
    assert "a9" not in {p["id"] for p in publish(publisher, 6)["peers"]}


def test_a_claim_not_put_to_the_test_never_makes_its_peer_the_only_root(store):
    """Before: the largest claim (16x the median, here as capped) was the site's only root, every version; a
    liar there held the whole site. Now a site's roots are chosen with the claims of peers that had no child
    lately counted at most at the median (the hash order among equals), and a claim counts in full from the
    version after its peer relayed to a child that did not report it."""
    honest = {f"a{i}": 200.0 for i in range(5)}
    rates = {**honest, "a9": topology.MAX_RATE_MBIT}
    launch(store, rates)
    publisher = publisher_of(store, fanout=1)
    v1 = publish(publisher, 1)
    assert v1["peers"][0]["id"] != "a9" and children(v1)["a9"] > 0  # under the root, with children: put to the test
    v2 = publish(publisher, 2)
    assert v2["peers"][0]["id"] == "a9"  # no child reported it: its claim counts
    live = {a: f"http://127.0.0.1:{9000 + int(a[1:])}" for a in rates}
    for version in range(1, 6):
        untested = topology.plan(live, version, fanout=1, roots=1, rates=rates, measured=set())
        at_median = topology.plan(live, version, fanout=1, roots=1, rates={**rates, "a9": 200.0})
        assert untested["peers"][0]["id"] == at_median["peers"][0]["id"]  # the root: the hash order's
        tested = topology.plan(live, version, fanout=1, roots=1, rates=rates, measured={"a9"})
        assert tested["peers"][0]["id"] == "a9"


class FlakyManifest:
    """The run's store, except that the first read of one version's manifest fails as a store that drops a
    request does (a test double of the store, not of the code under test)."""

    def __init__(self, store, key):
        self._store, self.key, self.failed = store, key, 0

    def get_json(self, key):
        if key == self.key and not self.failed:
            self.failed += 1
            raise StoreError(f"{key}: 503 SlowDown")
        return self._store.get_json(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_plan_the_store_failed_to_read_once_is_read_again_not_taken_as_none(store):
    """A resumed learner reads back the plan a report names; a transient store error on that read must not be
    remembered as "no plan" (before: the report then never demoted its peer, for as long as it counted)."""
    honest = {f"a{i}": 200.0 for i in range(5)}
    launch(store, {**honest, "a9": topology.MAX_RATE_MBIT})
    v1 = publish(publisher_of(store, fanout=1), 1)
    child = next(a for a, p in parents(v1).items() if p == "a9")
    report(store, child, {"a9": 1})
    flaky = FlakyManifest(store, layout.manifest_key(layout.policy_dir(1)))
    resumed = publisher_of(flaky, fanout=1)
    publish(resumed, 2)
    assert flaky.failed == 1
    v3 = publish(resumed, 3)
    assert depth(v3)["a9"] == max(depth(v3).values()) and children(v3)["a9"] == 0


def test_a_report_of_a_peer_the_reporter_never_fetched_from_demotes_nobody(store):
    rates = {"a0": 1000.0, "a1": 1000.0, "a2": 100.0, "a3": 25.0}
    launch(store, rates)
    publisher = publisher_of(store, fanout=1)
    v1 = publish(publisher, 1)
    root = next(a for a, d in depth(v1).items() if d == 0)
    report(store, root, {"a2": 1})  # the root read the store: it fetched nothing from a2
    v2 = publish(publisher, 2)
    urls = {a: r.url for a, r in topology.read_peers(store, max_age_s=3600).items()}
    assert v2 == topology.plan(urls, 2, fanout=1, roots=1, rates=rates)  # as if nobody had reported
    assert depth(v2)["a2"] <= depth(v2)["a3"] and children(v2)["a2"] >= children(v2)["a3"]


def test_a_new_actor_joins_the_forest_from_the_next_version_at_the_median(store):
    launch(store, {"a0": 1000.0, "a1": 200.0, "a2": 200.0, "a3": 25.0, "a4": 25.0})
    publisher = publisher_of(store, fanout=1)
    assert "a5" not in {p["id"] for p in publish(publisher, 1)["peers"]}
    launch(store, {"a5": None})  # joins mid-version: it measured nothing yet
    v2 = publish(publisher, 2)
    assert topology.source_peers(v2, "a5")  # a parent to fetch from, not the store
    assert depth(v2)["a5"] <= min(depth(v2)[a] for a in ("a3", "a4"))  # the median (200), above the 25s


def test_old_manifests_without_explicit_parents_still_resolve_and_odd_shapes_mean_the_store():
    old = {"fanout": 2, "roots": 1, "peers": [{"id": f"a{i}", "url": f"http://h{i}:1"} for i in range(5)]}
    assert [[i for _, i in topology.source_peers(old, f"a{k}")] for k in range(5)] == [
        [], ["a0"], ["a0"], ["a1", "a0"], ["a1", "a0"]]
    sited = {"fanout": 1, "roots": 1, "site_roots": {"x/1": 1, "y/2": 1},
             "peers": [{"id": "a", "url": "http://a:1", "site": "x/1"}, {"id": "b", "url": "http://b:1", "site": "y/2"},
                       {"id": "c", "url": "http://c:1", "site": "x/1"}]}
    assert topology.source_peers(sited, "c") == [("http://a:1", "a")] and topology.source_peers(sited, "b") == []
    loop = {"fanout": 1, "roots": 1, "shape": "parents",
            "peers": [{"id": "a", "url": "http://a:1", "parent": "b"}, {"id": "b", "url": "http://b:1", "parent": "a"},
                      {"id": "c", "url": "http://c:1", "parent": "zz"}]}
    assert topology.source_peers(loop, "a") == [("http://b:1", "b")]  # a chain never loops
    assert topology.source_peers(loop, "c") == []  # a parent not in the plan: the store
    assert topology.source_peers({**loop, "shape": "spiral"}, "a") == []  # a shape this code does not know


def test_where_no_rate_is_known_a_report_below_quorum_moves_nobody():
    """The hash order's rule (``test_relay_hostile``): a claim counted for nothing, so nothing to take back."""
    live = {f"a{i}": f"http://10.0.0.{i}:1" for i in range(6)}
    for version in range(4):
        first = topology.plan(live, version, fanout=2, roots=1, rates={})["peers"][0]["id"]
        assert topology.plan(live, version, fanout=2, roots=1, rates={}, demoted={first}) == topology.plan(
            live, version, fanout=2, roots=1, rates={})
        rated = topology.plan(live, version, fanout=2, roots=1, rates=dict.fromkeys(live, 200.0), demoted={first})
        assert rated["peers"][-1]["id"] == first  # with rates known: behind its equals, at the leaves


def test_each_peer_of_the_plan_carries_the_rate_its_children_hold_it_to():
    live, up = mixed(8)
    up["p01"] = None
    relay = topology.plan(live, 2, fanout=1, roots=1, rates=up)
    carried = {p["id"]: p.get("up_mbit") for p in relay["peers"]}
    assert carried == {p: (None if p == "p01" else up[p]) for p in live}
    assert "up_mbit" not in json.dumps(topology.plan(live, 2, fanout=1, roots=1))


def test_with_sites_each_sites_fastest_peer_is_its_root_and_parents_stay_in_the_site():
    live, up = mixed(16)
    east = {p for i, p in enumerate(live) if i % 2}
    placement = {p: ("aws", "us-east-1") if p in east else ("gcp", "us-central1") for p in live}
    for store_site, want in ((("aws", "us-east-1"), {"aws/us-east-1": 2, "gcp/us-central1": 1}),
                             (None, {"aws/us-east-1": 2, "gcp/us-central1": 2})):
        for version in range(4):
            relay = topology.plan(live, version, fanout=1, roots=2, rates=up, placement=placement,
                                  store_site=store_site)
            assert relay["site_roots"] == want
            site = {p["id"]: p["site"] for p in relay["peers"]}
            roots = [a for a, d in depth(relay).items() if d == 0]
            assert sorted(site[a] for a in roots) == sorted(s for s, n in want.items() for _ in range(n))
            for name in want:  # a site's roots are its fastest peers
                members = [a for a in live if site[a] == name]
                assert min(up[a] for a in roots if site[a] == name) == max(up[a] for a in members)
            for actor in live:
                assert all(site[p] == site[actor] for _, p in topology.source_peers(relay, actor))


def test_a_demoted_peers_claim_counts_for_nothing_even_where_no_other_rate_of_its_site_is_known():
    live = {f"a{i}": f"http://10.0.0.{i}:1" for i in range(6)}
    placement = {a: ("aws", "us-east-1") if i < 3 else ("gcp", "us-central1") for i, a in enumerate(live)}
    rates = {"a0": topology.MAX_RATE_MBIT, "a3": 100.0, "a4": 200.0, "a5": 50.0}  # a1, a2: unknown
    for version in range(6):
        relay = topology.plan(live, version, fanout=1, roots=1, rates=rates, placement=placement, demoted={"a0"})
        unrated = topology.plan(live, version, fanout=1, roots=1, rates={**rates, "a0": None}, placement=placement)
        east = [p["id"] for p in relay["peers"] if p["site"] == "aws/us-east-1"]
        assert east == [p["id"] for p in unrated["peers"] if p["site"] == "aws/us-east-1"]  # its hash place


def test_a_peer_is_planned_by_its_uplink_but_never_faster_than_its_downlink(store):
    topology.register(store, "a0", "http://127.0.0.1:9000", None, up_mbit=1000.0, down_mbit=50.0)
    topology.register(store, "a1", "http://127.0.0.1:9001", None, up_mbit=200.0, down_mbit=1000.0)
    topology.register(store, "a2", "http://127.0.0.1:9002", None, up_mbit=100.0)
    for version in range(4):
        relay = topology.relay_plan(store, version, fanout=1, roots=1, max_age_s=3600)
        assert [p["id"] for p in relay["peers"]] == ["a1", "a2", "a0"]
        assert [p["up_mbit"] for p in relay["peers"]] == [200.0, 100.0, 50.0]


# -- the latency model: fan-out where the delay per level outweighs what fan-out costs in bandwidth -------------

MB = 2**20


def test_the_latency_model_keeps_the_chain_for_a_large_version_and_fans_out_a_small_one_over_long_trips():
    a = {"version_bytes": 64 * MB, "chunk_bytes": MB, "rate_mbit": 200.0}
    # scenario A of issue 22: 8 peers, 80 ms: the chain's 3.34 s against fan-out 2's 5.86 s
    assert forest.pipeline_s(8, 1, one_way_s=0.04, **a) == pytest.approx(64 * MB * 8 / 200e6 + 8 * (0.04 + MB * 8
                                                                                                   / 200e6))
    assert forest.pipeline_s(8, 2, one_way_s=0.04, **a) > forest.pipeline_s(8, 1, one_way_s=0.04, **a)
    assert forest.latency_fanout(8, rtt_s=0.08, **a) == 1
    small = {"version_bytes": 4 * MB, "chunk_bytes": MB // 4, "rate_mbit": 200.0}
    assert forest.latency_fanout(8, rtt_s=0.2, **small) == 2  # a 4 MB delta over 200 ms round trips
    assert forest.latency_fanout(8, rtt_s=0.0, **small) == 1  # no delay: the chain, every link at full rate
    assert forest.latency_fanout(32, rtt_s=0.4, **small) >= 2
    assert forest.latency_fanout(1, rtt_s=1.0, **small) == 1
    assert [forest.levels(n, 2) for n in (1, 2, 3, 4, 7, 8)] == [1, 2, 2, 3, 3, 4]
    assert forest.levels(8, 1) == 8 and forest.levels(13, 3) == 3


def test_the_plan_fans_out_by_the_latency_model_deterministically_and_keeps_the_chain_without_it():
    live = {f"a{k}": f"http://10.0.0.{k + 1}:8000" for k in range(8)}
    rates = dict.fromkeys(live, 200.0)
    small = (4 * MB, MB // 4, 0.2)
    relay = topology.plan(live, 7, fanout=1, roots=1, rates=rates, latency=small)
    again = topology.plan(dict(reversed(list(live.items()))), 7, fanout=1, roots=1, rates=rates, latency=small)
    assert relay == again and relay["fanout"] == 2
    kids = {}
    for actor, parent in parents(relay).items():
        kids.setdefault(parent, []).append(actor)
    roots = kids.pop(None)
    assert len(roots) == 1 and max(len(c) for c in kids.values()) == 2
    assert max(depth(relay).values()) == 3  # 4 levels (the chain: 8)
    chain = topology.plan(live, 7, fanout=1, roots=1, rates=rates, latency=(64 * MB, MB, 0.08))
    assert chain == topology.plan(live, 7, fanout=1, roots=1, rates=rates)  # the model keeps today's chain here
    assert max(depth(chain).values()) == 7


# -- an actor the plan does not name (it joined after the plan was signed) ----------------------------------

def _rated(sites: dict[str, str] | None = None) -> dict:
    rates = {"f0": 1000.0, "f1": 1000.0, "m0": 200.0, "m1": 200.0, "m2": 200.0, "s0": 25.0, "s1": 25.0}
    live = {a: f"http://{a}:1" for a in rates}
    placement = {a: tuple(s.split("/")) for a, s in sites.items()} if sites else None
    return topology.plan(live, 3, fanout=1, roots=1, rates=rates, placement=placement)


def test_a_joiner_fetches_from_one_of_the_fastest_leaves_then_its_ancestors():
    relay = _rated()
    leaves = {p["id"] for p in relay["peers"]} - {p["parent"] for p in relay["peers"]}
    picked = {}
    for k in range(40):
        sources = topology.guest_sources(relay, f"new-{k}")
        guest = sources[0][1]
        assert guest in leaves and guest.startswith("m")  # a 200 Mbit/s leaf, never a 25 Mbit/s one
        assert sources[1:] == topology.source_peers(relay, guest)  # then its ancestors, then the store
        picked[guest] = picked.get(guest, 0) + 1
    assert len(picked) > 1  # joiners spread over the fastest leaves
    assert topology.guest_sources(relay, "new-0") == topology.guest_sources(relay, "new-0")  # deterministic


def test_a_joiner_gets_no_guest_where_the_plan_names_it_has_no_parents_or_is_in_another_site():
    relay = _rated()
    assert topology.guest_sources(relay, "m0") == []  # in the plan: its own place (a root: the store)
    assert topology.guest_sources({k: v for k, v in relay.items() if k != "shape"}, "new") == []
    assert topology.guest_sources({**relay, "shape": "spiral"}, "new") == []
    sited = _rated({"f0": "aws/us-east-1", "m0": "aws/us-east-1", "s0": "aws/us-east-1", "f1": "gcp/eu-west1",
                    "m1": "gcp/eu-west1", "m2": "gcp/eu-west1", "s1": "gcp/eu-west1"})
    assert topology.guest_sources(sited, "new") == []  # its site unknown: the store, not another cloud's peer
    here = topology.guest_sources(sited, "new", "aws/us-east-1")
    assert here and all(topology.site_of(sited, peer) == "aws/us-east-1" for _, peer in here)
    assert topology.guest_sources(sited, "new", "azure/westus") == []  # no peer in its site


def test_a_peer_demoted_to_the_leaves_is_no_guest_whatever_it_claims():
    rates = {"a": 200.0, "b": 200.0, "c": 200.0, "liar": 100_000.0}
    live = {a: f"http://{a}:1" for a in rates}
    relay = topology.plan(live, 1, fanout=2, roots=1, rates=rates, demoted={"liar"})
    assert relay["peers"][-1]["id"] == "liar"  # at the leaves, behind its equals
    assert all(topology.guest_sources(relay, f"new-{k}")[0][1] != "liar" for k in range(40))
