"""One short check of the learner on a GPU: correctness against references, then speed and memory.

    echo2 bench gpu-check --out DIR [--budget-s 480] [--model-config qwen3-1.7b] [--only step,varlen]
    python -m echo2.bench.gpu_check ...                        (the same, where only torch and transformers exist)
    python -m echo2.bench.gpu_check --tiny --device cpu         (seconds on a CPU: part of the test suite)

Everything runs through the real ``Learner`` (``echo2/learner/learner.py``) on random-weight models saved to a
folder in bf16 and loaded as a run loads its model: on a GPU that is FSDP2 over one rank with bf16 compute, varlen
attention over packs and checkpointed layers. Imports torch, transformers, accelerate, pyarrow, the standard
library and echo2's learner (a stock GPU image has them; pydantic and cryptography are not needed). Sections run
in order; each is timed, guarded (an exception is recorded as ERROR and the next section runs) and skipped once
``--budget-s`` is spent. Every result is one JSON line in DIR/gpu_check.jsonl and one line on stdout (PASS / FAIL /
INFO / SKIP / ERROR); the last line is ``SUMMARY PASS=.. FAIL=.. ERROR=.. SKIP=..`` (``gpu_check_record.py``).

    env       versions, the card, measured bf16 matmul TFLOP/s and copy GB/s (the real ceilings)
    head      the chunked head against a float64 reference: values and both gradients, fp32 and bf16
    packing   a packed row against each sequence alone, and no leak across sequences, in the learner's attention
    step      the learner's step (packs, chunked head, checkpointed layers; fp32 with TF32, and bf16) against the
              old step (each row alone, full logits, fp32 log-softmax, no checkpointing): loss, gradient norm,
              gradient direction
    varlen    the learner with sdpa (a dense block-diagonal mask per pack) against varlen on mixed lengths:
              agreement and speed-up (on a GPU torch's varlen flash attention; on a CPU sdpa per sequence)
    perf      tokens/s, MFU (6N, and 6N + attention) and peak memory of the learner's step at the model's shape:
              16 sequences of 8k tokens, and mixed lengths (64..4096)
    moe       2 layers of the Qwen3-30B-A3B shape: the step with autocast over fp32 experts (unsharded) against
              FSDP2's bf16 compute (experts in bf16): time of each
    fsdp      a checkpoint of the sharded learner (DCP) written and read back: every weight and moment equal

Tolerances: ``FP32`` and ``BF16`` below (the tests' own: tests/support/precision_step.py, docs/learner.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from echo2.bench.gpu_check_record import Check
from echo2.bench.learner_models import cpu_model_config, load_model_config, to_transformers
from echo2.bench.learner_steps import (
    LEARNER_DEFAULTS,
    LOSS,
    TEMPERATURE,
    _padded,
    _signal,
    attention_flops,
    bench_learner,
    computed_tokens,
    make_columns,
    save_random_model,
)
from echo2.learner.logprobs import chunked_token_logprobs
from echo2.learner.loss import policy_loss

BF16 = {"loss": 1e-2, "grad_norm": 1e-2, "cos": 0.99, "head_mean": 0.03, "head_grad": 0.02}
"""bf16 against fp32 (relative; cos: the gradients' cosine): tests/support/precision_step.py's BF16_TOLERANCE and
docs/learner.md's head bounds."""
FP32 = {"loss": 1e-4, "grad_norm": 1e-4, "grad": 1e-3, "head": 1e-4, "pack": 2e-4, "leak": 1e-5}
"""fp32 against the float64 head or the old fp32 step, on a CPU."""
TF32 = {"loss": 5e-3, "grad_norm": 5e-3, "grad": 2e-2, "pack": 2e-3, "leak": 1e-5}
"""fp32 with TF32 matmuls (what the learner runs for ``dtype: float32`` on a GPU: 10-bit mantissa inputs, fp32
accumulation) against the old step in full fp32."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, warmup: int = 1, reps: int = 2) -> list[float]:
    """Seconds of each of ``reps`` synchronized calls, after ``warmup``."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - start)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (float64 for small tensors, float32 for a whole model's gradient)."""
    dtype = torch.float64 if b.numel() < 2**27 else torch.float32
    a, b = a.to(dtype), b.to(dtype)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Models:
    """Random-weight models saved once per shape (bf16 on a GPU, as published models are), and learners on them."""

    def __init__(self, args, device: torch.device, tmp: Path):
        self.args, self.device, self.tmp = args, device, tmp
        self.dirs: dict[str, Path] = {}

    def config(self, name: str) -> dict:
        if self.args.tiny:
            small = cpu_model_config(vocab=512, hidden=64, layers=2)
            if name == "moe":
                small = load_model_config("qwen3-30b-a3b", layers=2)
                small.update(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_experts=8, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=32, bos_token_id=0, eos_token_id=1)
            return small
        if name == "moe":
            return load_model_config("qwen3-30b-a3b", layers=2)
        return load_model_config(self.args.model_config, layers=4 if name == "short" else None)

    def folder(self, name: str) -> Path:
        if name not in self.dirs:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
            self.dirs[name] = save_random_model(to_transformers(self.config(name)), self.tmp / name, dtype=dtype,
                                                seed=0)
        return self.dirs[name]

    def learner(self, name: str, *, dtype: str, attention: str = "auto", sharded: bool | None = None,
                micro_batch_tokens: int = 8192, checkpointing: bool = True):
        from echo2.learner.learner import Learner

        if sharded is None:
            return bench_learner(self.folder(name), device=str(self.device), dtype=dtype, attention=attention,
                                 micro_batch_tokens=micro_batch_tokens, chunk_tokens=self.chunk,
                                 activation_checkpointing=checkpointing)
        from echo2.bench.learner_steps import learner_settings

        settings = learner_settings(dtype=dtype, attention=attention,
                                    micro_batch_tokens=micro_batch_tokens, logprob_chunk_tokens=self.chunk,
                                    activation_checkpointing=checkpointing)
        return Learner(self.folder(name), settings, temperature=TEMPERATURE, device=str(self.device), sharded=sharded)

    @property
    def chunk(self) -> int:
        return 16 if self.args.tiny else 1024


def free(*objects) -> None:
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def captured_gradient(learner, columns) -> tuple[dict, dict[str, torch.Tensor]]:
    """The learner's step on ``columns``, and its gradient by parameter name as the optimizer received it."""
    grads: dict[str, torch.Tensor] = {}
    step = learner.optimizer.step

    def capture(*args, **kwargs):
        for name, p in learner.model.named_parameters():
            if p.grad is not None:
                grads[name] = whole(p.grad).detach().float().clone()
        return step(*args, **kwargs)

    learner.optimizer.step = capture
    try:
        metrics = learner.step_on_columns(columns)
    finally:
        learner.optimizer.step = step
    return metrics, grads


def reference_step(folder: Path, columns, device: torch.device) -> tuple[float, float, dict[str, torch.Tensor]]:
    """The old step: each row alone, full logits, fp32 log-softmax, fp32 weights, no checkpointing; (loss, gradient
    norm, gradient by name)."""
    from transformers import AutoModelForCausalLM

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # full fp32 matmuls, whatever a learner set before
    try:
        return _reference_step(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    device_map=str(device), use_kernels=False).eval(),
                               columns, device)
    finally:
        torch.set_float32_matmul_precision(precision)


def _reference_step(model, columns, device: torch.device) -> tuple[float, float, dict[str, torch.Tensor]]:
    advantages, keep, n_tokens = _signal(columns)
    loss = 0.0
    for i in keep:
        ids, attention, targets, mask, behavior = _padded(columns, [i], device)
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
        lp = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, targets[..., None]).squeeze(-1)
        terms = policy_loss(lp, behavior, advantages[[i]].to(device), mask, n_tokens=n_tokens, **LOSS)
        terms.loss.backward()
        loss += float(terms.loss.detach())
        del logits, lp
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    free(model)
    return loss, norm, grads


def compare(chk: Check, section: str, label: str, metrics: dict, grads: dict, ref: tuple, bounds: dict) -> None:
    ref_loss, ref_norm, ref_grads = ref
    names = sorted(set(grads) & set(ref_grads))
    # the optimizer received the clipped gradient: undo the clip (torch's coefficient) to compare it with the raw one
    clip = min(1.0, LEARNER_DEFAULTS["max_grad_norm"] / (metrics["grad_norm"] + 1e-6))
    mine = torch.cat([grads[n].reshape(-1) for n in names]) / clip
    theirs = torch.cat([ref_grads[n].reshape(-1) for n in names])
    loss_rel = abs(metrics["loss"] - ref_loss) / max(abs(ref_loss), 1e-30)
    norm_rel = abs(metrics["grad_norm"] - ref_norm) / max(ref_norm, 1e-30)
    chk.bound(section, f"{label}_loss_rel", loss_rel, bounds["loss"], loss=metrics["loss"], ref=ref_loss)
    chk.bound(section, f"{label}_grad_norm_rel", norm_rel, bounds["grad_norm"])
    if "grad" in bounds:
        chk.bound(section, f"{label}_grad_rel", rel(mine, theirs), bounds["grad"])
    else:
        cos = float(torch.dot(mine.double(), theirs.double()) / (mine.double().norm() * theirs.double().norm()))
        chk.bound(section, f"{label}_grad_cos", cos, bounds["cos"], above=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo2.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="folder of gpu_check.jsonl")
    parser.add_argument("--budget-s", type=float, default=480.0, help="sections after this are skipped")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-config", default="qwen3-1.7b")
    parser.add_argument("--tiny", action="store_true", help="tiny models and cases (a smoke run, seconds)")
    parser.add_argument("--only", default="", help="comma-separated sections to run (env always runs)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chk = Check(out, args.budget_s)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    tiny = args.tiny
    if tiny:
        torch.set_num_threads(1)
    sizes = dict(head_tokens=64 if tiny else 2048, pack=[7, 12, 3, 18, 5] if tiny else [700, 1200, 333, 1800, 97],
                 rows=[9, 30, 17, 4, 25, 11, 40, 6] if tiny else [300, 900, 620, 150, 1200, 480, 777, 64],
                 prompt=16 if tiny else 128, big=[48] * 4 if tiny else [8192] * 16, big_prompt=16 if tiny else 256,
                 mixed=(8, 64) if tiny else (64, 4096), budget=64 if tiny else 8192)
    work = tempfile.TemporaryDirectory(prefix="echo2-gpu-check-")
    models = Models(args, device, Path(work.name))
    state: dict = {}

    def env():
        import transformers

        from echo2.devices import device_name, peak_tflops_of_device

        info = dict(torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                    python=sys.version.split()[0], device=device_name(device))
        size = 512 if tiny else 8192
        dtype = torch.bfloat16 if cuda else torch.float32
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn_like(a)
        info["matmul_tflops"] = round(2 * size**3 / min(timed(lambda: a @ b, device, 2, 5)) / 1e12, 3)
        if cuda:
            p = torch.cuda.get_device_properties(device)
            info.update(mem_gib=round(p.total_memory / 2**30, 1), capability=torch.cuda.get_device_capability(device),
                        datasheet_bf16_tflops=peak_tflops_of_device(p.name))
            x = torch.empty(2**30, dtype=torch.uint8, device=device)
            y = torch.empty_like(x)
            info["copy_gbs"] = round(2 * x.numel() / min(timed(lambda: y.copy_(x), device, 2, 5)) / 1e9, 1)
        state["matmul_tflops"] = info["matmul_tflops"]
        chk.record("env", "versions", "INFO", **info)

    def head():
        config = models.config("short")
        V, H, T = config["vocab_size"], config["hidden_size"], sizes["head_tokens"]
        gen = torch.Generator(device=device).manual_seed(1)
        hidden = torch.randn(T, H, device=device, generator=gen)
        weight = torch.randn(V, H, device=device, generator=gen) * H**-0.5
        y = torch.randint(0, V, (T,), device=device, generator=gen)
        g = torch.randn(T, device=device, generator=gen)
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        ref = torch.log_softmax(h64 @ w64.t() / TEMPERATURE, -1).gather(1, y[:, None]).squeeze(1)
        (ref * g.double()).sum().backward()
        ref = ref.detach()
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            h, w = (t.detach().to(dtype).clone().requires_grad_() for t in (hidden, weight))
            out = chunked_token_logprobs(h, w, y, TEMPERATURE, models.chunk // 2 + 3)  # a chunk that does not divide
            (out * g).sum().backward()
            err = (out.detach().double() - ref).abs()
            gh, gw = rel(h.grad, h64.grad), rel(w.grad, w64.grad)
            if name == "fp32":
                chk.bound("head", "fp32_value_max", float(err.max()), FP32["head"])
                chk.bound("head", "fp32_grads_rel", max(gh, gw), FP32["head"], hidden=gh, weight=gw)
            else:
                chk.bound("head", "bf16_value_mean", float(err.mean()), BF16["head_mean"], max=float(err.max()))
                chk.bound("head", "bf16_grads_rel", max(gh, gw), BF16["head_grad"], hidden=gh, weight=gw)

    def packing():
        gen = torch.Generator().manual_seed(2)
        V = models.config("short")["vocab_size"]
        lengths = sizes["pack"]
        columns = make_columns(1, lengths, len(lengths), V, seed=2)  # one-token prompts: sequences of these lengths
        rows = list(range(len(lengths)))
        for label, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
            learner = models.learner("short", dtype=dtype)
            batch = learner._pack(columns, rows, torch.zeros(len(rows)))
            with torch.no_grad():
                packed = _all_logprobs(learner, batch)
                alone = torch.cat([_all_logprobs(learner, learner._pack(columns, [r], torch.zeros(len(rows))))
                                   for r in rows])
                d = (packed - alone).abs()
                if label == "fp32":
                    chk.bound("packing", "fp32_packed_vs_alone_max", float(d.max()), (TF32 if cuda else FP32)["pack"],
                              attention=learner.attention)
                    changed = learner._pack(columns, rows, torch.zeros(len(rows)))
                    prefix, segments = changed.layout[0]
                    first = prefix + segments[0]  # the shared prefix and the first row's segment
                    changed.input_ids[0, :first] = torch.randint(0, V, (first,), generator=gen).to(device)
                    other = _all_logprobs(learner, changed)
                    chk.bound("packing", "fp32_no_leak_max", float((other[first:] - packed[first:]).abs().max()),
                              FP32["leak"])
                else:
                    chk.bound("packing", "bf16_packed_vs_alone_mean", float(d.mean()), BF16["head_mean"],
                              max=float(d.max()))
            free(learner)

    def step():
        V = models.config("short")["vocab_size"]
        columns = make_columns(sizes["prompt"], sizes["rows"], 4, V, seed=3)
        ref = reference_step(models.folder("short"), columns, device)
        budget = max(sizes["rows"]) + sizes["prompt"] + 50  # several packs, several sequences in most
        for label, dtype, bounds in (("fp32", "float32", TF32 if cuda else FP32), ("bf16", "bfloat16", BF16)):
            learner = models.learner("short", dtype=dtype, micro_batch_tokens=budget)
            metrics, grads = captured_gradient(learner, columns)
            compare(chk, "step", label, metrics, grads, ref,
                    {k: bounds[k] for k in ("loss", "grad_norm", "grad" if label == "fp32" else "cos")})
            free(learner, grads)

    def varlen():
        rng = random.Random(0)
        mixed = [rng.randint(*sizes["mixed"]) for _ in range(16)]
        columns = make_columns(sizes["big_prompt"], mixed, 8, models.config("full")["vocab_size"], seed=0)
        results = {}
        for attention in ("sdpa", "varlen"):  # on a CPU, varlen is sdpa sequence by sequence (exact, no mask)
            learner = models.learner("full", dtype="bfloat16", attention=attention)
            seconds = timed(lambda: learner.step_on_columns(columns), device, 1, 2)
            batch = learner._pack(columns, list(range(4)), torch.zeros(columns.num_rows))
            with torch.no_grad():  # the completions' targets: sdpa lays a shared prompt out once per row, varlen once
                policy = _all_logprobs(learner, batch)[batch.mask[0] > 0]
                results[attention] = (min(seconds), policy.float())
            free(learner)
        d = (results["sdpa"][1] - results["varlen"][1]).abs()
        chk.bound("varlen", "bf16_vs_sdpa_mean", float(d.mean()), BF16["head_mean"], max=float(d.max()))
        chk.record("varlen", "speedup", "INFO", value=results["sdpa"][0] / results["varlen"][0],
                   sdpa_s=results["sdpa"][0], varlen_s=results["varlen"][0])

    def perf():
        from echo2.bench.learner_steps import active_parameters
        from echo2.devices import peak_tflops_of_device

        learner = models.learner("full", dtype="bfloat16" if cuda else "float32", micro_batch_tokens=sizes["budget"])
        lm = learner.policy_lm(learner.model)
        active = active_parameters(lm)
        peak = peak_tflops_of_device(torch.cuda.get_device_name(device)) if cuda else state.get("matmul_tflops")
        rng = random.Random(0)
        cases = {"8k": (sizes["big"], sizes["big_prompt"]),
                 "mixed": ([rng.randint(*sizes["mixed"]) for _ in range(16)], sizes["big_prompt"])}
        for case, (lengths, prompt) in cases.items():
            columns = make_columns(prompt, lengths, 8 if len(lengths) >= 8 else 2, lm.config.vocab_size, seed=0)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            seconds = timed(lambda: learner.step_on_columns(columns), device, 1, 3 if cuda else 1)
            tokens = computed_tokens(learner, columns)  # what the model ran on: a group's shared prompt once
            dense = 6.0 * active * tokens
            attention = attention_flops(columns, lm.config, share_prompts=learner.shares_prompts)
            median = sorted(seconds)[len(seconds) // 2]
            values = dict(tokens=tokens, seconds_median=median, seconds_min=min(seconds),
                          tokens_per_s=tokens / median, attention_share=attention / (dense + attention))
            if peak:
                values.update(mfu=dense / median / (peak * 1e12),
                              mfu_attention=(dense + attention) / median / (peak * 1e12),
                              mfu_best=dense / min(seconds) / (peak * 1e12),
                              mfu_vs_measured_matmul=dense / median / (state.get("matmul_tflops", peak) * 1e12))
            if cuda:
                values["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            chk.record("perf", case, "INFO", **values)
        free(learner)

    def moe():
        rng = random.Random(1)
        lengths = [rng.randint(*sizes["mixed"]) for _ in range(8)]
        columns = make_columns(sizes["prompt"], lengths, 4, models.config("moe")["vocab_size"], seed=1)
        info = {}
        for label, sharded in (("autocast_fp32_experts", False), ("fsdp_bf16_experts", True)):
            learner = models.learner("moe", dtype="bfloat16", sharded=sharded, checkpointing=False)
            try:
                info[f"{label}_s"] = min(timed(lambda: learner.step_on_columns(columns), device, 1, 2))
            except Exception as exc:
                info[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            free(learner)
            _leave_group()
        if "autocast_fp32_experts_s" in info and "fsdp_bf16_experts_s" in info:
            info["fp32_expert_slowdown"] = info["autocast_fp32_experts_s"] / info["fsdp_bf16_experts_s"]
        chk.record("moe", "qwen3_30b_a3b_2_layers", "INFO", tokens=sum(lengths), **info)

    def fsdp():
        import torch.distributed.checkpoint as dcp

        learner = models.learner("short", dtype="bfloat16" if cuda else "float32", sharded=True)
        columns = make_columns(sizes["prompt"], sizes["rows"][:4], 2, models.config("short")["vocab_size"], seed=5)
        learner.step_on_columns(columns)  # AdamW moments that are not zero
        saved = learner.sharded_state()
        wanted = {k: whole(v).detach().clone() for k, v in _tensors(saved)}
        with tempfile.TemporaryDirectory() as tmp:
            dcp.save(saved, checkpoint_id=tmp)
            learner.step_on_columns(columns)  # move on, then read the checkpoint back
            state_now = learner.sharded_state()
            dcp.load(state_now, checkpoint_id=tmp)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(learner.model, learner.optimizer, model_state_dict=state_now["model"],
                           optim_state_dict=state_now["optim"], options=StateDictOptions(strict=False))
        after = dict(_tensors(learner.sharded_state()))
        worst = max(float((whole(after[k]).float() - v.float()).abs().max()) for k, v in wanted.items())
        chk.bound("fsdp", "dcp_roundtrip_max", worst, 0.0, tensors=len(wanted), sharded=learner.sharded)
        free(learner)
        _leave_group()

    only = {name for name in args.only.split(",") if name}
    sections = (("env", env), ("head", head), ("packing", packing), ("step", step), ("varlen", varlen),
                ("perf", perf), ("moe", moe), ("fsdp", fsdp))
    try:
        for name, fn in sections:
            if not only or name in only | {"env"}:
                chk.run(name, fn)
    finally:
        _leave_group()
        work.cleanup()
    print(chk.summary(), flush=True)
    for r in chk.rows:
        if r["verdict"] in ("FAIL", "ERROR"):
            print("  ", json.dumps({k: v for k, v in r.items() if k != "traceback"}, default=str)[:400])
    return 1 if any(r["verdict"] in ("FAIL", "ERROR") for r in chk.rows) else 0


def _all_logprobs(learner, batch) -> torch.Tensor:
    """Every position's target log-probability of a pack (each position's target is its own sequence's next token),
    under the learner's own attention and compute dtype."""
    batch.weighed = torch.arange(batch.tokens, device=batch.input_ids.device)
    return learner._logprobs(learner.policy, batch)[0].float()


def _tensors(state: dict, prefix: str = ""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _tensors(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


def _leave_group() -> None:
    """Take down the one-rank group a sharded learner made, so the next learner starts as a fresh process would."""
    import torch.distributed as dist

    from echo2.learner import process_group

    if dist.is_initialized():
        dist.destroy_process_group()
    process_group._control = None


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
