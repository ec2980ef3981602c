"""What ``echo2 bench learner`` prints: the JSON objects other tools read, the targets judged PASS/FAIL, and the
table (``echo2/bench/learner.py`` measures; this file only reports, and imports nothing but the standard library,
so the GPU machine's path stays torch + transformers)."""

from __future__ import annotations

TARGETS = {"memory_ratio_2048": 1 / 8, "total_8192_mb": 8192, "speed_512": 0.9, "speed_mixed": 1.5, "mfu_1_7b": 0.40}


JSON_KEYS = ("case", "tokens", "device", "device_name", "peak_mb", "baseline_peak_mb", "baseline_need_mb",
             "tokens_per_s", "baseline_tokens_per_s", "padding_fraction", "seconds", "seconds_min", "mfu",
             "mfu_attention", "mfu_best", "mfu_attention_best", "peak_tflops", "peak_source", "gpu_peak_mb")


def json_object(result: dict) -> dict:
    """The interface other tools read: exactly these keys (``baseline_need_mb`` where the baseline was not
    run, ``gpu_peak_mb`` only on a GPU; the MFU figures against ``peak_tflops`` from ``peak_source``)."""
    return {k: result[k] for k in JSON_KEYS if k in result}


def target_lines(results: list[dict], *, cuda: bool, model_config: str | None) -> list[str]:
    """The issue's targets, each PASS, FAIL or n/a with the numbers it compared."""
    by = {r["case"]: r for r in results}
    lines = []

    def line(ok, text):
        lines.append(f"{'n/a ' if ok is None else 'PASS' if ok else 'FAIL'}  {text}")

    if cuda:  # the other targets are the CPU machine's
        r = by.get("8192")
        if model_config == "qwen3-1.7b" and r and r.get("mfu") is not None:
            line(r["mfu"] >= TARGETS["mfu_1_7b"], f"qwen3-1.7b at 8192: MFU {r['mfu']:.1%} >= 40%")
        else:
            line(None, "MFU >= 40% for qwen3-1.7b at 8192 tokens (not this run)")
        return lines

    r = by.get("2048")
    if r and "baseline_peak_mb" in r:
        ok = r["peak_mb"] <= r["baseline_peak_mb"] * TARGETS["memory_ratio_2048"]
        line(ok, f"2048: peak above the model {r['peak_mb']:.0f} MB <= 1/8 of the baseline's "
                 f"{r['baseline_peak_mb']:.0f} MB ({r['baseline_peak_mb'] / r['peak_mb']:.1f}x less)")
    else:
        line(None, "2048: peak memory <= 1/8 of the baseline's (case or baseline not run)")
    r = by.get("8192")
    if r:
        line(r["total_peak_mb"] <= TARGETS["total_8192_mb"], f"8192: {r['total_peak_mb']:.0f} MB in all <= 8192 MB")
    else:
        line(None, "8192: within 8 GB in all (case not run)")
    for name, target in (("512", "speed_512"), ("mixed", "speed_mixed")):
        r = by.get(name)
        if r and r.get("baseline_tokens_per_s"):
            ratio = r["tokens_per_s"] / r["baseline_tokens_per_s"]
            line(ratio >= TARGETS[target], f"{name}: tokens/s {ratio:.2f}x the baseline's >= {TARGETS[target]}x")
        else:
            line(None, f"{name}: tokens/s >= {TARGETS[target]}x the baseline's (case or baseline not run)")
    return lines


def describe(opts, results: list[dict] | None = None) -> str:
    """One line: the model and the settings the numbers were taken with (``opts``: the bench's ``Options``; and the
    MFU's peak, once measured)."""
    c = opts.model_config
    peak = next((r for r in results or [] if r.get("peak_tflops")), None)
    against = f"; MFU against {peak['peak_tflops']:.3g} TFLOP/s ({peak['peak_source']}, {peak['device_name']})" \
        if peak else ""
    return (f"{c['model_type']} {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"vocabulary {c['vocab_size']}, "
            f"on {opts.device}{' (bf16, checkpointed layers)' if opts.bf16_checkpointed else ' (fp32)'}; "
            f"echo2: micro_batch_tokens {opts.micro_batch_tokens}, logprob chunk {opts.chunk_tokens}; "
            f"{opts.steps} measured step(s) after {opts.warmup} warm-up (times: the median step); memory = peak above "
            f"model + grads + AdamW{against}")


def table_rows(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    cuda = any("gpu_peak_mb" in r for r in results)
    headers = ["case", "tokens", "echo2 MB", "baseline MB", "ratio", "echo2 tok/s", "baseline tok/s", "speed-up",
               "padding echo2/baseline", "baseline rows/mb", "echo2 total MB", "MFU 6N", "MFU +attn"] + (
        ["GPU peak MB"] if cuda else [])
    rows = []
    for r in results:
        ran = "baseline_peak_mb" in r
        base_mb = f"{r['baseline_peak_mb']:.0f}" if ran else f"needs ~{r['baseline_need_mb']:.0f}"
        ratio = r.get("baseline_peak_mb", r.get("baseline_need_mb")) / max(r["peak_mb"], 1e-9)
        speed = f"{r['tokens_per_s'] / r['baseline_tokens_per_s']:.2f}x" if ran else "-"
        rows.append([r["case"], str(r["tokens"]), f"{r['peak_mb']:.0f}", base_mb,
                     f"{ratio:.1f}x{'' if ran else ' est.'}",
                     f"{r['tokens_per_s']:.0f}", f"{r['baseline_tokens_per_s']:.0f}" if ran else "-", speed,
                     f"{r['padding_fraction']:.0%} / " + (f"{r['baseline_padding_fraction']:.0%}" if ran else "-"),
                     str(r["baseline_micro_batch"]) if ran else "-", f"{r['total_peak_mb']:.0f}",
                     _percent(r.get("mfu")), _percent(r.get("mfu_attention"))]
                    + ([f"{r['gpu_peak_mb']:.0f}"] if cuda else []))
    return headers, rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def plain_table(results: list[dict]) -> str:
    headers, rows = table_rows(results)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [headers, *rows])
