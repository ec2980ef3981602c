"""Worker profiles overridden by what earlier runs measured.

The profiles (``infra/profiles/rollout-throughput.yaml``) are estimates. A run records, for each
rollout file, the completion tokens it holds and the seconds its batch took to generate
(``generation_seconds``, the same on every row of a file: the engine call's wall time), and the
ledger's fleet events record which GPU each actor ran on (``gpu``, ``gpu_count``: the offer's
fields, ``backend.Offer.event_fields``). Together they give a measured rollout speed per GPU:

    an actor's tokens/s per GPU = median over its files of policy tokens (completion_mask = 1) /
                                  (generation_seconds x gpu_count)
    a GPU's tokens/s per GPU    = median over the actors that ran on it (and over runs, ``merge``)

over every file a step used of an actor whose GPU is known (version 0 left out when later files exist:
the first batch carries the engine's warm-up), as its ledger entry records them (``fit.used_files``:
no actor's file is read, and none a step did not use). Per actor first, then across actors, so that no actor's
claims weigh more than another's however many files it wrote, and one liar among several moves the median by
at most one place; each claimed time is cut to the store's own clock first (``fit.bounded``: at most the time
between the actor's previous commit and this one, so ``generation_seconds`` = 3e38 cannot zero a GPU's speed),
and an actor the run banned or expelled is not measured at all. Events of a local process *priced as* an offer
(``simulated_price``) are ignored: the process ran on this machine's CPU, not on that GPU.

The model size is the event's ``model_params_b`` when the fleet recorded it, else what the caller
says the run trained; a measurement of unknown size is reported but never applied. Applying:
``with_measurements`` puts each measured figure into its GPU's profile at the measured size,
replacing a listed figure within ``SIZE_TOLERANCE`` (so the measured figure is what that GPU is
planned with at that size, and nearby sizes interpolate from it), and names the run in the
profile's ``source``. ``speed_for`` is the one-call form for one GPU and size.

Actors are untrusted: their numbers only feed this estimate (finite and positive or skipped, bounded by the
store's clock, one median per actor).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace

from echo2.data.ledger import read_events
from echo2.data.store import ObjectStore
from echo2.fleet.prices.catalog import Profile, gpu_key, profile_for
from echo2.fleet.sizing.fit import actor_starts, banned_actors, bounded, file_limit, used_files

SIZE_TOLERANCE = 0.05
"""A measurement at 1.47B replaces the profile's 1.5B figure (relative size difference <= 5%)."""


@dataclass(frozen=True)
class Measurement:
    """A GPU's measured rollout speed at one model size, over one or more runs."""

    gpu: str
    model_params_b: float | None
    tokens: int
    gpu_seconds: float
    files: int
    runs: tuple[str, ...]
    actor_speeds: tuple[float, ...] = ()
    """Each measured actor's median tokens/s per GPU (``tokens_per_second`` is their median)."""

    @property
    def tokens_per_second(self) -> float:
        """Per GPU: the median of the actors' medians (see the module docstring)."""
        return statistics.median(self.actor_speeds) if self.actor_speeds else self.tokens / self.gpu_seconds

    def as_dict(self) -> dict:
        return {"gpu": self.gpu, "model_params_b": self.model_params_b, "tokens_per_second": self.tokens_per_second,
                "tokens": self.tokens, "gpu_seconds": self.gpu_seconds, "files": self.files, "runs": list(self.runs)}


def _positive(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def actor_gpus(events: list[dict]) -> dict[str, tuple[str, int, float | None]]:
    """Actor id -> (GPU, GPU count, model size or None) from the newest event that names a real GPU."""
    out: dict[str, tuple[str, int, float | None]] = {}
    for e in sorted(events, key=lambda e: e.get("ts", 0)):
        gpu = e.get("gpu")
        if not isinstance(gpu, str) or not gpu or e.get("simulated_price") or not isinstance(e.get("actor_id"), str):
            continue
        count = _positive(e.get("gpu_count")) or 1.0
        out[e["actor_id"]] = (gpu, max(1, int(count)), _positive(e.get("model_params_b")))
    return out


def measure_run(store: ObjectStore, model_params_b: float | None = None) -> list[Measurement]:
    """The measured speed of every (GPU, model size) the run in ``store`` used."""
    events = read_events(store)
    gpus, banned = actor_gpus(events), banned_actors(store, events)
    files = defaultdict(list)
    for f in bounded(store, used_files(store, max_file_bytes=file_limit(store)), actor_starts(events)):
        if f.actor in gpus and f.actor not in banned:
            files[f.actor].append(f)
    totals: dict[tuple[str, float | None], list] = {}
    for actor, used in files.items():
        speeds = []
        for f in [f for f in used if f.version > 0] or used:
            seconds, tokens = _positive(f.measured.get("generation_seconds")), f.measured.get("tokens") or 0
            if seconds is None or tokens <= 0:
                continue
            speeds.append(_add(totals, gpus[actor], model_params_b, int(tokens), seconds))
        if speeds:
            totals[_key(gpus[actor], model_params_b)][4].append(statistics.median(speeds))
    return [Measurement(gpu, size, tokens, seconds, n, (store.url,), tuple(speeds))
            for (_, size), (gpu, tokens, seconds, n, speeds) in sorted(totals.items(), key=lambda kv: str(kv[0]))]


def _key(gpu_of_actor: tuple[str, int, float | None], model_params_b: float | None) -> tuple[str, float | None]:
    gpu, _, size = gpu_of_actor
    return gpu_key(gpu), size if size is not None else model_params_b


def _add(totals: dict, gpu_of_actor: tuple[str, int, float | None], model_params_b: float | None, tokens: int,
         seconds: float) -> float:
    """Add one file's tokens and GPU-seconds to its (GPU, model size) total; the file's tokens/s per GPU."""
    gpu, count, _ = gpu_of_actor
    t = totals.setdefault(_key(gpu_of_actor, model_params_b), [gpu, 0, 0.0, 0, []])
    t[1] += tokens
    t[2] += seconds * count
    t[3] += 1
    return tokens / (seconds * count)


def merge(measurements: list[Measurement]) -> list[Measurement]:
    """One measurement per (GPU, size) over several runs: tokens and GPU-seconds add up."""
    out: dict[tuple[str, float | None], Measurement] = {}
    for m in measurements:
        key = (gpu_key(m.gpu), m.model_params_b)
        if key in out:
            o = out[key]
            m = Measurement(o.gpu, o.model_params_b, o.tokens + m.tokens, o.gpu_seconds + m.gpu_seconds,
                            o.files + m.files, tuple(dict.fromkeys(o.runs + m.runs)), o.actor_speeds + m.actor_speeds)
        out[key] = m
    return list(out.values())


def with_measurements(profiles: dict[str, Profile], measurements: list[Measurement]) -> dict[str, Profile]:
    """The profiles with each measured figure in place of the estimate at its size (see the module
    docstring); a GPU nobody profiled gets a profile of its measurements alone."""
    out = dict(profiles)
    for m in merge(measurements):
        if m.model_params_b is None:
            continue
        old = profile_for(out, m.gpu) or Profile(m.gpu, {}, "")
        table = {s: v for s, v in old.tokens_per_second.items()
                 if abs(s - m.model_params_b) > SIZE_TOLERANCE * m.model_params_b}
        table[m.model_params_b] = m.tokens_per_second
        note = (f"measured {m.tokens_per_second:.0f} tok/s/GPU at {m.model_params_b:g}B "
                f"({m.files} files of {', '.join(r.rstrip('/').rsplit('/', 1)[-1] for r in m.runs)})")
        new = replace(old, tokens_per_second=table, source=f"{note}; else {old.source}" if old.source else note)
        for key in {gpu_key(m.gpu), gpu_key(old.name), *(gpu_key(a) for a in old.aliases)}:
            out[key] = new
    return out


def speed_for(profiles: dict[str, Profile], gpu: str, model_params_b: float,
              measurements: list[Measurement] = ()) -> tuple[float, str] | None:
    """(tokens/s per GPU, where the figure comes from) for ``gpu`` at ``model_params_b``: the
    measured figure when a run measured that GPU at that size, else the profile's; None when
    neither knows the GPU."""
    merged = merge(list(measurements))
    for m in merged:
        if gpu_key(m.gpu) == gpu_key(gpu) and m.model_params_b is not None and \
                abs(m.model_params_b - model_params_b) <= SIZE_TOLERANCE * model_params_b:
            return m.tokens_per_second, f"measured ({m.files} files of {len(m.runs)} run(s))"
    profile = profile_for(with_measurements(profiles, merged), gpu)
    if profile is None:
        return None
    return profile.speed(model_params_b), profile.source
