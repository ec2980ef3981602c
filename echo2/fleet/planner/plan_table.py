"""``echo2 plan``'s tables: the plan (``run_plan.plan_run``'s JSON-ready dict) as rich tables."""

from __future__ import annotations

import json


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def fleet_table(title: str, fleet: list[dict]):
    """The fleet a plan buys, one row per offer (``echo2 plan``'s point and range both print it)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("count", "offer", "GPUs", "market", "$/h each", "$/h", "tok/s each", "available"):
        table.add_column(col, justify="left" if col == "offer" else "right")
    for row in fleet:
        o = row["offer"]
        table.add_row(str(row["count"]), o["name"], f"{o['gpu']} x{o['gpu_count']}", row["market"],
                      f"{row['usd_per_hour_each']:.4f}", f"{row['usd_per_hour']:.4f}",
                      f"{row['tokens_per_second_each']:.0f}", f"{row['availability']:.3f}")
    return table


def print_plan(out: dict) -> None:
    """The plan as rich tables (``echo2 plan`` without --json)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
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
    console.print(fleet_table(f"{out['workload_name']}: cheapest actor fleet ({out['prices']}) at "
                              f"S={w['staleness']} for {out['target_utilization']:.0%} learner utilization",
                              out["fleet"]))
    step, v = out["learner_step"], out["versions"]
    how = (f"FLOP model: {step['flops_per_step']:.3g} FLOP over {step['peak_tflops']:g} TFLOP/s x GPUs x MFU "
           f"{step['mfu']:.0%}" if step.get("from") == "FLOP model" else "given")
    console.print(f"required {out['required_throughput']:.3f} groups/s "
                  f"({out['required_tokens_per_second']:.0f} tok/s): "
                  f"T={w['train_seconds']:.1f}s ({how}) R={w['groups_per_step']} b={w['groups_per_batch']} "
                  f"D={w['dissemination_seconds']:.1f}s (keyframe {_gb(v['keyframe'])}, delta {_gb(v['delta'])} at "
                  f"{v['changed_fraction']:.1%} changed, mean {_gb(v['mean'])}; a keyframe alone "
                  f"{out['dissemination_seconds_keyframe']:.1f}s) U={w['upload_seconds']:g}s "
                  f"k={w['publish_every']} Q={w['max_pending_batches']}")
    if out["feasible"]:
        tail = out.get("tail") or {}
        console.print(f"fleet ${out['usd_per_hour']:.4f}/h, predicted utilization {out['utilization']:.3f} "
                      f"({out['bound']}-bound), step {out['step_seconds']:.1f}s, S_min {out['min_staleness']}"
                      + (f"; batches tail-bound (the slowest takes {tail['seconds']:.0f} s: its longest "
                         "completions decode at a small batch)"
                         if tail.get("binds") else "")
                      + ("" if out["proven_optimal"] else "; search cut: maybe not optimal"))
    if "hours" in out:
        _totals(console, out)
    table = Table(title="neighbouring S")
    for col in ("S", "workers", "$/h", "utilization", "step s", "$/step", "fleet"):
        table.add_column(col, justify="left" if col == "fleet" else "right")
    for n in sorted([out, *out["neighbours"]], key=lambda r: r["staleness"]):
        s = n["staleness"]
        if not n["feasible"]:
            table.add_row(str(s), "-", "-", "-", "-", "-", n["reason"])
            continue
        fleet = ", ".join(f"{r['count']}x {r['offer']['gpu']}x{r['offer']['gpu_count']}" for r in n["fleet"])
        table.add_row(f"{s}{' *' if n is out else ''}", str(n["workers"]), f"{n['usd_per_hour']:.4f}",
                      f"{n['predicted_utilization']:.3f}", f"{n['step_seconds']:.1f}", f"{n['usd_per_step']:.5f}",
                      fleet)
    console.print(table)
    if "reclaims" in out and "hours" not in out:
        _reclaims(console, out["reclaims"])
    table = Table(title="assumptions (change any in the workload file or by flag, and plan again)")
    for col in ("name", "value", "source"):
        table.add_column(col, overflow="fold")
    for a in out["assumptions"]:
        table.add_row(a["name"], str(a["value"]), a["source"])
    console.print(table)


def _totals(console, out: dict) -> None:
    from rich.table import Table

    table = Table(title=f"the whole run: {out['steps']} steps")
    for col in ("", "hours", "$ total", "$ learner", "$ actors", "$ traffic", "source"):
        table.add_column(col, justify="left" if col in ("", "source") else "right", overflow="fold")
    learner = out["learner"]
    table.add_row("echo2 (this plan)", f"{out['hours']:.1f}", f"{out['usd_total']:,.0f}", f"{out['usd_learner']:,.0f}",
                  f"{out['usd_actors']:,.0f}", f"{out['usd_traffic']:,.0f}",
                  f"learner {learner['offer']['name']} {learner['market']} ${learner['usd_per_hour']:.2f}/h"
                  + (f"; $ total includes its expected reclaims, ${out['usd_learner_reclaims']:,.2f}"
                     if out.get("usd_learner_reclaims") else ""))
    spot = out.get("spot_learner")
    if spot and spot["finishes"] and learner["market"] == "on-demand":
        table.add_row("echo2, spot learner", f"{spot['hours']:.1f}", f"{spot['usd_total']:,.0f}",
                      f"{spot['usd_learner']:,.0f}", f"{out['usd_actors']:,.0f}", f"{spot['traffic_usd']:,.0f}",
                      f"learner {spot['offer']['name']} spot ${spot['usd_per_hour']:.2f}/h; with its "
                      f"{spot['expected_reclaims']:.2f} expected reclaims: ${spot['usd_reclaims']:,.2f}")
    elif spot and spot.get("on_demand_offer") and learner["market"] == "spot":
        base = spot["plan_hours"]
        table.add_row("echo2, on-demand learner", f"{base:.1f}", f"{spot['on_demand_usd_total']:,.0f}",
                      f"{spot['on_demand_usd_per_hour'] * base:,.0f}", f"{out['usd_actors']:,.0f}",
                      f"{spot['on_demand_traffic_usd']:,.0f}",
                      f"learner {spot['on_demand_offer']['name']} on-demand ${spot['on_demand_usd_per_hour']:.2f}/h")
    for r in out.get("compare", []):
        table.add_row(r["name"], f"{r['hours']:g}", f"{r['usd']:,.0f}", "", "", "", r["source"])
    console.print(table)
    if out.get("verdict"):
        console.print(out["verdict"])
    if spot:
        console.print(spot["verdict"])
    t = out["traffic"]
    console.print(f"traffic: ${t['usd_with_relay']:,.2f} with the relay (one store read per provider and region), "
                  f"${t['usd_store_only']:,.2f} with every actor reading the store; {t['versions']} versions, store "
                  f"{out['store']['provider']}/{out['store']['region']}; of it the learner's uploads "
                  f"${t['usd_learner_to_store']:,.2f}, the rollout files ${t['usd_rollouts']:,.2f}")
    _reclaims(console, out["reclaims"])
    c, b = out["checkpoints"], out["bursts"]
    console.print(f"in the hours and dollars: {c['count']} checkpoints x {c['gb_each']:.0f} GB "
                  f"({c['seconds'] / 3600:.2f} h, egress ${c['usd_egress']:,.2f}), "
                  f"start-up {out['startup_seconds'] / 60:.1f} min, "
                  f"{b['bursts']:.2f} expected reclaim bursts ({b['hours']:.2f} h), the fleet with "
                  f"{out['extra_workers']} extra for the reliability rule (${out['fleet_usd_per_hour']:.2f}/h)")
    needs = out["learner"]["needs"]
    console.print(f"learner memory: {needs['gpu_per_rank_gib']:.0f} GiB per GPU, {needs['host_total_gib']:.0f} GiB of "
                  "host RAM (learner_memory.py)")
    for refused in out["learner"].get("cheaper_refused", []):
        console.print(f"  refused: {refused['offer']} (${refused['usd_per_hour']:.2f}/h): {refused['refused']}")
    if "budget" in out:
        b = out["budget"]
        console.print(f"budget ${b['usd']:,.0f}: " + ("covers the run" if b["met"] else
                      f"buys {b['hours_bought']:.1f} h, {b['steps_bought']} of {out['steps']} steps"))
    if "deadline" in out:
        d = out["deadline"]
        console.print(f"deadline {d['hours']:g} h: " + (f"met, ${d['usd']:,.0f}" if d["met"] else
                      f"missed: {d['steps_by_then']} of {out['steps']} steps by then, ${d['usd_by_then']:,.0f} spent"))


def _reclaims(console, r: dict) -> None:
    extra = ("not held even with the extras tried" if r["extra_workers"] is None else "no extra worker needed"
             if r["extra_workers"] == 0 else f"+{r['extra_workers']} x {r['extra_offer']} -> "
             f"${r['usd_per_hour_with_extra']:.4f}/h, {r['share_with_extra']:.1%} of the time at target")
    console.print(f"reclaims over {r['hours']:.1f}h at {r['reclaim_rate_per_hour']:g}/instance-h, replacement "
                  f"{r['replacement_seconds']:g}s: {r['expected_reclaims']:.1f} expected (${r['usd_lost_time']:.2f} "
                  f"of billed time not producing), planned throughput held {r['share_of_time_at_target']:.1%} of the "
                  f"time; to hold it {r['hold']:.0%}: {extra}")
