"""Refill benchmark: rollout throughput with ``rollout.refill`` against batch by batch, side by side, on completions
of mixed lengths.

    echo2 bench refill [--groups N] [--group-size G] [--groups-per-batch B] [--max-new-tokens M] [--mean-tokens L]

Workload: the tiny random Llama (``tiny_model.py``) in the transformers engine on this machine's device, with its
end-of-sequence logit raised (a forward hook on the output layer, the same in both modes) so that a completion
ends after a geometric number of tokens of mean about L, or is cut at M: a long tail, as RL completions have.
The same N arithmetic prompts, G completions each, in both modes:

    batch   today's actor: B groups per ``generate`` call (batch_size B x G rows), one call after another
    refill  one ``generate_stream`` over the N groups, at most B in flight, B slots of G rows

Reported per mode: completion tokens per second (sampled tokens, padding not counted), groups per second, the
mean completion length, and the ratio refill / batch of tokens per second. The modes alternate order over the
repeats (batch first, then refill first, ...) and the median of the per-repeat ratios is the result. Sampling
differs between the modes (other rows share a step), so lengths differ a little; tokens per second is the
figure that does not depend on them. Timings only: exactness is the tests' (``tests/unit/rollout/test_refill.py``).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from echo2.bench.tiny_model import make_tiny_model
from echo2.rollout.engines.base import Completion, SamplingParams


@dataclass(frozen=True)
class Settings:
    groups: int = 256
    group_size: int = 4
    groups_per_batch: int = 8
    max_new_tokens: int = 64
    mean_tokens: float = 16.0
    """Mean completion length the raised end-of-sequence logit aims at (before the cut at max_new_tokens)."""
    repeats: int = 3
    threads: int = 1
    """torch threads (an actor's default, ``rollout.num_threads``)."""
    seed: int = 0


def eos_boost(vocab: int, mean_tokens: float) -> float:
    """The logit added to end-of-sequence so that, with the random model's near-uniform logits over ``vocab``
    tokens, it is drawn with probability 1 / ``mean_tokens`` per step."""
    p = 1.0 / mean_tokens
    return math.log(p * (vocab - 1) / (1 - p))


def _engine(model_dir: Path, settings: Settings):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2.data.weights import unique_state_dict
    from echo2.rollout.engines.transformers import TransformersEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = TransformersEngine(model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                batch_size=settings.groups_per_batch * settings.group_size)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_kernels=False)
    engine.load_weights(unique_state_dict(model).items())
    eos, boost = tok.eos_token_id, eos_boost(len(tok), settings.mean_tokens)

    def raise_eos(_module, _inputs, logits):
        logits = logits.clone()
        logits[..., eos] += boost
        return logits

    engine.model.get_output_embeddings().register_forward_hook(raise_eos)
    chats = [tok.apply_chat_template([{"role": "user", "content": f"What is {i % 10} + {i * 7 % 10}?"}],
                                     add_generation_prompt=True, tokenize=False) for i in range(settings.groups)]
    return engine, [tok(text, add_special_tokens=False)["input_ids"] for text in chats]


def _measure(name: str, run: Callable[[], list[list[Completion]]]) -> dict:
    t0 = time.perf_counter()
    groups = run()
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    completions = sum(len(g) for g in groups)
    return {"mode": name, "seconds": seconds, "tokens": tokens, "groups": len(groups),
            "tokens_per_s": tokens / seconds, "groups_per_s": len(groups) / seconds,
            "mean_tokens": tokens / completions}


def run_refill_bench(settings: Settings, progress: Callable[[str], None] = lambda line: None) -> dict:
    torch.set_num_threads(settings.threads)
    with tempfile.TemporaryDirectory(prefix="echo2-bench-refill-") as tmp:
        engine, prompts = _engine(make_tiny_model(Path(tmp) / "model"), settings)
        per, n = settings.groups_per_batch, settings.group_size

        def batch() -> list[list[Completion]]:  # the actor without refill: one generate per batch, in turn
            out = []
            for start in range(0, len(prompts), per):
                params = SamplingParams(n=n, max_new_tokens=settings.max_new_tokens)
                out.extend(engine.generate(prompts[start:start + per], params))
            return out

        def refill() -> list[list[Completion]]:
            params = SamplingParams(n=n, max_new_tokens=settings.max_new_tokens)
            return [g for _, g in engine.generate_stream(iter(enumerate(prompts)), params, window=per)]

        modes = {"batch": batch, "refill": refill}
        _measure("warm-up", lambda: engine.generate(prompts[:1], SamplingParams(n=n, max_new_tokens=4)))
        repeats = []
        for r in range(settings.repeats):
            torch.manual_seed(settings.seed + r)
            order = ("batch", "refill") if r % 2 == 0 else ("refill", "batch")
            rows = {name: _measure(name, modes[name]) for name in order}
            ratio = rows["refill"]["tokens_per_s"] / rows["batch"]["tokens_per_s"]
            repeats.append({"repeat": r, "ratio": ratio, **{name: rows[name] for name in modes}})
            progress(f"repeat {r}: batch {rows['batch']['tokens_per_s']:.0f} tok/s, refill "
                     f"{rows['refill']['tokens_per_s']:.0f} tok/s, ratio {ratio:.2f}")
    return {"settings": asdict(settings), "device": str(engine.device), "repeats": repeats,
            "ratio": statistics.median(r["ratio"] for r in repeats)}


def print_result(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result["settings"]
    table = Table(title=f"echo2 bench refill: {s['groups']} groups x {s['group_size']}, {s['groups_per_batch']} per "
                        f"batch, max {s['max_new_tokens']} tokens (mean aimed {s['mean_tokens']:g}), "
                        f"{result['device']}, {s['threads']} thread(s)")
    for header in ("repeat", "mode", "seconds", "tokens", "mean tokens", "tokens/s", "groups/s", "refill/batch"):
        table.add_column(header, justify="right")
    for r in result["repeats"]:
        for name in ("batch", "refill"):
            m = r[name]
            table.add_row(str(r["repeat"]), name, f"{m['seconds']:.2f}", str(m["tokens"]), f"{m['mean_tokens']:.1f}",
                          f"{m['tokens_per_s']:.0f}", f"{m['groups_per_s']:.2f}",
                          f"{r['ratio']:.2f}" if name == "refill" else "")
    Console(width=200).print(table)


def summary_line(result: dict) -> str:
    return f"refill / batch rollout throughput (tokens/s, median of {len(result['repeats'])}): {result['ratio']:.2f}x"
