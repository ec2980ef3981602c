from pathlib import Path

import pytest

from echo2.config import Config, ConfigError, dump_config, load_config

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def test_quickstart_loads_with_documented_defaults():
    cfg = load_config(QUICKSTART)
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.train.staleness == 2
    assert cfg.fleet.actors == 1


@pytest.mark.parametrize("path", sorted(QUICKSTART.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    """A config in configs/ is what a user copies first: each must load as it is."""
    assert isinstance(load_config(path), Config)


def test_every_field_has_a_docstring():
    """Every section, including each member of a union (tasks, opponents, price sources) and of a list."""
    import typing

    section = Config.__mro__[1]

    def sections_in(ann):
        if isinstance(ann, type) and issubclass(ann, section):
            yield ann
        for arg in typing.get_args(ann):
            yield from sections_in(arg)

    seen = set()

    def walk(model_cls, prefix=""):
        seen.add(model_cls)
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no docstring"
            for sub in sections_in(field.annotation):
                walk(sub, f"{prefix}{name}.")

    walk(Config)
    from echo2.config import (
        CheckpointOpponentConfig,
        LocalFleetConfig,
        MathColumnsConfig,
        PokerTaskConfig,
        SkyPilotFleetConfig,
    )

    assert {PokerTaskConfig, CheckpointOpponentConfig, MathColumnsConfig, LocalFleetConfig, SkyPilotFleetConfig} <= seen


def test_overrides_are_parsed_as_yaml_values():
    cfg = load_config(QUICKSTART, ["train.lr=3e-6", "train.max_steps=7", "run.id=abc", "store.options={a: 1}"])
    assert cfg.train.lr == pytest.approx(3e-6)
    assert cfg.train.max_steps == 7
    assert cfg.run.id == "abc"
    assert cfg.store.options == {"a": 1}


def test_unknown_key_is_named_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, ["train.learning_rate=1"])
    assert "train.learning_rate: unknown key" in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_value_is_named_with_its_input():
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, ["train.staleness=-1"])
    assert "train.staleness" in str(err.value) and "-1" in str(err.value)


def test_cross_field_rule(tmp_path):
    with pytest.raises(ConfigError, match="groups_per_batch"):
        load_config(QUICKSTART, ["rollout.groups_per_batch=9", "train.groups_per_step=8"])


def test_yaml_that_is_not_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_dump_round_trips():
    cfg = load_config(QUICKSTART, ["train.max_steps=3"])
    again = Config.model_validate(__import__("yaml").safe_load(dump_config(cfg)))
    assert again == cfg


def test_staleness_below_the_publish_period_is_refused():
    # with publish.every=2 and staleness 0, step 2 needs rollouts of version 1, which is never
    # published: the learner would wait until rollout_timeout_s and fail
    with pytest.raises(ConfigError, match="train.staleness"):
        load_config(None, ["publish.every=2", "train.staleness=0"])
    assert load_config(None, ["publish.every=2", "train.staleness=1"]).train.staleness == 1


def test_fleet_size_is_a_number_or_auto():
    assert load_config(None, ["fleet.actors=auto"]).fleet.actors == "auto"
    assert load_config(None, ["fleet.actors=3"]).fleet.actors == 3
    with pytest.raises(ConfigError, match="fleet.actors"):
        load_config(None, ["fleet.actors=0"])
    with pytest.raises(ConfigError, match="fleet.actors"):
        load_config(None, ["fleet.actors=many"])


def test_fleet_is_a_union_on_backend_with_each_backends_fields_beside_the_shared_ones():
    from echo2.config import LocalFleetConfig, SkyPilotFleetConfig

    fleet = load_config(None, ["fleet.reclaim_rate=2", "fleet.actors=3"]).fleet
    assert isinstance(fleet, LocalFleetConfig) and fleet.backend == "local" and fleet.reclaim_rate == 2
    fleet = load_config(None, ["fleet.backend=skypilot", "store.url=s3://b/e", "fleet.credentials_role_arn=arn:x",
                               "fleet.providers=[runpod]", "fleet.gpus=[L4]", "fleet.actors=3"]).fleet
    assert isinstance(fleet, SkyPilotFleetConfig) and fleet.gpus == ["L4"] and fleet.actors == 3
    # a field of the other backend is unknown, and named where it is written (not under the union's tag)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["fleet.gpus=[L4]"])
    assert "fleet.gpus: unknown key (fleet.backend: local)" in str(err.value)
    with pytest.raises(ConfigError, match="fleet.backend must be one of local, skypilot"):
        load_config(None, ["fleet.backend=kubernetes"])


def test_a_fleet_subsection_of_old_is_refused_in_one_line_that_says_where_its_fields_went(tmp_path):
    """``fleet.local:`` and ``fleet.skypilot:`` were subsections until FleetConfig became a union on ``backend``."""
    old = tmp_path / "old.yaml"
    old.write_text("fleet:\n  backend: local\n  actors: 2\n  local:\n    reclaim_rate: 0.4\n    seed: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(old)
    message = str(err.value)
    assert "\n" not in message
    assert ("fleet.local is no longer a subsection: write its fields (reclaim_rate, seed) directly under fleet, "
            "beside fleet.backend: local (e.g. fleet.reclaim_rate)") in message
    with pytest.raises(ConfigError, match=r"fleet.skypilot is no longer a subsection: write its fields \(gpus\) "
                                          r"directly under fleet, beside fleet.backend: skypilot"):
        load_config(None, ["fleet.backend=skypilot", "fleet.skypilot.gpus=[L4]"])


def test_every_shipped_config_validates():
    from echo2.config import load_config

    for path in sorted((QUICKSTART.parent).glob("*.yaml")):
        load_config(path)  # raises ConfigError naming the field
