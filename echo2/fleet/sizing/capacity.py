"""The overlap-based capacity model: how much rollout throughput keeps the learner busy, at which
staleness, and what utilization and lag a given fleet gives.

Inputs (every time in seconds; a *group* is one prompt with its G completions)

    T   learner busy time per step: loss, backward, optimizer, publish, checkpoint share
        (everything but waiting for rollouts; measured as step seconds minus wait seconds)
    R   groups per learner step                  (train.groups_per_step)
    b   groups per actor batch, one rollout file (rollout.groups_per_batch)
    G_i one batch on worker i: sampling, scoring, encoding (its whole turn but the commit)
    U   upload: from a batch's last token to its file seen by the learner; the actor waits for
        the commit (``put_seconds``, default all of U), so worker i makes mu_i = b / (G_i + put)
        groups/s; a waiting learner lists the store every ``learner_poll_seconds``
    D   dissemination: one version's transfer to an actor (plus, in the simulation, the waits
        around it: for the receiver to be free, for the batch under way to end, the swap)
    S   staleness: a group of version v is usable at learner version t iff t - v <= S
    k   publish period (publish.every): versions 0, k, 2k, ... reach the actors
    Q   fleet-wide backlog bound in batches: max(rollout.max_pending_batches, ceil(R / b)) (``config.backlog_bound``)

Derivation (the idealized pipeline: every actor identical in behaviour, D and U constant)

1. Throughput. The learner consumes R groups per step and trains for T, so it never waits for
   *volume* iff the fleet makes  sum_i mu_i >= R / T   (``required_throughput``). Below that the
   step time is R / sum mu_i.
2. Freshness. Step t+1 is collected at learner version t and needs R groups of version >= t - S.
   The oldest version that qualifies and is published is v* = k * ceil((t - S) / k); it was
   published (t - v*) steps ago and reached the actors D later. Actors that flow control held back
   (they never start a batch that would be stale, ``rollout/actor.py``) start at once, so the R
   groups are visible  D + F_R  after v* was published, where F_R is the time the fleet needs to
   make and upload R groups from a standing start (smallest F with
   sum_i b * floor(F / (G_i + U)) >= R). Over a cycle of k steps, t - v* takes every value from
   S - k + 1 to S, so the learner never waits for fresh rollouts iff  (S - k + 1) * T >= D + F_R:

       S_min = k - 1 + ceil((D + F_R) / T)                                      (``min_staleness``)

   The design states  k + ceil((D + G + U) / T): one more, the worst phase of an actor that is
   always busy (it may have just started a batch with the old version). With flow control the
   actor is idle at that moment instead, and the benchmark (``echo2 bench overlap``) measures
   the tighter form. The ECHO-2 paper (arXiv 2602.02192) states the overlap condition in words
   (dissemination and generation hidden behind S training steps); its exact constants are not
   given there, so the ones above are derived here and checked by the benchmark.
   An actor's receiver transfers one version at a time. When D > k * T it is never idle, and a
   new version waits up to D for the transfer under way, so then S_min counts D twice.
   S < k - 1 can never be satisfied (the version it needs is never published): the config
   refuses it.
3. Step time when freshness binds (k = 1): the learner waits W = D + F_R - S * (T + W) per
   step, so, with the throughput bound of 1, the steady step time is

       T_step = max(T, R / sum mu_i, (T + D + F_R) / (1 + S))   and  utilization = T / T_step.

   S = 0 is the synchronous loop: T_step = T + D + F_R. (A lower bound when D > T: it lets
   transfers of successive versions overlap, which one receiver does not.)
4. In general (k > 1, heterogeneous workers, both bounds close, the backlog Q shifting lag, one
   transfer at a time, the learner's poll) the closed forms are bounds; ``predict`` evaluates the
   pipeline turn by turn as the processes act (``_Pipeline``) and reports its steady state: step
   time, utilization, which bound holds, and the lag distribution of the groups the learner uses.
   Checked against the real system by ``echo2 bench overlap``: the first version of this module
   (D as a pure delay, U charged to every batch) was off by up to 0.51 utilization where D >= T;
   following the processes turn by turn brought every grid point within about 0.1.

Not modelled: contention between learner and actors for the same CPU or GPU (on one machine they
slow each other; the benchmark uses a timing workload, so it does not), variance of G and D
(use measured medians), reclaims (``planner/reclaim_simulation.simulate_reclaims`` over-provisions for them).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from echo2.config import backlog_bound


@dataclass(frozen=True)
class Workload:
    """What the learner needs, and the time constants between it and the fleet."""

    train_seconds: float
    groups_per_step: int
    groups_per_batch: int
    staleness: int
    dissemination_seconds: float = 0.0
    upload_seconds: float = 0.0
    publish_every: int = 1
    max_pending_batches: int = 2
    learner_poll_seconds: float = 0.0
    """A learner waiting for rollouts sees new files only when it lists the store again (train.poll_seconds)."""
    swap_seconds: float = 0.0
    """An actor's pause to load a new version into its engine (between two batches)."""
    put_seconds: float | None = None
    """The part of ``upload_seconds`` the actor waits for (its commit; the rest is the learner's
    poll delay). None: the actor waits for all of it."""

    def __post_init__(self):
        if self.train_seconds <= 0 or self.groups_per_step < 1 or self.groups_per_batch < 1:
            raise ValueError("train_seconds must be > 0, groups_per_step and groups_per_batch >= 1")
        if self.staleness < 0 or self.publish_every < 1 or self.max_pending_batches < 1:
            raise ValueError("staleness must be >= 0, publish_every and max_pending_batches >= 1")
        if self.dissemination_seconds < 0 or self.upload_seconds < 0 or (self.put_seconds or 0) < 0:
            raise ValueError("dissemination_seconds, upload_seconds and put_seconds must be >= 0")

    @property
    def actor_wait(self) -> float:
        """Seconds an actor waits per batch after its last token (its commit)."""
        return self.upload_seconds if self.put_seconds is None else self.put_seconds

    @property
    def visible_after(self) -> float:
        """Seconds from a batch's last token to the learner seeing its file."""
        return max(self.upload_seconds, self.actor_wait)


def _workers(batch_seconds: list[float]) -> list[float]:
    return [g for g in batch_seconds if g > 0 and math.isfinite(g)]


def throughput(w: Workload, batch_seconds: list[float]) -> float:
    """Groups per second of a fleet whose workers take ``batch_seconds`` to generate a batch."""
    return sum(w.groups_per_batch / (g + w.actor_wait) for g in _workers(batch_seconds))


def required_throughput(w: Workload) -> float:
    """Groups per second that keep the learner from waiting for volume: R / T."""
    return w.groups_per_step / w.train_seconds


def fill_seconds(w: Workload, batch_seconds: list[float]) -> float:
    """F_R: time for the fleet, all starting together, to commit R groups (inf without workers)."""
    cycles = [g + w.actor_wait for g in _workers(batch_seconds)]
    if not cycles:
        return math.inf
    # the answer is a multiple of some worker's cycle: walk those in order
    rounds = math.ceil(w.groups_per_step / w.groups_per_batch)
    for t in sorted({c * n for c in cycles for n in range(1, rounds + 1)}):
        if sum(w.groups_per_batch * math.floor(t / c + 1e-9) for c in cycles) >= w.groups_per_step:
            return t + w.visible_after - w.actor_wait  # the learner sees the last file after its poll
    raise AssertionError("unreachable: the slowest worker alone finishes in `rounds` cycles")


def min_staleness(w: Workload, batch_seconds: list[float]) -> int | None:
    """The smallest S at which the learner never waits for fresh rollouts; None if no S suffices
    because the fleet is too slow for the learner at any staleness."""
    if throughput(w, batch_seconds) < required_throughput(w) * (1 - 1e-9):
        return None
    hidden = w.dissemination_seconds + fill_seconds(w, batch_seconds)
    if w.dissemination_seconds > w.publish_every * w.train_seconds:
        # a receiver transfers one version at a time: slower than versions appear, it is always busy,
        # and a new version also waits for the transfer under way (up to D)
        hidden += w.dissemination_seconds
    return w.publish_every - 1 + math.ceil(hidden / w.train_seconds - 1e-9)


def closed_form_step_seconds(w: Workload, batch_seconds: list[float]) -> float:
    """T_step from the closed forms (publish every step): the larger of the three bounds."""
    lam = throughput(w, batch_seconds)
    if lam <= 0:
        return math.inf
    hidden = w.dissemination_seconds + fill_seconds(w, batch_seconds)
    return max(w.train_seconds, w.groups_per_step / lam, (w.train_seconds + hidden) / (1 + w.staleness))


@dataclass
class Prediction:
    step_seconds: float
    """Steady-state seconds per learner step."""
    utilization: float
    """Share of wall time the learner trains (T / step_seconds)."""
    bound: str
    """What sets the pace: "learner" (never waits), "throughput" or "staleness"."""
    lag: dict[int, float] = field(default_factory=dict)
    """Share of used groups by lag (learner version minus policy version)."""
    wasted_groups: float = 0.0
    """Share of generated groups dropped as stale (0 with flow control, unless actors overshoot)."""

    @property
    def steps_per_minute(self) -> float:
        return 60.0 / self.step_seconds if self.step_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"step_seconds": self.step_seconds, "utilization": self.utilization, "bound": self.bound,
                "steps_per_minute": self.steps_per_minute, "lag": {str(k): v for k, v in sorted(self.lag.items())},
                "wasted_groups": self.wasted_groups}


def predict(w: Workload, batch_seconds: list[float], *, steps: int = 400) -> Prediction:
    """Steady state of the idealized pipeline for a fleet with the given per-worker batch times."""
    if throughput(w, batch_seconds) <= 0:
        return Prediction(math.inf, 0.0, "throughput")
    if w.staleness < w.publish_every - 1:
        return Prediction(math.inf, 0.0, "staleness")
    sim = _Pipeline(w, _workers(batch_seconds))
    sim.run(steps)
    half = steps // 2  # the first half warms up (version 0 reaching everyone, the backlog filling)
    elapsed = sim.collected_at[steps] - sim.collected_at[half]
    step_seconds = elapsed / (steps - half)
    utilization = min(1.0, w.train_seconds / step_seconds)
    lag = Counter()
    for step, groups, lag_of in sim.used:
        if step > half:
            lag[lag_of] += groups
    total = sum(lag.values())
    if utilization > 0.999:
        bound = "learner"
    elif step_seconds <= w.groups_per_step / throughput(w, batch_seconds) * 1.02 + w.learner_poll_seconds:
        bound = "throughput"
    else:
        bound = "staleness"
    generated = sim.generated_groups or 1
    return Prediction(step_seconds, utilization, bound, {k: v / total for k, v in lag.items()},
                      sim.dropped_groups / generated)


def workers_needed(w: Workload, batch_seconds: float, target_utilization: float, max_workers: int) -> int:
    """The smallest number of identical workers (``batch_seconds`` per batch) whose predicted
    utilization reaches ``target_utilization``; ``max_workers`` when none up to it does."""
    lam = w.groups_per_batch / (batch_seconds + w.actor_wait)
    start = max(1, min(max_workers, math.ceil(required_throughput(w) * target_utilization / lam)))
    for n in range(start, max_workers + 1):  # below `start` even the throughput bound misses the target
        if predict(w, [batch_seconds] * n, steps=120).utilization >= target_utilization:
            return n
    return max_workers


class _Actor:
    def __init__(self, index: int, batch_seconds: float):
        self.index = index
        self.batch_seconds = batch_seconds
        self.busy = False
        self.version: int | None = None      # the policy it generates with
        self.fetching: int | None = None     # the version its receiver is transferring
        self.fetched: int | None = None      # transferred and verified, swapped in at the next loop turn
        self.turned_in: int | None = None    # the learner's epoch (``_Pipeline.epoch``) of its last turn


class _Pipeline:
    """Event simulation of the idealized pipeline, turn by turn as the real processes act.

    Learner (``learner/run.py``): collect R usable groups, whole files, oldest version first (stale
    ones dropped; while short, it lists the store again every ``learner_poll_seconds``), train T,
    publish every k steps. Actor (``rollout/actor.py``), at each turn of its
    loop (when a batch is committed, or at once while idle): swap in a version its receiver has
    finished (a pause of ``swap_seconds``); start receiving the newest published version if the receiver's rule
    wants it (one transfer at a time, D seconds; a transfer in progress is kept while it will still be fresh,
    ``broadcast/receiver.py``); then, flow control permitting, generate a batch: busy G + put, the
    file visible to the learner U after the last token.
    """

    def __init__(self, w: Workload, batch_seconds: list[float]):
        self.w = w
        self.actors = [_Actor(i, g) for i, g in enumerate(batch_seconds)]
        self.backlog_bound = backlog_bound(w.max_pending_batches, w.groups_per_step, w.groups_per_batch)
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.learner_version = 0          # version the learner has (steps completed)
        self.published = 0                # what LATEST points at
        self.chosen = 0                   # newest step whose files were chosen (actors' "next use")
        self.training = False
        self.backlog: list[tuple[int, int]] = []  # (version, groups) visible, not yet used
        self.collected_at: list[float] = []
        self.used: list[tuple[int, int, int]] = []  # (step, groups, lag)
        self.generated_groups = 0
        self.dropped_groups = 0
        self.usable_files: int | None = None  # backlog files of a usable version; None: count again
        self.epoch = 0  # bumped whenever what an idle actor's turn reads of the learner's side changes
        # the workload's derived times, read on every turn
        self.visible_after, self.actor_wait = w.visible_after, w.actor_wait

    def _at(self, t: float, kind: str, *data) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, data))

    def run(self, steps: int) -> None:
        self._collect()
        self._turns()
        while len(self.collected_at) <= steps and self.events:
            self.now, _, kind, data = heapq.heappop(self.events)
            # An idle actor's turn depends on its own state and on what the learner published and chose
            # and the files it has not used yet; a turn leaves it as it would leave itself (a second
            # turn in the same state does nothing). So the actor an event is about takes a turn, and
            # every other idle actor only when the learner's side changed since its last turn (a new
            # ``epoch``: a version published, files taken or dropped): a file becoming visible only
            # fills the backlog, which can hold an actor back, never let one go. These are the turns
            # of turning every idle actor after every event, without the calls that do nothing.
            if kind == "fetched":
                actor, version = self.actors[data[0]], data[1]
                if actor.fetching == version:  # not a transfer the receiver abandoned since
                    actor.fetching, actor.fetched = None, version
                    if not actor.busy:
                        self._turn(actor)
            elif kind == "free":  # a batch committed, or a swap done
                self.actors[data[0]].busy = False
                self._turn(self.actors[data[0]])
            elif kind == "visible":
                self.backlog.append((data[0], self.w.groups_per_batch))
                self.usable_files = None
            elif kind == "trained":
                self.training = False
                self.learner_version += 1
                if self.learner_version % self.w.publish_every == 0:
                    self.published = self.learner_version
                    self.epoch += 1
            if kind in ("trained", "poll") or (kind == "visible" and self.w.learner_poll_seconds == 0):
                self._collect()
                self._turns()

    def _turns(self) -> None:
        for actor in self.actors:
            if not actor.busy and actor.turned_in != self.epoch:
                self._turn(actor)

    def _turn(self, actor: _Actor) -> None:
        w = self.w
        index = actor.index
        actor.turned_in = self.epoch
        if actor.fetched is not None:
            actor.version, actor.fetched = actor.fetched, None
            if w.swap_seconds > 0:
                actor.busy = True
                self._at(self.now + w.swap_seconds, "free", index)
                return
        latest = self.published
        pending = actor.fetching
        if (latest != actor.version and latest != pending
                and (pending is None or not pending < latest < pending + w.staleness)):
            actor.fetching = latest
            self._at(self.now + w.dissemination_seconds, "fetched", index, latest)
        oldest_usable = self.chosen - w.staleness
        if actor.version is None or actor.version < oldest_usable:
            return
        # like the real actor it counts committed files only: actors deciding at the same moment
        # may all start, and the backlog can overshoot its bound by the fleet's size
        if self.usable_files is None:  # counted again only when the backlog or the learner's choice changed
            self.usable_files = sum(1 for v, _ in self.backlog if v >= oldest_usable)
        if self.usable_files >= self.backlog_bound:
            return
        actor.busy = True
        self.generated_groups += w.groups_per_batch
        # the file is visible no later than the actor's next turn: scheduled first, it is popped first at a tie
        self._at(self.now + actor.batch_seconds + self.visible_after, "visible", actor.version)
        self._at(self.now + actor.batch_seconds + self.actor_wait, "free", index)

    def _collect(self) -> None:
        if self.training:
            return
        self.usable_files = None
        t = self.learner_version
        fresh = sorted(b for b in self.backlog if t - b[0] <= self.w.staleness)
        if len(fresh) < len(self.backlog):  # stale files dropped: room in the backlog
            self.dropped_groups += sum(b[1] for b in self.backlog if t - b[0] > self.w.staleness)
            self.epoch += 1
        self.backlog = fresh
        if sum(b[1] for b in fresh) < self.w.groups_per_step:
            if self.w.learner_poll_seconds > 0:  # list the store again after a poll interval
                self._at(self.now + self.w.learner_poll_seconds, "poll")
            return
        taken = 0
        while taken < self.w.groups_per_step:  # whole files, oldest version first
            version, groups = self.backlog.pop(0)
            taken += groups
            self.used.append((t + 1, groups, t - version))
        self.collected_at.append(self.now)
        self.chosen = t + 1
        self.epoch += 1
        self.training = True
        self._at(self.now + self.w.train_seconds, "trained")
