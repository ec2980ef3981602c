"""Every cost figure of a run, from its ledger: one owner, so the live ``usd_so_far``, the end-of-run
report and ``echo2 report`` can never disagree.

``cost_report`` puts the pieces of the bill together, JSON-ready: the workers' rows (``ledger.py``: one row per
worker life, from the fleet's events), the learner's sessions and the gaps between them (``learner.py``: when no
fleet event describes the learner, one row per learner session, in the market of ``learner.market``, priced at
``fleet.learner_usd_per_hour`` of the run's config or labelled unpriced; the report's ``learner`` object sums them
and counts the gaps, with ``gap_actor_usd``, the share of the actors' bill that fell in them), and the traffic
(``egress.py``: what each actor read, from the learner's snapshots of the actors' own counters, priced from where
the store and each parent sit to where the actor sits; bytes whose price depends on a place not known are
counted and unpriced). ``total_usd`` is GPU plus traffic (``gpu_usd``, ``traffic_usd``); ``fleet_usd``, the live
figure the fleet's budget reads (``ledger.fleet_usd``), stays GPU hours only. ``write_cost_reports`` folds the
counters in once more, then writes the report and its renderings (``render.py``).
"""

from __future__ import annotations

import time

from echo2.data import layout
from echo2.data.audit import failure_kind
from echo2.data.ledger import read_events
from echo2.data.run_folder import RunInfo
from echo2.data.site import site_name
from echo2.data.store import ObjectStore
from echo2.fleet.bill import egress, learner, ledger, render


def cost_report(store: ObjectStore, *, summary: dict | None = None, now: float | None = None) -> dict:
    """Every cost figure of the run at ``store`` (JSON-ready). ``summary`` (steps, eval_before,
    eval_after, wall_seconds) defaults to ``reports/summary.json`` when the run has one."""
    now = time.time() if now is None else now
    summary = summary if summary is not None else ledger.get_record(store, layout.SUMMARY)
    events = read_events(store)
    facts = ledger.ledger_facts(store)
    rows = ledger.worker_rows(events, now, learner_activity=facts["written"])
    run = RunInfo.read(store)
    timeline = ledger.timeline(events)
    if not any(r["role"] == "learner" for r in rows):
        rows += learner.session_rows(run, summary, facts, timeline, now)
    learner_rows = [r for r in rows if r["role"] == "learner"]
    gaps = learner.gaps(learner_rows, timeline, now=now, committed=facts["committed"]) if learner_rows else []
    learner_bill = learner.learner_summary(learner_rows, gaps, [r for r in rows if r["role"] != "learner"],
                                           market=run.learner_market, now=now)
    store_at = run.store_site
    traffic = egress.traffic_rows(egress.read_snapshots(store), egress.places(rows), store_at)
    gpu_usd = sum(r["usd"] for r in rows)
    traffic_usd = sum(t["usd"] for t in traffic)
    total = gpu_usd + traffic_usd
    steps = int(ledger.num(summary.get("steps"), facts["steps"]))
    completions = facts["completions_used"]
    before, after = ledger.num(summary.get("eval_before")), ledger.num(summary.get("eval_after"))
    # accuracy points only for an accuracy (a poker run's headline is bb/100, not a fraction)
    is_accuracy = summary.get("eval_metric", "accuracy") == "accuracy"
    gain = (after - before) * 100 if before is not None and after is not None and is_accuracy else None
    marks = [{"ts": float(e["ts"]), "what": failure_kind(e), "actor_id": str(e.get("actor_id", "?"))}
             for e in timeline if failure_kind(e)]
    return {
        "run_id": str(summary.get("run_id") or store.url.rstrip("/").rsplit("/", 1)[-1]),
        "total_usd": total,
        "gpu_usd": gpu_usd,
        "traffic_usd": traffic_usd,
        "store_site": None if store_at is None else site_name(*store_at),
        "traffic_bytes_from_store": sum(t["bytes_from_store"] for t in traffic),
        "traffic_bytes_from_peers": sum(t["bytes_from_peers"] for t in traffic),
        "traffic_unpriced_bytes": sum(t["unpriced_bytes"] for t in traffic),
        "traffic": traffic,
        # nothing had a price (local actors, an unpriced learner): $0 means "not known", not "free"
        "priced_resources": any(r["price_usd_per_hour"] > 0 for r in rows) or any(t["usd"] > 0 for t in traffic),
        "hours": sum(r["hours"] for r in rows),
        "by_role": ledger.group(rows, "role"),
        "by_gpu": ledger.group(rows, "gpu"),
        "by_provider": ledger.group(rows, "provider"),
        "by_market": ledger.group(rows, "market"),
        "steps": steps,
        "completions_used": completions,
        "usd_per_step": total / steps if steps else None,
        "usd_per_1k_rollouts": 1000 * total / completions if completions else None,
        "eval_before": before,
        "eval_after": after,
        "accuracy_points_gained": gain,
        "usd_per_accuracy_point": total / gain if gain and gain > 0 else None,
        "on_demand_equivalent_usd": sum(r["on_demand_usd"] for r in rows),
        "simulated_prices": any(r["simulated_price"] for r in rows),
        "learner_priced": all(r["priced"] for r in rows if r["role"] == "learner"),
        "still_running": sum(r["end"] is None for r in rows),
        "reclaims": sum(m["what"] == "reclaim" for m in marks),
        "crashes": sum(m["what"] == "crash" for m in marks),
        "failures": marks,
        "learner": learner_bill,
        "computed_at": now,
        "workers": rows,
    }


def write_cost_reports(store: ObjectStore, *, summary: dict | None = None, now: float | None = None) -> dict:
    """Fold the byte counters of actors still registered into the ledger (``egress.fold_counters``), compute the
    report and write ``reports/cost.json``, ``cost.md`` and ``cost.png`` (overwriting: ``echo2 report`` recomputes
    a finished or crashed run's report from its ledger)."""
    egress.fold_counters(store)  # the counters of actors still registered, before they are gone
    report = cost_report(store, summary=summary, now=now)
    store.put_json(layout.report_key("cost.json"), report, if_absent=False)
    store.put(layout.report_key("cost.md"), render.cost_markdown(report).encode(), if_absent=False)
    store.put(layout.report_key("cost.png"), render.cost_png(report), if_absent=False)
    return report
