"""The chaos scenario ``slow-peers`` in its small form (``make chaos`` runs it at full size): an actor that claims
the largest uplink and answers every chunk just before a chunk's old deadline, and one that asks every peer for
runs and never reads; the versions still reach every honest actor within twice the time they take without them
(measured side by side in the same run), no honest relay holds more than one version more, and both attackers
are reported and left (echo2/chaos/scenarios/slow_peers.py)."""

from __future__ import annotations

import json

import pytest

from echo2.chaos.runner import failed
from echo2.chaos.scenarios.slow_peers import slow_peers


@pytest.mark.e2e
def test_slow_and_non_reading_peers_are_reported_and_left_and_versions_keep_their_pace(tmp_path):
    row = slow_peers(tmp_path, quick=True)
    print("chaos:", json.dumps(row))
    assert not failed(row), row
    assert row["detected"] == row["injected"] == 2
