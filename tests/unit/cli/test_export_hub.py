"""``echo2 export`` beyond the weights folder: ``--dtype`` (the weights and config.json's dtype), ``--adapter-only``
(a LoRA run's adapter alone, as peft writes it; refused for a run without one) and ``--push-to-hub`` (a model card,
then the upload through ``hub.upload_folder``, replaced here: no network).

A real learner (LearnerRun, the tiny model, a local store) writes the run's versions and checkpoints, as in
``test_signed_checkpoints.py``."""

from __future__ import annotations

import json

import pytest
import torch
from signed_checkpoints_shared import export, learner_run, train_to

from echo2.cli import hub
from echo2.data import layout
from echo2.data.run_key import KEY_ENV

SUMMARY = {"run_id": "r1", "steps": 2, "wall_seconds": 61.0, "eval_before": 0.25, "eval_after": 0.5, "eval_n": 40,
           "eval_metric": "accuracy", "cost_usd": 0.0, "cost_priced": False,
           "eval_metrics": {"before": {"accuracy": 0.25, "pass_at_1_ci95_low": 0.14, "pass_at_1_ci95_high": 0.4},
                            "after": {"accuracy": 0.5, "pass_at_1_ci95_low": 0.35, "pass_at_1_ci95_high": 0.65}}}


@pytest.fixture(autouse=True)
def key_here(tmp_path, monkeypatch):
    """The learner's key in a secrets folder of this test (the run's key file, as on the learner's machine)."""
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv(KEY_ENV, raising=False)


@pytest.fixture
def uploads(monkeypatch):
    """The Hub, replaced: every upload the export asks for, with its arguments."""
    calls = []
    monkeypatch.setattr(hub, "upload_folder", lambda repo, folder, *, private, token: calls.append(
        {"repo": repo, "folder": folder, "private": private, "token": token, "files": sorted(
            p.name for p in folder.iterdir())}))
    monkeypatch.setenv(hub.TOKEN_ENV, "hf_test")
    return calls


def test_export_in_bfloat16_with_a_model_card_pushed_to_the_hub(tiny_model, tmp_path, uploads):
    from transformers import AutoModelForCausalLM

    run = learner_run(tiny_model, tmp_path, resume=False)
    train_to(run, 2)
    run.sink.close()
    run.store.put_json(layout.SUMMARY, SUMMARY)
    exact, half = tmp_path / "fp32", tmp_path / "bf16"
    assert export(run.store, exact, "--step", "2").exit_code == 0  # the default: the trained weights, exactly
    result = export(run.store, half, "--step", "2", "--dtype", "bfloat16", "--push-to-hub", "me/tiny-grpo",
                    "--private")
    assert result.exit_code == 0, result.output

    fp32 = AutoModelForCausalLM.from_pretrained(exact).state_dict()
    bf16 = AutoModelForCausalLM.from_pretrained(half).state_dict()  # in the dtype config.json names
    assert {t.dtype for t in fp32.values()} == {torch.float32} and {t.dtype for t in bf16.values()} == {torch.bfloat16}
    assert all(torch.equal(bf16[k], v.to(torch.bfloat16)) for k, v in fp32.items())
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((exact / "config.json").read_text())["torch_dtype"] == "float32"

    card = (half / "README.md").read_text()
    front = card.split("---")[1]
    assert "tags:\n- echo2\n- grpo\n- rl\n" in front and "library_name: transformers" in front
    assert "| steps trained | 2 |" in card and "| staleness bound S |" in card and "bfloat16" in card
    assert "| before training | 0.250 | [0.140, 0.400] |" in card
    assert "| after training (step 2) | 0.500 | [0.350, 0.650] |" in card
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-grpo", dtype="bfloat16")' in card
    assert uploads == [{"repo": "me/tiny-grpo", "folder": half, "private": True, "token": "hf_test",
                        "files": sorted(p.name for p in half.iterdir())}] and "README.md" in uploads[0]["files"]
    assert "uploaded" in result.output and not (exact / "README.md").exists()


def test_the_card_names_the_hub_id_of_the_base_model():
    card = hub.model_card(repo="me/m", config={"model": {"name": "smollm2-135m-instruct"}, "train": {"lora_rank": 8}},
                          summary=None, exported="policy/v000004", steps_trained=4, dtype="float32",
                          adapter_only=True)
    front = card.split("---")[1]
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in front and "library_name: peft" in front
    assert "has not finished" in card and "AutoPeftModelForCausalLM" in card
    assert hub.base_model_id({"model": {"name": "Qwen/Qwen3-4B"}}) == "Qwen/Qwen3-4B"


def test_adapter_only_of_a_run_without_lora_is_refused_in_one_line(tiny_model, tmp_path):
    run = learner_run(tiny_model, tmp_path, resume=False)
    train_to(run, 2)
    run.sink.close()
    result = export(run.store, tmp_path / "out", "--adapter-only")
    assert result.exit_code == 2 and "has no adapter" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_adapter_only_writes_the_lora_run_s_adapter_as_peft_loads_it(tiny_model, tmp_path, uploads):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = learner_run(tiny_model, tmp_path, resume=False, lora_rank=4, lora_alpha=8.0, lr=5e-2)
    train_to(run, 2)
    run.sink.close()
    ids = torch.tensor([[1, 5, 9, 30, 2, 7]])
    with torch.no_grad():
        ours = run.learner.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=ids).logits
    assert not torch.allclose(base, ours, atol=1e-4)  # the adapter learned something: B A != 0
    for name, args in (("version", []), ("checkpoint", ["--step", "2"])):
        out = tmp_path / name
        result = export(run.store, out, "--adapter-only", *args, "--push-to-hub", "me/adapter")
        assert result.exit_code == 0, result.output
        assert {"adapter_config.json", hub.ADAPTER_WEIGHTS, "README.md"} <= {p.name for p in out.iterdir()}
        assert not (out / "config.json").exists()  # the base's: transformers would take the folder for a model
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out).eval()
        with torch.no_grad():
            assert torch.allclose(adapted(input_ids=ids).logits, ours, atol=1e-4), name
        assert "library_name: peft" in (out / "README.md").read_text()
    assert [c["folder"].name for c in uploads] == ["version", "checkpoint"]
    # version 0 of a LoRA run is its base: there is no adapter to export yet
    result = export(run.store, tmp_path / "v0", "--adapter-only", "--step", "0")
    assert result.exit_code == 2 and "no adapter yet" in result.output
