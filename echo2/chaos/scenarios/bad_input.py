"""Chaos scenario 7 (things going wrong): bad configs and command-line input, each refused in one clear line
with exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import result_row

BAD_INPUT = [
    (["--set", "train.bogus=1"], "train.bogus: unknown key"),
    (["--set", "rollout.group_size=-4"], "rollout.group_size"),
    (["--set", "publish.shard_mb=0"], "publish.shard_mb"),
    (["--set", "train.staleness=-1"], "train.staleness"),
    (["--set", "store.url=s3://echo2-unreachable/x", "--set", "store.options={endpoint_url: http://127.0.0.1:9}"],
     "unreachable"),
    (["--set", "fleet.backend=skypilot"], "s3:// or gs://"),
    (["--set", "task.name=chess"], "task.name"),
    (["--resume", "--set", "run.id=never-started"], "never-started"),
    (["--set", "train.lr=fast"], "train.lr"),
]


def bad_input(workdir: Path, quick: bool = False) -> dict:
    """Bad configs and CLI input: one clear line each, exit 2, nothing written."""
    store = workdir / "bad-input-store"
    store.mkdir(parents=True, exist_ok=True)
    ok, problems = 0, []
    cases = [*BAD_INPUT, (["--set", "x"], "key.path=value")]
    for i, (args, expect) in enumerate(cases):
        log = workdir / f"bad-{i}.log"
        code = h.run_cli(["run", h.QUICKSTART, "--set", f"store.url={store}", *args], workdir, log, timeout=300)
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0]:
            ok += 1
        else:
            problems.append(f"{' '.join(args)}: exit {code}, {lines[-1:] if lines else 'nothing'}")
    written = [str(p.relative_to(store)) for p in store.rglob("*") if p.is_file()]
    ok_nothing_written = not written
    return result_row("bad-input", injected=len(cases), detected=ok, finished=ok_nothing_written,
                detail=f"{ok}/{len(cases)} refused in one line with exit 2; files written: {len(written)}"
                       + (f"; {problems[:2]}" if problems else ""))
