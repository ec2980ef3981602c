"""``echo2 audit``: every committed rollout file of a run, and how the ledger accounts for it.

The ledger is the run's only record of what the learner did with the rollouts it was sent; the
audit checks that record against what lies in the store, so a bug that trains on a file twice or
forgets one shows up as a number, not as a silently skewed gradient. It is pure data-plane code
(store + ledger) so that both the CLI and the tests use the same rules.

Each committed file lands in exactly one category:

- ``used``: a step trained on it (a later amendment that quarantined it moves it to ``quarantined``);
- ``dropped[category]``: a step or the final entry set it aside with a reason -- ``stale``,
  ``duplicate``, ``unused_at_end`` (left when the run finished), ``orphaned`` (moved to
  ``orphaned/<time>/`` by a resume because its policy version belongs to a lost timeline; the
  resume's ledger event is what settles it: a ``resume`` event that names it, or whose checkpoint
  step is older than its version);
- ``quarantined``: rejected by validation (under ``quarantine/``, with its reason);
- ``dropped[after_end]``: committed after the run's final entry (by the store's clock): the run was
  over, no step could use it (an actor that does not stop, or a hostile one, writing on);
- ``pending``: not settled yet, in a run that has not finished (a resume will settle it);
- ``lost``: nothing settles it although the run has finished (or an orphaned file no resume
  explains). Lost files and files used twice are the two failures (exit code 1 of the command).

Fleet health comes from ``ledger/events`` as the fleet manager writes them: ``reclaims`` (kind
``reclaimed``), ``crashes`` (kind ``crashed``: every backend reports a nonzero exit as a crash, and
``exited`` means code 0, so an ``exited`` event is never a failure) and ``replacements`` (each failure matched to the
first later launch not already matched; a launch naming ``replaces`` is matched to that actor).
"""

from __future__ import annotations

import collections
import math
from typing import Any

from echo2.data import layout
from echo2.data.ledger import SECTIONS, consumed_keys, consumed_records, read_events
from echo2.data.store import NotFound, ObjectStore

FAILURES = ("reclaimed", "crashed")
STARTS = ("launch", "requested")


def drop_category(reason: Any, final: bool = False) -> str:
    """``"stale: lag 3 > S=2"`` -> ``stale``: the word before the colon, what a dashboard groups by."""
    if final:
        return "unused_at_end"
    text = str(reason or "").strip()
    head = text.split(":", 1)[0].strip().lower().replace(" ", "_")
    return head or "other"


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float, or None: events and actor figures are parsed, never trusted."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def failure_kind(event: dict) -> str | None:
    """``reclaim``, ``crash`` or None: a reclaim is the provider taking the machine back; a crash is
    the actor dying by itself. Only the event's kind decides: the manager records an actor's end as
    ``reclaimed``, ``crashed`` or ``exited`` (code 0, ``ActorState.EXITED``) with a free-text
    ``detail``, and writes no exit code."""
    kind = event.get("kind")
    if kind in FAILURES:
        return "reclaim" if kind == "reclaimed" else "crash"
    return None


def fleet_failures(events: list[dict]) -> dict[str, Any]:
    """Reclaims, crashes and which of them a later launch replaced."""
    timeline = sorted((e for e in events if isinstance(e, dict) and finite_number(e.get("ts")) is not None),
                      key=lambda e: float(e["ts"]))
    failures: list[dict] = []
    launches: list[dict] = []
    for e in timeline:
        what = failure_kind(e)
        if what:
            failures.append({"actor_id": str(e.get("actor_id", "?")), "what": what, "ts": float(e["ts"]),
                             "replaced_by": None})
        elif e.get("kind") in STARTS:
            launches.append(e)
    taken: set[int] = set()
    for f in failures:  # explicit `replaces` first, then the first later launch nobody claimed
        for i, e in enumerate(launches):
            if i not in taken and e.get("replaces") == f["actor_id"] and float(e["ts"]) >= f["ts"]:
                taken.add(i)
                f["replaced_by"] = str(e.get("actor_id"))
                break
    for f in failures:
        if f["replaced_by"] is not None:
            continue
        for i, e in enumerate(launches):
            if i not in taken and not e.get("replaces") and float(e["ts"]) >= f["ts"]:
                taken.add(i)
                f["replaced_by"] = str(e.get("actor_id"))
                break
    return {"reclaims": sum(f["what"] == "reclaim" for f in failures),
            "crashes": sum(f["what"] == "crash" for f in failures),
            "replacements": sum(f["replaced_by"] is not None for f in failures),
            "unreplaced": [f"{f['actor_id']} ({f['what']})" for f in failures if f["replaced_by"] is None]}


def _resume_explains(events: list[dict], key: str) -> bool:
    version = layout.version_of_rollout_key(key)
    for e in events:
        if not isinstance(e, dict) or e.get("kind") != "resume":
            continue
        named = e.get("orphaned_rollouts")
        if isinstance(named, list) and key in named:
            return True
        step = finite_number(e.get("step"))
        if step is not None and version is not None and version > step:
            return True
    return False


def _committed_after(store: ObjectStore, key: str, final_at: float | None) -> bool:
    """Whether the store committed ``key`` after the final entry (False where it keeps no times)."""
    at = _modified(store, key) if final_at is not None else None
    return at is not None and at > final_at


def _modified(store: ObjectStore, key: str) -> float | None:
    """When the store committed ``key`` (None where it keeps no times, or the key is gone)."""
    try:
        return store.modified(key)
    except (NotImplementedError, NotFound):
        return None


def audit_run(store: ObjectStore) -> dict[str, Any]:
    """The audit of one run (see the module docstring); JSON-ready."""
    live = [k for k in store.list(layout.ROLLOUTS) if k.endswith(".arrow")]
    quarantined_files = [k[len(layout.QUARANTINE):] for k in store.list(layout.QUARANTINE) if k.endswith(".arrow")]
    orphaned_files = [k for k in store.list(layout.ORPHANED) if k.endswith(".arrow")]
    keys = consumed_keys(store)
    finished = layout.FINAL_CONSUMED in keys

    shown: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    drop_of: dict[str, str] = {}
    amended: set[str] = set()
    for entry_key, record in consumed_records(store, keys):
        if record.get("amendment"):  # corrects a step after training: used -> quarantined, not a 2nd showing
            amended.update(str(i.get("key")) for i in record.get("quarantined", []) if isinstance(i, dict))
            continue
        for section in SECTIONS:
            for item in record.get(section, []) or []:
                if not isinstance(item, dict) or "key" not in item:
                    continue
                shown[item["key"]][section] += 1
                if section == "dropped":
                    drop_of[item["key"]] = drop_category(item.get("reason"), entry_key == layout.FINAL_CONSUMED)

    events = read_events(store)
    category: dict[str, str] = {}
    problems: list[str] = []
    used_twice: list[str] = []
    final_at = _modified(store, layout.FINAL_CONSUMED) if finished else None  # read once, by the store's clock
    for key in sorted(set(live) | set(quarantined_files)):
        seen = shown.get(key, collections.Counter())
        total = sum(seen.values())
        if total == 0:
            if not finished:
                category[key] = "pending"
            elif _committed_after(store, key, final_at):
                category[key] = "dropped:after_end"
            else:
                category[key] = "lost"
                problems.append(f"{key}: committed but in no ledger entry")
            continue
        if seen["used"] > 1:
            used_twice.append(key)
            problems.append(f"{key}: used by {seen['used']} steps")
        elif total > 1:
            problems.append(f"{key}: settled {total} times ({dict(seen)})")
        if seen["used"] and key not in amended:
            category[key] = "used"
        elif seen["quarantined"] or key in amended:
            category[key] = "quarantined"
        else:
            category[key] = "dropped:" + drop_of.get(key, "other")
    present = set(live) | set(quarantined_files)
    for physical in sorted(orphaned_files):
        key = physical.split("/", 2)[2] if physical.count("/") >= 2 else physical
        if shown.get(key) and key not in present:
            problems.append(f"{key}: orphaned by a resume but in the ledger")
        if _resume_explains(events, key):
            category[physical] = "dropped:orphaned"
        else:
            category[physical] = "lost"
            problems.append(f"{physical}: orphaned, and no resume event explains it")

    counts = collections.Counter(category.values())
    dropped = {c.split(":", 1)[1]: n for c, n in sorted(counts.items()) if c.startswith("dropped:")}
    orphan_keys = {p.split("/", 2)[2] for p in orphaned_files if p.count("/") >= 2}
    missing = [k for k in shown if k not in present and k not in orphan_keys]
    return {
        "run": store.url,
        "finished": finished,
        "committed": len(category),
        "used": counts["used"],
        "dropped": dropped,
        "quarantined": counts["quarantined"],
        "pending": counts["pending"],
        "lost": counts["lost"],
        "used_twice": len(used_twice),
        **fleet_failures(events),
        "orphaned": len(orphaned_files),
        "ledger_keys_without_file": len(missing),
        "lost_files": sorted(k for k, c in category.items() if c == "lost"),
        "used_twice_files": used_twice,
        "problems": problems,
    }


def audit_failed(result: dict[str, Any]) -> bool:
    """The command's exit status: a lost file or a file trained on twice."""
    return result["lost"] > 0 or result["used_twice"] > 0
