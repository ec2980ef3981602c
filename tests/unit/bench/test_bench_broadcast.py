"""The broadcast benchmark's wide-area parts: the delaying forwarder, the lower bound, uplink mixes, today's
rotating chain, churn victims, and one small end-to-end run (loopback: no namespaces needed)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from echo2.bench import wan
from echo2.bench.broadcast import planned, relay_files, rotating_chain, victims
from echo2.errors import Echo2InputError


class _Echo:
    """A plain TCP echo server on loopback (the server a forwarder stands in front of)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)


@pytest.fixture
def forwarder():
    made = []

    def make(delay_s: float, target_port: int) -> int:
        fwd = wan.DelayForwarder("127.0.0.1", 0, "127.0.0.1", target_port, delay_s)
        made.append(fwd)
        return fwd.start()

    yield make
    for fwd in made:
        fwd.close()


def _round_trip(conn: socket.socket, payload: bytes) -> float:
    t = time.monotonic()
    conn.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += conn.recv(1 << 16)
    assert got == payload
    return time.monotonic() - t


def test_forwarder_adds_one_round_trip_per_request_and_one_more_for_the_handshake(forwarder):
    delay = 0.05  # one way: an RTT of 100 ms
    port = forwarder(delay, _Echo().port)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        first = _round_trip(conn, b"GET chunk 0")
        later = [_round_trip(conn, f"GET chunk {i}".encode()) for i in range(1, 4)]
    assert first >= 3 * delay  # handshake round trip, then the request's own
    assert all(2 * delay <= t < 2 * delay + 0.08 for t in later), later


def test_forwarder_passes_every_byte_in_order_both_ways_and_the_end_of_stream(forwarder):
    port = forwarder(0.005, _Echo().port)
    payload = os.urandom(3 * 2**20 + 17)  # more than one read, under the back-pressure bound
    with socket.create_connection(("127.0.0.1", port)) as conn:
        received = bytearray()

        def drain():
            while data := conn.recv(1 << 16):
                received.extend(data)

        reader = threading.Thread(target=drain)
        reader.start()
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)  # our EOF reaches the echo server, whose EOF comes back to us
        reader.join(timeout=20)
    assert not reader.is_alive()
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


def test_forwarder_in_front_of_a_dead_server_closes_the_connection(forwarder):
    sock = socket.create_server(("127.0.0.1", 0))
    dead_port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: as a killed node's relay
    port = forwarder(0.01, dead_port)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(5)
        try:
            assert conn.recv(10) == b""
        except ConnectionResetError:
            pass  # reset is as good: the child learns at once, no timeout


def test_forwarder_refuses_an_absurd_delay():
    with pytest.raises(Echo2InputError, match="delay"):
        wan.DelayForwarder("127.0.0.1", 0, "127.0.0.1", 1, -1.0)


def test_lower_bound_uniform_links_is_one_transfer_plus_the_round_trip():
    size = 64 * 2**20
    ideal = size * 8 / 200e6
    assert wan.lower_bound_s(size, 200, [200.0] * 8) == pytest.approx(ideal)
    assert wan.lower_bound_s(size, 200, [200.0] * 8, rtt_ms=80) == pytest.approx(ideal + 0.08)


def test_lower_bound_takes_the_binding_constraint():
    size = 10**6  # 8 Mbit
    # slow uplinks everywhere: the receivers' aggregate demand binds (8 x 8 Mbit over 200 + 8 x 25 Mbit/s)
    assert wan.lower_bound_s(size, 200, [25.0] * 8) == pytest.approx(64 / 400)
    # the issue's mix, 16 receivers, store at 200: the source's own uplink binds (8/200 > 128/(200+5300))
    mix = wan.cycle(wan.MIXES["wan"], 16)
    assert sum(mix) == 4 * (25 + 100 + 200 + 1000)
    assert wan.lower_bound_s(size, 200, mix, rtt_ms=40) == pytest.approx(0.04 + 8 / 200)
    # a slow downlink binds for its receiver
    assert wan.lower_bound_s(size, 200, [1000.0] * 2, downlinks_mbit=[None, 10.0]) == pytest.approx(8 / 10)
    assert wan.lower_bound_s(size, 200, []) == 0.0


def test_uplinks_lists_and_mixes_and_bad_ones():
    assert wan.parse_uplinks("25,100,200,1000") == [25.0, 100.0, 200.0, 1000.0]
    assert wan.parse_uplinks("home") == wan.MIXES["home"]
    assert wan.parse_uplinks(None) is None and wan.parse_uplinks(" ") is None
    assert wan.cycle([1.0, 2.0], 5) == [1.0, 2.0, 1.0, 2.0, 1.0]
    for bad, why in [("25,fast", "neither a rate"), ("0", "not in"), ("nan", "not in"), ("1e9", "not in")]:
        with pytest.raises(Echo2InputError, match=why):
            wan.parse_uplinks(bad)


def test_rotating_chain_is_the_pre_issue_plan_hash_order_one_chain():
    ids = [f"bench-{k:02d}" for k in range(6)]
    chains = rotating_chain(ids, version=3)
    ordered = sorted(ids, key=lambda p: hashlib.sha256(f"3:{p}".encode()).hexdigest())
    assert chains[ordered[0]] == []  # the root reads the store
    for k in range(1, 6):
        assert chains[ordered[k]] == ordered[:k][::-1]  # parent first, then up to the root
    assert rotating_chain(ids, version=4) != chains  # rotates with the version


def test_the_bench_plans_with_the_real_planner_and_each_receivers_uplink():
    ids = [f"bench-{k:02d}" for k in range(8)]
    rates = wan.cycle(wan.MIXES["wan"], 8)
    parents, order = planned(ids, rates, fanout=1)
    rate = dict(zip(ids, rates))
    roots = [i for i in ids if not parents[i]]
    assert len(roots) == 1 and rate[roots[0]] == 1000.0  # the fastest reads the store
    assert sorted(order) == ids
    for actor in ids:  # every chain of sources ends at the root, without cycles
        chain = parents[actor]
        assert actor not in chain and len(set(chain)) == len(chain) and (not chain or chain[-1] == roots[0])
    assert max(rate[p[0]] for p in parents.values() if p) == 1000.0
    assert not any(parents[a] and parents[a][0] == b for a in ids for b in ids if rate[b] == 25.0 and rate[a] > 25.0)


def test_churn_victims_are_spread_over_the_plan():
    order = [str(k) for k in range(16)]
    assert victims(order, 0.25) == ["2", "6", "10", "14"]
    assert victims(order, 0.0) == []
    assert len(victims(order[:2], 0.9)) == 1  # never every receiver


def test_small_wan_run_end_to_end_on_loopback():
    """Real nodes, relays and forwarders (loopback: no shaping, so only the shape of the result is checked):
    one receiver killed mid-version, one joining, every live one verified."""
    data = os.urandom(3 * 2**20)
    result = relay_files({"shard-0000.safetensors": ("shard", data)}, 3, 200.0, chunk_mb=0.25, shaped=False,
                         store_only=False, rtt_ms=20, uplinks=[25.0, 1000.0], churn=0.34)
    assert result["verified"] is True
    assert result["uplinks"] == [25.0, 1000.0, 25.0] and result["rtt_ms"] == 20 and result["churn"] == 0.34
    assert result["churn_killed"] == 1 and len(result["churn_joined_done_s"]) == 1
    assert result["lower_bound_s"] == pytest.approx(wan.lower_bound_s(len(data), 200.0, [25.0, 1000.0, 25.0],
                                                                      rtt_ms=20), abs=1e-3)
    assert result["rotating_chain_s"] > 0.02  # every request paid the forwarder's round trip
    assert result["churn_with_joiners_s"] >= result["churn_killed_s"][0]  # a joiner starts when its victim dies


@pytest.mark.parametrize("argv, why", [
    (["--receivers", "33"], "between 1 and 32"),
    (["--churn", "1"], "--churn 1 is not a share"),
    (["--rtt-ms", "-5"], "--rtt-ms -5"),
    (["--uplinks", "25,x"], "neither a rate"),
])
def test_bad_wan_options_are_one_clear_line(argv, why):
    from typer.testing import CliRunner

    from echo2.cli import app

    result = CliRunner().invoke(app, ["bench", "broadcast", "--loopback", *argv])
    assert result.exit_code != 0
    assert why in result.output
