"""``echo2 plan``'s tables: the plan (``plan.py``'s JSON-ready dict) as rich tables."""

from __future__ import annotations

import json


def print_plan(out: dict) -> None:
    """The plan as rich tables (``echo2 plan`` without --json)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if "fit" in out:
        f = out["fit"]
        table = Table(title=f"run {f['run'].rstrip('/').rsplit('/', 1)[-1]}: capacity model vs measured "
                            f"({f['steps']} steps)")
        for col in ("", "predicted", "measured"):
            table.add_column(col, justify="right")
        table.add_row("utilization", f"{f['predicted_utilization']:.3f}", f"{f['measured_utilization']:.3f}")
        table.add_row("step seconds", f"{f['predicted_step_seconds']:.2f}", f"{f['measured_step_seconds']:.2f}")
        table.add_row("lag shares", json.dumps({k: round(v, 2) for k, v in f["predicted_lag"].items()}),
                      json.dumps({k: round(v, 2) for k, v in f["measured_lag"].items()}))
        console.print(table)
    if "fleet" not in out:
        return
    w = out["workload"]
    table = Table(title=f"cheapest fleet ({out['prices']}) at S={w['staleness']} for "
                        f"{out['target_utilization']:.0%} learner utilization")
    for col in ("count", "offer", "GPUs", "$/h each", "$/h", "s/batch", "groups/s"):
        table.add_column(col, justify="left" if col == "offer" else "right")
    for row in out["fleet"]:
        o = row["offer"]
        table.add_row(str(row["count"]), o["name"], f"{o['gpu']} x{o['gpu_count']}", f"{row['usd_per_hour_each']:.4f}",
                      f"{row['usd_per_hour']:.4f}", f"{row['batch_seconds']:.1f}", f"{row['groups_per_second']:.2f}")
    console.print(table)
    console.print(f"required {out['required_throughput']:.3f} groups/s "
                  f"({out['required_tokens_per_second']:.0f} tok/s): "
                  f"T={w['train_seconds']:g}s R={w['groups_per_step']} b={w['groups_per_batch']} "
                  f"D={w['dissemination_seconds']:.1f}s U={w['upload_seconds']:g}s k={w['publish_every']} "
                  f"Q={w['max_pending_batches']}")
    if out["feasible"]:
        console.print(f"fleet ${out['usd_per_hour']:.4f}/h, predicted utilization {out['predicted_utilization']:.3f} "
                      f"({out['bound']}-bound), step {out['step_seconds']:.1f}s, S_min {out['min_staleness']} "
                      f"(the learner never waits){'' if out['proven_optimal'] else '; search cut: maybe not optimal'}")
    table = Table(title="neighbouring S")
    for col in ("S", "workers", "$/h", "utilization", "step s", "$/step", "fleet"):
        table.add_column(col, justify="left" if col == "fleet" else "right")
    for n in sorted([out, *out["neighbours"]], key=lambda r: r["staleness"]):
        if not n["feasible"]:
            table.add_row(str(n["staleness"]), "-", "-", "-", "-", "-", n["reason"])
            continue
        fleet = ", ".join(f"{r['count']}x {r['offer']['gpu']}x{r['offer']['gpu_count']}" for r in n["fleet"])
        table.add_row(f"{n['staleness']}{' *' if n is out else ''}", str(n["workers"]), f"{n['usd_per_hour']:.4f}",
                      f"{n['predicted_utilization']:.3f}", f"{n['step_seconds']:.1f}", f"{n['usd_per_step']:.5f}",
                      fleet)
    console.print(table)
    if "reclaims" in out:
        r = out["reclaims"]
        extra = ("not held even with the extras tried" if r["extra_workers"] is None else "no extra worker needed"
                 if r["extra_workers"] == 0 else f"+{r['extra_workers']} x {r['extra_offer']} -> "
                 f"${r['usd_per_hour_with_extra']:.4f}/h, {r['share_with_extra']:.1%} of the time at target")
        console.print(f"reclaims over {r['hours']:g}h at {r['reclaim_rate_per_hour']:g}/worker-h, replacement "
                      f"{r['replacement_seconds']:g}s: {r['expected_reclaims']:.1f} expected, planned throughput held "
                      f"{r['share_of_time_at_target']:.1%} of the time; to hold it {r['hold']:.0%}: {extra}")
