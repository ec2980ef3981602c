"""Where a config problem was written (file:line:column, a variable, --set), close names for unknown keys,
``base:`` files and ``ECHO2_SET__`` variables, and ``echo2 config``."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from echo2.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _error(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_malformed_yaml_is_named_at_its_file_line_and_column(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("run:\n  name: x\ntrain:\n  lr: 1e-5\n  max_steps: 3: 4\n")
    assert _error(bad).startswith(f"{bad}:5:")
    assert "mapping values are not allowed here" in _error(bad)
    from echo2.cli import app

    result = CliRunner().invoke(app, ["config", "show", str(bad)])
    assert result.exit_code == 2 and result.output == f"error: {bad}:5:15: mapping values are not allowed here\n"


def test_a_key_written_twice_is_refused_where_it_is_written_again(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 1.0e-5\n  lr: 2.0e-5\n")
    assert _error(twice) == f"{twice}:3:3: duplicate key train.lr (first at line 2)"


def test_a_bad_key_or_value_is_named_with_its_path_and_where_it_is_written(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run:\n  name: c\ntrain:\n  lr: 1.0e-5\n  max_step: 3\nrollout:\n  group_size: -1\n")
    message = _error(cfg)
    assert f"{cfg}:5:3: train.max_step: unknown key (did you mean train.max_steps?)" in message
    assert f"{cfg}:7:3: rollout.group_size: Input should be greater than" in message
    assert message.startswith("invalid config ")


def test_a_key_inside_a_union_member_is_found_and_suggested_without_the_union_tag(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task:\n  name: math\n  eval_sise: 10\nfleet:\n  backend: local\n  actor: 2\n")
    message = _error(cfg)
    assert f"{cfg}:3:3: task.math.eval_sise: unknown key (did you mean task.eval_size?)" in message
    assert f"{cfg}:6:3: fleet.actor: unknown key (did you mean fleet.actors?) (fleet.backend: local)" in message


def test_an_override_names_itself_and_gets_a_close_name(monkeypatch):
    assert _error(None, ["train.max_step=3"]) == ("invalid config --set: train.max_step: unknown key "
                                                   "(did you mean train.max_steps?)")


def test_environment_variables_override_the_file_and_set_overrides_them(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  max_steps: 3\n  lr: 1.0e-5\n")
    env = {"ECHO2_SET__TRAIN__MAX_STEPS": "4", "ECHO2_SET__TRAIN__LR": "2e-5", "ECHO2_SET__STORE__OPTIONS": "{a: 1}",
           # echo2's own variables, some of which read like a section and a field, are no config fields
           "ECHO2_RUN_ID": "abc", "ECHO2_SETTINGS": "x", "ECHO2_CONFIG": "y"}
    loaded = load_config(cfg, environ=env)
    assert loaded.train.max_steps == 4 and loaded.train.lr == pytest.approx(2e-5)
    assert loaded.store.options == {"a": 1} and loaded.run.id is None
    assert load_config(cfg, ["train.max_steps=5"], environ=env).train.max_steps == 5


def test_an_unknown_field_in_a_variable_is_refused_naming_the_variable():
    message = _error(None, environ={"ECHO2_SET__TRAIN__MAX_STEP": "4"})
    assert message == ("invalid config $ECHO2_SET__TRAIN__MAX_STEP: train.max_step: unknown key "
                       "(did you mean train.max_steps?)")
    assert "SECTION__FIELD" in _error(None, environ={"ECHO2_SET__TRAIN____LR": "1"})


def test_the_process_environment_is_read_by_default(monkeypatch):
    monkeypatch.setenv("ECHO2_SET__TRAIN__MAX_STEPS", "7")
    assert load_config(None).train.max_steps == 7


def test_a_base_file_is_merged_under_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("run:\n  name: a\n  seed: 3\ntrain:\n  max_steps: 9\n  lr: 1.0e-5\n"
                                     "task:\n  name: poker\n  eval_opponents: [call_station, random]\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\ntrain:\n  lr: 3.0e-5\n")
    (tmp_path / "sub" / "c.yaml").write_text("base: [b.yaml]\nrun:\n  name: c\ntask:\n  name: poker\n"
                                             "  eval_opponents: [random]\n")
    cfg = load_config(tmp_path / "sub" / "c.yaml")
    assert (cfg.run.name, cfg.run.seed) == ("c", 3)                      # mappings merge key by key
    assert (cfg.train.max_steps, cfg.train.lr) == (9, pytest.approx(3e-5))
    assert cfg.task.eval_opponents == ["random"]                        # lists are replaced


def test_bases_merge_in_order_and_a_section_of_another_kind_replaces_the_bases(tmp_path):
    (tmp_path / "a.yaml").write_text("train:\n  max_steps: 1\n  lr: 1.0e-5\ntask:\n  name: arithmetic\n"
                                     "  digits: 2\n")
    (tmp_path / "b.yaml").write_text("train:\n  max_steps: 2\nrollout:\n  engine:\n    kind: transformers\n"
                                     "    batch_size: 4\n    dtype: float32\n")
    (tmp_path / "c.yaml").write_text("base: [a.yaml, b.yaml]\ntask:\n  name: math\n  eval_size: 7\n"
                                     "rollout:\n  engine:\n    kind: vllm\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.train.max_steps, cfg.train.lr) == (2, pytest.approx(1e-5))
    assert cfg.task.name == "math" and cfg.task.eval_size == 7         # no arithmetic `digits` merged into it
    assert cfg.rollout.engine.kind == "vllm"                            # nor the transformers engine's batch_size


def test_a_bad_key_of_a_base_is_named_in_the_base(tmp_path):
    (tmp_path / "a.yaml").write_text("train:\n  max_stepz: 1\n")
    (tmp_path / "c.yaml").write_text("base: a.yaml\n")
    assert f"{tmp_path / 'a.yaml'}:2:3: train.max_stepz: unknown key" in _error(tmp_path / "c.yaml")


def test_a_cycle_of_bases_and_a_missing_base_are_one_line_each(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    assert "base files form a cycle: a.yaml -> b.yaml -> a.yaml" in _error(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("run:\n  name: c\nbase: nowhere.yaml\n")
    assert _error(tmp_path / "c.yaml").startswith(f"{tmp_path / 'c.yaml'}:3:1: base nowhere.yaml: ")
    (tmp_path / "d.yaml").write_text("base: {a: 1}\n")
    assert "base must be a file name or a list" in _error(tmp_path / "d.yaml")


def test_the_configs_built_on_the_quickstart_are_built_on_it():
    quickstart = load_config(CONFIGS / "quickstart.yaml")
    for name in ("gpu-1gpu.yaml", "quickstart-relay.yaml", "quickstart-spot.yaml"):
        assert (CONFIGS / name).read_text().count("\nbase: quickstart.yaml") == 1, name
    relay = load_config(CONFIGS / "quickstart-relay.yaml")
    assert relay.train == quickstart.train and relay.task == quickstart.task and relay.fleet.actors == 2
    gpu = load_config(CONFIGS / "gpu-1gpu.yaml")
    assert gpu.task.name == "math" and gpu.rollout.engine.kind == "vllm" and gpu.run.seed == quickstart.run.seed


def test_config_schema_prints_the_json_schema_with_base():
    from echo2.cli import app

    result = CliRunner().invoke(app, ["config", "schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.output)
    assert {"base", "train", "task", "fleet"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False


def test_config_show_prints_the_resolved_config_or_one_line():
    from echo2.cli import app

    result = CliRunner().invoke(app, ["config", "show", str(CONFIGS / "quickstart-relay.yaml"),
                                      "--set", "train.max_steps=3"])
    assert result.exit_code == 0, result.output
    assert "name: quickstart-relay" in result.output and "max_steps: 3" in result.output
    result = CliRunner().invoke(app, ["config", "show", "--set", "train.max_step=3"])
    assert result.exit_code == 2
    assert "did you mean train.max_steps?" in result.output


def test_a_resumed_run_takes_the_variables_too_and_refuses_one_its_actors_would_miss(tmp_path, monkeypatch):
    from echo2.config import Config
    from echo2.data.run_folder import create_run
    from echo2.data.run_key import run_key
    from echo2.data.store import open_store
    from echo2.errors import Echo2InputError
    from echo2.launch import resume_config

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv("ECHO2_RUN_KEY", raising=False)
    runs = open_store(str(tmp_path / "store")).child("runs")
    config = Config.model_validate({"run": {"id": "r1"}}).model_dump(mode="json")
    create_run(runs.child("r1"), "r1", config, key=run_key("r1", create=True), echo2_version="test")
    monkeypatch.setenv("ECHO2_SET__TRAIN__MAX_STEPS", "40")
    assert resume_config(runs, "r1", []).train.max_steps == 40
    assert resume_config(runs, "r1", ["train.max_steps=41"]).train.max_steps == 41
    monkeypatch.setenv("ECHO2_SET__ROLLOUT__TEMPERATURE", "0.5")
    with pytest.raises(Echo2InputError, match="--resume cannot change rollout.temperature"):
        resume_config(runs, "r1", [])
