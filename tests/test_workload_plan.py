"""Workload plans (issue 21): MoE decode speed, the FLOP model of the learner step, run totals and
the `echo2 plan --workload` command."""

from __future__ import annotations

import pytest

from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import Profile, load_profiles


def test_moe_speed_follows_active_params_and_memory_the_total():
    profiles = load_profiles()
    h200 = profiles["H200"]
    dense_30 = h200.speed(30.0)
    moe = h200.speed(30.0, 3.3)
    assert moe > dense_30  # an MoE of 30B total decodes faster than a dense 30B
    # the stated model: the dense speed of active x bytes_factor parameters
    assert moe == pytest.approx(h200.dense_speed(3.3 * h200.moe_bytes_factor))
    assert moe < h200.speed(3.3)  # but slower than a dense model of the active size (KV, expert over-read)
    assert h200.speed(30.0, None) == dense_30 == h200.speed(30.0, 30.0)  # dense as before
    # never slower than the dense model of the same total
    p = Profile("X", {1.0: 1000.0, 7.0: 100.0}, "test", moe_bytes_factor=100.0)
    assert p.speed(7.0, 1.0) == p.speed(7.0)
    with pytest.raises(Echo2InputError, match="active parameters"):
        h200.speed(30.0, 0.0)


def test_profile_moe_factor_read_and_checked(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("moe: {bytes_factor: 2.0}\nworkers:\n  G: {tokens_per_second: {1: 100, 4: 25}}\n")
    assert load_profiles(f)["G"].speed(8.0, 1.0) == pytest.approx(50.0)  # dense 2B: log-log between 1 and 4
    f.write_text("moe: {bytes_factor: 0.5}\nworkers:\n  G: {tokens_per_second: {1: 100}}\n")
    with pytest.raises(Echo2InputError, match="moe.bytes_factor"):
        load_profiles(f)
