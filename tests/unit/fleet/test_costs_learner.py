"""The learner's bill by market and session, and the gaps between sessions (echo2/fleet/bill/learner.py through
bill/report.py), on hand-built ledgers in a local store: the figures below are worked out by hand from the events."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import T0, new_run

from echo2.data import ledger
from echo2.fleet.bill.render import cost_markdown
from echo2.fleet.bill.report import cost_report, write_cost_reports

REPO = Path(__file__).resolve().parents[3]
H = 3600.0


def at(clock, hours: float) -> None:
    clock[0] = T0 + hours * H


def event(store, clock, hours, kind, actor="learner", **fields):
    at(clock, hours)
    ledger.write_event(store, kind, actor, **fields)


def step(store, clock, hours, n):
    at(clock, hours)
    ledger.write_consumed(store, n, {"used": []})


SPOT = {"fleet": {"learner_usd_per_hour": 6.0}, "learner": {"market": "spot"}}


def two_reclaims(store, clock):
    """A spot learner reclaimed twice: once with a notice (it checkpointed and left), once without (SIGKILL after
    its last step); one cloud actor at $2/h kept running through both gaps."""
    event(store, clock, 0, "launch", "a1", backend="skypilot", provider="aws", gpu="H100", spot=True,
          price_usd_per_hour=2.0)
    step(store, clock, 0.5, 1)
    step(store, clock, 1.0, 2)
    event(store, clock, 1.2, "learner_notice", step=2, source="aws", deadline_s=120)
    event(store, clock, 1.25, "learner_left", step=2, reason="notice", checkpoint_step=2, notice_to_checkpoint_s=40,
          abandoned_step=True)
    event(store, clock, 1.5, "resume", step=2, orphaned=0, orphaned_rollouts=[])  # the relaunched learner
    step(store, clock, 2.0, 3)
    step(store, clock, 3.0, 4)  # then killed without a notice
    event(store, clock, 3.5, "resume", step=4, orphaned=0, orphaned_rollouts=[])
    step(store, clock, 4.0, 5)
    event(store, clock, 5.0, "terminated", "a1", code=0)


def test_a_spot_learner_is_billed_per_session_and_the_gaps_are_counted(tmp_path, clock):
    store = new_run(tmp_path / "spot", SPOT, summary={"run_id": "spot", "steps": 5, "wall_seconds": 3.0 * H,
                                                      "finished_at": T0 + 4.5 * H})
    two_reclaims(store, clock)
    report = write_cost_reports(store, now=T0 + 6 * H)
    learner = report["learner"]
    # sessions: 0 -> 1.25 h (it left), 1.5 -> 3 h (its last step), 3.5 -> 4.5 h (finished_at)
    assert learner["market"] == "spot" and learner["sessions"] == 3
    assert learner["hours"] == pytest.approx(1.25 + 1.5 + 1.0)
    assert learner["usd"] == pytest.approx(6.0 * 3.75)
    # gaps: from the notice (1.2 h) to the resume, and from the last step (3 h) to the resume
    assert learner["reclaims"] == 2 and learner["with_notice"] == 1
    assert learner["gap_hours"] == pytest.approx(0.3 + 0.5)
    assert learner["gap_actor_usd"] == pytest.approx(2.0 * 0.8)  # a1 was up through both
    first, second = learner["gaps"]
    assert first["notice"] and first["source"] == "aws" and first["step"] == 2 and first["resume_step"] == 2
    assert not second["notice"] and not second["left"] and second["resume_step"] == 4 and second["resumed"]
    assert first["last_step"] == 2 and second["last_step"] == 4 and first["steps_lost"] == second["steps_lost"] == 0
    # the learner's rows are in the spot market, and the gap share is inside the actors' bill, not added to it
    assert report["by_market"]["spot"]["usd"] == pytest.approx(6.0 * 3.75 + 2.0 * 5)
    assert report["total_usd"] == pytest.approx(6.0 * 3.75 + 2.0 * 5)
    assert [r["ended_by"] for r in report["workers"] if r["role"] == "learner"] == ["restarted", "restarted",
                                                                                    "finished"]
    md = (tmp_path / "spot" / "reports" / "cost.md").read_text()
    assert "- learner: spot, 3 session(s), 3.7500 h, $22.5000" in md
    assert "- learner reclaims: 2 (1 with a notice); the gap 0.8000 h with the actors waiting: $1.6000" in md
    assert "| 1 | 2 | yes (aws) | 0.3000 | 0.6000 | 2 | 0 |" in md and "| 2 | 4 | no | 0.5000 | 1.0000 | 4 | 0 |" in md
    written = json.loads((tmp_path / "spot" / "reports" / "cost.json").read_text())
    assert {k: written["learner"][k] for k in ("market", "sessions", "reclaims")} == {
        "market": "spot", "sessions": 3, "reclaims": 2}
    assert (tmp_path / "spot" / "reports" / "cost.png").read_bytes()[:4] == b"\x89PNG"


def test_a_learner_gone_on_a_notice_and_not_back_yet_is_an_open_gap(tmp_path, clock):
    store = new_run(tmp_path / "away", SPOT)
    event(store, clock, 0, "launch", "a1", backend="skypilot", provider="gcp", gpu="L4", spot=True,
          price_usd_per_hour=1.0)
    step(store, clock, 1.0, 1)
    event(store, clock, 2.0, "learner_notice", step=1, source="gcp", deadline_s=30)
    event(store, clock, 2.01, "learner_left", step=1, reason="notice", checkpoint_step=1, notice_to_checkpoint_s=20,
          abandoned_step=False)
    report = cost_report(store, now=T0 + 3 * H)  # an hour later: the actor still waits
    learner = report["learner"]
    assert learner["sessions"] == 1 and learner["hours"] == pytest.approx(2.01)
    assert learner["reclaims"] == 1 and learner["gap_hours"] == pytest.approx(1.0)
    assert learner["gap_actor_usd"] == pytest.approx(1.0) and not learner["gaps"][0]["resumed"]
    assert "| 1 | 1 | yes (gcp) | 1.0000 | 1.0000 | not yet | ? |" in cost_markdown(report)


def test_an_on_demand_learner_that_never_left_has_one_session_and_no_gap(tmp_path, clock):
    store = new_run(tmp_path / "plain", {"fleet": {"learner_usd_per_hour": 4.0}},
                    summary={"run_id": "plain", "steps": 2, "wall_seconds": 2 * H})
    step(store, clock, 1.0, 1)
    step(store, clock, 1.9, 2)
    report = cost_report(store, now=T0 + 5 * H)
    learner = report["learner"]
    assert learner["market"] == "on-demand" and learner["sessions"] == 1
    assert learner["hours"] == pytest.approx(2.0)  # no finished_at: the summary's wall seconds, as before sessions
    assert learner["reclaims"] == 0 and learner["gap_hours"] == 0 and learner["gap_actor_usd"] == 0
    md = cost_markdown(report)
    assert "- learner: on-demand, 1 session(s), 2.0000 h, $8.0000" in md
    assert "learner reclaims" not in md and "learner gap" not in md


def test_echo2_report_shows_the_spot_hours_and_the_gap(tmp_path, clock):
    run_dir = tmp_path / "runs" / "spotcli"
    store = new_run(run_dir, SPOT, summary={"run_id": "spotcli", "steps": 5, "finished_at": T0 + 4.5 * H})
    two_reclaims(store, clock)
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "report", str(run_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "- learner: spot, 3 session(s), 3.7500 h" in proc.stdout
    assert "learner reclaims: 2 (1 with a notice)" in proc.stdout


def test_steps_the_resume_went_back_over_are_counted_per_gap(tmp_path, clock):
    """Killed without a notice two steps after its last checkpoint: the resume (the real orphan_after) moves the
    entries of steps 4 and 5 aside and the relaunched learner goes on from step 3; the dead learner's session still
    ends at step 5's entry, and the gap threw away 2 steps."""
    from echo2.data.run_folder import orphan_after

    store = new_run(tmp_path / "lost", SPOT)
    for n in range(1, 6):
        step(store, clock, 0.2 * n, n)
    at(clock, 1.5)
    orphan_after(store, 3)
    event(store, clock, 1.5, "resume", step=3, orphaned=2, orphaned_rollouts=[])
    step(store, clock, 1.7, 4)
    report = cost_report(store, now=T0 + 2 * H)
    gap = report["learner"]["gaps"][0]
    assert gap["last_step"] == 5 and gap["resume_step"] == 3 and gap["steps_lost"] == 2
    assert gap["start"] == pytest.approx(T0 + 1.0 * H) and gap["hours"] == pytest.approx(0.5)
    assert report["learner"]["hours"] == pytest.approx(1.0 + 0.2)  # 0 -> step 5's entry, 1.5 h -> 1.7 h
