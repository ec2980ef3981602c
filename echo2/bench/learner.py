"""``echo2 bench learner``: the learner's training step against its old padded full-logits step.

Cases: a step of ``groups`` x ``group_size`` rows (2 x 8), each a ``prompt_tokens`` (256) prompt shared by its
group and a completion of 512, 2,048 or 8,192 tokens, and a mixed step whose completion lengths are uniform in
64..4,096 (seeded), the one that looks like RL. Per case, side by side in one run: echo2's step, which is the real
``Learner`` (``learner_steps.py``: a random-weight model saved to a folder, loaded as a run loads its model, then
``Learner.step_on_columns``), and the baseline, each with its peak memory above the model and optimizer, tokens per
second (prompt and completion tokens of the step over the median step's wall time) and padding share (positions
run on that held no token).

Model. On the CPU: a random-weight Qwen3 (transformers' ``Qwen3Config``) with Qwen3's vocabulary, 151,936,
and a small body (2 layers, hidden size 128), so that the vocabulary term dominates memory and time as it
does at scale. With ``--device cuda --model-config NAME``: a real architecture at random weights from
``learner_configs/NAME.json``, saved in bf16; the learner then runs as on any GPU (FSDP2 over one rank, bf16
compute over fp32 master weights, varlen attention over packs) with every decoder layer checkpointed. The configs
are the published ``config.json`` numbers of Qwen/Qwen3-1.7B, Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B (as their model
cards list them: 1.7B = 28 layers, 16 query / 8 KV heads, tied embeddings; 8B = 36 layers, 32 / 8, untied;
30B-A3B = 48 layers, 32 / 4, 128 experts of 768, 8 active); tests/e2e/test_bench_learner.py checks that each builds a
model of the published parameter count (1.7B, 8.2B, 30.5B total with 3.3B active).

Memory. On the CPU each variant of each case runs in a fresh child process (``python -m echo2.bench.learner
--child``): it builds the model, allocates the gradients and AdamW's state, reads its resident set size, resets the
kernel's high-water mark (``/proc/self/clear_refs``, 5), runs the step(s) and reports the high-water mark minus that
resident size: what the step added on top of the model, gradients and optimizer (where the reset is refused,
``ru_maxrss`` stands in and also counts the set-up's own transients). ``total_peak_mb`` is the whole process's
high-water mark. On a GPU one process runs echo2's learner over every case, frees it, then runs the baseline, and
the same two numbers come from ``torch.cuda.max_memory_allocated`` (reset before each variant) and
``gpu_peak_mb``. MB here is 2**20 bytes.

The baseline's micro-batch. The old learner took ``micro_batch_size`` rows at a time (16 by default, the
whole step, which no case here fits). The bench takes the largest power of two rows whose estimated need
fits ``--memory-budget-mb`` (default: 60% of the memory available at start, 85% of the GPU's free memory),
unless ``--baseline-micro-batch`` fixes it, and says which. Estimate of one micro-batch: rows x width x
(vocabulary x 16 bytes: four fp32 copies of the logits, the logits, their log-softmax and the two gradients,
an upper bound since they are not all alive at once) + activations. A case whose baseline does not fit even
one row at a time (or the size asked for) is not run: ``baseline_need_mb`` says what it would need.

echo2's settings. On the CPU: packs of at most 4,096 tokens and log-probability chunks of 128 tokens (the
learner's defaults are 8,192 and 1,024): sdpa's block-diagonal mask over a pack is N x N, and a chunk's
logits are chunk x vocabulary x 4 bytes, so both set memory here. On a GPU: the learner's defaults.
``--micro-batch-tokens`` and ``--chunk-tokens`` change them; the output names those used.

MFU (echo2's step, ``learner_mfu.py``): ``mfu`` = 6 x active parameters (``learner_steps.active_parameters``) x the
tokens the model ran on (``computed_tokens``: a group's shared prompt once) / seconds / the device's peak, and
``mfu_attention`` adds causal attention's own FLOPs (``learner_steps.attention_flops``, piece by piece), both at the
median step (``_best``: at the fastest); ``tokens_per_s`` counts the step's sequences' tokens, as the baseline's does.
The peak is the GPU's dense bf16 datasheet figure (``echo2.devices.PEAK_BF16_TFLOPS``), or on a CPU the rate of a
dense matmul measured in the compute dtype (``peak_source`` says which; ``device_name`` names the card). The GPU
path imports torch, transformers, accelerate, pyarrow, the standard library and echo2's learner, nothing else
(tests/e2e/test_bench_learner.py runs it with the others blocked): run it where only those exist as
``python -m echo2.bench.learner --device cuda --model-config qwen3-1.7b``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from echo2.bench.learner_mfu import flops_figures, peak_of
from echo2.bench.learner_models import MODEL_CONFIGS, QWEN3_VOCAB, cpu_model_config, load_model_config, to_transformers
from echo2.bench.learner_report import describe, json_object, plain_table, target_lines


@dataclass
class Case:
    name: str
    prompt_tokens: int
    completion_lengths: list[int]
    group_size: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens * len(self.completion_lengths) + sum(self.completion_lengths)


@dataclass
class Options:
    model_config: dict
    """A transformers config as a dict (``model_type`` and its fields)."""
    device: str = "cpu"
    micro_batch_tokens: int = 4096
    chunk_tokens: int = 128
    baseline_micro_batch: int | None = None
    memory_budget_mb: float | None = None
    steps: int = 1
    warmup: int = 0
    seed: int = 0
    bf16_checkpointed: bool = False
    """bf16 autocast over fp32 weights and per-layer activation checkpointing (the GPU path's settings)."""


def make_cases(*, completion_tokens: list[int], mixed: tuple[int, int] | None, prompt_tokens: int = 256,
               groups: int = 2, group_size: int = 8, seed: int = 0) -> list[Case]:
    rows = groups * group_size
    cases = [Case(str(n), prompt_tokens, [n] * rows, group_size) for n in completion_tokens]
    if mixed is not None:
        rng = random.Random(seed)
        cases.append(Case("mixed", prompt_tokens, [rng.randint(*mixed) for _ in range(rows)], group_size))
    # smallest first: a run cut short (an interrupt prints what is done) has the cheap cases
    return sorted(cases, key=lambda case: case.tokens)


# -- the baseline's memory -----------------------------------------------------------------------------
def baseline_need_mb(case: Case, rows: int, config: dict, *, checkpointed: bool) -> float:
    """Estimated peak above the model of the baseline at ``rows`` rows per micro-batch (module docstring)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    inner = config.get("moe_intermediate_size", 0) * config.get("num_experts_per_tok", 0) or config["intermediate_size"]
    per_layer = 16 * hidden + 4 * inner  # fp32 bytes / 4 kept per token by one layer for backward, roughly
    act = 4 * (layers * hidden + per_layer) if checkpointed else 4 * layers * per_layer
    widths = sorted(case.prompt_tokens + n for n in case.completion_lengths)
    worst = max(len(widths[s : s + rows]) * widths[s : s + rows][-1] for s in range(0, len(widths), rows))
    return worst * (config["vocab_size"] * 16 + act) / 2**20


def baseline_plan(case: Case, config: dict, budget_mb: float, forced: int | None, *,
                  checkpointed: bool) -> tuple[int | None, float]:
    """(rows per micro-batch or None when it does not fit, the estimated need at that size or at 1 row)."""
    sizes = [forced] if forced else [2**k for k in range(int(math.log2(len(case.completion_lengths))), -1, -1)]
    for rows in sizes:
        need = baseline_need_mb(case, rows, config, checkpointed=checkpointed)
        if need <= budget_mb:
            return rows, need
    return None, need


# -- measuring one variant -----------------------------------------------------------------------------
def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def measure(variant: str, case: Case, opts: Options, state, rows: int | None) -> dict:
    """Run ``opts.warmup`` then ``opts.steps`` steps of ``variant`` (``state``: the learner for echo2, the model and
    optimizer for the baseline); each measured step's seconds and the peak memory."""
    import torch

    from echo2.bench.learner_steps import baseline_step, echo2_step, make_columns

    device = torch.device(opts.device)
    dtype = torch.bfloat16 if opts.bf16_checkpointed else torch.float32
    columns = make_columns(case.prompt_tokens, case.completion_lengths, case.group_size,
                           opts.model_config["vocab_size"], opts.seed)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        setup_mb = torch.cuda.memory_allocated() / 2**20
    else:
        setup_mb, exact = _status_mb("VmRSS"), _reset_peak_rss()
    seconds = []
    for i in range(opts.warmup + opts.steps):
        start = time.perf_counter()
        if variant == "echo2":
            stats = echo2_step(state, columns)  # the learner reads its numbers back once: the step has ended
        else:
            stats = baseline_step(*state, columns, micro_batch_rows=rows, dtype=dtype)
        if cuda:
            torch.cuda.synchronize()
        if i >= opts.warmup:
            seconds.append(time.perf_counter() - start)
    if cuda:
        total = torch.cuda.max_memory_allocated() / 2**20
        method = "torch.cuda.max_memory_allocated"
    else:
        total = _status_mb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        method = "VmHWM after clear_refs" if exact else "ru_maxrss (no reset: includes set-up)"
    median = statistics.median(seconds)
    return {"seconds": median, "seconds_min": min(seconds), "tokens_per_s": case.tokens / median,
            "peak_mb": total - setup_mb, "total_peak_mb": total, "padding_fraction": stats.padding_fraction,
            "micro_batches": stats.micro_batches, "loss": stats.loss, "memory_method": method}


def learner_state(opts: Options, workdir: Path):
    """The real learner (echo2's variant) on a random model of ``opts.model_config`` saved under ``workdir``."""
    import torch

    from echo2.bench.learner_steps import bench_learner, save_random_model

    cuda = opts.device == "cuda"
    model_dir = save_random_model(to_transformers(opts.model_config), workdir / "model",
                                  dtype=torch.bfloat16 if cuda else torch.float32, seed=opts.seed)
    return bench_learner(model_dir, device=opts.device, dtype="bfloat16" if opts.bf16_checkpointed else "float32",
                         micro_batch_tokens=opts.micro_batch_tokens, chunk_tokens=opts.chunk_tokens,
                         activation_checkpointing=opts.bf16_checkpointed)


def baseline_state(opts: Options):
    """The baseline's model (fp32 master weights) with its gradients and AdamW state."""
    import torch

    from echo2.bench.learner_steps import build_model, make_optimizer

    model = build_model(to_transformers(opts.model_config), device=torch.device(opts.device),
                        activation_checkpointing=opts.bf16_checkpointed, seed=opts.seed)
    return model, make_optimizer(model)


def _refuse_what_cannot_fit(opts: Options, device_mb: float) -> None:
    """One clear line where fp32 weights, gradients and AdamW's two moments (16 bytes a parameter; FSDP2 gathers
    bf16 copies one layer at a time) alone exceed 90% of the GPU: Qwen3-8B's 131 GB on an 80 GB H100, 30B-A3B's
    488 GB anywhere (one process holds it all; the distributed learner shards it over its ranks)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel()
                     for p in AutoModelForCausalLM.from_config(to_transformers(opts.model_config)).parameters())
    need = 16 * params / 2**20
    if need > 0.9 * device_mb:
        layers = opts.model_config["num_hidden_layers"]
        fit = max(1, int(layers * 0.6 * device_mb / need))
        raise RuntimeError(f"{params / 1e9:.1f}B parameters need {need / 1024:.0f} GB for fp32 weights, gradients "
                           f"and AdamW state, more than this GPU's {device_mb / 1024:.0f} GB holds "
                           f"(one process, no sharding): try --layers {fit} (of {layers}) for the same shape truncated")


def child_main(spec: dict) -> None:
    """One variant of one case in this fresh process: prints its measurement as one JSON line."""
    opts, case = Options(**spec["options"]), Case(**spec["case"])
    with tempfile.TemporaryDirectory(prefix="echo2-bench-") as tmp:
        if spec["variant"] == "echo2":
            learner = learner_state(opts, Path(tmp))
            result = measure("echo2", case, opts, learner, None)
            result.update(flops_figures(learner, case, opts, result))
        else:
            result = measure("baseline", case, opts, baseline_state(opts), spec["rows"])
    print(json.dumps(result), flush=True)


def _in_child(variant: str, case: Case, opts: Options, rows: int | None) -> dict:
    spec = json.dumps({"variant": variant, "case": asdict(case), "options": asdict(opts), "rows": rows})
    proc = subprocess.run([sys.executable, "-m", "echo2.bench.learner", "--child", spec], capture_output=True,
                          text=True)
    if proc.returncode == -9 and variant == "baseline":
        return {"killed": True}  # SIGKILL: the kernel's OOM killer, most likely; the caller reports the need
    if proc.returncode != 0:
        raise RuntimeError(f"the {variant} step of case {case.name} failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gpu_baseline(case: Case, opts: Options, state: tuple, rows: int) -> dict:
    """The baseline on the GPU, or ``{"killed": True}`` when it runs out of memory (the estimate is rough)."""
    import torch

    try:
        return measure("baseline", case, opts, state, rows)
    except torch.cuda.OutOfMemoryError:
        state[1].zero_grad(set_to_none=False)  # what the failed step accumulated; no weight moved
        torch.cuda.empty_cache()
        return {"killed": True}


# -- the run -------------------------------------------------------------------------------------------
_ECHO2_KEYS = ("peak_mb", "total_peak_mb", "tokens_per_s", "seconds", "seconds_min", "padding_fraction",
               "micro_batches", "memory_method", "mfu", "mfu_attention", "mfu_best", "mfu_attention_best",
               "peak_tflops", "peak_source", "device_name", "attention_flops_share")


def run_learner_bench(cases: list[Case], opts: Options, progress=lambda line: None,
                      results: list[dict] | None = None) -> list[dict]:
    """Every case, echo2's step (the real learner) then the baseline's (or its estimated need); one dict per case,
    appended to ``results`` as each case ends (a caller interrupted midway keeps the cases done). On the CPU each
    variant of each case runs in a fresh process; on a GPU one process runs echo2's learner over every case, then
    frees it and runs the baseline's model over every case."""
    cuda = opts.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device here")
        _refuse_what_cannot_fit(opts, torch.cuda.get_device_properties(0).total_memory / 2**20)
        budget = opts.memory_budget_mb or 0.85 * torch.cuda.mem_get_info()[0] / 2**20
    else:
        budget = opts.memory_budget_mb or 0.6 * _available_mb()
    progress(f"baseline memory budget {budget:.0f} MB; echo2: micro_batch_tokens {opts.micro_batch_tokens}, "
             f"logprob chunk {opts.chunk_tokens} tokens")
    mine = _gpu_echo2(cases, opts, progress) if cuda else {}
    results = [] if results is None else results
    baseline = baseline_state(opts) if cuda else None
    for case in cases:
        rows, need = baseline_plan(case, opts.model_config, budget, opts.baseline_micro_batch,
                                   checkpointed=opts.bf16_checkpointed)
        ours = mine[case.name] if cuda else _in_child("echo2", case, opts, None)
        mfu = f", MFU {ours['mfu']:.1%} ({ours['mfu_attention']:.1%} with attention)" if ours.get("mfu") else ""
        progress(f"case {case.name}: echo2 {ours['seconds']:.2f} s, {ours['tokens_per_s']:.0f} tokens/s, "
                 f"peak +{ours['peak_mb']:.0f} MB{mfu}")
        r = {"case": case.name, "tokens": case.tokens, "device": opts.device,
             **{k: ours[k] for k in _ECHO2_KEYS if k in ours}, "baseline_micro_batch": rows,
             "baseline_estimate_mb": need}
        if cuda:
            r["gpu_peak_mb"] = ours["total_peak_mb"]
        base = None
        if rows is None:
            progress(f"case {case.name}: baseline not run: needs ~{need:.0f} MB, budget {budget:.0f} MB")
        else:
            base = _gpu_baseline(case, opts, baseline, rows) if cuda else _in_child("baseline", case, opts, rows)
            if base.get("killed"):
                progress(f"case {case.name}: baseline ({rows} rows per micro-batch) ran out of memory "
                         f"(killed): needs ~{need:.0f} MB")
                base = None
        if base is None:
            r.update(baseline_need_mb=need, baseline_tokens_per_s=None)
        else:
            progress(f"case {case.name}: baseline ({rows} rows per micro-batch) {base['seconds']:.2f} s, "
                     f"{base['tokens_per_s']:.0f} tokens/s, peak +{base['peak_mb']:.0f} MB")
            r.update(baseline_peak_mb=base["peak_mb"], baseline_tokens_per_s=base["tokens_per_s"],
                     baseline_padding_fraction=base["padding_fraction"])
        results.append(r)
    return results


def _gpu_echo2(cases: list[Case], opts: Options, progress) -> dict[str, dict]:
    """echo2's variant of every case with one learner on the GPU, which is then freed for the baseline."""
    import gc

    import torch

    with tempfile.TemporaryDirectory(prefix="echo2-bench-") as tmp:
        learner = learner_state(opts, Path(tmp))
        peak, source, name = peak_of(learner.device, learner.dtype)
        progress(f"{name}: bf16 peak {f'{peak:g} TFLOP/s ({source})' if peak else 'unknown (no MFU)'}")
        out = {}
        for case in cases:
            result = measure("echo2", case, opts, learner, None)
            out[case.name] = {**result, **flops_figures(learner, case, opts, result)}
    del learner
    gc.collect()
    torch.cuda.empty_cache()
    return out


# -- command line (the CLI's `echo2 bench learner` calls the same functions) ------------------------------
def parse_range(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    low, _, high = text.partition("..")
    if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
        raise ValueError(f"--mixed takes LOW..HIGH completion tokens (or none), not {text!r}")
    return int(low), int(high)


def build(*, device: str, model_config: str | None, layers: int | None, vocab: int, hidden: int,
          completion_tokens: list[int], mixed: str, cases: list[str] | None, prompt_tokens: int, groups: int,
          group_size: int, micro_batch_tokens: int | None, chunk_tokens: int | None, baseline_micro_batch: int | None,
          memory_budget_mb: float | None, steps: int | None, warmup: int | None,
          seed: int) -> tuple[list[Case], Options]:
    """Cases and options from the command line's values (shared by ``main`` and ``echo2 bench learner``)."""
    cuda = device == "cuda"
    if group_size < 2:
        raise ValueError("--group-size must be at least 2: a group of one has no signal (advantage 0), so the "
                         "learner would leave its rows out and train on nothing")
    if model_config is not None and not cuda:
        raise ValueError("--model-config runs a real architecture: only with --device cuda")
    config = (load_model_config(model_config, layers=layers) if model_config
              else cpu_model_config(vocab=vocab, hidden=hidden))
    all_cases = make_cases(completion_tokens=completion_tokens, mixed=parse_range(mixed), prompt_tokens=prompt_tokens,
                           groups=groups, group_size=group_size, seed=seed)
    chosen = [c for c in all_cases if not cases or c.name in cases]
    if not chosen:
        raise ValueError(f"no case named {', '.join(cases)}: the cases are {', '.join(c.name for c in all_cases)}")
    # CPU defaults: packs of 4,096 tokens (sdpa's block-diagonal mask of a pack is N x N) and chunks of 128
    # tokens (less memory than the learner's 1,024, and no slower here); GPU: the learner's defaults
    opts = Options(model_config=config, device=device,
                   micro_batch_tokens=micro_batch_tokens or (8192 if cuda else 4096),
                   chunk_tokens=chunk_tokens or (1024 if cuda else 128), baseline_micro_batch=baseline_micro_batch,
                   memory_budget_mb=memory_budget_mb, steps=steps or (5 if cuda else 3),
                   warmup=warmup if warmup is not None else (1 if cuda else 0), seed=seed, bf16_checkpointed=cuda)
    return chosen, opts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m echo2.bench.learner", description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model-config", choices=MODEL_CONFIGS)
    parser.add_argument("--layers", type=int, help="with --model-config: keep only this many decoder layers")
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB, help="CPU model's vocabulary")
    parser.add_argument("--hidden", type=int, default=128, help="CPU model's hidden size")
    parser.add_argument("--completion-tokens", type=int, action="append",
                        help="fixed-length cases (default 512 2048 8192)")
    parser.add_argument("--mixed", default="64..4096", help="LOW..HIGH completion tokens of the mixed case, or none")
    parser.add_argument("--cases", action="append", help="run only these cases (names as printed)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int,
                        help="echo2's token budget (default 4096 on CPU, 8192 on GPU)")
    parser.add_argument("--chunk-tokens", type=int, help="echo2's logprob chunk (default 128 on CPU, 1024 on GPU)")
    parser.add_argument("--baseline-micro-batch", type=int,
                        help="baseline rows per micro-batch (default: largest that fits)")
    parser.add_argument("--memory-budget-mb", type=float)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per case")
    args = parser.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return
    try:
        cases, opts = build(device=args.device, model_config=args.model_config, layers=args.layers, vocab=args.vocab,
                            hidden=args.hidden, completion_tokens=args.completion_tokens or [512, 2048, 8192],
                            mixed=args.mixed, cases=args.cases, prompt_tokens=args.prompt_tokens, groups=args.groups,
                            group_size=args.group_size, micro_batch_tokens=args.micro_batch_tokens,
                            chunk_tokens=args.chunk_tokens, baseline_micro_batch=args.baseline_micro_batch,
                            memory_budget_mb=args.memory_budget_mb, steps=args.steps, warmup=args.warmup,
                            seed=args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(run_and_report(cases, opts, as_json=args.json, model_config=args.model_config,
                                    table=lambda results: print(plain_table(results))))


def run_and_report(cases: list[Case], opts: Options, *, as_json: bool, model_config: str | None, table) -> int:
    """Run, then JSON lines or ``table(results)`` on stdout and the targets (on stderr under --json); the exit
    code. An interrupt or a failed step still reports the cases done."""
    results, code = [], 0
    try:
        run_learner_bench(cases, opts, progress=lambda line: print(line, file=sys.stderr, flush=True), results=results)
    except KeyboardInterrupt:
        print(f"interrupted: cases not run: {', '.join(c.name for c in cases[len(results):])}", file=sys.stderr)
        code = 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    for r in results:
        if as_json:
            print(json.dumps(json_object(r)), flush=True)
    if not as_json:
        print(describe(opts, results))
        table(results)
    for line in target_lines(results, cuda=opts.device == "cuda", model_config=model_config):
        print(line, file=sys.stderr if as_json else sys.stdout)
    return code


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
