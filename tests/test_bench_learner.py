"""``echo2 bench learner``: its JSON interface on a tiny case, its step being the Learner's own, its targets'
verdicts, and the GPU path importing nothing but torch, transformers and the standard library.
No timing is asserted: the numbers are the benchmark's to print."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO

from echo2.bench import learner as bench
from echo2.bench.learner_steps import LOSS, LR, MAX_GRAD_NORM, WEIGHT_DECAY, echo2_step, make_columns, make_optimizer
from echo2.config import TrainConfig
from echo2.learner.learner import Learner
from echo2.learner.logprobs import PolicyLogprobs

TINY = ["--vocab", "97", "--hidden", "16", "--prompt-tokens", "4", "--groups", "2", "--group-size", "2",
        "--micro-batch-tokens", "24", "--chunk-tokens", "16"]
KEYS = {"case", "tokens", "peak_mb", "tokens_per_s", "baseline_tokens_per_s", "padding_fraction"}


@pytest.mark.e2e
def test_json_has_one_object_per_case_with_the_interface_keys():
    cases = bench.make_cases(completion_tokens=[8], mixed=(4, 20), prompt_tokens=4, groups=2, group_size=2)
    config = bench.cpu_model_config(vocab=97, hidden=16)
    need = {c.name: bench.baseline_need_mb(c, 1, config, checkpointed=False) for c in cases}
    assert need["8"] < need["mixed"]  # the mixed case's longest row is longer than 12 tokens
    # a budget that holds the 8-token case's baseline one row at a time, and not the mixed case's
    budget = (need["8"] + need["mixed"]) / 2
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "bench", "learner", *TINY, "--completion-tokens", "8",
                           "--mixed", "4..20", "--memory-budget-mb", str(budget), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["case"] for r in lines] == [c.name for c in cases]
    ran, skipped = lines
    assert set(ran) == KEYS | {"baseline_peak_mb"}
    assert set(skipped) == KEYS | {"baseline_need_mb"}
    assert ran["tokens"] == 4 * (4 + 8) and skipped["tokens"] == cases[1].tokens
    for r in lines:
        assert r["peak_mb"] > 0 and r["tokens_per_s"] > 0 and r["padding_fraction"] == 0.0  # packed: no padding
    assert ran["baseline_peak_mb"] > 0 and ran["baseline_tokens_per_s"] > 0
    assert skipped["baseline_tokens_per_s"] is None and skipped["baseline_need_mb"] == need["mixed"]
    assert "case 8: baseline (1 rows per micro-batch)" in proc.stderr  # the micro-batch it ran at is said
    assert "case mixed: baseline not run" in proc.stderr


def test_the_bench_step_is_the_learners(tiny_model):
    """echo2_step composes Learner.step_on_columns' calls: the same weights after one step, with uneven
    lengths (several packs, one sequence longer than the budget) and a group without signal left out."""
    config = TrainConfig(micro_batch_tokens=24, logprob_chunk_tokens=16)
    assert (config.lr, config.max_grad_norm, config.weight_decay) == (LR, MAX_GRAD_NORM, WEIGHT_DECAY)
    assert {k: getattr(config, k) for k in LOSS} == LOSS
    learner = Learner(tiny_model, config, temperature=1.0)
    model = copy.deepcopy(learner.model)
    before = [p.detach().clone() for p in model.parameters()]
    columns = make_columns(3, [2, 9, 30, 5, 1, 14, 7, 3, 11], 3, 300, seed=1)
    columns.reward[6:] = 0.5  # the third group carries no signal
    columns.completion_mask[::5] = 0  # and some tokens came from the environment
    # the bench's optimizer comes with its state made (one AdamW step on zero gradients): so does this one
    for p in learner.model.parameters():
        p.grad = torch.zeros_like(p)
    learner.optimizer.step()
    learner.step_on_columns(columns)
    stats = echo2_step(PolicyLogprobs(model, temperature=1.0, chunk_tokens=16), model, make_optimizer(model), columns,
                       micro_batch_tokens=24, dtype=torch.float32)
    assert stats.micro_batches >= 3
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the step moved weights
    for (name, mine), theirs in zip(model.named_parameters(), learner.model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0, msg=name)


def test_targets_say_pass_fail_or_not_run():
    results = [
        {"case": "512", "tokens": 1, "peak_mb": 100, "total_peak_mb": 900, "tokens_per_s": 95.0,
         "baseline_peak_mb": 400, "baseline_tokens_per_s": 100.0},
        {"case": "2048", "tokens": 1, "peak_mb": 100, "total_peak_mb": 900, "tokens_per_s": 1.0,
         "baseline_peak_mb": 900, "baseline_tokens_per_s": 1.0},
        {"case": "8192", "tokens": 1, "peak_mb": 100, "total_peak_mb": 9000, "tokens_per_s": 1.0,
         "baseline_need_mb": 20000, "baseline_tokens_per_s": None},
    ]
    lines = bench.target_lines(results, cuda=False, model_config=None)
    assert [line[:4] for line in lines] == ["PASS", "FAIL", "PASS", "n/a "]  # 2048, 8192, 512, mixed
    assert "9.0x less" in lines[0] and "9000 MB" in lines[1] and "0.95x" in lines[2]


GPU_PATH = textwrap.dedent("""
    import importlib.machinery, json, sys

    HIDDEN = {"pydantic", "pyarrow", "s3fs", "tenacity", "aiohttp", "zstandard", "cryptography", "pokerkit",
              "math_verify", "prefect", "peft", "gguf", "accelerate", "boto3", "botocore"}

    class NotInstalled(importlib.machinery.PathFinder):
        # these packages look absent, as on a GPU machine holding only torch and transformers
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in HIDDEN:
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [NotInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path]

    import torch
    from transformers import AutoModelForCausalLM
    from echo2.bench import learner as bench
    from echo2.bench.learner_steps import active_parameters

    params = {}
    for name in bench.MODEL_CONFIGS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(bench.to_transformers(bench.load_model_config(name)))
        params[name] = [sum(p.numel() for p in model.parameters()), active_parameters(model)]
    # the GPU path's settings (bf16 autocast, checkpointed layers) on a tiny model, on the CPU
    opts = bench.Options(model_config=bench.cpu_model_config(vocab=97, hidden=16), micro_batch_tokens=24,
                         chunk_tokens=16, bf16_checkpointed=True)
    case = bench.make_cases(completion_tokens=[8], mixed=None, prompt_tokens=4, groups=2, group_size=2)[0]
    state = bench.setup(opts)
    steps = [bench.measure(v, case, opts, *state, 2)["loss"] for v in ("echo2", "baseline")]
    try:
        bench.main(["--device", "cuda", "--model-config", "qwen3-1.7b", "--json"])
    except SystemExit as exc:
        code = exc.code
    print(json.dumps({"params": params, "losses": steps, "exit": code,
                      "echo2": sorted(m for m in sys.modules if m.split(".")[0] == "echo2"),
                      "hidden": sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN)}))
""")


@pytest.mark.e2e
def test_the_gpu_path_needs_only_torch_and_transformers():
    proc = subprocess.run([sys.executable, "-c", GPU_PATH], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hidden"] == []
    assert set(out["echo2"]) <= {"echo2", "echo2.bench", "echo2.bench.learner", "echo2.bench.learner_steps",
                                 "echo2.bench.learner_models", "echo2.bench.learner_report", "echo2.learner",
                                 "echo2.learner.packing",
                                 "echo2.learner.logprobs", "echo2.learner.loss"}
    assert all(abs(loss) < 1e3 for loss in out["losses"])  # both steps ran in bf16 with checkpointed layers
    # no GPU here: the path stops at its one clear line, after importing all it imports
    assert out["exit"] == 1 and "torch sees no CUDA device" in proc.stderr
    # the configs build the published models: 1.7B (tied), 8.2B, 30.5B total with 3.3B active (the input
    # embedding, 0.31B, is left out of active: a lookup)
    (total_1_7, active_1_7), (total_8, active_8), (total_30, active_30) = (
        out["params"][n] for n in ("qwen3-1.7b", "qwen3-8b", "qwen3-30b-a3b"))
    assert round(total_1_7 / 1e9, 2) == 1.72 and active_1_7 == total_1_7
    assert round(total_8 / 1e9, 2) == 8.19 and total_8 - active_8 == 151_936 * 4096
    assert round(total_30 / 1e9, 1) == 30.5 and 3.3e9 <= active_30 + 151_936 * 2048 < 3.4e9
