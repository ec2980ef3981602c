"""The actor loop: follow the latest policy, generate groups, score them, commit Arrow files.

    loop:
        if a newer policy version is ready to load: swap to it
            (broadcast/weight_source.py, one call: the version is received in the background from
            the parent relay peer or the store, chunk by chunk, each checked against the signed
            manifest; a sparse delta is rebuilt and every tensor checked against the signed hashes,
            a LoRA adapter merged into its base or handed to an engine that applies it itself)
        if a batch started now would be too stale when the learner next collects, or the
            fleet already has enough usable batches waiting: sleep                    (flow control)
        draw groups_per_batch problems; the task plays G episodes of each with the engine
            (one sampled reply, or a multi-turn game) and scores them
        commit rollouts/v{v}/{actor}-{seq}.arrow (create-if-absent)

With ``rollout.refill`` (single-turn tasks) the last two steps are one stream per version instead (``refill.py``):
a new group starts as an earlier one finishes, a batch is committed as its last group finishes, the checks above
run before every batch the stream takes, and a new version is swapped in once the groups in flight are done.

An actor holds no state that matters: killing it loses at most the batch in flight. It stops
on SIGTERM/SIGINT or a spot preemption notice from the instance metadata (``preemption.py``;
finishing a commit already under way, dropping a batch in generation, leaving ``peers/``), when
its parent process dies, when the run has written its summary, or when the learner has left no new mark in
the store (LATEST, the ledger) for ``fleet.learner_silence_s`` (``learner_watch.py``: a dead learner cannot
stop a cloud actor, which would bill on). It never imports Prefect or the learner.

A store outage longer than ``store.retry_s`` (the store's own retries) does not end the actor: a transient store
error in its loop (``store.is_transient``) is waited out, with a growing pause, as ``LearnerWatch`` waits out a store
that fails; only an outage as long as ``fleet.learner_silence_s`` stops it, with exit 0, like a learner that fell
silent. So an outage neither crashes every actor nor counts against ``fleet.max_restarts``.

Learner incarnations (``data/lease.py``): every manifest names the incarnation that published it, and the actor
never loads a version of an older incarnation than the newest it has loaded, so a learner that another one
replaced cannot steer it even if one of its versions reached the store.

A spot learner's actors outlive it: during the gap the actor keeps its weights and relay, stops at the
backlog bound (the dead learner judges nothing, so the backlog fills), and carries on when LATEST moves, also
back: a resumed learner re-points LATEST at its checkpoint c and publishes c + 1 ... again with other weights.
Every file names the signed manifest it was generated with (``rollouts.policy_digest``), so the learner keeps
the files of the new timeline and drops those of the lost one, whatever their version numbers.
"""

from __future__ import annotations

import _thread
import logging
import os
import random
import shutil
import signal
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoTokenizer

from echo2.broadcast.receiver import PolicyReceiver
from echo2.broadcast.relay_tls import relay_tls
from echo2.broadcast.weight_source import ReadyVersion, VersionRejected, WeightSource
from echo2.config import Config, backlog_bound, config_from_run
from echo2.data import layout
from echo2.data.lease import Incarnation
from echo2.data.ledger import ConsumedIndex
from echo2.data.relay_tokens import token_from_env
from echo2.data.rollouts import Rollout, encode_rollouts, policy_digest
from echo2.data.run_key import public_key_of
from echo2.data.store import NotFound, ObjectStore, is_transient
from echo2.preemption import Notice, start_watcher
from echo2.rollout.engines import Engine, SamplingParams, make_engine
from echo2.rollout.learner_watch import LearnerWatch
from echo2.rollout.machine import machine_broadcast, machine_site
from echo2.rollout.refill import Played, refillable, stream_batches
from echo2.tasks import make_task
from echo2.tasks.task_data import localize

log = logging.getLogger("echo2.actor")


def per_actor_cap(config: Config) -> int:
    """The most waiting batches of any one other actor that count against the backlog: its share of
    ``backlog_bound`` in the configured fleet (``fleet.actors``, or ``fleet.max_actors`` when sized
    automatically), at least one. An honest actor keeps about its share waiting, so the cap costs the
    honest fleet nothing, while an actor that floods the store with files counts no more than its share
    (and nothing once the learner found one of its files junk: ``ledger.fleet_backlog``)."""
    actors = config.fleet.actors if isinstance(config.fleet.actors, int) else config.fleet.max_actors
    r = config.rollout
    return max(1, -(-backlog_bound(r.max_pending_batches, config.train.groups_per_step, r.groups_per_batch) // actors))


class _Stop(Exception):
    pass


OUTAGE_PAUSE_S = (1.0, 60.0)
"""The first and the longest pause between two looks at a store that keeps failing."""


def store_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says the store is not answering now."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if is_transient(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class Actor:
    def __init__(self, store: ObjectStore, actor_id: str, *, parent_pid: int | None = None,
                 engine_factory: Callable[[Path, object], Engine] | None = None):
        """``engine_factory(model_dir, tokenizer)`` replaces the configured engine (the overlap
        benchmark's timing workload; ``echo2 actor`` never passes one)."""
        self.store = store
        self.engine_factory = engine_factory
        self.actor_id = actor_id
        self.parent_pid = parent_pid
        run = store.get_json(layout.RUN_JSON)
        self.run_id: str = run["run_id"]
        self.config: Config = config_from_run(run["config"], f"{store.url}/run.json")
        if hasattr(store, "retry_s"):  # ride out an outage of the store as long as the run says
            store.retry_s = self.config.store.retry_s
        self._workdir = Path(tempfile.mkdtemp(prefix=f"echo2-{actor_id}-"))
        # a Hugging Face dataset's rows as the learner resolved them, from the run folder: never the hub
        self.task = make_task(localize(self.config.task, run.get("task_data") or {}, store,
                                       self._workdir / "task-data"))
        self.refill = self.config.rollout.refill and refillable(self.task)
        """Generate in streams (``refill.py``): asked for, and the task's prompts are known before sampling."""
        if self.config.rollout.refill and not self.refill:
            log.warning("rollout.refill: task %s plays multi-turn episodes; generating batch by batch",
                        self.task.name)
        self._ready: ReadyVersion | None = None
        """A version a stream saw ready and stopped for, swapped in by the next ``_follow_policy``."""
        self.seed = self.config.run.seed * 1_000_003 + zlib.crc32(actor_id.encode())
        """This actor's own seed: its problem draws, torch's generator and the engine's sampling."""
        self.rng = random.Random(self.seed)
        torch.manual_seed(self.seed)
        self.consumed = ConsumedIndex(store)
        self._newest_entry: tuple[int, object] | None = None
        """(the newest ledger step the index read, what marked its entry then): a resume's rewrite changes it."""
        self.learner_watch = LearnerWatch(store, self.config.fleet.learner_silence_s)
        # what an actor holds: the run's public key (verifies versions and peers' tokens) and its own
        # relay token (talks to peers); neither signs anything, and the learner's private key is never read here
        r = self.config.rollout  # the relay binds and advertises this machine's address (machine.py)
        broadcast = machine_broadcast(self.config.broadcast, preemption_source=r.preemption_source,
                                      preemption_endpoint=r.preemption_endpoint)
        # across hosts the relay speaks mutual TLS with this actor's certificate ($ECHO2_RELAY_TLS) and run.json's CA
        receiver = PolicyReceiver(store, actor_id, public_key_of(run), token_from_env(),
                                  broadcast, staleness=self.config.train.staleness, run_id=self.run_id,
                                  tls=relay_tls(broadcast, run, actor_id), site=machine_site())
        # hands over each new version ready to load: full, a rebuilt delta, a merged or native LoRA adapter
        self.source = WeightSource(receiver, lora=self.config.train.lora_rank > 0)
        self.engine: Engine | None = None
        self.tokenizer = None
        self.version: int | None = None
        self.policy_digest: str | None = None
        """The sha256 of the signed manifest of the version in use, named in every file (``rollouts.policy_digest``)."""
        self.dissemination_seconds: float | None = None
        """From the learner's publish (manifest ``created_at``) to this actor generating with it."""
        self.fetch_seconds: float | None = None
        """How long the transfer of the version in use took (its part of ``dissemination_seconds``)."""
        self.put_seconds: float | None = None
        """How long the previous batch's commit took (the actor waits for it)."""
        self.swap_seconds: float | None = None
        """How long loading the version in use into the engine took."""
        self.previous_batch_seconds: float | None = None
        """The previous batch's whole turn: swap, flow control, sampling, scoring, encoding, commit."""
        self.seq = 0
        self.incarnation = Incarnation()
        """The newest learner incarnation whose version this actor loaded."""
        self._stopping = False
        self._committing = False
        self._closing = False
        self.notice: Notice | None = None
        """The preemption notice the actor stopped on, if any."""

    # -- lifecycle -------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self._stopping = True
            if not self._committing and not self._closing:  # abandon a batch in generation, not a commit
                raise _Stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _on_notice(self, notice: Notice) -> None:
        """From the watcher thread: stop as SIGTERM would. ``_stopping`` ends the loop at its next turn
        even where no handler is installed (an in-process actor); ``interrupt_main`` runs the installed
        handler in the main thread, which abandons a batch in generation but never a commit."""
        self.notice = notice
        self._stopping = True
        _thread.interrupt_main(signal.SIGTERM)  # a no-op where SIGTERM has no Python handler

    def _should_stop(self) -> bool:
        if self._stopping:
            return True
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("parent process %d is gone; stopping", self.parent_pid)
            return True
        if self.store.exists(layout.SUMMARY):
            log.info("run %s has finished; stopping", self.run_id)
            return True
        if self.learner_watch.silent():
            log.warning("no new policy version or ledger entry for %.0fs (fleet.learner_silence_s): the learner "
                        "is gone; stopping", self.config.fleet.learner_silence_s)
            return True
        return False

    def run(self) -> None:
        log.info("actor %s joins run %s at %s", self.actor_id, self.run_id, self.store.url)
        cfg = self.config.rollout
        watcher = None
        try:
            watcher = start_watcher(cfg.preemption_source, cfg.preemption_endpoint, cfg.preemption_poll_s,
                                    self._on_notice)
            outage_since: float | None = None
            while True:
                try:
                    if self._should_stop():
                        break
                    self._turn(cfg)
                    outage_since = None
                except Exception as exc:
                    if not store_outage(exc):
                        raise
                    now = time.monotonic()
                    outage_since = now if outage_since is None else outage_since
                    if now - outage_since >= self.config.fleet.learner_silence_s:
                        log.warning("the store has not answered for %.0fs (fleet.learner_silence_s): stopping",
                                    now - outage_since)
                        break
                    pause = min(OUTAGE_PAUSE_S[1], max(OUTAGE_PAUSE_S[0], (now - outage_since) / 2))
                    log.warning("the store is not answering (%s: %s): waiting %.0fs, then trying again",
                                type(exc).__name__, str(exc)[:200], pause)
                    self._pause(pause)
        except _Stop:
            pass
        finally:
            self._closing = True  # a second signal must not cut the clean-up short
            if watcher is not None:
                watcher.close()
            self.source.close()
            if self.engine is not None:
                self.engine.close()
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self.notice is not None:
            log.warning("actor %s leaves on a preemption notice (%s) after %d batches",
                        self.actor_id, self.notice.source, self.seq)
        log.info("actor %s stops after %d batches", self.actor_id, self.seq)

    def _turn(self, cfg) -> None:
        """One turn of the loop: follow the policy, then generate a batch if one can still be used."""
        turn_started = time.time()
        if self._follow_policy():
            turn_started = time.time()  # a swap is measured on its own (swap_seconds)
        if self.engine is None or not self._has_capacity():
            time.sleep(cfg.poll_seconds)
            return
        if self.refill:
            self._generate_stream(turn_started)
            return
        self._generate_batch()
        self.previous_batch_seconds = time.time() - turn_started

    def _pause(self, seconds: float) -> None:
        """Wait out a store outage (a signal still stops the actor: its handler raises here)."""
        time.sleep(seconds)

    # -- steps -----------------------------------------------------------------------------
    def _follow_policy(self) -> bool:
        """Swap to a newer version once it is ready to load (received whole and verified in the background
        while generation goes on; a sparse delta rebuilt bit for bit); whether it swapped."""
        ready, self._ready = self._poll_ready(), None
        if ready is None:
            return False
        if not self.incarnation.admits(ready.manifest):
            log.error("not swapping to v%d: published by learner incarnation %s, older than %d whose version this "
                      "actor loaded (a learner another one replaced)", ready.version,
                      ready.manifest.get("incarnation"), self.incarnation.newest)
            return False
        self.incarnation = self.incarnation.seen(ready.manifest)
        if self.engine is None:
            self._build_engine(ready)
        if ready.weights is not None:
            self.engine.load_weights(ready.weights.items())
        if ready.adapter is not None:
            self.engine.load_lora(ready.adapter.tensors, version=ready.version, rank=ready.adapter.rank,
                                  alpha=ready.adapter.alpha)
        if self.version is not None and ready.version <= self.version:  # a resumed learner's checkpoint, c + 1 ...
            log.warning("policy v%d -> v%d of a resumed learner's timeline", self.version, ready.version)
        self.version = ready.version
        self.policy_digest = policy_digest(ready.manifest)
        created = ready.manifest.get("created_at")
        self.dissemination_seconds = time.time() - created if isinstance(created, (int, float)) else None
        self.fetch_seconds = ready.fetch_seconds
        self.swap_seconds = time.time() - ready.received_at
        how = f", {ready.route} in {ready.rebuild_seconds:.2f}s" if ready.route != "full" else ""
        log.info("now generating with policy v%d (loaded in %.1fs%s)", self.version, self.swap_seconds, how)
        return True

    def _poll_ready(self) -> ReadyVersion | None:
        """The version ready to load, if any (kept until ``_follow_policy`` swaps to it)."""
        if self._ready is None:
            native_lora = self.engine is not None and self.engine.native_lora  # it applies adapters on its base itself
            try:
                self._ready = self.source.poll(native_lora=native_lora)
            except VersionRejected as exc:  # no route rebuilt it: keep generating with the weights we trust
                log.error("not swapping to v%d: %s (still on v%s)", exc.version, exc.reason, self.version)
        return self._ready

    def _build_engine(self, first: ReadyVersion) -> None:
        """The engine and tokenizer, from the model files of the first version (or of its keyframe)."""
        model_dir = self._workdir / "model"
        model_dir.mkdir(parents=True, exist_ok=True)
        for name, data in first.model_files.items():
            (model_dir / name).write_bytes(data)  # plain names only: the receiver checked them
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.engine_factory is not None:
            self.engine = self.engine_factory(model_dir, self.tokenizer)
        else:
            self.engine = make_engine(self.config, model_dir, self.tokenizer, seed=self.seed)

    def _has_capacity(self, in_flight: int = 0) -> bool:
        """Whether a batch started now can still be used: flow control, so no generation is thrown away.
        ``in_flight``: this actor's batches started and not yet committed (a refill stream's), counted as waiting.

        The learner's next collection happens at version c, the newest step in the ledger; a batch of
        version v is usable there only if c - v <= S, so an older policy waits for the next version
        instead of generating a batch the learner could only drop (with S = 0 it would otherwise
        generate one doomed batch per step). The fleet's backlog of batches still usable at c must
        also be short (``rollout.max_pending_batches``, never less than one step's worth), which
        bounds the lag a queue adds. Only files the learner has not judged count, other actors' files at
        most ``per_actor_cap`` each and junk producers' not at all (``ConsumedIndex.backlog``), and only
        in the folders of versions the learner has published (up to ``latest_step``): a flood of junk or
        of files from the future cannot stop honest actors.
        """
        assert self.version is not None
        self._refresh_consumed()
        oldest_usable = self.consumed.latest_step - self.config.train.staleness
        if self.version < oldest_usable:
            return False
        newest = max(self.consumed.latest_step, self.version)
        waiting = self.consumed.backlog(self.actor_id, oldest_usable, newest, per_actor_cap(self.config))
        r = self.config.rollout
        return waiting + in_flight < backlog_bound(r.max_pending_batches, self.config.train.groups_per_step,
                                                   r.groups_per_batch)

    def _may_start_batch(self, in_flight: int) -> bool:
        """A refill stream's check before each batch it takes: the actor's before each batch (stopping, a newer
        version ready to swap to, flow control), with the stream's batches in flight counted as waiting."""
        return not self._should_stop() and self._poll_ready() is None and self._has_capacity(in_flight)

    def _refresh_consumed(self) -> None:
        """``ConsumedIndex.refresh``, and a fresh index when a resume rewrote the ledger (an adopted actor
        outlives its learner). The index reads each entry once, by name; a resume moves the entries after its
        checkpoint aside and the new timeline writes those step numbers again, so a cached entry would hold the
        lost timeline's verdicts and count files the new one settled as still waiting (with a backlog bound of
        one, every actor then waits for the learner, which waits for them). Any rewrite includes the newest entry
        this index read (it is after the checkpoint, or nothing it read was rewritten): one look at that entry
        per refresh (its modification time, or its bytes where the store keeps no times) tells."""
        self.consumed.refresh()
        step = self.consumed.latest_step
        if self._newest_entry is not None and self._newest_entry[0] and self._entry_mark(
                self._newest_entry[0]) != self._newest_entry[1]:
            log.info("the ledger's entry of step %d was written again (a resumed learner's timeline): reading the "
                     "ledger anew", self._newest_entry[0])
            self.consumed = ConsumedIndex(self.store)
            self.consumed.refresh()
            step = self.consumed.latest_step
        self._newest_entry = (step, self._entry_mark(step) if step else None)

    def _entry_mark(self, step: int) -> object:
        """What identifies the ledger entry of ``step`` as written: its modification time (or bytes); None: gone."""
        key = layout.consumed_key(step)
        try:
            return self.store.modified(key)
        except NotImplementedError:
            try:
                return self.store.get(key)
            except NotFound:
                return None
        except NotFound:
            return None

    def _sample(self, prompts: list[list[int]], max_new_tokens: int) -> list:
        """The task's sampler: one continuation of each prompt from the engine, at the run's temperature."""
        groups = self.engine.generate(prompts, SamplingParams(n=1, max_new_tokens=max_new_tokens,
                                                              temperature=self.config.rollout.temperature))
        return [group[0] for group in groups]

    def _generate_batch(self) -> None:
        cfg = self.config.rollout
        version, digest = self.version, self.policy_digest
        problems = self.task.sample_train(self.rng, cfg.groups_per_batch)
        t0 = time.time()
        # the task plays the episodes (one reply each, or a multi-turn game) and scores them
        groups = self.task.rollout_groups(self._sample, self.tokenizer, problems, cfg.group_size, cfg.max_new_tokens)
        self._commit(version, digest, list(zip(problems, groups)), time.time() - t0)

    def _generate_stream(self, started: float) -> None:
        """One refill stream on the version in use (``refill.py``): each batch committed as its last group finishes,
        every file of it this version's (the weights change only after the stream ends)."""
        version, digest = self.version, self.policy_digest
        for played, seconds in stream_batches(self.engine, self.task, self.tokenizer, self.rng, self.config.rollout,
                                              self._may_start_batch):
            self._commit(version, digest, played, seconds)
            # batches overlap: a batch's turn is the time between two commits (the stream's start for the first)
            self.previous_batch_seconds = time.time() - started
            started = time.time()

    def _commit(self, version: int, digest: str | None, played: Played, seconds: float) -> None:
        """Commit one batch of scored groups as a rollout file of ``version``; ``seconds``: its generation time."""
        rollouts = []
        for gi, (problem, episodes) in enumerate(played):
            group_id = f"{self.actor_id}-{self.seq:06d}-{gi:03d}"
            for si, e in enumerate(episodes):
                rollouts.append(Rollout(
                    prompt_id=problem.id, group_id=group_id, sample_index=si, prompt_token_ids=e.prompt_token_ids,
                    completion_token_ids=e.completion_token_ids, completion_mask=e.completion_mask,
                    behavior_logprobs=e.behavior_logprobs, reward=e.reward, reward_detail=e.reward_detail,
                    finish_reason=e.finish_reason, generation_seconds=seconds,
                ))
        measured = {k: v for k, v in (("dissemination_seconds", self.dissemination_seconds),
                                      ("fetch_seconds", self.fetch_seconds), ("put_seconds", self.put_seconds),
                                      ("swap_seconds", self.swap_seconds),
                                      ("previous_batch_seconds", self.previous_batch_seconds))
                    if v is not None}
        data = encode_rollouts(rollouts, run_id=self.run_id, actor_id=self.actor_id, policy_version=version,
                               task=self.task.name, measured=measured, policy_digest=digest)
        self._committing = True
        put_started = time.time()
        try:
            self.store.put(layout.rollout_key(version, self.actor_id, self.seq), data)
        finally:
            self._committing = False
        self.put_seconds = time.time() - put_started
        tokens = sum(sum(r.completion_mask) for r in rollouts)  # the policy's tokens, not the environment's
        mean_reward = sum(r.reward for r in rollouts) / len(rollouts)
        log.info("batch %d: v%d, %d completions, %d tokens in %.1fs (%.0f tok/s), reward %.3f",
                 self.seq, version, len(rollouts), tokens, seconds, tokens / max(seconds, 1e-9), mean_reward)
        self.seq += 1
        if self._stopping:
            raise _Stop()


def run_actor(run_url: str, actor_id: str, store_options: dict, parent_pid: int | None = None, *,
              store: ObjectStore | None = None, engine_factory: Callable[[Path, object], Engine] | None = None) -> None:
    from echo2.data.store import open_store

    store = store or open_store(run_url, store_options)
    actor = Actor(store, actor_id, parent_pid=parent_pid, engine_factory=engine_factory)
    if actor.config.rollout.num_threads:
        torch.set_num_threads(actor.config.rollout.num_threads)
    actor.install_signal_handlers()
    actor.run()
