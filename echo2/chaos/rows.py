"""What a chaos scenario reports (one row each) and how it judges what the actors loaded."""

from __future__ import annotations

import json
from pathlib import Path

from echo2.chaos import harness as h


def result_row(name: str, **fields) -> dict:
    row = {"scenario": name, "injected": 0, "detected": 0, "lost": 0, "bad_loaded": 0, "finished": False,
           "leaks": [], "broken": [], "detail": ""}
    row.update(fields)
    return row


def audit_row(name: str, run_dir: Path, code: int, **fields) -> dict:
    result = h.audit(str(run_dir))
    return result_row(name, lost=h.lost(result), finished=code == 0 and bool(result.get("finished")), audit=result,
                      **fields)


def loaded_versions(run_dir: Path) -> list[tuple[str, int]]:
    """(actor, version) of every swap the actors logged: what they generated with."""
    out = []
    for log in (run_dir / "logs").glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "now generating with policy v" in line:
                out.append((log.stem, int(line.split("now generating with policy v")[1].split()[0])))
    return out


def bad_loads(run_dir: Path, bad: set[int] | None = None) -> int:
    """Swaps the actors logged to a bad version: one of ``bad`` (forged, truncated: what a scenario planted),
    or, without it, one the learner never got to (a number above its final version). An actor swaps only
    after every chunk matched the signed manifest, so this must be 0."""
    if bad is None:
        try:
            final = json.loads((run_dir / "policy" / "LATEST").read_text())["version"]
        except (OSError, ValueError, KeyError):
            final = -1
        return sum(v > final for _, v in loaded_versions(run_dir))
    return sum(v in bad for _, v in loaded_versions(run_dir))
