"""Workload plans: MoE decode speed, the FLOP model of the learner step, run totals and
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


# -- the FLOP model, the workload file, run totals ------------------------------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from conftest import REPO  # noqa: E402

from echo2.fleet.planner import step_time  # noqa: E402
from echo2.fleet.planner.run_plan import plan_run  # noqa: E402
from echo2.fleet.planner.workload_file import (  # noqa: E402
    from_flags,
    load_workload,
    parse_workload,
)
from echo2.fleet.prices.catalog import load_catalog  # noqa: E402
from echo2.models import params_from_config  # noqa: E402

CONFIGS = REPO / "echo2" / "bench" / "learner_configs"
JSON_KEYS = ("hours", "usd_total", "usd_learner", "usd_actors", "usd_traffic", "fleet", "utilization", "assumptions")


@pytest.fixture(scope="module")
def offers():
    return load_catalog(spot=None)


@pytest.fixture(scope="module")
def profiles():
    return load_profiles()


@pytest.fixture(scope="module")
def preset(offers, profiles):
    wf = load_workload("echo2-paper-30b")
    started = time.perf_counter()
    out = plan_run(wf, offers, profiles)
    print(f"echo2-paper-30b planned in {time.perf_counter() - started:.2f} s")  # the < 1 s goes in docs/fleet.md
    return wf, out


def test_flop_model_by_hand():
    # 3.3B active, 1M tokens, 10% spot-checked: (6 + 0.2) x 3.3e9 x 1e6 FLOPs
    assert step_time.flops_per_step(3.3, 1e6, 0.1) == pytest.approx(6.2 * 3.3e9 * 1e6)
    # over 4 H200 (989 TFLOP/s dense bf16) at 25% MFU
    t = step_time.train_seconds(3.3, 1e6, gpu="H200", gpus=4, mfu=0.25, audit_fraction=0.1)
    assert t == pytest.approx(6.2 * 3.3e9 * 1e6 / (4 * 989e12 * 0.25))
    assert step_time.train_seconds(3.3, 1e6, gpu="h200", gpus=8, mfu=0.25, audit_fraction=0.1) == pytest.approx(t / 2)
    with pytest.raises(Echo2InputError, match="no bf16 peak"):
        step_time.peak_tflops("NOPE")


def test_mfu_read_from_the_learner_bench_json(tmp_path):
    f = tmp_path / "bench.json"
    f.write_text('{"case": "512", "tokens": 512, "mfu": 0.31}\n{"case": "8192", "tokens": 8192, "mfu": 0.42}\n'
                 '{"case": "mixed", "tokens": 4000}\n')
    mfu, source = step_time.mfu_from_bench(f)
    assert mfu == 0.42 and "8192" in source  # without a mixed case that has an MFU: the largest that has one
    f.write_text('{"case": "8192", "tokens": 8192, "device": "cuda", "mfu": 0.42, "mfu_attention": 0.47}\n'
                 '{"case": "mixed", "tokens": 4000, "device": "cuda", "mfu": 0.2, "mfu_attention": 0.22, '
                 '"device_name": "NVIDIA H200"}\n')
    mfu, source = step_time.mfu_from_bench(f)
    assert mfu == 0.22 and "mixed" in source and "attention" in source and "H200" in source  # the RL-shaped case
    f.write_text('{"case": "mixed", "tokens": 4000, "device": "cpu", "mfu": 0.2}\n')  # a CPU's says nothing of a GPU
    with pytest.raises(Echo2InputError, match="no GPU case with an MFU"):
        step_time.mfu_from_bench(f)
    f.write_text('{"case": "512", "tokens": 512, "peak_mb": 3}\n')
    with pytest.raises(Echo2InputError, match="no GPU case with an MFU"):
        step_time.mfu_from_bench(f)


def test_parameters_counted_from_a_model_config():
    total, active = params_from_config(CONFIGS / "qwen3-30b-a3b.json")
    assert total == pytest.approx(30.5, abs=0.1) and active == pytest.approx(3.3, abs=0.1)  # the model card's
    total, active = params_from_config(CONFIGS / "qwen3-1.7b.json")
    assert total == active and total == pytest.approx(1.7, abs=0.1)  # dense (tied embeddings counted once)


@pytest.mark.parametrize("old, new", [("rollout.groups_per_step", "train.groups_per_step"),
                                      ("train.max_pending_batches", "rollout.max_pending_batches"),
                                      ("data.steps", "train.max_steps"),
                                      ("network.keyframe_every", "publish.keyframe_every"),
                                      ("train.keyframe_every", "publish.keyframe_every")])
def test_fields_renamed_to_the_run_configs_names_say_where_they_went(old, new):
    """A workload field that means a run-config field has that field's name and section; the old one is one line."""
    section, field = old.split(".")
    for data in ({section: {field: 4}}, {"sources": {old: "x"}}):
        with pytest.raises(Echo2InputError, match=rf"^workload: {old} is now {new}, the run config's name"):
            parse_workload({"model": {"total_params_b": 1}, **data})
    new_section, new_field = new.split(".")
    wf = parse_workload({"model": {"total_params_b": 1}, new_section: {new_field: 4}, "sources": {new: "x"}})
    assert getattr(getattr(wf, new_section), new_field) == 4


def test_workload_file_errors_are_one_line_naming_the_field(tmp_path):
    with pytest.raises(Echo2InputError, match=r"rollout.group_size: Input should be greater than or equal to 1"):
        parse_workload({"model": {"total_params_b": 1}, "rollout": {"group_size": 0}})
    with pytest.raises(Echo2InputError, match=r"rollout.nope: Extra inputs"):
        parse_workload({"model": {"total_params_b": 1}, "rollout": {"nope": 1}})
    with pytest.raises(Echo2InputError, match="give model.total_params_b or model.config"):
        parse_workload({})
    with pytest.raises(Echo2InputError, match="sources name unknown field"):
        parse_workload({"model": {"total_params_b": 1}, "sources": {"rollout.nope": "x"}})
    with pytest.raises(Echo2InputError, match="no workload 'nope'.*echo2-paper-30b"):
        load_workload("nope")
    (tmp_path / "w.yaml").write_text("model: {config: cfg.json}\n")
    (tmp_path / "cfg.json").write_text((CONFIGS / "qwen3-30b-a3b.json").read_text())
    assert load_workload(tmp_path / "w.yaml").params_b()[1] == pytest.approx(3.35, abs=0.01)  # relative to the file


def test_flags_build_the_same_workload_object():
    by_flags = from_flags(model={"total_params_b": 7.0, "active_params_b": None}, rollout={"group_size": 4},
                          train={"staleness": 3})
    by_file = parse_workload({"model": {"total_params_b": 7.0}, "rollout": {"group_size": 4},
                              "train": {"staleness": 3}})
    assert by_flags == by_file


def test_preset_plans_with_every_key_and_every_assumption_sourced(preset):
    wf, out = preset
    for key in JSON_KEYS:
        assert key in out, key
    assert out["feasible"] and out["fleet"] and out["utilization"] > 0.9
    assert out["usd_total"] == pytest.approx(out["usd_learner"] + out["usd_actors"] + out["usd_traffic"])
    # steps x step, the start, the checkpoints and the expected reclaim bursts
    assert out["hours"] == pytest.approx((out["steps"] * out["step_seconds"] + out["startup_seconds"]
                                          + out["checkpoints"]["seconds"]) / 3600 + out["bursts"]["hours"])
    assert out["steps"] == 67  # ceil(17000 prompts x 2 epochs / 512 groups per step)
    # the learner: the cheapest whole instance with >= 4 H200, billed for every hour
    assert out["learner"]["offer"]["gpu"] == "H200" and out["learner"]["offer"]["gpu_count"] >= 4
    assert out["usd_learner"] == pytest.approx(out["learner"]["usd_per_hour"] * out["hours"])
    # the MoE speed, not the dense 30B one, sized the fleet: the decode model from the model's config
    assert out["fleet"][0]["tokens_per_second_each"] > load_profiles()["H200"].speed(30.5)
    assert out["fleet"][0]["speed_source"].startswith("decode model")
    names = {a["name"] for a in out["assumptions"]}
    assert {"learner.mfu", "network.changed_fraction", "rollout.completion_tokens_mean", "data.epochs"} <= names
    assert all(a["source"] for a in out["assumptions"])
    assert [r["name"] for r in out["compare"]] == ["ECHO-2 (article)", "Tinker", "Fireworks"]
    assert out["verdict"].startswith("echo2 predicts")
    if out["hours"] > 9.5 or out["usd_total"] > 425:  # then the line names what keeps it above
        assert "above it" in out["verdict"] and ("MFU" in out["verdict"] or "largest share" in out["verdict"])
    assert out["traffic"]["usd_with_relay"] <= out["traffic"]["usd_store_only"]
    assert out["reclaims"]["expected_reclaims"] > 0  # spot actors over ~10 h
    assert out["spot_learner"]["usd_total"] < out["usd_total"]  # the optional spot-learner row
    json.dumps(out)  # JSON-ready


def _with(wf, **changes):
    data = wf.model_dump(exclude={"base_dir"}, exclude_unset=True)
    for dotted, value in changes.items():
        section, field = dotted.split("__")
        data.setdefault(section, {})[field] = value
    return parse_workload(data, base_dir=wf.base_dir)


def test_a_field_change_moves_the_answer(preset, offers, profiles):
    wf, base = preset
    more_changed = plan_run(_with(wf, network__changed_fraction=0.2), offers, profiles)
    assert more_changed["versions"]["mean"] > base["versions"]["mean"]
    assert more_changed["dissemination_seconds"] >= base["dissemination_seconds"]
    assert more_changed["usd_traffic"] > base["usd_traffic"] and more_changed["usd_total"] >= base["usd_total"]
    faster = plan_run(_with(wf, learner__mfu=0.5), offers, profiles)
    assert faster["hours"] < base["hours"] and faster["usd_learner"] < base["usd_learner"]
    no_relay = plan_run(_with(wf, network__relay=False), offers, profiles)
    assert no_relay["usd_traffic"] >= base["usd_traffic"]
    given_t = plan_run(_with(wf, train__train_seconds=100.0), offers, profiles)
    assert given_t["learner_step"]["from"] == "given" and given_t["workload"]["train_seconds"] == 100.0


def test_budget_and_deadline(preset, offers, profiles):
    wf, base = preset
    out = plan_run(wf, offers, profiles, budget_usd=base["usd_total"] / 2, deadline_hours=base["hours"] * 2)
    assert out["budget"]["met"] is False and 0 < out["budget"]["steps_bought"] < out["steps"]
    assert out["deadline"]["met"] is True and out["deadline"]["usd"] == pytest.approx(out["usd_total"])
    out = plan_run(wf, offers, profiles, deadline_hours=base["hours"] / 2)
    assert out["deadline"]["met"] is False and out["deadline"]["steps_by_then"] < out["steps"]


def test_tail_slows_a_fleet_that_would_finish_a_batch_sooner(preset, offers, profiles):
    wf, base = preset
    # a p95 so long that one batch takes longer than its tokens at full speed: the fleet must grow or cost more
    long_tail = plan_run(_with(wf, rollout__completion_tokens_p95=30000.0,
                               rollout__single_stream_tokens_per_second=50.0), offers, profiles)
    assert long_tail["tail"]["binds"] and long_tail["usd_per_hour"] >= base["usd_per_hour"]
    assert all(r["offer"]["gpu"] == "H200" for r in long_tail["fleet"])  # names restored after the chooser


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "echo2.cli", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_cli_workload_json_and_table(preset):
    _, out = preset
    proc = _cli("--workload", "echo2-paper-30b", "--point", "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for key in JSON_KEYS:
        assert key in got, key
    assert got["usd_total"] == pytest.approx(out["usd_total"]) and got["fleet"] == out["fleet"]
    # a flag overrides the file: a higher MFU shortens the run
    faster = json.loads(_cli("--workload", "echo2-paper-30b", "--mfu", "0.5", "--point", "--json").stdout)
    assert faster["hours"] < got["hours"]
    table = _cli("--workload", "echo2-paper-30b", "--point")
    assert table.returncode == 0 and "assumptions" in table.stdout and "Tinker" in table.stdout, table.stderr
    bad = _cli("--workload", "nope")
    assert bad.returncode == 2 and bad.stderr.startswith("error: no workload 'nope'"), bad.stderr


def test_plan_buys_what_choose_fleet_buys(offers, profiles):
    """One chooser: with no batch tail, the plan's fleet is choose_fleet's for the same capacity workload."""
    from echo2.fleet.planner.run_plan import capacity_workload
    from echo2.fleet.sizing.choose import choose_fleet

    wf = from_flags(model={"total_params_b": 7.0}, train={"staleness": 4, "train_seconds": 60.0, "max_steps": 100},
                    network={"dissemination_seconds": 30.0})
    out = plan_run(wf, offers, profiles)
    direct = choose_fleet(capacity_workload(wf, 60.0, 30.0), offers, profiles, model_params_b=7.0,
                          batch_tokens=8 * 8 * 512)
    assert out["fleet"] == direct.as_dict()["fleet"] and out["usd_per_hour"] == pytest.approx(direct.usd_per_hour)
    # the headline pays for the extras the reliability rule asks for, and the bursts' replacements
    assert out["fleet_usd_per_hour"] >= direct.usd_per_hour
    assert out["usd_actors"] == pytest.approx(out["fleet_usd_per_hour"] * out["hours"]
                                              + out["bursts"]["usd_replacements"])


def test_every_field_is_documented_in_the_readme():
    from echo2.fleet.planner.workload_file import WORKLOADS, WorkloadFile, _Part

    readme = (WORKLOADS / "README.md").read_text()
    for section, info in WorkloadFile.model_fields.items():
        cls = info.annotation
        if isinstance(cls, type) and issubclass(cls, _Part):
            for field, finfo in cls.model_fields.items():
                assert f"`{section}.{field}`" in readme, f"{section}.{field}"
                assert finfo.description, f"{section}.{field} has no docstring"


def test_cli_mfu_from_a_bench_file(tmp_path, preset):
    _, out = preset
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"case": "8192", "tokens": 8192, "mfu": 0.5}) + "\n")
    got = json.loads(_cli("--workload", "echo2-paper-30b", "--mfu-from", str(bench), "--point", "--json").stdout)
    assert got["learner_step"]["mfu"] == 0.5 and got["learner_step"]["mfu_source"].startswith("measured")
    step = out["learner_step"]
    assert got["learner_step"]["train_seconds"] == pytest.approx(step["train_seconds"] * step["mfu"] / 0.5)
