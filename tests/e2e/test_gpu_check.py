"""The prepared GPU check (``echo2 bench gpu-check``) in its tiny form on the CPU: every section runs through the
real learner and passes, on an install that holds torch, transformers, accelerate and pyarrow but not pydantic or
cryptography (what a stock GPU image has)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e

STOCK_IMAGE = textwrap.dedent("""
    import importlib.machinery, sys

    HIDDEN = {"pydantic", "s3fs", "tenacity", "aiohttp", "zstandard", "cryptography", "pokerkit", "math_verify",
              "prefect", "gguf", "boto3", "botocore", "typer"}

    class NotInstalled(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in HIDDEN:
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [NotInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    from echo2.bench.gpu_check import main
    code = main(sys.argv[1:])
    hidden = sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN)
    print("HIDDEN-IMPORTED", hidden)
    raise SystemExit(code)
""")


def test_the_tiny_gpu_check_passes_on_the_cpu_without_pydantic(tmp_path):
    proc = subprocess.run([sys.executable, "-c", STOCK_IMAGE, "--tiny", "--device", "cpu", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    summary = next((line for line in lines if line.startswith("SUMMARY ")), None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary is not None and "FAIL=0" in summary and "ERROR=0" in summary, summary
    assert "HIDDEN-IMPORTED []" in lines
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    sections = {r["section"] for r in rows if r["verdict"] == "PASS"}
    assert {"head", "packing", "step", "varlen", "fsdp"} <= sections
    perf = {r["name"]: r for r in rows if r["section"] == "perf"}
    assert perf["8k"]["tokens_per_s"] > 0 and 0 < perf["mixed"]["mfu"] < perf["mixed"]["mfu_attention"]
