"""``echo2 plan``'s default answer as rich tables: the run's P10/P50/P90 hours and dollars, the fleet it buys, the
inputs that move it most and every drawn input with its source (``run_range.plan_range`` and the likely plan)."""

from __future__ import annotations

SENSITIVITY_ROWS = 8


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def print_range(out: dict) -> None:
    """The range (``out["range"]``) beside the likely plan's fleet, learner and costs (``out`` is ``plan_run``'s)."""
    from rich.console import Console
    from rich.table import Table

    from echo2.fleet.planner.plan_table import fleet_table

    console = Console(width=max(120, Console().width))
    r = out["range"]
    if out.get("description"):
        console.print(f"[bold]{out['workload_name']}[/bold]: {out['description']}")
    table = Table(title=f"the whole run, {out['steps']} steps: {r['method']}")
    for col in ("", "P10", "P50", "P90", "likely inputs"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row("hours", *(f"{r['hours'][p]:.1f}" for p in ("p10", "p50", "p90")), f"{r['likely']['hours']:.1f}")
    for key, label in (("usd", "$ total"), ("usd_learner", "$ learner"), ("usd_actors", "$ actors"),
                       ("usd_traffic", "$ traffic")):
        table.add_row(label, *(f"{r[key][p]:,.0f}" for p in ("p10", "p50", "p90")), f"{r['likely'][key]:,.0f}")
    console.print(table)
    for ref in out.get("compare", []):
        inside = (r["usd"]["p10"] <= ref["usd"] <= r["usd"]["p90"],
                  r["hours"]["p10"] <= ref["hours"] <= r["hours"]["p90"])
        console.print(f"{ref['name']}: ${ref['usd']:,.0f} in {ref['hours']:g} h -- dollars "
                      f"{'inside' if inside[0] else 'outside'} P10-P90, hours {'inside' if inside[1] else 'outside'}")
    extra = f", with {r['extra_workers']} extra for the 95% reliability rule" if r["extra_workers"] else ""
    console.print(fleet_table(f"the fleet bought (planned at the likely inputs, S={out['staleness']}, "
                              f"{out['target_utilization']:.0%} learner utilization{extra})", r["fleet"]))
    learner = out["learner"]
    needs = learner["needs"]
    console.print(f"learner: {learner['offer']['name']} ({learner['market']}) ${learner['usd_per_hour']:.2f}/h; its "
                  f"ranks need {needs['gpu_per_rank_gib']:.0f} GiB of GPU memory each and {needs['host_total_gib']:.0f}"
                  f" GiB of host RAM (rank 0 holds {needs['versions_held_at_publish']} bf16 version(s) at a publish)")
    for refused in learner.get("cheaper_refused", []):
        console.print(f"  refused: {refused['offer']} (${refused['usd_per_hour']:.2f}/h): {refused['refused']}")
    c = out["checkpoints"]
    console.print(f"checkpoints: {c['count']} x {c['gb_each']:.0f} GB, {c['seconds_each']:.0f} s each "
                  f"({c['seconds'] / 3600:.2f} h of learner time), egress ${c['usd_egress']:,.2f} ({c['route']}); "
                  f"start-up {out['startup_seconds'] / 60:.1f} min; fleet-bound in {r['fleet_bound_share']:.0%} of "
                  "the draws")
    s = r["scenario"]
    console.print(f"scenario, {s['name']} ({s['actors.burst_share']:.0%} of a provider's actors at once, "
                  f"{s['actors.burst_per_hour']:g}/h): hours P50 {s['hours']['p50']:.1f} / P90 {s['hours']['p90']:.1f},"
                  f" dollars P50 {s['usd']['p50']:,.0f} / P90 {s['usd']['p90']:,.0f}")
    table = Table(title="what moves the answer most (each input alone at its low and high, the rest likely)")
    for col in ("input", "low .. high", "$ at low", "$ at high", "h at low", "h at high"):
        table.add_column(col, justify="left" if col == "input" else "right")
    for row in r["sensitivity"][:SENSITIVITY_ROWS]:
        table.add_row(row["name"], f"{_fmt(row['low'])} .. {_fmt(row['high'])}", f"{row['usd_at_low']:,.0f}",
                      f"{row['usd_at_high']:,.0f}", f"{row['hours_at_low']:.1f}", f"{row['hours_at_high']:.1f}")
    console.print(table)
    table = Table(title="drawn inputs (low, likely, high; change them in the workload file's ranges:)")
    for col in ("input", "low", "likely", "high", "source"):
        table.add_column(col, overflow="fold", justify="left" if col in ("input", "source") else "right")
    for i in r["inputs"]:
        table.add_row(i["name"], _fmt(i["low"]), _fmt(i["likely"]), _fmt(i["high"]), i["source"])
    console.print(table)
    console.print("one point at the likely inputs, with every assumption: `echo2 plan ... --point`")
