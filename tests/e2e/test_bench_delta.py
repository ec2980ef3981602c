"""``echo2 bench broadcast --delta --json``: the interface other tools script against, on the versions
of a small delta run, relayed over loopback to real receiver processes that rebuild what they get."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO
from delta_versions_shared import make_publisher, publish_all, versions

from echo2.data.store import open_store

pytestmark = pytest.mark.e2e


def test_delta_bench_prints_one_object_per_version_then_the_relay(tmp_path):
    run = tmp_path / "run"
    publish_all(make_publisher(open_store(str(run)), keyframe_every=100), versions(4, share=0.02))
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "bench", "broadcast", "--delta", "--from-run", str(run),
                           "--receivers", "2", "--loopback", "--chunk-mb", "0.01", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    rows, relay = lines[:-1], lines[-1]
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"version", "full_bytes", "delta_bytes", "changed_fraction", "encode_s", "apply_s"} <= r.keys()
        assert 0 < r["delta_bytes"] < r["full_bytes"] and 0.01 < r["changed_fraction"] < 0.03 and r["bit_exact"]
    assert {"receivers", "relay_full_s", "relay_delta_s", "verified"} <= relay.keys()
    assert relay["receivers"] == 2 and relay["verified"] is True and relay["network"] == "unshaped loopback"
    assert relay["relay_full_s"] > 0 and relay["relay_delta_s"] > 0


def test_delta_bench_refuses_a_run_without_consecutive_versions(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "bench", "broadcast", "--delta", "--from-run",
                           str(tmp_path / "nothing"), "--loopback"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error:") and "consecutive" in proc.stderr
