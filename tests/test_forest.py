"""The bandwidth-aware relay forest (issue 22, item 4) and the peer record's rates it plans with.

Real parts: records written with ``topology.register`` into a real local store and read back with
``read_peers``; plans made by ``topology.plan`` and resolved by ``topology.source_peers`` as every actor does."""

from __future__ import annotations

import json

import pytest

from echo2.broadcast import topology
from echo2.data import layout
from echo2.data.store import open_store


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
