"""``echo2 bench learner``: its JSON interface on a tiny case, its step being the Learner's own, its targets'
verdicts, and the GPU path importing nothing but torch, transformers and the standard library.
No timing is asserted: the numbers are the benchmark's to print."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO

from echo2.bench import learner as bench
from echo2.bench.learner_steps import LEARNER_DEFAULTS, attention_flops, bench_learner, echo2_step, make_columns
from echo2.config import TrainConfig
from echo2.learner.learner import Learner

TINY = ["--vocab", "97", "--hidden", "16", "--prompt-tokens", "4", "--groups", "2", "--group-size", "2",
        "--micro-batch-tokens", "24", "--chunk-tokens", "16"]
KEYS = {"case", "tokens", "device", "device_name", "peak_mb", "tokens_per_s", "baseline_tokens_per_s",
        "padding_fraction", "seconds", "seconds_min", "mfu", "mfu_attention", "mfu_best", "mfu_attention_best",
        "peak_tflops", "peak_source"}


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
        # both MFU figures of the real learner's step, against this CPU's own measured matmul rate
        assert 0 < r["mfu"] < r["mfu_attention"] and r["seconds_min"] <= r["seconds"]
        assert r["device"] == "cpu" and r["peak_source"].startswith("measured")
    assert ran["baseline_peak_mb"] > 0 and ran["baseline_tokens_per_s"] > 0
    assert skipped["baseline_tokens_per_s"] is None and skipped["baseline_need_mb"] == need["mixed"]
    assert "case 8: baseline (1 rows per micro-batch)" in proc.stderr  # the micro-batch it ran at is said
    assert "case mixed: baseline not run" in proc.stderr


def test_the_bench_drives_the_real_learner_at_the_configs_defaults(tiny_model):
    """The bench's echo2 step is ``Learner.step_on_columns`` of a ``Learner`` built with TrainConfig's defaults (the
    bench's copy of them, for machines without pydantic, is theirs), on the device and dtype asked."""
    defaults = TrainConfig()
    assert {k: getattr(defaults, k) for k in LEARNER_DEFAULTS} == LEARNER_DEFAULTS
    learner = bench_learner(tiny_model, device="cpu", dtype="float32", micro_batch_tokens=24, chunk_tokens=16,
                            activation_checkpointing=True)
    assert type(learner) is Learner and learner.config.micro_batch_tokens == 24
    before = [p.detach().clone() for p in learner.model.parameters()]
    columns = make_columns(3, [2, 9, 30, 5, 1, 14, 7, 3, 11], 3, 300, seed=1)
    columns.reward[6:] = 0.5  # the third group carries no signal
    columns.completion_mask[::5] = 0  # and some tokens came from the environment
    stats = echo2_step(learner, columns)
    assert stats.micro_batches >= 3 and learner.version == 1
    assert not all(torch.equal(p, b) for p, b in zip(learner.model.parameters(), before))  # the step moved weights


def test_attention_flops_count_each_piece_causally():
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=2, num_attention_heads=4, head_dim=8, hidden_size=32)
    columns = make_columns(3, [2, 5], 2, 97, seed=0)  # one group: sequences of 3 + 2 - 1 = 4 and 3 + 5 - 1 = 7 tokens
    assert attention_flops(columns, config, share_prompts=False) == 6 * 2 * 4 * 8 * (4**2 + 7**2)
    # the shared prompt's prefix (2 tokens) once, each segment (2 and 5 tokens) over it and itself
    pairs = 2**2 / 2 + (2 * 2 + 2**2 / 2) + (5 * 2 + 5**2 / 2)
    assert attention_flops(columns, config, share_prompts=True) == 12 * 2 * 4 * 8 * pairs


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

    # a stock GPU image: torch, transformers, accelerate, peft, pyarrow, safetensors (no pydantic, cryptography...)
    HIDDEN = {"pydantic", "s3fs", "tenacity", "aiohttp", "zstandard", "cryptography", "pokerkit",
              "math_verify", "prefect", "gguf", "boto3", "botocore"}

    class NotInstalled(importlib.machinery.PathFinder):
        # these packages look absent, as on a GPU machine holding only torch and transformers
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in HIDDEN:
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [NotInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path]

    import tempfile
    from pathlib import Path
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
    with tempfile.TemporaryDirectory() as tmp:
        learner = bench.learner_state(opts, Path(tmp))
        steps = [bench.measure("echo2", case, opts, learner, None)["loss"],
                 bench.measure("baseline", case, opts, bench.baseline_state(opts), 2)["loss"]]
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
                                 "echo2.bench.learner_models", "echo2.bench.learner_report", "echo2.bench.learner_mfu",
                                 "echo2.learner", "echo2.learner.packing", "echo2.learner.logprobs",
                                 "echo2.learner.loss", "echo2.learner.learner", "echo2.learner.columns",
                                 "echo2.learner.model_load", "echo2.learner.fsdp_units",
                                 "echo2.learner.process_group", "echo2.learner.attention", "echo2.devices",
                                 "echo2.errors", "echo2.data", "echo2.data.lora",
                                 "echo2.learner.notice", "echo2.preemption"}  # signals deferred in a step
    assert "echo2.learner.learner" in out["echo2"]  # the real learner, not a copy of its step
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
