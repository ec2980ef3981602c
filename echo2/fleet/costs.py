"""Every cost figure of a run, from its ledger: one owner, so the live ``usd_so_far``, the end-of-run
report and ``echo2 report`` can never disagree.

The only input is what the learner and the fleet (trusted) wrote to ``ledger/events`` -- one
billing row per worker, from its start (``launch`` or ``requested``; a ``running``/``ready`` of a
worker never seen before also starts one) to its end (``exited``, ``terminated``, ``reclaimed``,
``crashed``, or ``unavailable``: the provider had no capacity for a request; a worker with no end is billed until
``now``). Any event of the row may carry its offer:
``backend``, ``provider``, ``gpu``, ``region``, ``spot``, ``price_usd_per_hour``,
``on_demand_usd_per_hour``, ``simulated_price``, ``role``; the latest value wins (a ``running`` event
knows which of a launch's candidate offers was bought). Missing or malformed fields fall back to
defaults (price 0, on-demand price = price), so a report is always written.

The learner is a worker too. When no event describes it, it gets one row per learner session
(``learner_bill.py``: the run's start and each ``resume`` event start one; each ends at the learner's last
activity before the next, the last at ``reports/summary.json``'s ``finished_at``, else its ``wall_seconds`` for a
run that never resumed, else the last ledger activity), in the market of ``train.market`` (run.json's config),
priced at ``fleet.learner_usd_per_hour`` of the run's config when that field exists, otherwise at $0 and
labelled unpriced -- a bill that guesses is worse than one that says what it does not know. The report's
``learner`` object sums them (``market``, ``sessions``, ``hours``, ``usd``) and counts the gaps between sessions
(``reclaims``, ``gap_hours``, and ``gap_actor_usd``: the share of the actors' bill that fell in the gaps, while
they waited for the relaunched learner).

A local actor (``backend: local``) is a child of the learner and dies with it (PR_SET_PDEATHSIG): one
whose row has no end event was killed with a learner that could write none (SIGKILL, a crash). Its
row ends at that learner's last ledger activity before the next ``resume`` event, and in a report
(not the live ``usd_so_far`` of a running learner) at the run's last activity: never at the time the
report is made.

Traffic: what each actor read (``egress.py``: the learner's snapshots of the actors' own counters, folded
in at each publish and here before a report is written) is priced with ``providers.transfer_usd_per_gb``:
bytes from the store from where the store lives (``store.provider``/``store.region`` in ``run.json``'s
config) to the actor's placement (its row's provider and region, from its ledger events), bytes from peers
from the parent's site (``provider/region`` as the signed relay plan named it) to the actor's, and from an
unknown site ("") as if within the actor's own site (what a transfer within a site costs: $0 on
hyperscalers). Where the store's place, the actor's provider, or (within the store's provider) its region
is not known, those bytes are counted and unpriced, and the report says so. ``total_usd`` is GPU plus
traffic (``gpu_usd``, ``traffic_usd``); ``fleet_usd``, the live figure the fleet's budget reads, stays GPU
hours only.

Prices marked ``simulated_price`` (a local actor priced as a catalog offer) make the whole report
say "simulated prices" in its title: the dollars are what the hours would have cost, not a bill.
"""

from __future__ import annotations

import math
import time
from typing import Any

from echo2.data import layout
from echo2.data.audit import failure_kind, finite_number
from echo2.data.ledger import consumed_keys, read_events
from echo2.data.run_folder import RunInfo
from echo2.data.site import site_name, split_site
from echo2.data.store import NotFound, ObjectStore
from echo2.fleet import egress, learner_bill
from echo2.fleet.providers import transfer_usd_per_gb
from echo2.plots import figure_png

STARTS = ("launch", "requested")
NO_PRICES_WHY = "no worker and no traffic had a price, so the $0 figures below mean unknown, not free"
STATUS = ("running", "ready")
ENDS = ("exited", "terminated", "reclaimed", "crashed", "unavailable")  # unavailable: the offer had no capacity
LEARNER_PRICE_FIELD = ("fleet", "learner_usd_per_hour")
"""Where the learner's price lives in the run's config (``FleetConfig.learner_usd_per_hour``)."""


def _num(value: Any, default: float | None = None) -> float | None:
    out = finite_number(value)
    return default if out is None else out


def _price(value: Any) -> float | None:
    out = _num(value)
    return out if out is not None and out >= 0 else None


def _new_row(e: dict, ts: float) -> dict:
    actor_id = str(e.get("actor_id", "?"))
    return {"actor_id": actor_id, "role": "learner" if actor_id == "learner" else "actor", "backend": "?",
            "provider": None, "gpu": "none", "region": "-", "spot": False, "price_usd_per_hour": 0.0,
            "on_demand_usd_per_hour": None, "simulated_price": False, "priced": True, "start": ts, "end": None,
            "ended_by": None}


def _update(row: dict, e: dict) -> None:
    for field in ("backend", "provider", "gpu", "region", "role"):
        if isinstance(e.get(field), (str, int, float)) and not isinstance(e.get(field), bool) and str(e[field]):
            row[field] = str(e[field])
    if isinstance(e.get("spot"), bool):
        row["spot"] = e["spot"]
    if _price(e.get("price_usd_per_hour")) is not None:
        row["price_usd_per_hour"] = _price(e["price_usd_per_hour"])
    if _price(e.get("on_demand_usd_per_hour")) is not None:
        row["on_demand_usd_per_hour"] = _price(e["on_demand_usd_per_hour"])
    if e.get("simulated_price") is True:
        row["simulated_price"] = True


def _finish(row: dict, now: float) -> dict:
    end = row["end"] if row["end"] is not None else max(now, row["start"])
    row["hours"] = (end - row["start"]) / 3600
    row["provider"] = row["provider"] or row["backend"]
    row["market"] = "spot" if row["spot"] else "on-demand"
    if row["on_demand_usd_per_hour"] is None:
        row["on_demand_usd_per_hour"] = row["price_usd_per_hour"]
    row["usd"] = row["hours"] * row["price_usd_per_hour"]
    row["on_demand_usd"] = row["hours"] * row["on_demand_usd_per_hour"]
    return row


def _timeline(events: list[dict]) -> list[dict]:
    valid = [e for e in events if isinstance(e, dict) and _num(e.get("ts")) is not None]
    return sorted(valid, key=lambda e: float(e["ts"]))


def _died_with_the_learner(open_rows: dict[str, dict], at: float, before: float = math.inf) -> None:
    """Close the open rows of local actors started before ``before`` at ``at``: their learner is gone,
    so are they."""
    for actor_id, row in list(open_rows.items()):
        if row["backend"] == "local" and row["start"] < before:
            row["end"], row["ended_by"] = max(at, row["start"]), "died with the learner"
            del open_rows[actor_id]


def worker_rows(events: list[dict], now: float | None = None, *,
                learner_activity: list[float] | None = None) -> list[dict]:
    """One billing row per worker life, from the fleet events (see the module docstring).
    A local actor still open at a ``resume`` event ends at the dead learner's last activity before it;
    with ``learner_activity`` (when each ledger record was written: a report, not the live figure of a
    running learner) one still open at the end ends at the last activity."""
    now = time.time() if now is None else now
    activity = sorted([*(learner_activity or []), *(float(e["ts"]) for e in _timeline(events))])
    rows: list[dict] = []
    open_rows: dict[str, dict] = {}
    seen: set[str] = set()
    for e in _timeline(events):
        ts, kind, actor_id = float(e["ts"]), e.get("kind"), str(e.get("actor_id", "?"))
        if kind == "resume":  # a new learner: the old one's children died with it
            _died_with_the_learner(open_rows, max([t for t in activity if t < ts], default=ts), before=ts)
        row = open_rows.get(actor_id)
        if row is None and (kind in STARTS or (kind in STATUS and actor_id not in seen)):
            row = open_rows[actor_id] = _new_row(e, ts)
            rows.append(row)
            seen.add(actor_id)
        if row is None:
            continue
        _update(row, e)
        if kind in ENDS:
            row["end"], row["ended_by"] = ts, kind
            del open_rows[actor_id]
    if learner_activity is not None and activity:
        _died_with_the_learner(open_rows, activity[-1])
    return [_finish(r, now) for r in rows]


def actor_costs(events: list[dict], now: float | None = None) -> list[dict]:
    """The actors' rows only (what ``LocalFleet.cost_so_far`` sums while a run is under way)."""
    return [r for r in worker_rows(events, now) if r["role"] != "learner"]


def _ledger_facts(store: ObjectStore) -> dict:
    """Steps, completions used (an amendment's quarantine takes them back), the last activity, and when each
    step's entry was written (``committed``), the entries a resume moved under ``orphaned/`` included (when the
    dead learner was last active, and the steps the resume went back over)."""
    steps, completions, last = 0, 0, None
    written: list[float] = []
    committed: list[tuple[float, int]] = []  # (written_at, step) of each step's entry
    used: dict[str, int] = {}
    amended: set[str] = set()
    for key in consumed_keys(store):
        try:
            record = store.get_json(key)
        except (NotFound, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        last = max(last or 0.0, _num(record.get("written_at"), 0.0))
        if _num(record.get("written_at")) is not None:
            written.append(_num(record.get("written_at")))
        if record.get("amendment"):
            amended.update(str(i.get("key")) for i in record.get("quarantined", []) if isinstance(i, dict))
            continue
        steps = max(steps, layout.step_of_consumed_key(key) or 0)
        if _num(record.get("written_at")) is not None and layout.step_of_consumed_key(key) is not None:
            committed.append((_num(record.get("written_at")), layout.step_of_consumed_key(key)))
        for item in record.get("used", []) or []:
            if isinstance(item, dict) and "key" in item:
                used[str(item["key"])] = used.get(str(item["key"]), 0) + int(_num(item.get("rows"), 0))
    for key in store.list(layout.ORPHANED):  # a resume moved the lost timeline's entries aside: the learner wrote them
        inner = key.split("/", 2)[2] if key.count("/") >= 2 else ""
        n = layout.step_of_consumed_key(inner) if inner.endswith(".json") else None
        if n is None or inner.endswith(".deleted.json"):
            continue
        at = _num(_get(store, key).get("written_at"))
        if at is not None:
            written.append(at)
            committed.append((at, n))
    completions = sum(n for k, n in used.items() if k not in amended)
    return {"steps": steps, "completions_used": completions, "last_activity": last, "written": written,
            "committed": committed}


def _get(store: ObjectStore, key: str) -> dict:
    try:
        value = store.get_json(key)
    except (NotFound, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _learner_rows(run: RunInfo, summary: dict, facts: dict, timeline: list[dict], now: float) -> list[dict]:
    """One row per learner session (``learner_bill.py``), priced from the run's config."""
    start = _num(run.created_at)
    if start is None:
        return []
    price = _price(run.section(LEARNER_PRICE_FIELD[0]).get(LEARNER_PRICE_FIELD[1]))
    spot = run.learner_market == "spot"
    rows = []
    for s in learner_bill.sessions(start, timeline, facts["written"], finished_at=_num(summary.get("finished_at")),
                                   wall_seconds=_num(summary.get("wall_seconds")), now=now):
        row = _new_row({"actor_id": "learner"}, s["start"])
        row.update(backend="learner", provider="unknown", gpu="unknown", end=s["end"], price_usd_per_hour=price or 0.0,
                   spot=spot, ended_by=s["ended_by"], priced=price is not None)
        rows.append(_finish(row, now))
    return rows


def _group(rows: list[dict], field: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        g = out.setdefault(str(r[field]), {"hours": 0.0, "usd": 0.0})
        g["hours"] += r["hours"]
        g["usd"] += r["usd"]
    return dict(sorted(out.items()))


def _placement(rows: list[dict]) -> dict[str, tuple[str | None, str | None]]:
    """actor -> (provider, region) as its billing rows know them (None where unknown)."""
    out: dict[str, tuple[str | None, str | None]] = {}
    for r in rows:
        if r["role"] == "learner":
            continue
        provider = r["provider"] if r["provider"] not in (None, "?") else None
        out[r["actor_id"]] = (provider and provider.lower(), r["region"] if r["region"] not in ("-", "") else None)
    return out


def _usd_per_gb(src: tuple[str | None, str | None] | None, dst: tuple[str | None, str | None]) -> float | None:
    """``transfer_usd_per_gb`` from ``src`` to ``dst``, or None where what is unknown decides the price."""
    if src is None or src[0] is None or dst[0] is None:
        return None
    if src[0] != dst[0]:  # across providers: the sender's internet egress (+ ingress), whatever the regions
        return transfer_usd_per_gb(src[0], src[1] or "?", dst[0], dst[1] or "?")
    if src[1] in (None, "?") or dst[1] is None:
        return None  # within one provider: same region or not decides, and one is unknown
    return transfer_usd_per_gb(src[0], src[1], dst[0], dst[1])


def traffic_rows(reads: dict[str, egress.ReadBytes], placement: dict[str, tuple[str | None, str | None]],
                 store_at: tuple[str, str] | None) -> list[dict]:
    """One row per actor the fleet launched with counters: bytes from the store and from peers, priced."""
    rows = []
    for actor, read in sorted(reads.items()):
        if actor not in placement:
            continue  # not an actor of this fleet's ledger: nothing to bill it to
        at = placement[actor]
        store_price = _usd_per_gb(store_at, at)
        usd, unpriced = 0.0, 0
        if store_price is None:
            unpriced += read.store
        else:
            usd += read.store / egress.GB * store_price
        for site, n in read.peers.items():
            parent = split_site(site)
            price = _usd_per_gb(at if parent is None else (parent[0].lower(), parent[1]), at)
            if price is None:
                unpriced += n
            else:
                usd += n / egress.GB * price
        rows.append({"actor_id": actor, "provider": at[0], "region": at[1], "bytes_from_store": read.store,
                     "bytes_from_peers": sum(read.peers.values()), "peers_by_site": dict(read.peers),
                     "store_usd_per_gb": store_price, "usd": usd, "unpriced_bytes": unpriced})
    return rows


def cost_report(store: ObjectStore, *, summary: dict | None = None, now: float | None = None) -> dict:
    """Every cost figure of the run at ``store`` (JSON-ready). ``summary`` (steps, eval_before,
    eval_after, wall_seconds) defaults to ``reports/summary.json`` when the run has one."""
    now = time.time() if now is None else now
    summary = summary if summary is not None else _get(store, layout.SUMMARY)
    events = read_events(store)
    facts = _ledger_facts(store)
    rows = worker_rows(events, now, learner_activity=facts["written"])
    run = RunInfo.read(store)
    timeline = _timeline(events)
    if not any(r["role"] == "learner" for r in rows):
        rows += _learner_rows(run, summary, facts, timeline, now)
    learner_rows = [r for r in rows if r["role"] == "learner"]
    gaps = learner_bill.gaps(learner_rows, timeline, now=now, committed=facts["committed"]) if learner_rows else []
    learner = learner_bill.learner_summary(learner_rows, gaps, [r for r in rows if r["role"] != "learner"],
                                           market=run.learner_market, now=now)
    store_at = run.store_site
    traffic = traffic_rows(egress.read_snapshots(store), _placement(rows), store_at)
    gpu_usd = sum(r["usd"] for r in rows)
    traffic_usd = sum(t["usd"] for t in traffic)
    total = gpu_usd + traffic_usd
    steps = int(_num(summary.get("steps"), facts["steps"]))
    completions = facts["completions_used"]
    before, after = _num(summary.get("eval_before")), _num(summary.get("eval_after"))
    # accuracy points only for an accuracy (a poker run's headline is bb/100, not a fraction)
    is_accuracy = summary.get("eval_metric", "accuracy") == "accuracy"
    gain = (after - before) * 100 if before is not None and after is not None and is_accuracy else None
    marks = [{"ts": float(e["ts"]), "what": failure_kind(e), "actor_id": str(e.get("actor_id", "?"))}
             for e in _timeline(events) if failure_kind(e)]
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
        "by_role": _group(rows, "role"),
        "by_gpu": _group(rows, "gpu"),
        "by_provider": _group(rows, "provider"),
        "by_market": _group(rows, "market"),
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
        "learner": learner,
        "computed_at": now,
        "workers": rows,
    }


def _usd(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"${x:,.{digits}f}"


def _bytes(n: float) -> str:
    """GB (10^9 bytes, as billed), or MB below a tenth of one."""
    return f"{n / egress.GB:.3f} GB" if n >= egress.GB / 10 else f"{n / 1e6:.3f} MB"


def cost_markdown(report: dict) -> str:
    """The Markdown report (``reports/cost.md``, and the Prefect cost artifact)."""
    sim = " (simulated prices)" if report["simulated_prices"] else ""
    lines = [f"## Cost of {report['run_id']}: {_usd(report['total_usd'])}{sim}", ""]
    if sim:
        lines += ["Some workers were priced as catalog offers they are not (simulated_price): the dollars are "
                  "what their hours would have cost, not a bill.", ""]
    if not report.get("priced_resources", True):
        lines += [f"No priced resources in this run: {NO_PRICES_WHY}.", ""]
    saved = report["on_demand_equivalent_usd"] - report["total_usd"]
    gain = report["accuracy_points_gained"]
    lines += [f"- {report['hours']:.4f} worker-hours; {report['steps']} steps, "
              f"{report['completions_used']} completions used",
              f"- per step: {_usd(report['usd_per_step'], 6)}; "
              f"per 1k rollouts: {_usd(report['usd_per_1k_rollouts'], 6)}",
              f"- per accuracy point: {_usd(report['usd_per_accuracy_point'], 6)}"
              + (f" ({report['eval_before']:.3f} -> {report['eval_after']:.3f}, {gain:+.1f} points)" if gain is not None
                 else " (no eval before and after)"),
              f"- all on-demand the same hours would have cost {_usd(report['on_demand_equivalent_usd'])}"
              + (f" ({saved / report['on_demand_equivalent_usd']:.0%} saved)" if report["on_demand_equivalent_usd"] > 0
                 else ""),
              f"- reclaims: {report['reclaims']}, crashes: {report['crashes']}",
              f"- GPU {_usd(report['gpu_usd'])}, traffic {_usd(report['traffic_usd'], 6)}: "
              f"{_bytes(report['traffic_bytes_from_store'])} read from the store"
              f" ({report['store_site'] or 'where it lives is unknown: set store.provider and store.region'}), "
              f"{_bytes(report['traffic_bytes_from_peers'])} from relay peers"]
    if report["traffic_unpriced_bytes"]:
        lines.append(f"- {_bytes(report['traffic_unpriced_bytes'])} of that traffic is unpriced: the "
                     "store's or an actor's place is not known")
    lines += learner_bill.learner_lines(report["learner"])
    if not report["learner_priced"]:
        lines.append("- the learner is unpriced ($0): the run's config has no learner price "
                     f"(`{'.'.join(LEARNER_PRICE_FIELD)}`)")
    if report["still_running"]:
        lines.append(f"- {report['still_running']} worker(s) have no end event: billed until the report was made")
    lines += ["", "| by | name | hours | $ |", "| --- | --- | ---: | ---: |"]
    for label, field in (("provider", "by_provider"), ("GPU", "by_gpu"), ("role", "by_role"), ("market", "by_market")):
        lines += [f"| {label} | {name} | {g['hours']:.4f} | {g['usd']:.4f} |" for name, g in report[field].items()]
    lines += ["", "| worker | role | provider | GPU | region | market | $/h | on-demand $/h | hours | $ | end |",
              "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in report["workers"]:
        role = r["role"] if r["priced"] else f"{r['role']} (unpriced)"
        lines.append(f"| {r['actor_id']} | {role} | {r['provider']} | {r['gpu']} | {r['region']} | {r['market']} | "
                     f"{r['price_usd_per_hour']:.4f} | {r['on_demand_usd_per_hour']:.4f} | {r['hours']:.4f} | "
                     f"{r['usd']:.4f} | {r['ended_by'] or 'running'} |")
    lines += learner_bill.gap_table(report["learner"])
    if report["traffic"]:
        lines += ["", "| actor | provider | region | GB from the store | $/GB from the store | GB from peers | $ |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for t in report["traffic"]:
            price = "unpriced" if t["store_usd_per_gb"] is None else f"{t['store_usd_per_gb']:.4f}"
            lines.append(f"| {t['actor_id']} | {t['provider'] or '?'} | {t['region'] or '?'} | "
                         f"{t['bytes_from_store'] / egress.GB:.4f} | {price} | "
                         f"{t['bytes_from_peers'] / egress.GB:.4f} | {t['usd']:.4f} |")
    return "\n".join(lines) + "\n"


def cost_png(report: dict) -> bytes:
    """Cumulative cost and workers alive over time, reclaims and crashes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows, now = report["workers"], report["computed_at"]
    spans = [(r["start"], r["end"] if r["end"] is not None else now, r) for r in rows]
    t0 = min((s for s, _, _ in spans), default=now)
    t1 = max([e for _, e, _ in spans] + [m["ts"] for m in report["failures"]] + [t0 + 1])
    points = sorted({t0, t1, *(s for s, _, _ in spans), *(e for _, e, _ in spans),
                     *(t0 + (t1 - t0) * i / 200 for i in range(201))})
    cum = [sum(r["price_usd_per_hour"] * max(0.0, min(e, t) - s) / 3600 for s, e, r in spans) for t in points]
    alive = [sum(1 for s, e, r in spans if r["role"] != "learner" and s <= t < e) for t in points]
    minutes = [(t - t0) / 60 for t in points]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    if report.get("priced_resources", True):
        ax1.plot(minutes, cum)
        ax1.set_title(f"{report['run_id']}: {_usd(report['total_usd'])}"
                      + (" (simulated prices)" if report["simulated_prices"] else ""))
    else:  # a flat line at $0 would read as "free"
        ax1.text(0.5, 0.5, "no priced resources in this run", ha="center", va="center", transform=ax1.transAxes)
        ax1.set_title(f"{report['run_id']}: no priced resources")
    ax1.set_ylabel("cumulative $")
    ax2.step(minutes, alive, where="post")
    ax2.set_ylabel("actors alive")
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("minutes since the run started")
    for i, g in enumerate(report.get("learner", {}).get("gaps", [])):  # the learner away, the actors waiting
        for ax in (ax1, ax2):
            ax.axvspan((g["start"] - t0) / 60, (g["end"] - t0) / 60, color="grey", alpha=0.2,
                       label="learner gap" if i == 0 and ax is ax2 else None)
    for what, color, plural in (("reclaim", "red", "reclaims"), ("crash", "orange", "crashes")):
        xs = [(m["ts"] - t0) / 60 for m in report["failures"] if m["what"] == what]
        for i, x in enumerate(xs):
            for ax in (ax1, ax2):
                label = plural if i == 0 and ax is ax2 else None
                ax.axvline(x, color=color, linestyle="--", linewidth=1, label=label)
    if report["failures"] or report.get("learner", {}).get("gaps"):
        ax2.legend(loc="best")
    return figure_png(fig)


def write_cost_reports(store: ObjectStore, *, summary: dict | None = None, now: float | None = None) -> dict:
    """Fold the byte counters of actors still registered into the ledger (``egress.py``), compute the report
    and write ``reports/cost.json``, ``cost.md`` and ``cost.png`` (overwriting: ``echo2 report`` recomputes a
    finished or crashed run's report from its ledger)."""
    launched = {str(e.get("actor_id")) for e in read_events(store) if isinstance(e, dict) and e.get("kind") in STARTS}
    egress.EgressLedger(store).fold(launched)  # the counters of actors still registered, before they are gone
    report = cost_report(store, summary=summary, now=now)
    store.put_json(layout.report_key("cost.json"), report, if_absent=False)
    store.put(layout.report_key("cost.md"), cost_markdown(report).encode(), if_absent=False)
    store.put(layout.report_key("cost.png"), cost_png(report), if_absent=False)
    return report


def fleet_usd(store: ObjectStore, now: float | None = None) -> float:
    """Dollars the actors have cost so far (the flow's live ``usd_so_far``)."""
    return sum(r["usd"] for r in actor_costs(read_events(store), now))
