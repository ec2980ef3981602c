"""The fleet manager: desired against actual, for every backend.

    start: start the backend (its threads, its staged files); after a --resume, adopt what the previous
           learner's ledger launched and never saw end and the backend still reaches (``adoption.py``: a spot
           learner's local actors and SkyPilot clusters outlive it), stop the rest; then launch
           the desired number of actors (with fleet.actors: auto and fleet.workload over catalog offers: the
           fleet `echo2 plan --workload` prints for the same workload and catalog)
    every reconcile (between learner steps, and while the learner waits for rollouts):
        poll each actor; one that was reclaimed, crashed or exited is recorded, released (a cloud
            backend tears down what is left of it) and replaced in its slot (``slots.py``: a crash counts
            against fleet.max_restarts per slot for CRASH_WINDOW_S only, so rare crashes of a long run never add
            up to its end; a reclaim or a clean exit never counts: a reclaim is the provider's doing, and
            the replacement is the point of running on spot)
        a provider or STS call that keeps failing transiently (FleetApiError, after the backend's
            bounded retries) skips the rest of the pass, logged; the next pass asks again, and a
            replacement it could not launch is owed to its slot (crash count kept)
        an actor whose scoped store credentials expire within CREDENTIAL_MARGIN_S is replaced
        launch what is missing: a fixed count cheapest offer first (by $ per expected token/s), an offer that
            has no capacity now (CapacityError at once, or UNAVAILABLE once a launch gave up) skipped for the
            next cheapest and asked again after ``unavailable_retry_s``; with fleet.actors: auto over catalog
            offers, the chooser's mix (``sizing/choose.py`` through ``autosize.FleetChooser``: counts per
            offer), an offer found full asking the chooser again with that offer capped at what the fleet
            holds of it. A launch also names the offers interchangeable with its own (same GPU, other regions
            or clouds) that fit the budget (and, for a mix, cost no more than its own), for backends that can
            take any of several (SkyPilot's any_of)
        never start a worker that would take the fleet above fleet.max_usd_per_hour
    autosize(step, size): with fleet.actors: auto, at the steps autosize.due names (autosize.py): the
           chooser's mix for the fitted workload, the run's measured speeds and (where they differ beyond
           chance from the assumed ones) its ledger's reclaim rates in place; without catalog offers,
           resize(n) to the count the capacity model asks for; resize(n): grow, or retire the newest actors
    expel(actor): retire an actor the learner caught lying (spot_check.py) and replace it, and deny its
           scoped store session at once where the fleet minted one (``credentials.SessionDenier``); the flow
           hands reconcile the learner's banned actors, and reconcile returns every actor that ended or was
           retired, whose relay tokens the next published version revokes
    stop: terminate every actor

Every change goes to ``ledger/events/`` with the actor's offer and price (requested, running,
reclaimed, crashed, exited, terminated, resize, budget), which is all ``fleet/bill/`` needs
to bill the run. The flow only talks to this class; a new backend does not touch ``echo2/flows/``.
"""

from __future__ import annotations

import atexit
import logging
import secrets
import threading
import time
from dataclasses import replace
from typing import Callable, Mapping

from echo2.config import FleetConfig
from echo2.data.ledger import read_events, write_event
from echo2.data.store import ObjectStore
from echo2.fleet import adoption
from echo2.fleet.backends import (
    ActorLaunch,
    ActorOffer,
    ActorState,
    CapacityError,
    FleetApiError,
    FleetBackend,
    LaunchContext,
)
from echo2.fleet.bill.egress import fold_counters
from echo2.fleet.bill.ledger import fleet_usd
from echo2.fleet.credentials import SessionDenier
from echo2.fleet.sizing.autosize import FleetChooser, FleetSize, Mix
from echo2.fleet.sizing.autosize import due as autosize_due
from echo2.fleet.slots import CRASH_WINDOW_S, Slot, adopted_slots, recent

log = logging.getLogger("echo2.fleet")


class FleetFailed(RuntimeError):
    """An actor keeps crashing (more than fleet.max_restarts times in one slot): something is wrong
    with the actor's code or environment, and replacing it again would only burn money."""


CREDENTIAL_MARGIN_S = 600.0
"""An actor is replaced this long before its scoped credentials expire (a fresh actor gets fresh ones)."""


MAX_REPLANS_PER_PASS = 4
"""Times one pass asks the chooser again after offers ran out of capacity (each caps what it found full)."""


class FleetManager:
    def __init__(self, backend: FleetBackend, config: FleetConfig, store: ObjectStore, *,
                 launch: LaunchContext | None = None,
                 launch_spec: Callable[[str, ActorOffer], ActorLaunch] | None = None,
                 offers: list[ActorOffer] | None = None, desired: int | None = None, alternatives: int = 0,
                 unavailable_retry_s: float = 300.0, chooser: FleetChooser | None = None,
                 plan_from: FleetSize | tuple[Mix, FleetSize] | None = None, denier=None):
        """The backend builds each launch from ``launch`` (``FleetBackend.launch_spec``), or ``launch_spec(actor_id,
        offer)`` does (a test's); ``offers`` are the candidates (default: this machine, free), tried cheapest per
        expected token/s first; ``alternatives``: how many interchangeable offers a launch may name beside its
        own. ``chooser`` (``fleet.actors: auto`` over catalog offers): the fleet is the chooser's mix, first for
        ``plan_from`` (the workload to plan from before anything is measured, or a mix already chosen for it:
        ``FleetChooser.first_plan``) where given, else ``min_actors`` cheapest first until the first sizing."""
        self.backend = backend
        self.config = config
        self.store = store
        if launch is None and launch_spec is None:
            raise ValueError("FleetManager needs the launch context (or a launch_spec builder)")
        self.launch = launch
        self._spec_builder = launch_spec
        self.chooser = chooser
        self.plan_from = plan_from
        self.mix: dict[ActorOffer, int] | None = None
        """The chooser's fleet: instances wanted per offer (None: a count, cheapest offer first)."""
        self._inputs: FleetSize | None = None
        """The workload and tokens per batch the mix was chosen for (asked again when an offer is full)."""
        self.reclaim_overrides: dict[str, float] = {}
        """Reclaims per instance-hour the run's ledger measured, per offer, where they differ from the assumed."""
        self._replan_wanted = False
        self.offers = sorted(offers or [ActorOffer()], key=lambda o: (o.usd_per_throughput, o.usd_per_hour))
        self.alternatives = alternatives
        self.unavailable_retry_s = unavailable_retry_s
        self._unavailable_until: dict[ActorOffer, float] = {}
        self.desired = desired if desired is not None else (
            config.actors if isinstance(config.actors, int) else config.min_actors)
        self.slots: list[Slot] = []
        self.revoked: set[str] = set()
        """Actors that ended or were retired: their relay tokens are revoked at the next publish."""
        self.expelled: set[str] = set()
        """Actors the learner banned (a dishonest file): retired and replaced once."""
        self._sized_at: int | None = None
        """The learner step at which ``fleet.actors: auto`` last sized the fleet (``autosize``)."""
        self._next_index = 0
        self._owed: list[tuple[int, tuple[float, ...], str]] = []
        """Replacements a pass could not launch (slot index, its crashes, the actor replaced): first in ``_fill``."""
        self.skipped_passes = 0
        """Reconcile passes skipped because a provider or STS call kept failing (FleetApiError)."""
        self._budget_logged = False
        self._stopped = False
        self.denier = denier if denier is not None else SessionDenier.of_fleet(config, launch)
        """Denies an expelled actor's scoped store session at once (None: the fleet minted no sessions)."""
        atexit.register(self.stop)

    def launch_spec(self, actor_id: str, offer: ActorOffer) -> ActorLaunch:
        """What the backend launches for ``actor_id`` on ``offer``: the backend's own spec from the run's launch
        context (or the test's builder)."""
        if self._spec_builder is not None:
            return self._spec_builder(actor_id, offer)
        return self.backend.launch_spec(actor_id, offer, self.launch)

    # -- desired against actual ------------------------------------------------------------
    def start(self) -> None:
        self.backend.start()
        self._release_leftovers()
        if self.chooser is not None and isinstance(self.plan_from, tuple):
            mix, self._inputs = self.plan_from
            self._buy(mix, "first plan")
            self._fill()
        elif self.chooser is not None and self.plan_from is not None:
            self.plan(self.plan_from, "first plan, from the workload given")
        else:
            self._fill()

    def _release_leftovers(self) -> None:
        """A resumed run: the actors its ledger launched and never saw end are adopted where the backend can reach
        them (``fleet.adopt_on_resume``, ``adoption.py``: one ``adopt`` event each, a slot kept with its id, offer
        and bill); the others are stopped (``adopt_failed``, then ``terminated``) and their tokens revoked."""
        events = read_events(self.store)
        adopted, leftovers = adoption.take_over(self.backend, self.store, events, self.launch, self.offers,
                                                enabled=self.config.adopt_on_resume)
        slots, self._next_index = adopted_slots(adopted, events, self._next_index)
        self.slots.extend(slots)
        self.backend.release_leftovers(leftovers)
        for actor_id in leftovers:
            self.revoked.add(actor_id)
            write_event(self.store, "terminated", actor_id, reason="left by the learner before the resume")
        if leftovers:
            log.warning("fleet: stopping %d actors the previous learner left running: %s", len(leftovers),
                        ", ".join(leftovers))

    def reconcile(self, expel: Mapping[str, str] | None = None) -> dict:
        """Expel the actors in ``expel`` (id: why the learner banned it), record and replace ended actors, launch
        what is missing. A pass that a provider or STS error cuts short is skipped (logged): nothing is concluded
        from a failed request. Returns a status summary for the flow, and under ``revoked`` every actor that
        ended or was retired so far: the next published version revokes their relay tokens."""
        for actor_id, reason in (expel or {}).items():
            self.expel(actor_id, reason)
        if self.denier is not None:
            self.denier.retry()  # denials AWS refused for now
        try:
            self._reconcile()
        except FleetApiError as exc:
            self.skipped_passes += 1
            log.warning("fleet: reconcile pass skipped (%s); the next pass asks again", exc)
        return {"actors_alive": len(self.slots), "actors_desired": self.desired,
                "usd_per_hour": self.usd_per_hour(), "revoked": sorted(self.revoked)}

    def _reconcile(self) -> None:
        for slot in list(self.slots):
            status = self.backend.poll(slot.actor_id)
            if status.offer is not None and status.offer != slot.offer:  # the backend took an alternative
                slot.offer = status.offer
            if status.state == ActorState.RUNNING and not slot.running_seen:
                slot.running_seen = True
                write_event(self.store, "running", slot.actor_id, **slot.offer.event_fields())
            if not status.ended:
                if slot.expires_at is not None and slot.expires_at - time.time() < CREDENTIAL_MARGIN_S:
                    log.info("actor %s: its store credentials expire soon; replacing it", slot.actor_id)
                    self.slots.remove(slot)
                    self._retire(slot, reason="credentials expire")
                    self._replace(slot.index, slot.crash_times, slot.actor_id)
                continue
            self.slots.remove(slot)
            write_event(self.store, status.state.value, slot.actor_id, detail=status.detail,
                        **slot.offer.event_fields())
            self.revoked.add(slot.actor_id)
            self._release(slot)
            if status.state == ActorState.UNAVAILABLE:  # no capacity anywhere it asked: the next offer
                self._set_unavailable(slot.offer)
                log.warning("no capacity for %s (%s); trying the next offer", slot.actor_id, status.detail)
                self._replace(slot.index, slot.crash_times, slot.actor_id)
                continue
            now = time.time()
            crashes = recent(slot.crash_times, now) + ((now,) if status.state == ActorState.CRASHED else ())
            if status.state == ActorState.CRASHED and len(crashes) > self.config.max_restarts:
                raise FleetFailed(f"actor {slot.actor_id} crashed ({status.detail}) and slot {slot.index} was "
                                  f"replaced after {len(crashes) - 1} crashes within {CRASH_WINDOW_S:.0f} s; see its "
                                  "log")
            log.warning("actor %s %s (%s); replacing it", slot.actor_id, status.state.value, status.detail)
            self._replace(slot.index, crashes, slot.actor_id)
        self._fill()

    def _replace(self, index: int, crashes: tuple[float, ...], replaces: str) -> None:
        """Launch the successor of ``replaces`` in its slot, or owe it to the slot when it cannot start now."""
        self._owed.append((index, crashes, replaces))
        self._fill()

    def autosize(self, step: int, size: Callable[[], tuple[int, str] | FleetSize | None]) -> None:
        """``fleet.actors: auto``: at the learner steps ``autosize.due`` names, resize to what ``size`` (the
        capacity model, ``autosize.auto_fleet_size``) asks for: with a chooser, its mix for the fitted workload
        (the run's measured speeds and reclaim rates in place), else that many actors. A step where it cannot
        tell yet (None) is not counted as a sizing, so the next step asks again. A fixed fleet size: nothing."""
        if self.config.actors != "auto" or not autosize_due(step, self._sized_at):
            return
        sized = size()
        if sized is None:
            return
        self._sized_at = step
        if self.chooser is not None and isinstance(sized, FleetSize) and sized.workload is not None \
                and sized.batch_tokens:
            try:
                self.chooser.measured(self.store)
            except Exception as exc:  # an optimization: the profiles' figures stand
                log.warning("fleet: could not read the run's measured speeds (%s); planning on the profiles", exc)
            self.plan(sized, sized.reason)
        else:
            self.resize(*sized)

    def plan(self, inputs: FleetSize, reason: str) -> bool:
        """Buy the chooser's mix for ``inputs``, the ledger's measured reclaim rates in place; False (the fleet as it
        is, logged) when the chooser finds none."""
        self._update_reclaim_rates()
        if not self._choose(inputs, reason):
            return False
        self._fill()
        return True

    def _choose(self, inputs: FleetSize, reason: str) -> bool:
        """Ask the chooser (offers found full capped at what the fleet holds of them); set the mix and retire what
        it no longer wants. Launching is ``_fill``'s."""
        self._inputs = inputs
        now = time.time()
        caps = {o.name: sum(1 for s in self.slots if s.planned == o)
                for o in self.offers if self._unavailable_until.get(o, 0.0) > now}
        mix = self.chooser.choose(inputs.workload, inputs.batch_tokens, reclaim=dict(self.reclaim_overrides),
                                  caps=caps)
        if mix is None or not mix.counts:
            log.warning("fleet: the chooser found no fleet within the caps and the budget (%s); the fleet stays "
                        "as it is", reason)
            write_event(self.store, "plan", "fleet", found=False, reason=reason, caps=caps,
                        reclaim_overrides=dict(self.reclaim_overrides))
            return False
        self._buy(mix, reason)
        return True

    def _buy(self, mix: Mix, reason: str) -> None:
        wanted = {}
        for offer, n in mix.counts:
            wanted[offer] = wanted.get(offer, 0) + n
        total = sum(wanted.values())
        write_event(self.store, "resize", "fleet", actors_from=self.desired, actors_to=total,
                    reason=f"{reason}; {mix.reason}",
                    mix=[{"offer": o.name, "count": n, "usd_per_hour_each": o.usd_per_hour} for o, n in wanted.items()],
                    reclaim_overrides=dict(self.reclaim_overrides))
        log.info("fleet: %s -> %s (%s; %s)", self.desired, ", ".join(f"{n} x {o.name}" for o, n in wanted.items()),
                 reason, mix.reason)
        self.mix, self.desired = wanted, total
        for slot in reversed(list(self.slots)):  # the newest first, as resize retires
            planned = slot.planned or slot.offer
            if sum(1 for s in self.slots if (s.planned or s.offer) == planned) > wanted.get(planned, 0):
                self.slots.remove(slot)
                self._retire(slot, reason="the chooser's new mix")

    def _update_reclaim_rates(self) -> None:
        """The ledger's reclaims per instance-hour in place of the assumed rates where they differ beyond chance."""
        if self.chooser is None:
            return
        try:
            self.reclaim_overrides.update(self.chooser.measured_reclaims(read_events(self.store), time.time()))
        except Exception as exc:  # the store may be slow now; the next sizing reads it again
            log.warning("fleet: could not read the ledger's reclaims (%s)", exc)

    def resize(self, n: int, reason: str) -> None:
        """Grow to ``n`` actors, or retire the newest ones; recorded even when ``n`` is the size already
        (the decision and its reason are what a user auditing the fleet wants to see)."""
        write_event(self.store, "resize", "fleet", actors_from=self.desired, actors_to=n, reason=reason)
        self.mix = None  # a count: cheapest offer first again
        if n == self.desired:
            return
        log.info("fleet: %d -> %d actors (%s)", self.desired, n, reason)
        self.desired = n
        while len(self.slots) > n:
            self._retire(self.slots.pop())
        self._fill()

    def expel(self, actor_id: str, reason: str) -> None:
        """Retire ``actor_id`` for good (the learner caught it lying) and launch a replacement; once."""
        if actor_id in self.expelled:
            return
        self.expelled.add(actor_id)
        self.revoked.add(actor_id)
        if self.denier is not None:  # its store session first: it may hold a copy of its credentials anywhere
            self.denier.request(actor_id)
        write_event(self.store, "expelled", actor_id, reason=reason[:500])
        for slot in list(self.slots):
            if slot.actor_id == actor_id:
                log.error("expelling actor %s: %s", actor_id, reason)
                self.slots.remove(slot)
                self._retire(slot, reason="expelled")
                self._replace(slot.index, slot.crash_times, actor_id)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        # the actors' byte counters, before they stop and remove their peer records: the learner folds them only
        # at a publish, so without this the bill would miss what they read since (never raises: logged)
        fold_counters(self.store, [slot.actor_id for slot in self.slots])
        # every actor is told to stop at once, not one grace period after another: a cancelled flow run
        # has Prefect's 30 s grace for its checkpoint and the whole teardown
        # (threads, not a pool: this also runs at exit, where a pool takes no more work)
        stopping = [threading.Thread(target=self._retire, args=(slot,), name=f"echo2-stop-{slot.actor_id}")
                    for slot in self.slots]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        self.slots = []
        self.backend.close()
        atexit.unregister(self.stop)

    # -- money -------------------------------------------------------------------------------
    def usd_per_hour(self) -> float:
        return sum(slot.offer.usd_per_hour for slot in self.slots)

    def cost_so_far(self) -> float:
        """Dollars the fleet has cost this run so far (``fleet/bill/ledger.py``, from the ledger)."""
        return fleet_usd(self.store)

    # -- logs --------------------------------------------------------------------------------
    def new_log_lines(self) -> list[str]:
        return [f"[{slot.actor_id}] {line}" for slot in self.slots
                for line in self.backend.new_log_lines(slot.actor_id)]

    # -- inside --------------------------------------------------------------------------------
    def _fill(self) -> None:
        """Launch owed replacements, then new slots, up to ``desired``; a launch that cannot be prepared now
        (FleetApiError: STS throttled, say) ends it, logged, and the next reconcile goes on from there. With the
        chooser's mix, an offer found full asks the chooser again (that offer capped at what the fleet holds)."""
        for _ in range(MAX_REPLANS_PER_PASS + 1):
            try:
                self._fill_slots()
            except FleetApiError as exc:
                log.warning("fleet: could not launch every actor yet (%s); the next reconcile tries again", exc)
                return
            if not (self._replan_wanted and self._inputs is not None and self.chooser is not None):
                return
            self._replan_wanted = False
            if not self._choose(self._inputs, "an offer had no capacity"):
                return

    def _fill_slots(self) -> None:
        while self._owed and len(self.slots) < self.desired:
            index, crashes, replaces = self._owed[0]
            if not self._launch(index, crashes=crashes, replaces=replaces):
                return
            self._owed.pop(0)
        while len(self.slots) < self.desired:
            self._next_index += 1
            if not self._launch(self._next_index - 1):
                self._next_index -= 1
                return

    def _wanted_offers(self, available: list[ActorOffer]) -> list[ActorOffer]:
        """The offers a launch may take now: with the chooser's mix, the first one short of its count (in the mix's
        order) if it is available, else none (and the chooser is asked again); else every available offer, the
        cheapest per expected token/s first."""
        if self.mix is None:
            return available
        for offer, n in self.mix.items():
            if sum(1 for s in self.slots if s.planned == offer) < n:
                if offer in available:
                    return [offer]
                self._replan_wanted = True
                return []
        return []

    def _launch(self, index: int, *, crashes: tuple[float, ...] = (), replaces: str | None = None) -> bool:
        """Launch one actor in slot ``index``: on the chooser's next offer, or the cheapest offer that has capacity
        and fits the budget."""
        budget = self.config.max_usd_per_hour
        now = time.time()
        available = [o for o in self.offers if self._unavailable_until.get(o, 0.0) <= now]
        for offer in self._wanted_offers(available):
            if budget is not None and self.usd_per_hour() + offer.usd_per_hour > budget + 1e-9:
                if not self._budget_logged:
                    write_event(self.store, "budget", "fleet", max_usd_per_hour=budget,
                                usd_per_hour=self.usd_per_hour(), wanted=offer.usd_per_hour)
                    log.warning("fleet: another actor at $%.4f/h would exceed fleet.max_usd_per_hour=%g",
                                offer.usd_per_hour, budget)
                    self._budget_logged = True
                return False
            actor_id = f"actor{index}-{secrets.token_hex(3)}"
            # the spec first (it mints the actor's credentials, which may fail for now): "requested" opens a bill
            spec = replace(self.launch_spec(actor_id, offer), alternatives=self._alternatives(offer, available))
            write_event(self.store, "requested", actor_id, backend=self.backend.name, replaces=replaces,
                        **offer.event_fields())
            try:
                details = self.backend.launch(spec)
            except CapacityError as exc:
                write_event(self.store, "unavailable", actor_id, reason=str(exc)[:500], **offer.event_fields())
                log.warning("offer %s/%s in %s unavailable (%s); trying the next", offer.provider,
                            offer.instance_type, offer.region, exc)
                self._set_unavailable(offer, alternatives=False)
                if self.mix is not None:  # the chooser decides what stands in for it
                    self._replan_wanted = True
                    return False
                continue
            # the bill starts here: "launch" opens the billing row (fleet/bill/ledger.py); a "running" event
            # later names the alternative the backend took, whose price then bills the whole row
            write_event(self.store, "launch", actor_id, backend=self.backend.name, expires_at=spec.expires_at,
                        **offer.event_fields(), **details)
            self.slots.append(Slot(index, actor_id, offer, crashes, expires_at=spec.expires_at, planned=offer))
            self._budget_logged = False
            return True
        return False

    def _alternatives(self, offer: ActorOffer, available: list[ActorOffer]) -> tuple[ActorOffer, ...]:
        """Offers interchangeable with ``offer`` that would also fit the budget, cheapest first."""
        if self.alternatives <= 0:
            return ()
        budget = self.config.max_usd_per_hour
        room = None if budget is None else budget - self.usd_per_hour() + 1e-9
        if self.mix is not None:  # none dearer than the chooser's offer: the mix costs what it was chosen at
            room = offer.usd_per_hour + 1e-9 if room is None else min(room, offer.usd_per_hour + 1e-9)
        same = [o for o in available
                if o != offer and offer.interchangeable(o) and (room is None or o.usd_per_hour <= room)]
        return tuple(same[: self.alternatives])

    def _set_unavailable(self, offer: ActorOffer, *, alternatives: bool = True) -> None:
        """Skip ``offer`` (and, when the launch named them, the alternatives it was asked with) for a while."""
        until = time.time() + self.unavailable_retry_s
        for o in self.offers:
            if o == offer or (alternatives and self.alternatives > 0 and offer.interchangeable(o)):
                self._unavailable_until[o] = until

    def _release(self, slot: Slot) -> None:
        """What is left of an ended actor (a cloud VM kept up after a failed job) goes too."""
        try:
            self.backend.terminate(slot.actor_id, grace_s=0)
        except Exception as exc:
            log.warning("could not release %s: %s", slot.actor_id, exc)

    def _retire(self, slot: Slot, reason: str | None = None) -> None:
        self.revoked.add(slot.actor_id)
        try:
            self.backend.terminate(slot.actor_id)
            write_event(self.store, "terminated", slot.actor_id, reason=reason, **slot.offer.event_fields())
        except Exception as exc:  # the store or the provider may be why we are stopping
            log.warning("could not record the stop of %s: %s", slot.actor_id, exc)
