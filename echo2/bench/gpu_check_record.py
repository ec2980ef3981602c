"""The GPU check's record: every result one JSON line in ``DIR/gpu_check.jsonl`` and one line on stdout (PASS / FAIL
/ INFO / SKIP / ERROR), each section timed, guarded (an exception is recorded as ERROR and the next section runs)
and skipped once the time budget is spent, and the ``SUMMARY`` line. Imports torch and the standard library only
(``gpu_check.py`` runs where only torch and transformers are installed).
"""

from __future__ import annotations

import gc
import json
import math
import time
import traceback
from pathlib import Path

import torch


class Check:
    def __init__(self, out_dir: Path, budget_s: float):
        self.path = out_dir / "gpu_check.jsonl"
        self.deadline = time.monotonic() + budget_s
        self.rows: list[dict] = []

    def record(self, section: str, name: str, verdict: str, **values) -> None:
        row = {"section": section, "name": name, "verdict": verdict, **values}
        self.rows.append(row)
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
                         if k != "traceback")
        print(f"{verdict:5s} {section}.{name} {shown}", flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def bound(self, section: str, name: str, value: float, limit: float, *, above: bool = False, **extra) -> None:
        ok = math.isfinite(value) and (value >= limit if above else value <= limit)
        self.record(section, name, "PASS" if ok else "FAIL", value=value, limit=limit, **extra)

    def run(self, section: str, fn) -> None:
        if time.monotonic() > self.deadline:
            self.record(section, "section", "SKIP", reason="time budget spent")
            return
        start = time.monotonic()
        try:
            fn()
        except Exception as exc:  # one section's failure is a finding, not the end of the check
            self.record(section, "section", "ERROR", error=f"{type(exc).__name__}: {exc}"[:500],
                        traceback=traceback.format_exc()[-3000:])
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.record(section, "seconds", "INFO", value=time.monotonic() - start)

    def summary(self) -> str:
        verdicts = [r["verdict"] for r in self.rows]
        return "SUMMARY " + " ".join(f"{v}={verdicts.count(v)}" for v in ("PASS", "FAIL", "ERROR", "SKIP"))
