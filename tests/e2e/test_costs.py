"""The cost report (echo2/fleet/bill/) and the audit (echo2/data/audit.py) on synthetic ledgers,
and `echo2 report` / `echo2 audit` through the real CLI.

Totals are recomputed here from the raw event files, independently of bill/report.py, so a change in how
rows are built cannot quietly change the bill."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import T0, commit_rollouts, new_run

from echo2.data import layout, ledger
from echo2.data.audit import audit_run
from echo2.fleet.bill.ledger import fleet_usd
from echo2.fleet.bill.report import cost_report, write_cost_reports

REPO = Path(__file__).resolve().parents[2]


def event(store, clock, at_hours, kind, actor, **fields):
    clock[0] = T0 + at_hours * 3600
    ledger.write_event(store, kind, actor, **fields)


def fleet_history(store, clock):
    """Five actor lives across three providers: a reclaim and a crash, each replaced, one still running."""
    event(store, clock, 0, "launch", "a1", backend="skypilot", provider="aws", gpu="H100", region="us-east-1",
          spot=True, price_usd_per_hour=2.0, on_demand_usd_per_hour=8.0)
    event(store, clock, 0, "launch", "a3", backend="local", pid=1, price_usd_per_hour=0.0)
    event(store, clock, 0.2, "resize", "fleet", actors_from=1, actors_to=2, reason="test")
    event(store, clock, 0.5, "crashed", "a3", detail="exit code 1, log a3.log")
    event(store, clock, 0.5, "launch", "a4", backend="skypilot", provider="lambda", gpu="A100-80GB", spot=False,
          price_usd_per_hour=1.5)
    event(store, clock, 1, "reclaimed", "a1")
    event(store, clock, 1, "launch", "a2", backend="skypilot", provider="gcp", gpu="L4", spot=True,
          price_usd_per_hour="not a number")
    event(store, clock, 1.1, "running", "a2", region="us-central1", price_usd_per_hour=0.5, on_demand_usd_per_hour=1.0)
    event(store, clock, 1.5, "terminated", "a4", code=0)
    event(store, clock, 2, "resume", "learner", step=3, orphaned=0, orphaned_rollouts=[])
    event(store, clock, 2.5, "launch", "a5", backend="skypilot", provider="aws", gpu="H100", price_usd_per_hour=4.0)
    event(store, clock, 3, "terminated", "a2", code=-15)


def recompute(run_dir: Path, now: float) -> dict:
    """The bill from the raw event files: per actor, launch to its first end, at its last price."""
    lives: dict[str, dict] = {}
    for path in sorted((run_dir / "ledger" / "events").glob("*.json")):
        e = json.loads(path.read_text())
        life = lives.setdefault(e["actor_id"], {"price": 0.0, "od": None, "gpu": "none", "end": None})
        if e["kind"] == "launch":
            life["start"] = e["ts"]
        if e["kind"] in ("exited", "terminated", "reclaimed", "crashed") and life["end"] is None:
            life["end"] = e["ts"]
        if isinstance(e.get("price_usd_per_hour"), float):
            life["price"] = e["price_usd_per_hour"]
        life["od"] = e.get("on_demand_usd_per_hour", life["od"])
        life["gpu"] = e.get("gpu", life["gpu"])
    out = {"total": 0.0, "od": 0.0, "gpu": {}}
    for life in lives.values():
        if "start" not in life:
            continue
        hours = ((life["end"] or now) - life["start"]) / 3600
        out["total"] += hours * life["price"]
        out["od"] += hours * (life["od"] if life["od"] is not None else life["price"])
        out["gpu"][life["gpu"]] = out["gpu"].get(life["gpu"], 0.0) + hours * life["price"]
    return out


def test_cost_report_totals_equal_the_ledger_events(tmp_path, clock):
    run_dir = tmp_path / "runs" / "costly"
    summary = {"run_id": "costly", "steps": 10, "eval_before": 0.2, "eval_after": 0.45, "wall_seconds": 3 * 3600}
    store = new_run(run_dir, config={"fleet": {"learner_usd_per_hour": 3.0}}, summary=summary)
    fleet_history(store, clock)
    ledger.write_consumed(store, 1, {"used": [{"key": "rollouts/v000000/a1-000000.arrow", "rows": 400, "lag": 0}]})
    now = T0 + 3 * 3600
    report = write_cost_reports(store, now=now)
    expected = recompute(run_dir, now)

    assert expected["total"] == pytest.approx(2 + 1 + 0 + 1.5 + 2)  # the hand-made bill, checked once
    # priced from the config, per learner session: the run's start to its last activity before the resume at 2 h
    # (a4's end at 1.5 h), then the resume to the run's last activity (3 h); the half hour between is a gap
    learner_usd = 3.0 * (1.5 + 1)
    assert report["total_usd"] == pytest.approx(expected["total"] + learner_usd)
    assert report["by_role"]["actor"]["usd"] == pytest.approx(expected["total"])
    assert report["by_role"]["learner"] == pytest.approx({"hours": 2.5, "usd": learner_usd})
    assert report["learner"]["sessions"] == 2 and report["learner"]["reclaims"] == 1
    assert report["learner"]["gap_hours"] == pytest.approx(0.5)
    assert {g: v["usd"] for g, v in report["by_gpu"].items() if g != "unknown"} == pytest.approx(expected["gpu"])
    assert sum(v["usd"] for v in report["by_provider"].values()) == pytest.approx(report["total_usd"])
    assert report["by_provider"]["aws"]["usd"] == pytest.approx(2 + 2)
    assert report["by_market"]["spot"]["usd"] == pytest.approx(2 + 1)
    # the same hours at each offer's on-demand price (equal to the price where the event has none)
    assert report["on_demand_equivalent_usd"] == pytest.approx(expected["od"] + learner_usd)
    assert report["on_demand_equivalent_usd"] == pytest.approx(8 + 2 + 0 + 1.5 + 2 + learner_usd)
    assert report["usd_per_step"] == pytest.approx(report["total_usd"] / 10)
    assert report["usd_per_1k_rollouts"] == pytest.approx(report["total_usd"] / 400 * 1000)
    assert report["usd_per_accuracy_point"] == pytest.approx(report["total_usd"] / 25)
    assert report["still_running"] == 1 and report["reclaims"] == 1 and report["crashes"] == 1
    assert not report["simulated_prices"] and report["learner_priced"]
    # what the flow shows while the run goes on: the actors only, from the same rows
    assert fleet_usd(store, now=now) == pytest.approx(expected["total"])

    written = json.loads((run_dir / "reports" / "cost.json").read_text())
    assert written["total_usd"] == pytest.approx(report["total_usd"])
    md = (run_dir / "reports" / "cost.md").read_text()
    assert md.startswith("## Cost of costly: $14.0000\n") and "simulated" not in md
    assert "| GPU | H100 | 1.5000 | 4.0000 |" in md and "per accuracy point: $0.560000" in md
    assert (run_dir / "reports" / "cost.png").read_bytes()[:4] == b"\x89PNG"


def test_local_actors_killed_with_the_learner_are_billed_until_it_died(tmp_path, clock):
    """A SIGKILLed learner writes no `terminated` for its local actors, which die with it (PDEATHSIG):
    their rows end at its last ledger activity, not at the next resume or the time of the report."""
    store = new_run(tmp_path / "killed")
    event(store, clock, 0, "launch", "l1", backend="local", price_usd_per_hour=1.0)
    event(store, clock, 0, "launch", "c1", backend="skypilot", price_usd_per_hour=2.0)
    clock[0] = T0 + 3600
    ledger.write_consumed(store, 1, {"used": []})  # the learner's last step; then SIGKILL
    event(store, clock, 5, "resume", "learner", step=1, orphaned=0, orphaned_rollouts=[])  # resumed 4 h later
    event(store, clock, 5, "launch", "l2", backend="local", price_usd_per_hour=1.0)
    clock[0] = T0 + 6 * 3600
    ledger.write_consumed(store, 2, {"used": []})  # killed again, and nobody resumes
    report = cost_report(store, now=T0 + 100 * 3600)  # the report, days later
    rows = {r["actor_id"]: r for r in report["workers"]}
    assert rows["l1"]["hours"] == pytest.approx(1) and rows["l1"]["ended_by"] == "died with the learner"
    assert rows["l2"]["hours"] == pytest.approx(1) and rows["l2"]["ended_by"] == "died with the learner"
    # a cloud VM does not die with the learner (SkyPilot actors can outlive it): billed until seen gone
    assert rows["c1"]["hours"] == pytest.approx(100) and report["still_running"] == 1
    # the live figure of a running learner: the first local actor stopped costing at the resume, the
    # cloud VM and the new local actor go on until now
    assert fleet_usd(store, now=T0 + 50 * 3600) - fleet_usd(store, now=T0 + 6 * 3600) == pytest.approx((2 + 1) * 44)


def test_simulated_prices_and_an_unpriced_learner_say_so(tmp_path, clock):
    store = new_run(tmp_path / "sim")
    event(store, clock, 0, "launch", "a0", backend="local", provider="runpod", gpu="RTX 4090", spot=True,
          price_usd_per_hour=0.3, on_demand_usd_per_hour=0.7, simulated_price=True)
    event(store, clock, 2, "terminated", "a0", code=0)
    report = cost_report(store, now=T0 + 2 * 3600)
    assert report["simulated_prices"] and report["total_usd"] == pytest.approx(0.6)
    assert report["on_demand_equivalent_usd"] == pytest.approx(1.4)
    # no summary: the learner ran until the last ledger activity, and has no price in the config
    assert not report["learner_priced"] and report["by_role"]["learner"]["usd"] == 0
    from echo2.fleet.bill.render import cost_markdown

    md = cost_markdown(report)
    assert md.splitlines()[0] == "## Cost of sim: $0.6000 (simulated prices)"
    assert "learner (unpriced)" in md and "57% saved" in md


def test_malformed_events_fall_back_to_defaults(tmp_path):
    rows = cost_report(new_run(tmp_path / "odd"), now=T0)["workers"]
    assert [r["role"] for r in rows] == ["learner"]
    from echo2.fleet.bill.ledger import worker_rows

    odd = [{"ts": "x", "kind": "launch", "actor_id": "bad"}, {"kind": "launch"}, "junk",
           {"ts": T0, "kind": "launch", "actor_id": "a", "price_usd_per_hour": -5, "spot": "yes", "gpu": {"x": 1}},
           {"ts": T0 + 3600, "kind": "exited", "actor_id": "a", "code": 0}]
    (row,) = worker_rows(odd, now=T0 + 7200)
    assert (row["hours"] == pytest.approx(1) and row["usd"] == 0 and row["market"] == "on-demand"
            and row["gpu"] == "none")


def audit_fixture(run_dir: Path, *, finished: bool = True):
    """Eight committed files: two used (one of them twice), one lost, two quarantined (one by an
    amendment after it was used), one stale, one unused at the end, one orphaned by a resume."""
    store = new_run(run_dir)
    keys = {name: commit_rollouts(store, v, seq, actor=name, data=b"x")
            for name, v, seq in (("used", 1, 0), ("twice", 1, 1), ("bad", 1, 2), ("lost", 1, 3), ("amended", 1, 4),
                                 ("stale", 0, 0), ("left", 3, 0))}
    orphan = commit_rollouts(store, 5, 0, actor="orphan", data=b"x")
    store.move(orphan, layout.orphaned_prefix("123") + orphan)
    for name in ("bad", "amended"):
        store.put_json(layout.quarantine_reason_key(keys[name]), {"key": keys[name], "reason": "invalid"})
        store.move(keys[name], layout.quarantine_key(keys[name]))
    item = lambda name, **kw: {"key": keys[name], "rows": 4, "lag": 0, **kw}  # noqa: E731
    ledger.write_consumed(store, 1, {"used": [item("used"), item("twice"), item("amended")],
                                     "quarantined": [{"key": keys["bad"], "reason": "invalid"}]})
    ledger.write_consumed(store, 1, {"quarantined": [{"key": keys["amended"], "reason": "non-finite"}]},
                          amendment="quarantine")
    ledger.write_consumed(store, 2, {"used": [item("twice")],
                                     "dropped": [item("stale", reason="stale: lag 2 > S=1")]})
    if finished:
        ledger.write_final(store, 2, [keys["left"]])
    for kind, actor, fields in (("launch", "a1", {}), ("reclaimed", "a1", {}), ("launch", "a2", {}),
                                ("crashed", "a2", {"detail": "exit code 1"}), ("launch", "a3", {}),
                                ("exited", "a3", {"detail": "exit code 0"}),
                                ("resume", "learner", {"step": 4, "orphaned_rollouts": [orphan]}),
                                ("reclaimed", "a3", {})):
        ledger.write_event(store, kind, actor, **fields)
    return store


def test_audit_accounts_for_every_committed_file(tmp_path):
    result = audit_run(audit_fixture(tmp_path / "audited"))
    assert result["finished"] and result["committed"] == 8
    assert (result["used"] == 2 and result["used_twice"] == 1
            and result["used_twice_files"][0].endswith("twice-000001.arrow"))
    assert result["quarantined"] == 2
    assert result["dropped"] == {"orphaned": 1, "stale": 1, "unused_at_end": 1}
    assert result["lost"] == 1 and result["lost_files"][0].endswith("lost-000003.arrow")
    assert result["pending"] == 0 and result["orphaned"] == 1
    assert result["used"] + sum(result["dropped"].values()) + result["quarantined"] + result["lost"] == 8
    # a reclaim and a crash, each followed by a launch; the clean exit is no failure; the last reclaim is not replaced
    assert (result["reclaims"], result["crashes"], result["replacements"]) == (2, 1, 2)
    assert result["unreplaced"] == ["a3 (reclaim)"]


def test_the_audit_counts_fleet_failures_as_the_real_manager_records_them(tmp_path):
    """The events come from the real fleet manager and local backend, with real processes (one exits 0,
    one exits 3), not from a hand-made ledger: the audit's rules must fit what the manager writes, which
    is a ``crashed`` event for a nonzero exit and an ``exited`` event, with no exit code, for code 0."""
    from echo2.config import LocalFleetConfig
    from echo2.fleet.backends.base import ActorLaunch
    from echo2.fleet.backends.local import LocalBackend
    from echo2.fleet.manager import FleetManager

    store = new_run(tmp_path / "fleet")
    first = iter(["raise SystemExit(0)", "raise SystemExit(3)"])  # the two first actors; replacements wait
    backend = LocalBackend(LocalFleetConfig(), tmp_path / "logs")

    def spec(actor_id, offer):
        body = next(first, "import time\nwhile True: time.sleep(0.1)")
        return ActorLaunch(actor_id, store.url, [sys.executable, "-c", body], offer=offer)

    fleet = FleetManager(backend, LocalFleetConfig(actors=2, max_restarts=3), store, launch_spec=spec)
    fleet.start()
    try:
        for proc in list(backend.procs.values()):
            proc.wait(timeout=60)
        fleet.reconcile()  # records both ends and launches two replacements
    finally:
        fleet.stop()
    ended = {e["kind"]: e for e in ledger.read_events(store) if e["kind"] in ("exited", "crashed")}
    assert set(ended) == {"exited", "crashed"} and "code" not in ended["exited"], ended
    result = audit_run(store)
    assert (result["reclaims"], result["crashes"], result["replacements"], result["unreplaced"]) == (0, 1, 1, [])
    assert cost_report(store)["crashes"] == 1
    # what the manager never writes decides nothing: an `exited` event is a clean end whatever it carries
    from echo2.data.audit import failure_kind

    assert failure_kind({"kind": "exited", "actor_id": "a", "code": 1}) is None


def test_a_file_committed_after_the_run_finished_is_not_lost(tmp_path):
    """A (hostile or unstopped) actor writing on after the final entry: the run was over, nothing was lost."""
    store = audit_fixture(tmp_path / "late")
    for path in (tmp_path / "late").rglob("*.arrow"):  # by the store's own clock: the run's files, the final
        os.utime(path, (time.time() - 120,) * 2)       # entry, then the late file
    os.utime(tmp_path / "late" / layout.FINAL_CONSUMED, (time.time() - 60,) * 2)
    late = commit_rollouts(store, 3, 7, actor="late", data=b"x")
    assert store.modified(late) > store.modified(layout.FINAL_CONSUMED)
    result = audit_run(store)
    assert result["dropped"]["after_end"] == 1 and result["lost"] == 1  # the fixture's own lost file only
    assert not any("late" in p for p in result["problems"])


def test_an_unfinished_run_has_pending_files_not_lost_ones(tmp_path):
    result = audit_run(audit_fixture(tmp_path / "crashed", finished=False))
    assert result["lost"] == 0 and result["pending"] == 2  # the unrecorded one and the one final would list


def echo2(*args):
    return subprocess.run([sys.executable, "-m", "echo2.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.e2e
def test_audit_and_report_through_the_cli(tmp_path, clock):
    bad = tmp_path / "runs" / "bad"
    audit_fixture(bad)
    proc = echo2("audit", str(bad), "--json")
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout)
    for field in ("committed", "used", "dropped", "quarantined", "lost", "used_twice", "reclaims", "replacements"):
        assert field in result, field
    assert result["lost"] == 1 and result["used_twice"] == 1

    good = tmp_path / "runs" / "good"
    store = new_run(good, summary={"run_id": "good", "steps": 1, "eval_before": 0.1, "eval_after": 0.3,
                                   "wall_seconds": 60.0})
    key = commit_rollouts(store, 0, 0, data=b"x")
    ledger.write_consumed(store, 1, {"used": [{"key": key, "rows": 8, "lag": 0}]})
    ledger.write_final(store, 1, [])
    event(store, clock, 0, "launch", "a0", backend="local", gpu="L4", price_usd_per_hour=0.8, simulated_price=True)
    event(store, clock, 0.5, "terminated", "a0", code=0)
    proc = echo2("audit", str(good))
    assert proc.returncode == 0 and "1 committed rollout files (finished run): 1 used" in proc.stdout, proc.stdout
    proc = echo2("report", f"file://{good}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("## Cost of good: $0.4000 (simulated prices)")
    cost = json.loads((good / "reports" / "cost.json").read_text())
    for field in ("total_usd", "by_role", "by_gpu", "by_provider", "usd_per_step", "usd_per_1k_rollouts",
                  "on_demand_equivalent_usd", "simulated_prices"):
        assert field in cost, field
    assert cost["usd_per_1k_rollouts"] == pytest.approx(0.4 / 8 * 1000) and cost["by_gpu"]["L4"]["usd"] == 0.4
    assert (good / "reports" / "cost.png").stat().st_size > 1000

    proc = echo2("audit", str(tmp_path / "nothing-here"))
    assert proc.returncode == 2 and "not a run folder" in proc.stderr


def test_a_run_with_nothing_priced_says_so_instead_of_charting_zeros(tmp_path, clock, monkeypatch):
    """The quickstart's bill: local actors at $0 and a learner without a price. A cost chart of a flat $0 line
    reads as "free"; the report says that nothing was priced, in its Markdown and on its chart."""
    from echo2.fleet.bill import render

    store = new_run(tmp_path / "local")
    event(store, clock, 0, "launch", "a0", backend="local", pid=1, price_usd_per_hour=0.0)
    event(store, clock, 1, "terminated", "a0", code=0)
    report = cost_report(store, now=T0 + 3600)
    assert report["total_usd"] == 0 and not report["priced_resources"]
    assert "No priced resources in this run" in render.cost_markdown(report)
    figures = []
    monkeypatch.setattr(render, "figure_png", lambda fig: figures.append(fig) or b"")
    render.cost_png(report)
    top = figures[0].axes[0]
    assert not top.lines and any(t.get_text() == "no priced resources in this run" for t in top.texts)

    event(store, clock, 1, "launch", "a1", backend="skypilot", provider="aws", gpu="L4", price_usd_per_hour=0.5)
    priced = cost_report(store, now=T0 + 2 * 3600)
    assert priced["priced_resources"] and "No priced resources" not in render.cost_markdown(priced)
    render.cost_png(priced)
    assert figures[1].axes[0].lines and not figures[1].axes[0].texts
