"""Broadcast benchmark: relay vs store-only over real TCP on shaped links.

Every node (one origin that plays the object store, N receivers) is a process in its own Linux
network namespace, joined through veth pairs to a bridge in a hub namespace; ``tc tbf`` shapes
each node's egress to the link rate (the origin's too). Receivers run the real relay code. The
same payload is sent twice: through a relay chain (fan-out configurable) and store-only (every
receiver reads the origin). Where namespaces cannot be made (no root, no ``ip``/``tc``) the
nodes run on unshaped loopback and the result says so. With ``tls`` the relay chain also runs a
third time over mutual TLS (``broadcast/relay_tls.py``; every receiver holds one certificate of a
bench CA), measured beside the plain chain: ``tls_over_plain`` is the overhead.

Namespaces, veths and the bridge are created with a per-run prefix and removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.topology import parent_index
from echo2.data.manifest import chunk_hashes, sign
from echo2.data.relay_certs import RelayCA
from echo2.data.relay_tokens import mint as mint_relay_token
from echo2.data.run_key import public_key_text
from echo2.data.weights import sha256

SUBNET = "10.213"  # addresses only inside namespaces this benchmark creates
TBF_LATENCY = "1s"  # queue room for a few chunks: drops at the shaper would measure TCP backoff, not the relay


@dataclass
class Host:
    netns: str | None
    address: str
    port: int

    def command(self, argv: list[str]) -> list[str]:
        return (["ip", "netns", "exec", self.netns] if self.netns else []) + argv


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def namespaces_available() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = f"e2bprobe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "netns", "del", probe)
        return True
    except (subprocess.CalledProcessError, OSError):
        return False


@contextmanager
def shaped_network(n_nodes: int, link_mbit: float):
    """Yield one Host per node; each node's egress shaped to ``link_mbit``; everything removed after."""
    tag = f"{os.getpid() % 10000}"
    hub = f"e2b{tag}hub"
    made: list[str] = []
    try:
        _sh("ip", "netns", "add", hub)
        made.append(hub)
        _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", hub, "link", "set", "br0", "up")
        hosts = []
        for i in range(n_nodes):
            ns = f"e2b{tag}n{i}"
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            inner, outer = f"e2b{tag}i{i}", f"e2b{tag}o{i}"
            _sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", hub)
            address = f"{SUBNET}.{i // 250}.{i % 250 + 1}"
            _sh("ip", "-n", ns, "addr", "add", f"{address}/16", "dev", inner)
            _sh("ip", "-n", ns, "link", "set", inner, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", hub, "link", "set", outer, "master", "br0")
            _sh("ip", "-n", hub, "link", "set", outer, "up")
            # shape the sender: this node's uplink
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root", "tbf", "rate",
                f"{link_mbit}mbit", "burst", "256kb", "latency", TBF_LATENCY)
            hosts.append(Host(ns, address, 8000))
        yield hosts
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextmanager
def loopback_network(n_nodes: int, link_mbit: float):
    yield [Host(None, "127.0.0.1", 0) for _ in range(n_nodes)]


class Node:
    def __init__(self, host: Host, argv: list[str]):
        self.proc = subprocess.Popen(host.command([sys.executable, "-m", "echo2.bench.broadcast_node", *argv]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.url = self.read()["ready"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark node exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=15)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self.proc.kill()
            self.proc.wait()


def _transfer(hosts: list[Host], workdir: Path, manifest_path: Path, token_file: Path, origin_url: str,
              relay: bool, fanout: int, link_mbit: float, extra: list[str] = ()) -> dict:
    receivers = [Node(h, ["receiver", "--host", h.address, "--port", str(h.port), "--manifest", str(manifest_path),
                          "--origin", origin_url, "--token-file", str(token_file), "--expected-mbit", str(link_mbit),
                          *extra])
                 for h in hosts]
    try:
        start = time.time()
        for k, node in enumerate(receivers):
            chain = []
            j: int | None = k
            while relay and (j := parent_index(j, fanout=fanout, roots=1)) is not None:
                chain.append(receivers[j].url)
            node.send({"sources": chain})
        results = [node.read() for node in receivers]
        if "--base" in extra:  # one at a time: each holds a whole base version while it rebuilds
            for node, result in zip(receivers, results):
                node.send({"rebuild": True})
                result.update(node.read())
    finally:
        for node in receivers:
            node.close()
    return {"seconds": max(r["done"] for r in results) - start,
            "first_chunk_s": [round(r["first_chunk"] - start, 3) for r in results],
            "done_s": [round(r["done"] - start, 3) for r in results],
            "verified": all(r["verified"] for r in results),
            "rebuilt": [r.get("rebuilt") for r in results],
            "store_chunks": sum(r["from_store"] for r in results)}


def relay_files(files: dict[str, tuple[str, bytes]], receivers: int, link_mbit: float, *, chunk_mb: float = 1.0,
                fanout: int = 1, shaped: bool | None = None, store_only: bool = True,
                rebuild: tuple[bytes, dict] | None = None, tls: bool = False) -> dict:
    """Send one version (``files``: name -> (kind, bytes)) from an origin to ``receivers`` nodes, through a
    relay chain (fan-out ``fanout``) and, with ``store_only``, from the origin to every node as well;
    with ``tls`` also through the relay chain over mutual TLS.

    With ``rebuild`` = (safetensors bytes of the base version, the version's signed tensor table) every
    receiver of a delta version also applies what it received to its own copy of the base and checks
    the sha256 of every rebuilt tensor (after its transfer is timed)."""
    if shaped is None:
        shaped = namespaces_available()
    workdir = Path(tempfile.mkdtemp(prefix="echo2-bench-"))
    os.chmod(workdir, 0o755)
    try:
        (workdir / "store").mkdir()
        chunk = int(chunk_mb * 2**20)
        entries = []
        for name, (kind, data) in files.items():
            (workdir / "store" / name).write_bytes(data)
            entries.append({"name": name, "kind": kind, "size": len(data), "sha256": sha256(data),
                            "chunks": chunk_hashes(data, chunk)})
        key = Ed25519PrivateKey.generate()
        meta = {"tensors": rebuild[1], "weights": "delta"} if rebuild else {}
        manifest = sign({"version": 1, "chunk_size": chunk, "files": entries, **meta}, key)
        manifest_path = workdir / "manifest.json"
        manifest_path.write_text(json.dumps(manifest))
        token_file = workdir / "relay-auth.json"  # every receiver speaks as one bench actor, checked as actors are
        token_file.write_text(json.dumps({"run_id": "bench", "public_key": public_key_text(key),
                                          "token": mint_relay_token(key, "bench", "bench-node", time.time() + 86400)}))
        tls_file = workdir / "relay-auth-tls.json"  # the same, plus a certificate from a bench CA: mutual TLS
        tls_file.write_text(json.dumps({**json.loads(token_file.read_text()), "tls": {
            "actor": "bench-node", "ca": RelayCA(key, "bench").certificate_pem(),
            "bundle": RelayCA(key, "bench").issue("bench-node", time.time() + 86400)}}))
        extra: list[str] = []
        if rebuild:
            (workdir / "base.safetensors").write_bytes(rebuild[0])
            extra = ["--base", str(workdir / "base.safetensors")]
        network = shaped_network if shaped else loopback_network
        with network(receivers + 1, link_mbit) as hosts:
            origin = Node(hosts[0], ["origin", "--host", hosts[0].address, "--port", str(hosts[0].port),
                                     "--root", str(workdir / "store")])
            try:
                args = (hosts[1:], workdir, manifest_path, token_file, origin.url)
                relay = _transfer(*args, relay=True, fanout=fanout, link_mbit=link_mbit, extra=extra)
                over_tls = (_transfer(hosts[1:], workdir, manifest_path, tls_file, origin.url, relay=True,
                                      fanout=fanout, link_mbit=link_mbit) if tls else None)
                baseline = _transfer(*args, relay=False, fanout=fanout, link_mbit=link_mbit) if store_only else None
            finally:
                origin.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    size = sum(len(data) for _, data in files.values())
    ideal = size * 8 / (link_mbit * 1e6)
    return {
        "receivers": receivers, "size_mb": round(size / 2**20, 3), "link_mbit": link_mbit, "chunk_mb": chunk_mb,
        "fanout": fanout, "shaped": shaped, "network": "namespaces+tc" if shaped else "unshaped loopback",
        "relay_s": round(relay["seconds"], 3), "ideal_s": round(ideal, 3),
        "relay_over_ideal": round(relay["seconds"] / ideal, 3),
        "relay_first_chunk_s": relay["first_chunk_s"], "relay_done_s": relay["done_s"],
        "relay_store_chunks": relay["store_chunks"],
        **({"store_only_s": round(baseline["seconds"], 3),
            "store_only_over_relay": round(baseline["seconds"] / relay["seconds"], 3)} if baseline else {}),
        **({"relay_tls_s": round(over_tls["seconds"], 3),
            "tls_over_plain": round(over_tls["seconds"] / relay["seconds"], 3),
            "relay_tls_store_chunks": over_tls["store_chunks"]} if over_tls else {}),
        "verified": (relay["verified"] and (baseline is None or baseline["verified"])
                     and (over_tls is None or over_tls["verified"]) and (not rebuild or all(relay["rebuilt"]))),
    }


def run_broadcast_bench(receivers: int, size_mb: float, link_mbit: float, *, chunk_mb: float = 1.0,
                        fanout: int = 1, shaped: bool | None = None, store_only: bool = True,
                        tls: bool = False) -> dict:
    """One measurement: relay and store-only (and relay over TLS with ``tls``) for ``receivers`` nodes
    and a ``size_mb`` payload."""
    payload = os.urandom(int(size_mb * 2**20))
    result = relay_files({"shard-0000.safetensors": ("shard", payload)}, receivers, link_mbit, chunk_mb=chunk_mb,
                         fanout=fanout, shaped=shaped, store_only=store_only, tls=tls)
    return {**result, "size_mb": size_mb}
