"""The actor side never needs Prefect (vLLM and Prefect cannot share an environment): the actor entry
point runs, end to end, in an interpreter where Prefect, the flows and the learner cannot be imported;
and ``rollout.engine`` picks the engine ``make_engine`` builds."""

from __future__ import annotations

import pytest
import torch
from actor_helpers import make_run, start_actor, stop_actor, wait_for_rollouts
from transformers import AutoModelForCausalLM

from echo2.config import ConfigError, config_from_dict
from echo2.data.rollouts import decode_rollouts
from echo2.data.weights import unique_state_dict


@pytest.mark.e2e
def test_the_actor_entry_point_runs_with_prefect_unimportable(tiny_model, tmp_path, monkeypatch):
    tensors = unique_state_dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    config = {"rollout": {"engine": {"kind": "transformers", "batch_size": 4}, "group_size": 2, "groups_per_batch": 1,
                          "max_new_tokens": 4, "poll_seconds": 0.1},
              "train": {"groups_per_step": 1}}
    store, key, url = make_run(tmp_path, tiny_model, tensors, config, monkeypatch)
    log = tmp_path / "actor.log"
    proc = start_actor(url, key, "a0", log)
    try:
        keys = wait_for_rollouts(store, 0, proc, log, timeout=180)
    finally:
        code = stop_actor(proc)
    output = log.read_text()
    assert "BLOCKED-IMPORT" not in output, output
    assert code == 0, output
    table = decode_rollouts(store.get(keys[0]))
    assert table.num_rows == 2 and all(len(c) > 0 for c in table.column("completion_token_ids").to_pylist())


def test_the_blocker_does_block(tmp_path):
    """The check above means something: the same interpreter refuses ``import prefect`` and says so."""
    import subprocess
    import sys

    from actor_helpers import _BLOCKER

    code = _BLOCKER.replace("from echo2.cli import app\napp(sys.argv[1:], prog_name=\"echo2\")", "import prefect")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "BLOCKED-IMPORT prefect" in result.stderr


@pytest.mark.parametrize("engine, kind", [("transformers", "transformers"), ("vllm", "vllm"),
                                          ({"batch_size": 8}, "transformers"),
                                          ({"kind": "vllm", "dtype": "bfloat16"}, "vllm")])
def test_engine_config_accepts_a_name_or_a_mapping(engine, kind):
    config = config_from_dict({"rollout": {"engine": engine}})
    assert config.rollout.engine.kind == kind


def test_engine_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="rollout.engine"):
        config_from_dict({"rollout": {"engine": "sglang"}})
    with pytest.raises(ConfigError, match="rollout.engine.vllm.batch_size: unknown key"):
        config_from_dict({"rollout": {"engine": {"kind": "vllm", "batch_size": 8}}})


def test_a_vllm_engine_without_vllm_installed_is_one_clear_error(tiny_model):
    """Here (``.venv``) vLLM is not installed: the actor says what to install instead of a traceback."""
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    from transformers import AutoTokenizer

    from echo2.errors import Echo2InputError
    from echo2.rollout.engines import make_engine

    config = config_from_dict({"rollout": {"engine": "vllm"}})
    with pytest.raises(Echo2InputError, match=r"needs vLLM in the actor's environment.*echo2\[vllm\]"):
        make_engine(config, tiny_model, AutoTokenizer.from_pretrained(tiny_model), seed=1)
