"""``echo2 eval``: held-out metrics of a model folder or of a run's checkpoint, as JSON."""

import json

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from echo2.cli import app
from echo2.data import layout
from echo2.data.run_folder import create_run
from echo2.data.store import open_store
from echo2.data.weights import model_files, write_weights
from echo2.learner.checkpoint import save_checkpoint
from echo2.learner.checkpoint_files import save_sharded


def _checkpoint(tmp_path, tiny_model, *, signed: bool = True):
    """Step 3 of run r1 as its learner writes it: run.json, and a checkpoint signed with the run key (or not)."""
    from transformers import AutoModelForCausalLM

    from echo2.data.weights import unique_state_dict

    run = tmp_path / "runs" / "r1"
    store = open_store(str(run))
    key = Ed25519PrivateKey.generate()
    create_run(store, "r1", {}, key=key, echo2_version="test")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tensors = unique_state_dict(model)
    if signed:
        save_checkpoint(store, 3, lambda s, prefix: save_sharded(s, prefix, {"model": tensors}, file_mb=64),
                        {"history": [], "evals": {}, "wall_seconds": 0.0}, key=key, extra_files=model_files(tiny_model))
    else:
        write_weights(store, layout.checkpoint_dir(3), tensors, extra_files=model_files(tiny_model),
                      shard_mb=64, meta={"step": 3})
    return run / layout.checkpoint_dir(3)


def test_eval_of_a_checkpoint_prints_pass_at_1_and_pass_at_k(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))  # no key of run r1 on this machine
    ckpt = _checkpoint(tmp_path, tiny_model)
    args = ["eval", str(ckpt), "--task", "arithmetic", "--set", "task.eval_size=6", "--set", "eval.k=3",
            "--set", "eval.max_new_tokens=4", "--json"]
    refused = CliRunner().invoke(app, args)  # only run.json's key verifies it: whoever writes the store could sign
    assert refused.exit_code == 2 and "--trust-run-json-key" in refused.output
    assert refused.output.count("\n") == 1, refused.output
    result = CliRunner().invoke(app, [*args, "--trust-run-json-key"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["task"] == "arithmetic" and out["n"] == 6 and out["k"] == 3
    assert 0.0 <= out["pass_at_1"] <= 1.0 and 0.0 <= out["pass_at_k"] <= 1.0
    assert out["score"] == out["pass_at_1"]
    low, high = out["pass_at_1_ci95_low"], out["pass_at_1_ci95_high"]  # Wilson over the held-out problems
    assert 0.0 <= low <= out["pass_at_1"] <= high <= 1.0 and high - low > 0.1


def test_eval_refuses_a_checkpoint_its_run_did_not_sign_in_one_line(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))  # no key of run r1 on this machine
    ckpt = _checkpoint(tmp_path, tiny_model, signed=False)
    result = CliRunner().invoke(app, ["eval", str(ckpt), "--task", "arithmetic", "--set", "task.eval_size=2",
                                      "--trust-run-json-key"])  # trusting run.json's key still needs a signature
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "error:" in result.output and "step-000003" in result.output
    assert "sign" in result.output, result.output


def test_eval_of_poker_reports_bb_per_100_per_opponent(tmp_path, tiny_model):
    result = CliRunner().invoke(app, ["eval", str(tiny_model), "--task", "poker", "--set", "task.eval_deals=2",
                                      "--set", "task.starting_stack=20", "--set", "eval.max_new_tokens=6", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out["opponents"]) == {"random", "call_station", "equity"}
    for o in out["opponents"].values():
        assert o["hands"] == 4 and o["ci95_low"] <= o["bb_per_100"] <= o["ci95_high"]
    assert 0.0 <= out["illegal_action_rate"] <= 1.0 and out["metric"] == "bb_per_100"


def test_eval_bad_input_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "runs" / "r1" / "checkpoints" / "step-000009"),
                                      "--task", "math"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "error:" in result.output
