"""The words beside a plan's numbers: the verdict against the reference rows and the list of every assumption the
answer used, each with its source (``run_plan.plan_run`` fills both)."""

from __future__ import annotations

from echo2.fleet.planner import spot_learner, step_time
from echo2.fleet.planner.workload_file import WorkloadFile
from echo2.fleet.prices.catalog import Profile, gpu_key
from echo2.fleet.providers import BURST_SOURCE

ROLLOUT_BYTES_PER_TOKEN = 8.0
LEARNER_BYTES_PER_PARAM = 16.0
"""Training state per parameter: fp32 master weights, gradients and AdamW's two moments (4 x 4 bytes; bf16 copies
and activations are left to the rest of the GPU), sharded over the learner's GPUs (FSDP)."""


def verdict(out: dict, wf: WorkloadFile) -> str:
    """One line: does echo2 beat each reference row, and if not, which assumption keeps it above."""
    if not wf.compare:
        return ""
    ref = min(wf.compare, key=lambda r: r.usd)
    usd_ok, hours_ok = out["usd_total"] <= ref.usd, out["hours"] <= ref.hours
    head = (f"echo2 predicts ${out['usd_total']:,.0f} in {out['hours']:.1f} h against {ref.name}'s "
            f"${ref.usd:,.0f} in {ref.hours:g} h")
    if usd_ok and hours_ok:
        return head + ": at or under both, on these assumptions (the ones the hours follow are listed first)."
    parts = []
    step = out["learner_step"]
    if not hours_ok:
        if step.get("from") == "FLOP model" and out.get("bound") == "learner":
            need = step["mfu"] * (out["hours"] * 3600 - out["startup_seconds"]) / (ref.hours * 3600 -
                                                                                   out["startup_seconds"])
            parts.append(f"hours: learner-bound at MFU {step['mfu']:.0%} ({step['mfu_source'].split(':')[0]}); "
                         f"MFU >= {need:.0%} would reach {ref.hours:g} h")
        else:
            parts.append(f"hours: {out.get('bound', '?')}-bound at {out['step_seconds']:.0f} s/step "
                         f"x {out['steps']} steps")
    if not usd_ok:
        biggest = max(("learner", out["usd_learner"]), ("actors", out["usd_actors"]),
                      ("traffic", out["usd_traffic"]), key=lambda kv: kv[1])
        parts.append(f"cost: the {biggest[0]} (${biggest[1]:,.0f}) is the largest share")
    return head + "; above it -- " + "; ".join(parts) + "."


def assumptions(wf: WorkloadFile, t_info: dict, changed: tuple[float, str], total_b: float,
                active_b: float | None, profiles: dict[str, Profile], fleet: list) -> list[dict]:
    """Every value the plan used, with its source; ``fleet`` is the chosen [(Candidate, count)] (its speeds and their
    sources: the decode model's or the profile's)."""
    rows = [a for a in wf.assumptions() if a["name"] not in ("network.changed_fraction", "learner.mfu")]
    if t_info.get("from") == "FLOP model":
        rows.insert(0, {"name": "learner.mfu", "value": t_info["mfu"], "source": t_info["mfu_source"]})
        rows.insert(1, {"name": "learner bf16 peak (TFLOP/s per GPU)", "value": t_info["peak_tflops"],
                        "source": step_time.PEAK_SOURCE})
        rows.insert(2, {"name": "learner FLOPs per token", "value": "(6 x signal_share + 2 x audit_fraction) x active",
                        "source": "step_time.py: 6N training (forward + backward) on the groups with a signal + 2N "
                                  "spot check recomputation"})
    rows.append({"name": "network.changed_fraction", "value": changed[0], "source": changed[1]})
    decoded = any(c.speed_source.startswith("decode model") for c, _ in fleet)
    some = next(iter(profiles.values()), None)
    if active_b is not None and some is not None and not decoded:
        rows.append({"name": "MoE decode bytes factor", "value": some.moe_bytes_factor,
                     "source": "infra/profiles/rollout-throughput.yaml moe.bytes_factor: an estimate, not measured"})
    seen = set()
    for c, _ in fleet:
        label = f"actor speed {c.offer.gpu} x{c.offer.gpu_count} (tok/s per GPU)"
        if label not in seen:
            seen.add(label)
            rows.append({"name": label, "value": round(c.tokens_per_second / c.offer.gpu_count),
                         "source": c.speed_source})
    for name in wf.actors.gpus or []:
        profile = profiles.get(gpu_key(name))
        if profile is not None and not fleet:
            rows.append({"name": f"actor speed {profile.name} (tok/s per GPU)",
                         "value": round(profile.speed(total_b, active_b)), "source": profile.source})
    rows.append({"name": "learner training state (bytes per parameter)", "value": LEARNER_BYTES_PER_PARAM,
                 "source": "assumption: fp32 weights, gradients and AdamW moments, sharded over the learner's GPUs"})
    rows.append({"name": "rollout bytes per completion token", "value": ROLLOUT_BYTES_PER_TOKEN,
                 "source": "assumption: token id + behavior logprob, 4 bytes each, uncompressed"})
    rows.append({"name": "spot learner notice by provider (share of reclaims, seconds)",
                 "value": spot_learner.NOTICE, "source": spot_learner.NOTICE_SOURCE})
    rows.append({"name": "provider facts (reclaim rate, bursts, cap, egress)", "value": "providers.py",
                 "source": "echo2/fleet/providers.py: each provider's row states its source; " + BURST_SOURCE})
    return rows
