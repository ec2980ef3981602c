"""A spot learner's preemption notice (issue 23, item 1; ``echo2/learner/notice.py``): the real echo2-train flow and
``LearnerRun`` with a tiny random model, in this process. What is not reached here is replaced at its boundary: the
fleet (``_Fleet``: records whether it was stopped; real actors are test_chaos' learner-reclaim scenario's) and the
actors' rollout files (``collect`` hands the step a batch built here, as test_interrupted_step.py does).

The signal is a real SIGTERM to this process, sent from inside the step where the test wants it; the metadata
notice comes from a local fake of GCP's metadata server (test_preemption.py's)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import pytest
from helpers import rollout_bytes
from preemption_shared import FakeMetadata

import echo2.flows.train as train_flow
from echo2 import preemption
from echo2.config import config_from_dict
from echo2.data import layout
from echo2.data.ledger import read_events
from echo2.data.rollouts import decode_rollouts
from echo2.data.store import open_store
from echo2.learner import notice as notice_module
from echo2.learner.collector import Selection
from echo2.learner.notice import LearnerReclaimed, NoticeInterrupt, SpotNotice, StepClock, finish_budget_s
from echo2.learner.run import LearnerRun


class _Fleet:
    """The fleet as the flow drives it; ``stopped`` says whether the learner stopped it."""

    made: list["_Fleet"] = []

    def __init__(self, *args, **kwargs):
        self.stopped = False
        self.revoked: set[str] = set()  # actors a resume could not adopt (FleetManager.revoked)
        _Fleet.made.append(self)

    def start(self):
        pass

    def autosize(self, step, size):
        pass

    def reconcile(self, expel=None):
        return {"revoked": [], "actors_alive": 1}

    def new_log_lines(self):
        return []

    def cost_so_far(self):
        return 0.0

    def stop(self):
        self.stopped = True


def _config(tmp_path, run_id: str, market: str, **learner):
    return config_from_dict({
        "run": {"id": run_id}, "store": {"url": str(tmp_path / "store")}, "model": {"name": str(tmp_path / "model")},
        "rollout": {"group_size": 2, "groups_per_batch": 2, "max_new_tokens": 4},
        "train": {"max_steps": 5, "checkpoint_every": 1000, "groups_per_step": 2},
        "trust": {"spot_check_fraction": 0}, "learner": {"num_threads": 1, "market": market, **learner},
        "eval": {"before": False, "after": False}, "fleet": {"actors": 1},
    })


@pytest.fixture
def flow_env(tiny_model, tmp_path, monkeypatch):
    """The flow with ``_Fleet`` and a ``collect`` that hands each step one file's batch; ``signal_in(step, where)``
    sends SIGTERM once, in ``collect`` or in the optimizer step of ``step``. Yields the test's tools."""
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    (tmp_path / "model").symlink_to(tiny_model)
    monkeypatch.setattr(train_flow, "make_fleet", _Fleet)
    _Fleet.made = []
    plan: dict = {}

    def collect(self, should_abort=lambda: None):
        step = self.step + 1
        if plan.get("step") == step and plan.get("where") == "collect":
            plan.pop("where")
            os.kill(os.getpid(), signal.SIGTERM)
        if not getattr(self.learner, "_wrapped", False):
            real = self.learner.train_step

            def train_step(tables, _real=real, _run=self):
                if plan.get("step") == _run.step + 1 and plan.get("where") == "step":
                    plan.pop("where")
                    plan.get("before", lambda: None)()  # what happens before the signal is sent (a cancel)
                    os.kill(os.getpid(), signal.SIGTERM)
                return _real(tables)

            self.learner.train_step, self.learner._wrapped = train_step, True
        key = layout.rollout_key(self.step, "a", step)
        data = rollout_bytes(self.step, run_id=self.run_id, salt=f"-{step}")
        return Selection(step=step, learner_version=self.step, tables=[decode_rollouts(data)],
                         used=[{"key": key, "sha256": f"{step:064d}", "groups": 2}])

    monkeypatch.setattr(LearnerRun, "collect", collect)

    def signal_in(step: int, where: str) -> None:
        plan.update(step=step, where=where)

    signal_in.plan = plan  # a test may add what happens just before the signal ("before")

    def run_store(run_id: str):
        return open_store(str(tmp_path / "store")).child(layout.RUNS).child(run_id)

    yield signal_in, run_store


def _events(store, kind: str) -> list[dict]:
    return sorted((e for e in read_events(store) if e["kind"] == kind), key=lambda e: e["ts"])


def _settled(store, step: int) -> list[str]:
    return json.loads(store.get(layout.checkpoint_dir(step) + "/trainer_state.json"))["settled"]


def test_a_spot_learner_finishes_the_step_that_fits_its_notice_leaves_its_fleet_running_and_a_retry_resumes(
        tmp_path, flow_env):
    """SIGTERM in step 3's optimizer step, with a notice of 60 s: step 3 finishes (it fits), is checkpointed, the
    learner leaves with ``learner_notice`` and ``learner_left`` and its fleet not stopped; the flow run fails with
    LearnerReclaimed, and Prefect's retry of the same flow run resumes the run from step 3 and finishes it."""
    signal_in, run_store = flow_env
    cfg = _config(tmp_path, "spot-finish", "spot", sigterm_notice_s=60)
    signal_in(3, "step")
    retried = train_flow.train.with_options(retries=1, retry_delay_seconds=0)
    summary = retried(config=cfg.model_dump(mode="json"))
    store = run_store("spot-finish")
    [heard] = _events(store, "learner_notice")
    [left] = _events(store, "learner_left")
    assert (heard["step"], heard["source"], heard["deadline_s"]) == (2, "sigterm", 60)
    assert left["step"] == left["checkpoint_step"] == 3 and left["reason"] == "notice"
    assert left["abandoned_step"] is False and 0 < left["notice_to_checkpoint_s"] < 60
    assert layout.rollout_key(2, "a", 3) in _settled(store, 3)  # the step it finished is the checkpoint's
    first, second = _Fleet.made
    assert not first.stopped, "a spot learner's notice stopped its fleet"
    assert second.stopped  # the resumed run finished: its own fleet stopped as usual
    # the retry: the same flow run resumed the same run from the notice's checkpoint and finished it
    assert summary["run_id"] == "spot-finish" and summary["steps"] == 5
    [resume] = _events(store, "resume")
    assert resume["step"] == 3 and resume["market"] == "spot" and resume["host"]
    runs = _events(store, train_flow.FLOW_RUN_EVENT)
    assert [e["step"] for e in runs] == [0, 3] and len({e["flow_run_id"] for e in runs}) == 1
    assert not _events(store, "interrupted")
    assert signal.getsignal(signal.SIGTERM) is not notice_module.SpotNotice.on_signal  # handed back


def test_a_step_that_cannot_end_within_the_notice_is_abandoned_and_its_files_used_again(tmp_path, flow_env):
    """A notice of 2 s (the scenario's) arriving in the optimizer step when a step plus a checkpoint do not fit
    in it (made so by measured steps of 5 s): the step is abandoned, step 2 checkpointed within the notice, the
    abandoned step's file not settled; ``echo2 run`` would exit 75."""
    signal_in, run_store = flow_env
    cfg = _config(tmp_path, "spot-abandon", "spot", sigterm_notice_s=2)
    real_end = StepClock.end

    def slow_steps(self, completed):  # every step measured as 5 s: none fits a 2 s notice
        real_end(self, completed)
        if completed:
            self.steps[-1] = 5.0

    signal_in(3, "step")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepClock, "end", slow_steps)
        with pytest.raises(LearnerReclaimed) as err:
            train_flow.train(config=cfg.model_dump(mode="json"))
    assert err.value.step == 2 and err.value.source == "sigterm" and notice_module.RECLAIMED_EXIT == 75
    store = run_store("spot-abandon")
    [left] = _events(store, "learner_left")
    assert left["step"] == left["checkpoint_step"] == 2 and left["abandoned_step"] is True
    assert left["notice_to_checkpoint_s"] <= 2.0, left  # the target: a committed checkpoint within the notice
    assert layout.rollout_key(2, "a", 3) not in _settled(store, 2)  # used again after the resume
    assert not store.exists(layout.checkpoint_dir(3) + "/manifest.json")
    assert not _Fleet.made[0].stopped


def test_a_notice_while_collecting_leaves_at_once(tmp_path, flow_env, caplog):
    signal_in, run_store = flow_env
    cfg = _config(tmp_path, "spot-collect", "spot", sigterm_notice_s=2)
    signal_in(3, "collect")
    with pytest.raises(LearnerReclaimed):
        train_flow.train(config=cfg.model_dump(mode="json"))
    # an expected end: Prefect's report of it is one warning line, not an ERROR with a traceback
    said = [r for r in caplog.records if "LearnerReclaimed" in r.getMessage()]
    assert said and not [r for r in said if r.exc_info or r.levelno > logging.WARNING]
    [left] = _events(run_store("spot-collect"), "learner_left")
    assert left["checkpoint_step"] == 2 and left["abandoned_step"] is False and left["notice_to_checkpoint_s"] <= 2
    assert not _Fleet.made[0].stopped


def test_an_on_demand_learner_still_stops_its_fleet_on_sigterm(tmp_path, flow_env):
    signal_in, run_store = flow_env
    cfg = _config(tmp_path, "on-demand", "on-demand")
    signal_in(3, "step")
    stopped = []

    def stop(signum, frame):  # what `echo2 run` installs (cli/common.py's CtrlC), without its bookkeeping
        stopped.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(BaseException) as err:
            train_flow.train(config=cfg.model_dump(mode="json"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not isinstance(err.value, LearnerReclaimed)
    store = run_store("on-demand")
    assert _Fleet.made[0].stopped and stopped == [signal.SIGTERM]
    assert _events(store, "interrupted") and not _events(store, "learner_left")


def test_a_metadata_notice_reaches_the_main_thread(monkeypatch):
    """GCP's ``instance/preempted`` turns TRUE: the watcher's thread hands it to the main thread, which is
    interrupted (here out of a wait) with the notice's source and GCP's 30 s."""
    fake = FakeMetadata()
    monkeypatch.setenv(preemption.SOURCE_ENV, "gcp")
    monkeypatch.setenv(preemption.ENDPOINT_ENV, fake.url)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    notice = SpotNotice(2.0, poll_s=0.02).install()
    try:
        fake.notice = True
        with pytest.raises(NoticeInterrupt):
            threading.Event().wait(30)
        assert notice.heard.source == "gcp" and notice.heard.deadline_s == 30.0
    finally:
        notice.close()
        fake.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        signal.signal(signal.SIGTERM, previous)


def test_the_step_is_let_finish_only_when_it_and_a_checkpoint_fit_the_notice():
    clock = StepClock()
    assert finish_budget_s(clock, 30.0, 0.0, 0.0) is None  # between steps: leave at once
    clock.begin(4)
    assert finish_budget_s(clock, 30.0, clock.started, clock.started) is None  # no step measured yet
    clock.steps.append(10.0)
    clock.checkpoints.append(5.0)
    # 10 s left + 5 s checkpoint within 30 s less 10 %: finish, and the timer may wait 22 s
    assert finish_budget_s(clock, 30.0, clock.started, clock.started) == pytest.approx(22.0)
    assert finish_budget_s(clock, 12.0, clock.started, clock.started) is None  # 10 + 5 > 10.8
    assert finish_budget_s(clock, None, clock.started, clock.started) is None


def test_an_aws_notice_gives_the_seconds_to_its_time():
    assert notice_module.aws_deadline_s('{"action": "terminate", "time": "2026-01-01T00:02:00Z"}',
                                        now=1767225600.0) == 120.0
    assert notice_module.aws_deadline_s("not json") == 120.0


def test_a_resumed_learner_leaves_the_tokens_of_the_actors_it_may_adopt_good(tiny_model, tmp_path, monkeypatch):
    """``LearnerRun``'s revocations at a resume: only the actors the ledger saw end (the live ones are the fleet's to
    adopt, ``fleet/adoption.py``); with ``fleet.adopt_on_resume`` off, every actor launched before, as before."""
    from echo2.data.ledger import write_event

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    (tmp_path / "model").symlink_to(tiny_model)
    runs = open_store(str(tmp_path / "store")).child(layout.RUNS)
    first = LearnerRun(_config(tmp_path, "adoptable", "spot"), runs, resume=False)
    for actor in ("actor0-aa", "actor1-bb"):
        write_event(first.store, "launch", actor)
    write_event(first.store, "terminated", "actor1-bb")
    assert LearnerRun(_config(tmp_path, "adoptable", "spot"), runs, resume=True).revoked == {"actor1-bb"}
    config = _config(tmp_path, "adoptable", "spot")
    config.fleet.adopt_on_resume = False
    assert LearnerRun(config, runs, resume=True).revoked == {"actor0-aa", "actor1-bb"}


def test_a_prefect_cancel_of_a_spot_learner_stops_it_and_its_fleet_and_is_no_reclaim(tmp_path, flow_env):
    """Prefect cancels a flow run by setting it CANCELLING, then sending SIGTERM: with ``learner.market: spot`` that
    SIGTERM is a cancel, not a notice: checkpoint, the fleet stopped, the signal handed to the handler the notice
    replaced (``echo2 run``'s: exit 143), never ``LearnerReclaimed`` (exit 75, which a managed job relaunches)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.states import Cancelling

    signal_in, run_store = flow_env
    cfg = _config(tmp_path, "spot-cancel", "spot", sigterm_notice_s=60)

    def cancelling():  # what Prefect's cancel does before it signals the process
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelling(), force=True)

    signal_in(3, "step")
    signal_in.plan["before"] = cancelling
    stopped = []

    def stop(signum, frame):  # what `echo2 run` installs (cli/common.py's CtrlC), without its bookkeeping
        stopped.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(BaseException) as err:
            train_flow.train(config=cfg.model_dump(mode="json"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not isinstance(err.value, LearnerReclaimed), err.value
    store = run_store("spot-cancel")
    assert _Fleet.made[0].stopped, "a cancelled spot learner left its fleet billing"
    assert stopped == [signal.SIGTERM]
    assert _events(store, "interrupted") and not _events(store, "learner_left")
