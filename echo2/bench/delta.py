"""Sparse delta benchmark (``echo2 bench broadcast --delta``): what a delta version weighs and costs
next to a full bf16 version, on consecutive versions of a real short training run.

1. The run: ``echo2 run configs/quickstart.yaml`` (the embedded SmolLM2-135M at the quickstart's
   settings: lr, batch, staleness, one local actor) for ``steps`` steps with
   ``publish.dtype=bfloat16``, ``publish.delta=true``, every version kept and no
   keyframe after version 0, evaluation off. Or ``--from-run``: any run whose versions are still
   in its store (every version of its chain is rebuilt and checked).
2. Per version v >= 1: v-1 and v rebuilt through their chains, each link checked against the
   signed tensor table; then, timed in this process, ``encode_delta(v-1 -> v)`` and
   ``apply_delta`` of the result to a copy of v-1 (the actors' apply: decode, scatter, sha256 of
   every tensor); the rebuilt bytes must equal v's signed table (bit-exact). Printed beside the
   learner's own step time from the run's ``reports/metrics.json``.
3. The relay: the last version, as its full bf16 shards and as its delta shards, sent to
   ``receivers`` nodes through the relay chain in network namespaces with tc-shaped links
   (``broadcast.py``'s harness; unshaped loopback, labelled so, where namespaces cannot be made).
   Each delta receiver also applies what it got to its own copy of the base and checks every
   tensor's sha256. Full and delta in one run, side by side.

Targets: delta bytes <= 5% of the full bf16 version on average; relay time of a delta
to 8 receivers <= 0.1x the full version's; encode + apply <= 10% of a learner step; every version
rebuilt bit-exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from echo2.bench.broadcast import relay_files
from echo2.data import layout
from echo2.data.delta import apply_delta, encode_delta, mismatches
from echo2.data.delta_chain import read_version
from echo2.data.store import ObjectStore, open_store
from echo2.data.weights import published_versions, read_manifest

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
SHARD_MB = 256


def training_run(steps: int, workdir: Path, progress=lambda line: None) -> ObjectStore:
    """A real short quickstart run publishing bf16 deltas, every version kept; returns its run store."""
    settings = [f"store.url={workdir}", "run.id=delta-bench", f"train.max_steps={steps}",
                "publish.dtype=bfloat16", "publish.delta=true", f"publish.keyframe_every={steps + 1}",
                f"publish.keep_versions={steps + 1}", f"train.checkpoint_every={steps}", "eval.before=false",
                "eval.after=false"]
    command = [sys.executable, "-m", "echo2.cli", "run", str(QUICKSTART), *(a for s in settings for a in ("--set", s))]
    progress(f"training {steps} steps of the quickstart to get consecutive versions: {' '.join(command[2:])}")
    env = {**os.environ, "ECHO2_SECRETS": str(workdir / "secrets")}  # the bench run's key lives and dies here
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the training run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return open_store(str(workdir / layout.RUNS / "delta-bench"))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def _clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors.items()}


def measure_versions(store: ObjectStore, progress=lambda line: None) -> tuple[list[dict], dict, dict]:
    """Per-version rows; the last two versions' tensors (base, new); the run's learner step seconds."""
    versions = published_versions(store)
    if len(versions) < 2 or versions != list(range(versions[0], versions[-1] + 1)):
        raise ValueError(f"{store.url} keeps versions {versions}: need at least two consecutive ones")
    step_seconds = {}
    try:
        for m in json.loads(store.get(layout.report_key("metrics.json"))):
            step_seconds[m["step"]] = m.get("step_seconds")
    except Exception:  # a run without reports: no step times to compare with
        pass
    rows = []
    previous, _ = read_version(store, versions[0])
    for v in versions[1:]:
        current, _ = read_version(store, v)  # rebuilt through the chain, every link checked
        table = read_manifest(store, layout.policy_dir(v)).get("tensors")
        t0 = time.perf_counter()
        delta = encode_delta(previous, current, max_file_bytes=SHARD_MB * 2**20)
        encode_s = time.perf_counter() - t0
        rebuilt = _clone(previous)
        t0 = time.perf_counter()
        apply_delta(rebuilt, delta.files, delta.table)
        apply_s = time.perf_counter() - t0
        exact = rebuilt.keys() == current.keys() and all(_same_bits(rebuilt[k], current[k]) for k in current)
        exact = exact and (table is None or not mismatches(rebuilt, table))
        full = sum(t.numel() * t.element_size() for t in current.values())
        rows.append({"version": v, "full_bytes": full, "delta_bytes": delta.nbytes,
                     "changed_fraction": round(delta.changed_fraction, 6), "encode_s": round(encode_s, 3),
                     "apply_s": round(apply_s, 3), "bit_exact": exact, "step_seconds": step_seconds.get(v),
                     "delta_over_full": round(delta.nbytes / full, 5)})
        progress(f"v{v}: {delta.nbytes / 2**20:.2f} MB of {full / 2**20:.1f} MB, {delta.changed_fraction:.2%} changed, "
                 f"encode {encode_s:.2f}s apply {apply_s:.2f}s, bit-exact {exact}")
        base, previous = previous, current
    return rows, {"base": base, "new": current, "delta": delta}, step_seconds


def run_delta_bench(*, steps: int = 6, receivers: int = 8, link_mbit: float = 200.0, chunk_mb: float = 1.0,
                    shaped: bool | None = None, from_run: str | None = None, progress=lambda line: None) -> dict:
    with tempfile.TemporaryDirectory(prefix="echo2-delta-bench-") as tmp:
        store = open_store(from_run) if from_run else training_run(steps, Path(tmp), progress)
        rows, last, _ = measure_versions(store, progress)
    base, new, delta = last["base"], last["new"], last["delta"]
    full_file = st_save(new, metadata={"format": "pt"})
    progress(f"relaying v{rows[-1]['version']} to {receivers} receivers: full ({len(full_file) / 2**20:.1f} MB), "
             f"then delta ({delta.nbytes / 2**20:.2f} MB)")
    full = relay_files({"shard-0000.safetensors": ("shard", full_file)}, receivers, link_mbit, chunk_mb=chunk_mb,
                       shaped=shaped, store_only=False)
    del full_file
    shards = {f"shard-{i:04d}.safetensors": ("delta", data) for i, data in enumerate(delta.files)}
    sparse = relay_files(shards, receivers, link_mbit, chunk_mb=chunk_mb, shaped=full["shaped"], store_only=False,
                         rebuild=(st_save(base), delta.table))
    relay = {"receivers": receivers, "relay_full_s": full["relay_s"], "relay_delta_s": sparse["relay_s"],
             "verified": full["verified"] and sparse["verified"] and all(r["bit_exact"] for r in rows),
             "delta_over_full": round(sparse["relay_s"] / full["relay_s"], 4), "link_mbit": link_mbit,
             "network": full["network"], "full_mb": full["size_mb"], "delta_mb": sparse["size_mb"],
             "chunk_mb": chunk_mb}
    return {"versions": rows, "relay": relay, "summary": summarize(rows, relay)}


def summarize(rows: list[dict], relay: dict) -> dict:
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    steps = [r["step_seconds"] for r in rows if r["step_seconds"]]
    cost = mean([r["encode_s"] + r["apply_s"] for r in rows])
    out = {"mean_delta_over_full": mean([r["delta_over_full"] for r in rows]),
           "mean_changed_fraction": mean([r["changed_fraction"] for r in rows]),
           "mean_encode_plus_apply_s": cost, "mean_step_seconds": mean(steps),
           "relay_delta_over_full": relay["delta_over_full"], "bit_exact": all(r["bit_exact"] for r in rows)}
    out["encode_plus_apply_over_step"] = cost / out["mean_step_seconds"] if steps else None
    out["targets_met"] = {"delta_bytes_le_5pct": out["mean_delta_over_full"] <= 0.05,
                          "relay_le_0.1x": relay["delta_over_full"] <= 0.1,
                          "encode_apply_le_10pct_step":
                              None if not steps else out["encode_plus_apply_over_step"] <= 0.10,
                          "bit_exact": out["bit_exact"]}
    return out


def json_lines(result: dict) -> list[dict]:
    """``--json``: one object per version, then one for the relay (with the summary)."""
    return [*result["versions"], {**result["relay"], "summary": result["summary"]}]


def print_delta(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, Console().width))
    t = Table(title="sparse delta vs full bf16 version, consecutive versions of a real quickstart run "
                    "(step s: the learner's own step in that run)")
    for col in ("v", "full MB", "delta MB", "delta/full", "changed", "encode s", "apply s", "step s", "exact"):
        t.add_column(col, justify="right")
    for r in result["versions"]:
        t.add_row(str(r["version"]), f"{r['full_bytes'] / 2**20:.1f}", f"{r['delta_bytes'] / 2**20:.2f}",
                  f"{r['delta_over_full']:.2%}", f"{r['changed_fraction']:.2%}", f"{r['encode_s']:.2f}",
                  f"{r['apply_s']:.2f}", "-" if r["step_seconds"] is None else f"{r['step_seconds']:.1f}",
                  str(r["bit_exact"]))
    console.print(t)
    relay = result["relay"]
    t = Table(title=f"relay of v{result['versions'][-1]['version']} to {relay['receivers']} receivers, "
                    f"{relay['link_mbit']:g} Mbit/s links, {relay['chunk_mb']:g} MB chunks ({relay['network']})")
    for col in ("payload", "MB", "relay s", "delta/full"):
        t.add_column(col, justify="right")
    t.add_row("full bf16", f"{relay['full_mb']:.1f}", f"{relay['relay_full_s']:.2f}", "")
    t.add_row("sparse delta", f"{relay['delta_mb']:.2f}", f"{relay['relay_delta_s']:.2f}",
              f"{relay['delta_over_full']:.3f}")
    console.print(t)
    s = result["summary"]
    ratio = s["encode_plus_apply_over_step"]
    console.print(
        f"delta bytes / full: {s['mean_delta_over_full']:.2%} on average (target <= 5%); "
        f"relay delta / full: {s['relay_delta_over_full']:.3f} (target <= 0.1); "
        f"encode + apply: {s['mean_encode_plus_apply_s']:.2f}s = "
        + ("n/a" if ratio is None else f"{ratio:.1%}") + " of a learner step (target <= 10%); "
        f"bit-exact on every version: {s['bit_exact']}; receivers verified: {relay['verified']}")
