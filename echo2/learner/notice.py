"""A spot learner's preemption notice: hear it, finish or abandon the step in progress, checkpoint, leave.

Only with ``learner.market: spot``; an on-demand learner keeps SIGTERM as a stop (checkpoint, fleet stopped).

Where a notice comes from. SIGTERM, on any machine (a spot VM's shutdown, SkyPilot's or Kubernetes' stop; not
Prefect's cancellation, below): it gives ``learner.sigterm_notice_s`` seconds (the provider's grace; the learner-
reclaim scenario sends 2). The machine's metadata, polled by the actors' watcher (``echo2/preemption.py``,
``learner.preemption_source``, ``$ECHO2_PREEMPTION_SOURCE``): AWS ``spot/instance-action`` (its ``time`` field is the
deadline; about 120 s when it has none), GCP ``instance/preempted`` (about 30 s). The watcher's thread hands its
notice to the main thread as a SIGTERM sent to that thread (``signal.pthread_kill``: it also ends a sleep there), so
both ways meet in one handler.

What the handler does, in the main thread (``SpotNotice.on_signal``):

* outside a training step (collecting rollouts, evaluating, reconciling the fleet, starting): ``NoticeInterrupt`` at
  once. No trained work is lost; the files collected for the next step are used again after the resume.
* inside a step (``LearnerRun.update``: the optimizer step, its publish and any scheduled checkpoint): the step is
  let finish when what it has left plus a checkpoint fits in the notice, with a margin of 10 % of the notice; else
  it is abandoned (``NoticeInterrupt`` at its next safe point, below; its files are not settled, so the resumed run
  uses them again). What a step has left: the slowest of the last 5 measured steps (``StepClock``) minus how long
  this one has run; with no step measured yet in this process, the step is abandoned. A checkpoint: the slowest of
  the last 5 measured, or half the notice when none was measured in this process. A step let finish is still
  interrupted by a timer at the moment past which its checkpoint would no longer fit (estimates can be wrong), and
  ``leave_if_noticed()`` ends the run after it.

Safe points. A handler runs in the main thread at whatever bytecode it lands on; raised inside ``optimizer.step()``,
some parameters and moments would be updated and others not, and that state must never be checkpointed. So a
learner's step runs with SIGTERM and SIGINT deferred (``signals_deferred``) and hands what it received to the
handlers only at its safe points (``deliver_deferred``: between packs and before the optimizer step, where no weight
has changed); the clip, the optimizer step and the version bump run with the signals deferred throughout, and a
signal received there reaches its handler once the version has moved. A torchrun learner's rank 0 tells the other
ranks at every safe point whether a deferred signal abandoned the step (``distributed.py``), so all of them stop
there. What still escapes from inside the update (an error of the optimizer itself) leaves the learner ``torn``,
and a torn learner is never checkpointed (``LearnerRun.checkpoint``): the newest committed checkpoint stands.

A cancel is not a notice. With ``learner.market: spot`` a SIGTERM is a notice unless the flow's ``cancelled`` check
says the flow run is being cancelled (Prefect sets it CANCELLING before it sends the signal): then the run stops as
an on-demand one does (checkpoint, the fleet stopped, the SIGTERM handed to the handler it replaced), so a cancel
neither leaves the fleet billing nor exits 75. SIGINT (Ctrl-C) is never a notice.

The flow (``echo2/flows/train.py``, its block inside ``LearnerExit``) then writes ``learner_notice``, checkpoints
(``LearnerRun.leave_on_notice``), writes ``learner_left`` and raises ``LearnerReclaimed`` without stopping the fleet:
the actors wait for the relaunched learner. ``echo2 run`` exits ``RECLAIMED_EXIT`` (75, EX_TEMPFAIL: try again),
the code a SkyPilot managed job is told to recover on (``infra/skypilot/learner-spot.yaml``). Assumed: Python
delivers signals to the main thread only, and the flow runs there (``echo2 run``; rank 0 of ``echo2 learner``);
elsewhere no handler can be installed and the notice is not heard (logged).
"""

from __future__ import annotations

import atexit
import json
import logging
import signal
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

from echo2.preemption import Notice, PreemptionWatcher, start_watcher

log = logging.getLogger("echo2.learner")

RECLAIMED_EXIT = 75
"""The exit code of a learner that left on a notice (sysexits' EX_TEMPFAIL): relaunch it with ``--resume``."""
METADATA_NOTICE_S = {"aws": 120.0, "gcp": 30.0}
"""What each provider's metadata notice gives, where the notice itself does not say."""
KEEP = 5
"""Measured steps and checkpoints the estimates look at (the slowest of them)."""
MARGIN = 0.1
"""Share of the notice kept free when a step is let finish."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What stops a learner (Ctrl-C, a notice or a stop): deferred inside a step and an announced op."""


@dataclass
class _Deferral:
    """One ``signals_deferred`` block: the handlers it replaced and the signals it received."""

    previous: dict = field(default_factory=dict)
    received: list[int] = field(default_factory=list)


_deferrals: list[_Deferral] = []
"""The blocks open in the main thread, outermost first (a step inside a torchrun op nests two)."""


@contextmanager
def signals_deferred():
    """SIGINT and SIGTERM received inside the block reach the handlers in place (``echo2.cli.common.CtrlC``,
    ``SpotNotice.on_signal``, Prefect's) once it has ended, each once, or earlier at a safe point
    (``deliver_deferred``). Python runs a handler in the main thread only, so elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    block = _Deferral()
    for signum in STOP_SIGNALS:
        block.previous[signum] = signal.signal(signum, lambda signum, _frame: block.received.append(signum))
    _deferrals.append(block)
    try:
        yield
    finally:
        _deferrals.remove(block)
        for signum, handler in block.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        for signum in dict.fromkeys(block.received):
            signal.raise_signal(signum)


def deferred_pending() -> bool:
    """Whether a signal was received inside the open deferrals and has not reached its handler yet."""
    return any(block.received for block in _deferrals)


def deliver_deferred() -> None:
    """At a safe point: hand the signals received so far to the handlers outside every deferral, now. A handler may
    raise (a notice that abandons the step, Ctrl-C): it does so here, where no weight has changed; one that lets the
    step go on returns, and the deferrals stay in force."""
    if not _deferrals:
        return
    received = list(dict.fromkeys(signum for block in _deferrals for signum in block.received))
    for block in _deferrals:
        block.received.clear()
    outer = _deferrals[0].previous
    for signum in received:
        handler = outer.get(signum)
        if callable(handler):
            handler(signum, None)
        elif handler in (signal.SIG_DFL, None):  # the default action (end the process): at a safe point, at once
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


class NoticeInterrupt(BaseException):
    """Raised in the main thread when a notice ends what it is doing. A BaseException, as KeyboardInterrupt is: no
    ``except Exception`` on the way (a store retry, a task's error handling) may swallow it."""


class LearnerReclaimed(Exception):
    """The flow's outcome when the learner left on a notice: checkpointed, the actors left running. A plain
    Exception, so the flow run is FAILED (a Prefect retry of it resumes the run), not CRASHED."""

    def __init__(self, run_id: str | None, step: int, source: str):
        self.run_id, self.step, self.source = run_id, step, source
        super().__init__(f"the learner's machine is being reclaimed ({source} notice): checkpointed at step {step}, "
                         f"actors left running; relaunch with --resume --set run.id={run_id}")


@dataclass
class Heard:
    """One notice as the learner heard it."""

    source: str
    """``sigterm``, ``aws``, ``gcp``."""
    deadline_s: float | None
    """Seconds the notice gave from when it was heard (None: unknown)."""
    at: float
    """``time.monotonic()`` when heard."""
    step: int | None = None
    """The learner's step when heard (None: before the run was prepared)."""


class StepClock:
    """How long the learner's steps and checkpoints take, and whether a step is under way: what the handler
    estimates from. Kept by ``LearnerRun`` (always: it is cheap); read in the main thread only."""

    def __init__(self):
        self.steps: deque[float] = deque(maxlen=KEEP)
        self.checkpoints: deque[float] = deque(maxlen=KEEP)
        self.started: float | None = None
        """``monotonic()`` at the start of the step under way; None between steps."""
        self.from_step: int | None = None
        """The version the step under way started from."""

    def begin(self, step: int) -> None:
        self.started, self.from_step = time.monotonic(), step

    def end(self, completed: bool) -> None:
        if completed and self.started is not None:
            self.steps.append(time.monotonic() - self.started)
        self.started = None

    def checkpointed(self, seconds: float) -> None:
        self.checkpoints.append(seconds)

    def step_left_s(self, now: float) -> float | None:
        """What the step under way has left, by the slowest measured one; None between steps or unmeasured."""
        if self.started is None or not self.steps:
            return None
        return max(0.0, max(self.steps) - (now - self.started))

    def checkpoint_s(self, deadline_s: float) -> float:
        return max(self.checkpoints) if self.checkpoints else deadline_s / 2


def finish_budget_s(clock: StepClock, deadline_s: float | None, heard_at: float, now: float) -> float | None:
    """Seconds from ``now`` the step under way may still run before it must be abandoned, if letting it finish
    fits the notice; None when it must be abandoned now (see the module docstring)."""
    left = clock.step_left_s(now)
    if left is None or deadline_s is None:
        return None
    budget = deadline_s * (1 - MARGIN) - clock.checkpoint_s(deadline_s) - (now - heard_at)
    return budget if left <= budget else None


def aws_deadline_s(detail: str, now: float | None = None) -> float:
    """Seconds to the ``time`` of an AWS instance-action (its JSON), or the usual two minutes."""
    try:
        when = datetime.fromisoformat(str(json.loads(detail)["time"]).replace("Z", "+00:00")).timestamp()
    except (ValueError, KeyError, TypeError, AttributeError):
        return METADATA_NOTICE_S["aws"]
    return max(0.0, when - (time.time() if now is None else now))


class SpotNotice:
    """The notice handling of one spot learner process (``install`` ... ``close``)."""

    def __init__(self, sigterm_notice_s: float, *, preemption_source: str | None = None, poll_s: float = 5.0,
                 cancelled=lambda: False):
        """``cancelled()``: whether the flow run is being cancelled (asked once, when the run must end)."""
        self.sigterm_notice_s = sigterm_notice_s
        self.cancelled = cancelled
        self.preemption_source = preemption_source
        self.poll_s = poll_s
        self.heard: Heard | None = None
        self.clock: StepClock | None = None
        self.step_of = lambda: None
        """The learner's step now (``attach``)."""
        self.abandoned_from: int | None = None
        """The version of the step the notice abandoned (None: none was)."""
        self.leaving = False
        self._previous = None
        self._installed = False
        self._timer: threading.Timer | None = None
        self._watcher: PreemptionWatcher | None = None
        self._main = threading.main_thread().ident
        self._lock = threading.Lock()

    # -- set-up ----------------------------------------------------------------------------------------------------
    def install(self) -> "SpotNotice":
        """SIGTERM becomes a notice (in the main thread only), and the metadata watcher starts if configured."""
        try:
            self._previous = signal.signal(signal.SIGTERM, self.on_signal)
            self._installed = True
        except ValueError:  # not the main thread: signals cannot be handled here
            log.warning("learner.market is spot, but the flow does not run in the main thread: a preemption notice "
                        "cannot be heard here and stops the run as on-demand")
            return self
        self._watcher = start_watcher(self.preemption_source, None, self.poll_s, self._on_metadata)
        return self

    def attach(self, clock: StepClock, step_of) -> None:
        """The run's step clock and its step, once the run is prepared."""
        self.clock, self.step_of = clock, step_of
        if self.heard is not None and self.heard.step is None:
            self.heard.step = step_of()

    def close(self) -> None:
        """The watcher and timer stop; SIGTERM goes back to the handler it had (Prefect's, or the CLI's)."""
        self.leaving = True
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.close()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    # -- hearing ---------------------------------------------------------------------------------------------------
    def _hear(self, source: str, deadline_s: float | None) -> None:
        with self._lock:
            if self.heard is None:
                self.heard = Heard(source, deadline_s, time.monotonic(), self.step_of())
                log.warning("preemption notice (%s, %s s): the learner checkpoints and leaves; its actors keep running",
                            source, "?" if deadline_s is None else f"{deadline_s:.0f}")

    def _on_metadata(self, notice: Notice) -> None:
        """The watcher's thread: record the notice, then hand it to the main thread as a SIGTERM."""
        self._hear(notice.source, aws_deadline_s(notice.detail) if notice.source == "aws"
                   else METADATA_NOTICE_S.get(notice.source))
        self._interrupt_main()

    def _interrupt_main(self) -> None:
        if not self.leaving and self._installed:
            signal.pthread_kill(self._main, signal.SIGTERM)

    def on_signal(self, signum, frame) -> None:
        """The SIGTERM handler (a real SIGTERM, the watcher's, or the timer's): see the module docstring."""
        self._hear("sigterm", self.sigterm_notice_s)
        if self.leaving:  # already checkpointing on the way out: nothing may interrupt that
            return
        clock = self.clock
        if self._timer is None and clock is not None:
            now = time.monotonic()
            budget = finish_budget_s(clock, self.heard.deadline_s, self.heard.at, now)
            if budget is not None:  # the step ends in time: let it, but not past the budget
                log.warning("the step under way ends within the notice: finishing it (%.2f s left at most)", budget)
                self._timer = threading.Timer(budget, self._interrupt_main)
                self._timer.daemon = True
                self._timer.start()
                return
        if clock is not None and clock.started is not None:
            self.abandoned_from = clock.from_step
        self.leaving = True
        raise NoticeInterrupt(f"{self.heard.source} notice")

    def leave_if_noticed(self) -> None:
        """Between steps (the flow's loop): leave now if a notice was heard (a step it let finish has ended)."""
        if self.heard is not None and not self.leaving:
            self.leaving = True
            raise NoticeInterrupt(f"{self.heard.source} notice")

    def is_cancel(self) -> bool:
        """Whether what was heard is a cancel, not a notice: a SIGTERM while the flow run is being cancelled. A
        metadata notice is always a reclaim; a check that fails counts as a notice (the fleet then waits for a
        relaunch, and stops by itself after ``fleet.learner_silence_s``)."""
        if self.heard is None or self.heard.source != "sigterm":
            return False
        try:
            return bool(self.cancelled())
        except Exception as exc:
            log.warning("could not tell whether the flow run is being cancelled (%s): taking the SIGTERM as a notice",
                        exc)
            return False

    def leave(self) -> None:
        """The learner is on its way out (checkpointing, stopping): a further SIGTERM or notice interrupts nothing."""
        self.leaving = True

    def stop_as_cancel(self) -> None:
        """A cancel: the SIGTERM goes to the handler this one replaced (``CtrlC``: exit 143; Prefect's), which
        raises; KeyboardInterrupt where that handler does not."""
        self.leaving = True
        previous = self._previous
        if callable(previous):
            previous(signal.SIGTERM, None)
        raise KeyboardInterrupt("the flow run was cancelled")

    def abandoned(self, step: int) -> bool:
        """Whether the notice abandoned a step (its version did not move: ``step`` is still where it began)."""
        return self.abandoned_from is not None and step == self.abandoned_from


@contextmanager
def spot_notice(learner, *, cancelled=lambda: False):
    """With ``learner.market: spot`` (``learner``: the run's ``LearnerConfig``), a ``SpotNotice`` installed for the
    block and closed after it; on demand, None (SIGTERM stays a stop)."""
    if learner.market != "spot":
        yield None
        return
    notice = SpotNotice(learner.sigterm_notice_s, preemption_source=learner.preemption_source,
                        poll_s=learner.preemption_poll_s, cancelled=cancelled).install()
    try:
        yield notice
    finally:
        notice.close()


class LearnerExit:
    """How the flow's training block ends for the run's fleet, as a context manager: ended normally, by an error, a
    stop or a cancel, the fleet is stopped (while the run checkpoints, both inside Prefect's 30 s grace); on a spot
    notice it is left running for the relaunched learner (not even stopped at exit), the run checkpointed with its
    ``learner_notice`` and ``learner_left`` events, and the block ends with ``LearnerReclaimed``; when a newer
    learner incarnation took the run (``LeaseLost``) it is left running too and nothing is written: it is the new
    incarnation's fleet now. ``prepared`` and ``start`` hand it the run and the fleet."""

    def __init__(self, notice: SpotNotice | None, run_id: str | None, *, on_stopped=lambda: None):
        """``on_stopped()``: told when the run stopped or left early (the flow's progress display)."""
        self.notice, self.run_id, self.on_stopped = notice, run_id, on_stopped
        self._run = None
        self._fleet = None
        self._started = False

    def prepared(self, run):
        """The run (``LearnerRun``) once prepared: a notice from here on times its step by the run's clock."""
        self._run = run
        if self.notice is not None:
            self.notice.attach(run.clock, lambda: run.step)
        return run

    def start(self, fleet):
        """Start the fleet (``FleetManager``), held from before its start: a notice during it leaves it running."""
        self._fleet = fleet
        fleet.start()
        self._started = True
        return fleet

    def leave_if_noticed(self) -> None:
        """Between steps: leave now if a notice let the step finish (``SpotNotice.leave_if_noticed``)."""
        if self.notice is not None:
            self.notice.leave_if_noticed()

    def __enter__(self) -> "LearnerExit":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        from echo2.data.lease import LeaseLost  # (the learner's step imports this module without the data plane)

        if kind is None:
            self._stop()
            return
        if isinstance(error, LeaseLost):
            self._keep_running()
            return
        notice = self.notice
        heard = notice is not None and notice.heard is not None
        cancel = heard and notice.is_cancel()
        if heard and not cancel:
            notice.leave()  # a second SIGTERM must not interrupt the checkpoint
            self._leave_on_notice()
            self.on_stopped()
            raise LearnerReclaimed(self.run_id, self._run.step if self._run is not None else 0,
                                   notice.heard.source) from None
        try:
            if cancel:
                notice.leave()
                log.warning("the flow run is being cancelled: the SIGTERM stops the run and its fleet (not a notice)")
            if self._started:
                self._stop_interrupted()
                self.on_stopped()
            if cancel:
                notice.stop_as_cancel()
        finally:
            self._stop()

    def _stop(self) -> None:
        if self._started:
            self._fleet.stop()

    def _keep_running(self) -> None:
        """The fleet is not stopped at exit either (``FleetManager`` registers its ``stop`` there)."""
        if self._fleet is not None:
            atexit.unregister(self._fleet.stop)

    def _leave_on_notice(self) -> None:
        """The fleet left running, the run checkpointed with its notice events (``LearnerRun.leave_on_notice``)."""
        self._keep_running()
        if self._run is None:
            log.warning("preemption notice before the run was prepared: nothing to checkpoint")
            return
        self._run.leave_on_notice(self.notice.heard, self.notice.abandoned(self._run.step))

    def _stop_interrupted(self) -> None:
        """Cancellation, Ctrl-C, SIGTERM: the fleet is told to stop while the checkpoint is written, so that
        both end inside Prefect's grace (30 s from its SIGTERM to its SIGKILL)."""
        teardown = threading.Thread(target=self._fleet.stop, name="echo2-fleet-stop")
        teardown.start()
        try:
            self._run.interrupted()
        finally:
            teardown.join()
