"""Cost benchmark: activation's fleet against an all-on-demand single-GPU-type fleet of equal throughput.

The target is "R rollouts/s of an N-billion-parameter model", i.e. ``R x L`` output tokens/s
for completions of L tokens. Each GPU's speed comes from the worker profiles
(``infra/profiles/rollout-throughput.yaml``); a size between two profiled sizes (4B lies between
1.5B and 7B) is interpolated log-log per GPU (``prices.Profile.speed``), and runs given with
``measured_runs`` replace profile figures with what their ledgers measured (``fleet/sizing/measured.py``).

Two fleets meet the target, both from the same price source and under the same per-offer caps:

* activation (``fleet/sizing/activation.py``): any mix of offers, spot and on-demand, sized on expected
  throughput after reclaims;
* the baseline: the cheapest fleet of one GPU type bought on-demand only (``activation.baseline``),
  i.e. the best a planner can do without spot and without mixing types.

Both figures, their ratio, and the on-demand fleet of every GPU type are reported, so the ratio
can be read against any single type, not only the cheapest. Pure computation: no GPU, no network
(unless the price source is ``aws`` or ``skypilot``).

Traffic (the issue-21 column): what getting every policy version to each fleet costs over a run of
``run_versions`` versions (``RUN_VERSIONS``, over ``run_hours`` for the GPU dollars beside it), with the relay
and region-aware roots (one actor per provider and region reads the store, the rest read from peers there)
against every actor reading the store (``fleet/planner/traffic.py``). A version weighs the mean of a keyframe
every ``keyframe_every`` versions and sparse deltas at ``changed_fraction`` of a bf16 model of
``model_params_b`` (``fleet/planner/dissemination.py``); the store sits at ``store`` (provider, region); each
instance is one actor and holds one copy of the weights.
"""

from __future__ import annotations

import time

from echo2.errors import Echo2InputError
from echo2.fleet.planner.dissemination import (
    DEFAULT_CHANGED_FRACTION,
    DEFAULT_CHANGED_FRACTION_SOURCE,
    DEFAULT_KEYFRAME_EVERY,
    version_bytes,
)
from echo2.fleet.planner.traffic import traffic_per_run
from echo2.fleet.prices import make_price_source
from echo2.fleet.prices.catalog import DEFAULT_PROFILES, load_profiles
from echo2.fleet.sizing.activation import (
    CAPS,
    CAPS_SOURCE,
    RECLAIM_PER_HOUR,
    RECLAIM_SOURCE,
    RECOVERY_SECONDS,
    activate,
    baseline,
    candidates,
    parse_overrides,
)
from echo2.fleet.sizing.measured import measure_run, with_measurements

SWEEP = (8.0, 32.0, 128.0, 512.0, 1024.0)
"""Rollouts/s the table also shows (``--sweep``): from a few GPUs' worth to more than marketplaces offer."""
ACCEPTANCE_RATIO = 0.4
"""The fleet issue's acceptance: activation costs at most this share of the baseline."""
DEFAULT_STORE = ("aws", "us-east-1")
"""Where the run's object store lives unless ``--store`` says otherwise (an assumption: a common default region)."""
RUN_VERSIONS = 1000
"""Versions (learner steps) in the run the traffic column prices."""
RUN_HOURS = 10.0
"""Hours of that run, for the GPU dollars beside the traffic (1000 steps in 10 h: a 36 s step)."""


def parse_store(value: str | tuple[str, str]) -> tuple[str, str]:
    """``PROVIDER:REGION`` (``aws:us-east-1``) or a (provider, region) pair."""
    if isinstance(value, tuple):
        return value
    provider, sep, region = value.partition(":")
    if not (sep and provider.strip() and region.strip()):
        raise Echo2InputError(f"--store must be PROVIDER:REGION (e.g. aws:us-east-1), got {value!r:.80}")
    return provider.strip().lower(), region.strip()


def _fleet_traffic(fleet, per_version: float, versions: int, store: tuple[str, str], hours: float) -> dict | None:
    """Traffic over the run for the fleet ``fleet`` (an Activation), relay and store-only, beside its GPU dollars."""
    if fleet is None:
        return None
    actors = [(c.offer.provider, c.offer.region, n) for c, n in fleet.fleet]
    run = traffic_per_run(per_version, versions, actors, store)
    relay, store_only = run["relay"], run["store_only"]
    return {"relay_usd": relay["usd"], "store_only_usd": store_only["usd"],
            "relay_over_store_only": relay["usd"] / store_only["usd"] if store_only["usd"] else None,
            "relay_store_reads_per_version": relay["roots"], "actors": sum(n for _, _, n in actors),
            "relay_bytes_from_store": relay["bytes_from_store"], "store_only_bytes_from_store":
                store_only["bytes_from_store"], "gpu_usd": fleet.usd_per_hour * hours,
            "by_provider": {"relay": relay["by_provider"], "store_only": store_only["by_provider"]}}


def _interpolation(profiles: dict, model_params_b: float) -> str:
    sizes = sorted({s for p in profiles.values() for s in p.tokens_per_second if p.name.lower() != "cpu"})
    if model_params_b in sizes:
        return f"{model_params_b:g}B is a profiled size"
    lower = [s for s in sizes if s < model_params_b]
    upper = [s for s in sizes if s > model_params_b]
    if lower and upper:
        return (f"{model_params_b:g}B is not a profiled size ({', '.join(f'{s:g}' for s in sizes)}): each GPU's "
                f"tokens/s is interpolated log-log between its {max(lower):g}B and {min(upper):g}B figures")
    return (f"{model_params_b:g}B is outside the profiled sizes ({', '.join(f'{s:g}' for s in sizes)}): "
            "scaled as 1/params above the largest, the smallest's figure below it")


def run_cost_bench(*, rollouts_per_second: float = 32.0, model_params_b: float = 4.0, completion_tokens: float = 512.0,
                   source: str = "snapshot", source_options: dict | None = None, profiles_path=None,
                   reclaim: dict | list[str] | None = None, caps: dict | list[str] | None = None,
                   recovery_seconds: float = RECOVERY_SECONDS,
                   budget_usd_per_hour: float | None = None, measured_runs: list[str] | None = None,
                   sweep: tuple[float, ...] | None = None, store: str | tuple[str, str] = DEFAULT_STORE,
                   run_versions: int = RUN_VERSIONS, run_hours: float = RUN_HOURS,
                   keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
                   changed_fraction: float = DEFAULT_CHANGED_FRACTION) -> dict:
    """Activation and the baseline for one target, a JSON-ready dict: ``activation_usd_per_hour``,
    ``baseline_usd_per_hour``, ``ratio``, the fleets (``activation``, ``baseline``), the on-demand
    fleet of every GPU type, the assumptions; with ``sweep``, the two figures at each of those
    rollouts/s too (``sweep``), since where spot pays off depends on the size of the fleet; ``traffic``: each
    fleet's traffic over a run of ``run_versions`` versions, with the relay and with every actor reading the store
    at ``store`` (module docstring)."""
    started = time.perf_counter()
    if not (rollouts_per_second > 0 and model_params_b > 0 and completion_tokens > 0 and recovery_seconds >= 0):
        raise Echo2InputError("rollouts per second, model size and completion tokens must be > 0, "
                              "recovery seconds >= 0")
    if not (isinstance(run_versions, int) and run_versions >= 1 and run_hours > 0):
        raise Echo2InputError("--run-versions must be an integer >= 1 and --run-hours > 0")
    store = parse_store(store)
    vbytes = version_bytes(model_params_b * 1e9, keyframe_every=keyframe_every, changed_fraction=changed_fraction)
    if isinstance(reclaim, list):  # KEY=VALUE options from the command line
        reclaim = parse_overrides(reclaim, "--reclaim-rate")
    if isinstance(caps, list):
        caps = parse_overrides(caps, "--cap", int)
    prices = make_price_source(source, **(source_options or {}))
    offers = prices.offers()
    profiles = load_profiles(profiles_path or DEFAULT_PROFILES)
    measurements = []
    if measured_runs:
        from echo2.fleet.sizing.fit import open_run

        for run in measured_runs:
            measurements += measure_run(open_run(run))
        profiles = with_measurements(profiles, measurements)
    target = rollouts_per_second * completion_tokens
    cands = candidates(offers, profiles, model_params_b, reclaim=reclaim, caps=caps, recovery_seconds=recovery_seconds)
    fleet = activate(cands, target, budget_usd_per_hour=budget_usd_per_hour)
    base = baseline(cands, target)
    by_gpu = []
    for gpu in sorted({c.gpu_type for c in cands if not c.spot}):
        one = activate([c for c in cands if not c.spot and c.gpu_type == gpu], target)
        by_gpu.append({"gpu": gpu, "usd_per_hour": one.usd_per_hour if one else None,
                       "instances": one.instances if one else None,
                       "activation_over_this": (fleet.usd_per_hour / one.usd_per_hour) if one and fleet else None})
    by_gpu.sort(key=lambda r: (r["usd_per_hour"] is None, r["usd_per_hour"] or 0.0, r["gpu"]))
    points = []
    for rate in sweep or ():
        f, g = activate(cands, rate * completion_tokens, budget_usd_per_hour=budget_usd_per_hour), \
            baseline(cands, rate * completion_tokens)
        points.append({"rollouts_per_second": rate, "tokens_per_second": rate * completion_tokens,
                       "activation_usd_per_hour": f and f.usd_per_hour, "baseline_usd_per_hour": g and g.usd_per_hour,
                       "ratio": f.usd_per_hour / g.usd_per_hour if f and g else None,
                       "activation_instances": f and f.instances, "baseline_instances": g and g.instances,
                       "baseline_gpu": g.fleet[0][0].gpu_type if g else None,
                       "activation_spot_share":
                           f and sum(c.usd_per_hour * n for c, n in f.fleet if c.spot) / f.usd_per_hour,
                       "search_seconds": f and f.search_seconds,
                       "traffic": _fleet_traffic(f, vbytes["mean"], run_versions, store, run_hours)})
    a = fleet.usd_per_hour if fleet else None
    b = base.usd_per_hour if base else None
    ratio = a / b if a is not None and b else None
    return {
        "target": {"rollouts_per_second": rollouts_per_second, "completion_tokens": completion_tokens,
                   "tokens_per_second": target, "model_params_b": model_params_b,
                   "interpolation": _interpolation(profiles, model_params_b)},
        "prices": {**prices.describe(), "offers": len(offers)},
        "activation_usd_per_hour": a, "baseline_usd_per_hour": b, "ratio": ratio,
        "acceptance_ratio": ACCEPTANCE_RATIO, "meets_acceptance": ratio is not None and ratio <= ACCEPTANCE_RATIO,
        "activation": fleet.as_dict() if fleet else None, "baseline": base.as_dict() if base else None,
        "baseline_gpu": base.fleet[0][0].gpu_type if base else None, "on_demand_single_type": by_gpu,
        "sweep": points, "budget_usd_per_hour": budget_usd_per_hour, "measured": [m.as_dict() for m in measurements],
        "reclaim": {"per_hour": {f"{p}:{m}": r for (p, m), r in RECLAIM_PER_HOUR.items()}, "overrides": reclaim or {},
                    "recovery_seconds": recovery_seconds, "source": RECLAIM_SOURCE},
        "caps": {"per_offer": CAPS, "overrides": caps or {}, "source": CAPS_SOURCE},
        "traffic": {"store": {"provider": store[0], "region": store[1]}, "run_versions": run_versions,
                    "run_hours": run_hours, "version_bytes": vbytes, "keyframe_every": keyframe_every,
                    "changed_fraction": changed_fraction,
                    "changed_fraction_source": DEFAULT_CHANGED_FRACTION_SOURCE
                    if changed_fraction == DEFAULT_CHANGED_FRACTION else "given",
                    "activation": _fleet_traffic(fleet, vbytes["mean"], run_versions, store, run_hours),
                    "baseline": _fleet_traffic(base, vbytes["mean"], run_versions, store, run_hours),
                    "assumptions": "one actor per instance, one copy of the weights each; the relay gives each "
                                   "(provider, region) one root reading the store; prices from "
                                   "echo2/fleet/providers.py (list prices, first paid tier, no free allowances), "
                                   "GB = 1e9 bytes; no retries"},
        "seconds": time.perf_counter() - started,
    }


def print_cost(result: dict, console=None) -> None:
    """The two fleets as rich tables, then both figures and the ratio."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        console = console if console.is_terminal else Console(width=170)  # a pipe gets whole names
    t, p = result["target"], result["prices"]
    console.print(f"target: {t['rollouts_per_second']:g} rollouts/s x {t['completion_tokens']:g} tokens = "
                  f"{t['tokens_per_second']:.0f} tokens/s of a {t['model_params_b']:g}B model ({t['interpolation']})")
    for key, title in (("activation", "activation: cheapest mix of spot and on-demand offers, sized for reclaims"),
                       ("baseline", f"baseline: all on-demand, one GPU type ({result['baseline_gpu']})")):
        fleet = result[key]
        if fleet is None:
            console.print(f"{key}: no fleet meets the target")
            continue
        table = Table(title=f"{title} -- prices: {p['source']} {p.get('date') or ''} {p['detail']}")
        for col in ("count", "offer", "market", "GPUs", "$/h each", "$/h", "tok/s each", "avail.", "exp. tok/s"):
            table.add_column(col, justify="left" if col in ("offer", "market") else "right")
        for row in fleet["fleet"]:
            o = row["offer"]
            table.add_row(str(row["count"]), o["name"], row["market"], f"{o['gpu']} x{o['gpu_count']}",
                          f"{row['usd_per_hour_each']:.4f}", f"{row['usd_per_hour']:.4f}",
                          f"{row['tokens_per_second_each']:.0f}", f"{row['availability']:.3f}",
                          f"{row['expected_throughput']:.0f}")
        console.print(table)
        console.print(f"{key}: ${fleet['usd_per_hour']:.4f}/h, {fleet['instances']} instances, {fleet['gpus']} GPUs, "
                      f"expected {fleet['expected_throughput']:.0f} tok/s (nominal {fleet['nominal_throughput']:.0f}); "
                      f"search {fleet['search_seconds'] * 1000:.1f} ms over {fleet['candidates']} candidates "
                      f"({fleet['types_searched']} after merging and dominance)"
                      + ("" if fleet["proven_optimal"] else "; search cut: maybe not optimal"))
    others = ", ".join(f"{r['gpu']} ${r['usd_per_hour']:.2f} ({r['activation_over_this']:.2f})"
                       for r in result["on_demand_single_type"] if r["activation_over_this"] is not None)
    console.print(f"on-demand single-type fleets for the same throughput (activation / that fleet): {others}")
    tr = result["traffic"]
    run = f"{tr['run_versions']} versions in {tr['run_hours']:g} h"
    if result["sweep"]:
        table = Table(title="the same at other rollout rates (activation vs the cheapest on-demand single type); "
                            f"traffic of activation's fleet per run of {run}: relay with region-aware roots / every "
                            "actor reading the store")
        for col in ("rollouts/s", "tokens/s", "activation $/h", "spot share", "baseline $/h", "baseline GPU", "ratio",
                    "search ms", "traffic $/run relay", "store-only"):
            table.add_column(col, justify="right")
        for r in result["sweep"]:
            ok = r["ratio"] is not None
            t = r["traffic"]
            table.add_row(f"{r['rollouts_per_second']:g}", f"{r['tokens_per_second']:.0f}",
                          f"{r['activation_usd_per_hour']:.2f}" if ok else "-",
                          f"{r['activation_spot_share']:.0%}" if ok else "-",
                          f"{r['baseline_usd_per_hour']:.2f}" if ok else "-", r["baseline_gpu"] or "-",
                          f"{r['ratio']:.3f}" if ok else "-", f"{r['search_seconds'] * 1000:.0f}" if ok else "-",
                          f"{t['relay_usd']:.2f}" if t else "-", f"{t['store_only_usd']:.2f}" if t else "-")
        console.print(table)
    vb = tr["version_bytes"]
    console.print(f"traffic per run of {run}, store at {tr['store']['provider']}:{tr['store']['region']}: a version "
                  f"of the {result['target']['model_params_b']:g}B model weighs {vb['mean'] / 1e6:.1f} MB on average "
                  f"(a bf16 keyframe of {vb['keyframe'] / 1e6:.0f} MB every {tr['keyframe_every']}, deltas of "
                  f"{vb['delta'] / 1e6:.1f} MB at {tr['changed_fraction']:.1%} changed)")
    for key in ("activation", "baseline"):
        t = tr[key]
        if t is not None:
            ratio = f" ({t['relay_over_store_only']:.2f}x)" if t["relay_over_store_only"] is not None else ""
            actors = f"{t['actors']} actor{'' if t['actors'] == 1 else 's'}"
            console.print(f"  {key}: {actors}; relay ${t['relay_usd']:.2f}{ratio} "
                          f"({t['relay_store_reads_per_version']} store reads a version) vs every actor reading the "
                          f"store ${t['store_only_usd']:.2f}; GPUs over the run ${t['gpu_usd']:.2f}")
    if result["ratio"] is not None:
        console.print(f"activation ${result['activation_usd_per_hour']:.4f}/h vs baseline "
                      f"${result['baseline_usd_per_hour']:.4f}/h: ratio {result['ratio']:.3f} "
                      f"(acceptance <= {result['acceptance_ratio']}: "
                      f"{'met' if result['meets_acceptance'] else 'NOT met'})")
        if result["ratio"] > 1 - 1e-9:  # activation searches every mix, single-type on-demand fleets included
            console.print("the cheapest mix at this rate is itself an on-demand fleet of one type: no mix of these "
                          "offers costs less; spot pays where the cheapest on-demand rows run out (see the sweep)")
