"""The cost report rendered: Markdown (``reports/cost.md``, the Prefect cost artifact, ``echo2 report``) and the PNG
chart (``reports/cost.png``: cumulative dollars and actors alive over time, reclaims, crashes and learner gaps
marked). Everything here reads a finished report (``report.cost_report``'s dict) and computes no figure of its own.

A report whose prices are marked ``simulated_price`` (a local actor priced as a catalog offer) says "simulated
prices" in its title: the dollars are what the hours would have cost, not a bill. One with no priced resource says
that its $0 means unknown, not free, and its chart draws no line at $0.
"""

from __future__ import annotations

from typing import Any

from echo2.fleet.bill.egress import GB
from echo2.fleet.bill.learner import LEARNER_PRICE_FIELD
from echo2.plots import figure_png

NO_PRICES_WHY = "no worker and no traffic had a price, so the $0 figures below mean unknown, not free"


def _usd(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"${x:,.{digits}f}"


def _bytes(n: float) -> str:
    """GB (10^9 bytes, as billed), or MB below a tenth of one."""
    return f"{n / GB:.3f} GB" if n >= GB / 10 else f"{n / 1e6:.3f} MB"


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
    lines += learner_lines(report["learner"])
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
    lines += gap_table(report["learner"])
    if report["traffic"]:
        lines += ["", "| actor | provider | region | GB from the store | $/GB from the store | GB from peers | $ |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for t in report["traffic"]:
            price = "unpriced" if t["store_usd_per_gb"] is None else f"{t['store_usd_per_gb']:.4f}"
            lines.append(f"| {t['actor_id']} | {t['provider'] or '?'} | {t['region'] or '?'} | "
                         f"{t['bytes_from_store'] / GB:.4f} | {price} | "
                         f"{t['bytes_from_peers'] / GB:.4f} | {t['usd']:.4f} |")
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


def learner_lines(learner: dict) -> list[str]:
    """The cost report's Markdown lines about the learner (``cost_markdown``)."""
    lines = [f"- learner: {learner['market']}, {learner['sessions']} session(s), {learner['hours']:.4f} h, "
             f"${learner['usd']:,.4f}"]
    if learner["reclaims"]:
        lines.append(f"- learner reclaims: {learner['reclaims']} ({learner['with_notice']} with a notice); the "
                     f"gap {learner['gap_hours']:.4f} h with the actors waiting: ${learner['gap_actor_usd']:,.4f} "
                     "of their bill fell in it (the learner's machine is not billed in a gap)")
    return lines


def _or(value: Any, default: str) -> str:
    return default if value is None else str(value)


def gap_table(learner: dict) -> list[str]:
    """One Markdown row per gap (none without gaps)."""
    if not learner["gaps"]:
        return []
    lines = ["", "| learner gap | last step | notice | hours | actors' $ in it | resumed from step | steps lost |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for i, g in enumerate(learner["gaps"], 1):
        notice = f"yes ({g['source']})" if g["notice"] else ("left, no notice" if g["left"] else "no")
        lines.append(f"| {i} | {_or(g['last_step'], _or(g['step'], '?'))} | {notice} | {g['hours']:.4f} | "
                     f"{g['actor_usd']:.4f} | {_or(g['resume_step'], '?') if g['resumed'] else 'not yet'} | "
                     f"{_or(g['steps_lost'], '?')} |")
    return lines
