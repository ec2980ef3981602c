"""The learner's config in sections (``echo2/config/train.py``): ``train``, ``publish``, ``trust`` and ``learner`` where
one flat ``train`` section was. Every old key is refused in one line naming its place now, wherever it was written
(a file, ``--set``, an ``ECHO2_SET__`` variable, a resume's overrides), and a run created before the split still
resumes: its ``run.json`` config is read through the same table (``MOVED``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from echo2.config import (
    MOVED,
    Config,
    ConfigError,
    LearnerConfig,
    PublishConfig,
    TrainConfig,
    TrustConfig,
    config_from_run,
    load_config,
)
from echo2.config.train import upgraded
from echo2.data import layout
from echo2.data.run_folder import RunInfo, create_run
from echo2.data.run_key import KEY_ENV, run_key
from echo2.data.store import open_store
from echo2.errors import Echo2InputError
from echo2.launch import resume_config


def old_layout(config: Config) -> dict:
    """``config`` as an echo2 from before the split wrote it into ``run.json``: every moved field back in ``train``
    under its old name, and no ``publish``, ``trust`` or ``learner`` section."""
    data = config.model_dump(mode="json")
    for old, new in MOVED.items():
        section, name = new.split(".")
        data["train"][old.split(".")[1]] = data[section].pop(name)
    for section in ("publish", "trust", "learner"):
        assert data.pop(section) == {}
    return data


def test_the_sections_hold_every_field_once_and_moved_names_each_new_place():
    sections = {"train": TrainConfig, "publish": PublishConfig, "trust": TrustConfig, "learner": LearnerConfig}
    for name, cls in sections.items():
        assert Config.model_fields[name].annotation is cls
    for old, new in MOVED.items():
        section, field = new.split(".")
        assert field in sections[section].model_fields, new
        assert old.split(".")[1] not in TrainConfig.model_fields, old
    assert sum(len(cls.model_fields) for cls in sections.values()) == len(TrainConfig.model_fields) + len(MOVED)


def test_an_old_key_is_one_line_naming_its_new_place_wherever_it_was_written(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  max_steps: 3\n  publish_dtype: bfloat16\n  audit_fraction: 0.5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message
    assert f"{path}:3:3: train.publish_dtype moved to publish.dtype" in message
    assert f"{path}:4:3: train.audit_fraction moved to trust.spot_check_fraction" in message

    with pytest.raises(ConfigError, match=r"^invalid config --set: train\.nproc moved to learner\.nproc$"):
        load_config(None, ["train.nproc=2"])
    with pytest.raises(ConfigError, match=r"\$ECHO2_SET__TRAIN__MARKET: train\.market moved to learner\.market"):
        load_config(None, environ={"ECHO2_SET__TRAIN__MARKET": "spot"})
    with pytest.raises(ValueError, match="train.keep_versions moved to publish.keep_versions"):
        TrainConfig(keep_versions=3)  # in code too

    result = CliRunner().invoke(__import__("echo2.cli", fromlist=["app"]).app, ["config", "show", str(path)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "train.publish_dtype moved to publish.dtype" in result.output


def test_the_new_places_load_and_are_checked_across_sections():
    cfg = load_config(None, ["publish.dtype=bfloat16", "trust.spot_check_fraction=0", "learner.market=spot",
                             "learner.nproc=2", "publish.every=2", "train.staleness=1"])
    assert (cfg.publish.dtype, cfg.trust.spot_check_fraction, cfg.learner.market, cfg.learner.nproc) == (
        "bfloat16", 0.0, "spot", 2)
    with pytest.raises(ConfigError, match="publish.every - 1"):
        load_config(None, ["publish.every=3", "train.staleness=1"])
    with pytest.raises(ConfigError, match="learner.nproc > 1 .* LoRA"):
        load_config(None, ["learner.nproc=2", "train.lora_rank=4"])


def test_upgraded_moves_an_old_layout_and_leaves_a_new_one_as_it_is():
    new = load_config(None, ["publish.delta=true", "learner.market=spot", "trust.max_prompt_tokens=99"])
    old = old_layout(new)
    assert old["train"]["publish_delta"] is True and old["train"]["market"] == "spot"
    assert upgraded(old) == new.model_dump(mode="json")
    assert config_from_run(old, "run.json") == new
    assert upgraded(new.model_dump(mode="json")) == new.model_dump(mode="json")
    assert RunInfo.of({"config": old}).learner_market == "spot"  # the cost report of an old spot run
    assert RunInfo.of({"config": new.model_dump(mode="json")}).learner_market == "spot"


def test_a_run_created_before_the_split_resumes(tmp_path, monkeypatch):
    """Its ``run.json`` (signed, config in the old layout) resumes with every moved value in its new place; an
    override of an old key is refused in one line like anywhere else."""
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    new = load_config(None, ["run.id=old-run", f"store.url={tmp_path}", "publish.dtype=bfloat16",
                             "publish.keyframe_every=4", "trust.spot_check_fraction=0.5", "learner.market=spot",
                             "learner.sigterm_notice_s=7"])
    runs = open_store(str(tmp_path)).child(layout.RUNS)
    create_run(runs.child("old-run"), "old-run", old_layout(new), key=run_key("old-run", create=True),
               echo2_version="before the split")

    resumed = resume_config(runs, "old-run", ["train.max_steps=40", "learner.sigterm_notice_s=9"])
    assert resumed.publish.dtype == "bfloat16" and resumed.publish.keyframe_every == 4
    assert resumed.trust.spot_check_fraction == 0.5 and resumed.learner.market == "spot"
    assert (resumed.train.max_steps, resumed.learner.sigterm_notice_s) == (40, 9)
    assert resume_config(runs, "old-run", []) == new

    with pytest.raises(Echo2InputError, match=r"--set: train\.publish_every moved to publish\.every") as err:
        resume_config(runs, "old-run", ["train.publish_every=2"])
    assert "\n" not in str(err.value)


def test_the_planners_workload_fields_follow_the_run_configs_sections():
    from echo2.fleet.planner.workload_file import parse_workload

    for old, new in (("audit_fraction", "trust.spot_check_fraction"), ("publish_every", "publish.every")):
        with pytest.raises(Echo2InputError, match=rf"^workload: train\.{old} is now {new}, the run config's name"):
            parse_workload({"model": {"total_params_b": 1}, "train": {old: 1}})
    wf = parse_workload({"model": {"total_params_b": 1}, "publish": {"every": 2, "keyframe_every": 8},
                         "trust": {"spot_check_fraction": 0.2}, "train": {"staleness": 1}})
    assert (wf.publish.every, wf.publish.keyframe_every, wf.trust.spot_check_fraction) == (2, 8, 0.2)
    names = {a["name"] for a in wf.assumptions()}
    assert {"publish.every", "publish.keyframe_every", "trust.spot_check_fraction"} <= names
