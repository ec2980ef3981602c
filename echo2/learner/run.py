"""A training run as the learner sees it: create or resume the run folder, step, evaluate, report.

The Prefect flow (``echo2/flows/train.py``) drives this object; nothing here knows about Prefect.

Resume (``resume.py``): the learner restarts from its newest checkpoint c that the run's own signing key signed (its
public half is in ``run.json``, which must carry the learner's signature too: ``run_folder.check_run_key``);
a newer checkpoint folder that fails verification is planted or damaged, logged and skipped (``checkpoint.py``).
The resume first records the lost timeline's boundary in its ledger event (``learner/timelines.py``), then moves
what the dead learner wrote after c to ``orphaned/<time>/`` (``data/run_folder.py``; rollout files stay, judged by
that boundary), and the run continues from version c; every ban of the ledger (``ledger/bans/``) holds again,
found after the checkpoint or not. Rollout files a step had chosen
but not trained on when it died are used again; every committed rollout file ends in the ledger
exactly once: used, dropped (stale, duplicate, or unused when the run finished) or quarantined.

A spot learner's notice (``notice.py``, driven by the flow): ``update`` keeps ``clock`` (how long steps and
checkpoints take, whether one is under way) for the decision to finish or abandon the step; ``leave_on_notice``
writes ``learner_notice``, checkpoints the step reached and writes ``learner_left``. A resume revokes at once only
the tokens of actors the ledger saw end: the live ones are the fleet's to adopt (``fleet/adoption.py``).

One incarnation at a time: the run object takes the run's lease (``data/lease.py``) before it writes anything of its
own (after creating ``run.json``, or before a resume moves anything), renews it each step and checkpoint, and writes
through a fenced store that checks it before every manifest, ``LATEST`` and ledger write; its manifests carry its
incarnation number. It releases the lease when it finishes, stops or leaves on a notice.

Revocations are run-wide: every actor a published version revoked is recorded once in the ledger (a ``revoked``
event, before the version that revokes it), and a resumed learner revokes them all again, so the ``revoked`` list of
every manifest of the new timeline holds every revocation of the run (a relay keeps the newest list it verified).

A torn learner (``Learner.torn``: something escaped from inside an optimizer update) is never checkpointed:
``interrupted`` and ``leave_on_notice`` leave the newest committed checkpoint as the run's.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from echo2 import __version__
from echo2.config import Config, backlog_bound
from echo2.data import layout
from echo2.data.failpoints import failpoint
from echo2.data.lease import take as take_lease
from echo2.data.ledger import read_bans, read_events, write_consumed, write_event, write_final
from echo2.data.rollouts import RolloutLimits
from echo2.data.run_folder import check_run_key, create_run, new_run_id, read_run_record
from echo2.data.run_key import run_key
from echo2.data.store import NotFound, ObjectStore
from echo2.errors import Echo2InputError
from echo2.learner.checkpoint import prune_checkpoints, save_checkpoint, verified_steps
from echo2.learner.collector import PROGRESS_EVERY_S, RolloutCollector, Selection, pending_quota, quarantine
from echo2.learner.distributed import learner_options, make_learner
from echo2.learner.evaluate import evaluate_policy, flat_metrics
from echo2.learner.learner import Learner
from echo2.learner.metrics import MetricsSink
from echo2.learner.notice import Heard, StepClock
from echo2.learner.publisher import Publisher
from echo2.learner.report import ReportInputs, write_reports
from echo2.learner.resume import (
    lost_timelines,
    restore_newest,
    revoked_at_resume,
    run_revocations,
    set_lost_timeline_aside,
)
from echo2.learner.spot_check import SpotChecker
from echo2.learner.tracking import check_installed
from echo2.learner.verify import TaskVerifier
from echo2.models import params_from_config_dict, resolve_model
from echo2.tasks import make_task
from echo2.tasks.task_data import freeze, localize

log = logging.getLogger("echo2.learner")


class LearnerRun:
    def __init__(self, config: Config, runs: ObjectStore, *, resume: bool, learner: Learner | None = None):
        """``learner`` replaces the one built from ``config.model`` (the overlap benchmark's timing
        workload; ``echo2 run`` never passes one)."""
        self.config = config
        self.started = time.time()
        if config.run.id is None:
            config.run.id = new_run_id(config.run.name)
        self.run_id = config.run.id
        check_installed(config.logging)  # a tracker's missing library stops the run before it writes anything
        self.store = runs.child(self.run_id)
        # a Hugging Face dataset is read once, when the run is created, into the run folder; this learner, its
        # resumes and the actors all play the task from that copy (``tasks/task_data.py``)
        self.task_data = (read_run_record(runs, self.run_id).get("task_data") or {}) if resume else \
            freeze(config.task, self.store)
        self.task = make_task(localize(config.task, self.task_data, self.store, self.local_dir / layout.TASK_DATA))
        random.seed(config.run.seed)
        torch.manual_seed(config.run.seed)
        if config.learner.num_threads:
            torch.set_num_threads(config.learner.num_threads)
        model_dir = None if learner else resolve_model(config.model.name, revision=config.model.revision)
        self.learner = learner or make_learner(model_dir, config.train, temperature=config.rollout.temperature,
                                               **learner_options(config))
        self.history: list[dict] = []
        self.evals: dict[str, dict] = {}
        t, trust = config.train, config.trust
        self.spot_checker = SpotChecker(
            self.learner.behavior_gap, fraction=trust.spot_check_fraction, max_gap=trust.spot_check_max_gap,
            keep_versions=t.staleness + 1, micro_batch_tokens=t.micro_batch_tokens,
            load=self._published_weights) if trust.spot_check_fraction > 0 else None
        """Spot checks of actors' behavior logprobs (``spot_check.py``); None when off."""
        self.revoked: set[str] = set()
        """Actors whose relay tokens the next published version revokes (the fleet adds ended actors)."""
        self._revocations_recorded: set[str] = set()
        """The revocations the ledger holds already (``revoked`` events)."""
        self.lease = None
        """This incarnation's hold on the run (``data/lease.py``), taken before the run object writes."""
        self.wall_before = 0.0
        self.clock = StepClock()
        """How long steps and checkpoints take, and whether one is under way (a spot notice's estimates)."""
        state: dict = {}
        self.publisher: Publisher | None = None  # made once the signing key is known
        self.last_publish: dict = {}
        """The numbers of the newest publish (``publish_*``), merged into the metrics of its step."""
        if resume:
            record = read_run_record(runs, self.run_id)
            self.key = run_key(self.run_id)  # never a new key: actors verify versions with run.json's public key
            check_run_key(record, self.key)
            self._take_lease()  # before the resume moves anything: a live learner of this run refuses it
            state = self._resume()
            self.revoked |= self._run_revocations()
        else:
            self.key = run_key(self.run_id, create=True)  # Ed25519, signs manifests; never in the store or a log
            create_run(self.store, self.run_id, config.model_dump(mode="json"), key=self.key,
                       echo2_version=__version__, task_data=self.task_data)
            self._take_lease()
            self.publish()  # version 0: the initial policy
            log.info("run %s created at %s", self.run_id, self.store.url)
        self.sink = MetricsSink(self.local_dir, self.run_id, config.model_dump(mode="json"), settings=config.logging,
                                store=self.store)
        r, t = config.rollout, config.train
        limits = RolloutLimits(vocab_size=self.learner.vocab_size, group_size=r.group_size,
                               max_completion_tokens=r.max_new_tokens + self.task.max_env_tokens,
                               max_prompt_tokens=trust.max_prompt_tokens, reward_range=self.task.reward_range,
                               max_groups=r.groups_per_batch)  # an honest file holds one batch: no more in a step
        backlog = backlog_bound(r.max_pending_batches, t.groups_per_step, r.groups_per_batch)  # as actors bound it
        self.collector = RolloutCollector(
            self.store, run_id=self.run_id, staleness=t.staleness, groups_per_step=t.groups_per_step, limits=limits,
            verifier=TaskVerifier(self.task, self.learner.tokenizer, max_new_tokens=r.max_new_tokens),
            max_file_bytes=int(trust.max_rollout_file_mb * 2**20),
            settled=set(state.get("settled", ())), used_hashes=set(state.get("used_hashes", ())),
            spot_checker=self.spot_checker,
            banned={**state.get("banned", {}), **(read_bans(self.store) if resume else {})},
            max_invalid_files=trust.max_invalid_files_per_actor,
            max_ungradable_files=trust.max_ungradable_files_per_actor,
            max_ungradable_fraction=trust.max_ungradable_fraction,
            lost_timelines=lost_timelines(read_events(self.store)) if resume else None,
            backlog_batches=backlog, progress_every_s=min(PROGRESS_EVERY_S, config.fleet.learner_silence_s / 4),
            max_pending_files=pending_quota(files_per_step=-(-t.groups_per_step // r.groups_per_batch),
                                            backlog=backlog, checkpoint_every=t.checkpoint_every,
                                            staleness=t.staleness),
        )
        if resume and self.spot_checker is not None:  # what the checkpoint's version published, checked as such
            self._keep_for_spot_checks(*self.learner.policy_version_tensors())

    # -- start -----------------------------------------------------------------------------
    def _take_lease(self) -> None:
        """Take the run for this incarnation (``LeaseHeld`` if a live learner holds it); write through the fence."""
        self.lease = take_lease(self.store)
        self.store = self.lease.fenced(self.store)
        log.info("run %s: learner incarnation %d", self.run_id, self.lease.incarnation)

    def _run_revocations(self) -> set[str]:
        """Every actor a version of this run revoked, any timeline, now recorded as such."""
        revoked = run_revocations(self.store)
        self._revocations_recorded |= revoked
        return revoked

    def _resume(self) -> dict:
        """Restore the newest checkpoint this run's key signed (``resume.py``), move the lost timeline aside,
        re-point LATEST; returns its state."""
        step, state = restore_newest(self.store, self.key.public_key(), self.learner)
        if state is not None:
            self.history = state["history"]
            self.evals = state["evals"]
            self.wall_before = state["wall_seconds"]
        self.revoked = revoked_at_resume(self.store, adopt=self.config.fleet.adopt_on_resume)
        lost_latest, moved = set_lost_timeline_aside(self.store, step, market=self.config.learner.market)
        if self.store.exists(layout.manifest_key(layout.policy_dir(step))):
            self.store.put_pointer(layout.LATEST, json.dumps({"version": step}).encode())
        else:
            self.publish()  # never committed (killed while publishing it): publish it now
        log.info("run %s resumed from step %d (the lost timeline published up to v%d; %d objects of it moved to "
                 "orphaned/)", self.run_id, step, lost_latest, len(moved))
        return state if state is not None else {}

    # -- the loop --------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.learner.version

    def evaluate(self, label: str) -> dict:
        """The task's held-out metrics (``echo2 eval``'s code), recorded under ``label`` ("before", "after",
        "step-N"); ``score`` is the task's headline metric (accuracy, bb/100)."""
        if label in self.evals:  # a resumed run keeps its first "before"
            return self.evals[label]
        t0 = time.time()
        cfg = self.config.eval
        result = evaluate_policy(self.learner.eval_model(), self.learner.tokenizer, self.task,
                                 max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, k=cfg.k,
                                 temperature=cfg.temperature)
        result["seconds"] = time.time() - t0
        result["at_step"] = self.step
        self.evals[label] = result
        self.sink.log_eval(label, self.step, result["score"], flat_metrics(result))
        log.info("eval %s (step %d): %s %.3f on %d held-out problems", label, self.step, result["metric"],
                 result["score"], result["n"])
        return result

    def collect(self, should_abort=lambda: None) -> Selection:
        """Wait for enough fresh, valid rollouts for the next step; write its ledger entry."""
        return self.collector.collect(self.step + 1, self.step, timeout_s=self.config.train.rollout_timeout_s,
                                      poll_s=self.config.train.poll_seconds, should_abort=should_abort)

    def update(self, selection: Selection) -> dict:
        """One optimizer step on ``selection``; publish and checkpoint on schedule; returns metrics."""
        if self.lease is not None:
            self.lease.renew()
        self.clock.begin(self.step)
        completed = False
        try:
            metrics = self._update(selection)
            completed = True
        finally:
            self.clock.end(completed)
        return metrics

    def _update(self, selection: Selection) -> dict:
        cfg = self.config.train
        t0 = time.time()
        before = self.learner.version
        try:
            metrics = self.learner.train_step(selection.tables)
            failpoint("step")
            if metrics["nonfinite"]:
                self._quarantine_step(selection)
        finally:
            # settled as soon as the version moved: an interrupt landing after the optimizer step would otherwise
            # checkpoint step N (``interrupted``) without its files, and the resumed run would use them again
            if self.learner.version > before:
                self.collector.settle(selection)
        metrics.update(wait_seconds=selection.waited_s, list_seconds=selection.list_seconds,
                       dropped_stale=len(selection.dropped),
                       quarantined=len(selection.quarantined), time=time.time())
        is_last = self.step >= cfg.max_steps
        if self.step % self.config.publish.every == 0 or self.step % cfg.checkpoint_every == 0 or is_last:
            self.publish()
            metrics.update(self.last_publish)
        if self.step % cfg.checkpoint_every == 0 or is_last:
            self.checkpoint()
        metrics["seconds"] = time.time() - t0 + selection.waited_s
        self.history.append(metrics)
        self.sink.log_completions(self.step, selection.tables, self.learner.tokenizer)
        self.sink.log(self.step, metrics)
        return metrics

    def _quarantine_step(self, selection: Selection) -> None:
        """A non-finite step: set its files aside (they may be what diverged it) and amend its ledger entry."""
        reason = f"step {selection.step} had a non-finite loss or gradient with this file in its batch"
        moved = []
        for item in selection.used:
            try:
                quarantine(self.store, item["key"], reason)
            except NotFound:
                continue
            moved.append({"key": item["key"], "reason": reason})
        write_consumed(self.store, selection.step, {"learner_version": selection.learner_version, "used": [],
                                                    "dropped": [], "quarantined": moved}, amendment="quarantine")

    @property
    def banned(self) -> dict[str, str]:
        """Actors caught lying (id: why), whom the fleet expels (``FleetManager.reconcile(expel=...)``)."""
        return dict(self.collector.banned)

    def revoke(self, actor_ids: Iterable[str]) -> None:
        """Revoke the relay tokens of ``actor_ids`` (actors that ended or were retired) and of every banned
        actor, at the next published version: relays then refuse them."""
        self.revoked |= set(actor_ids) | set(self.collector.banned)

    def spot_check_summary(self) -> dict:
        """What the spot checks of actors found: files seen and checked, the largest gap that passed, and every
        actor banned (by a spot check or by the verifier)."""
        a = self.spot_checker
        return {"fraction": self.config.trust.spot_check_fraction, "max_gap": self.config.trust.spot_check_max_gap,
                "files_seen": a.seen if a else 0, "files_checked": a.sampled if a else 0,
                "largest_passing_gap": a.largest_pass if a else None, "banned": dict(self.collector.banned)}

    def interrupted(self) -> None:
        """The run is being stopped (Ctrl-C, cancellation): checkpoint so that --resume continues here (not a torn
        learner's weights: then the newest committed checkpoint stands), and release the lease."""
        if self._checkpoint_on_leaving():
            self.checkpoint()
        write_event(self.store, "interrupted", "learner", step=self.step)
        if self.lease is not None:
            self.lease.release()
        log.warning("run %s interrupted at step %d; resume with --resume", self.run_id, self.step)

    def _checkpoint_on_leaving(self) -> bool:
        """Whether leaving (a stop, a notice) checkpoints the step reached: not where it is committed already, and
        never the weights of a torn learner (an error escaped from inside an optimizer update)."""
        if getattr(self.learner, "torn", False):
            log.error("run %s: the step under way was interrupted inside its optimizer update; its weights are not "
                      "checkpointed (the newest committed checkpoint stands, and its step's files are used again)",
                      self.run_id)
            return False
        return self.step > 0 and not verified_steps(self.store, self.key.public_key(), [self.step])

    def _committed_step(self) -> int:
        """The step the run resumes from now: this one once checkpointed, else the newest checkpoint signed."""
        steps = verified_steps(self.store, self.key.public_key())
        return self.step if self.step in steps or not getattr(self.learner, "torn", False) else max(steps, default=0)

    def leave_on_notice(self, heard: Heard, abandoned_step: bool) -> dict:
        """A spot learner's notice (``notice.py``): ``learner_notice``, a checkpoint of the step reached unless it is
        committed already, then ``learner_left``, whose fields it returns. The fleet is not touched."""
        write_event(self.store, "learner_notice", "learner", step=self.step if heard.step is None else heard.step,
                    source=heard.source, deadline_s=heard.deadline_s)
        if self._checkpoint_on_leaving():
            self.checkpoint()
        left = {"step": self.step, "reason": "notice", "checkpoint_step": self._committed_step(),
                "notice_to_checkpoint_s": round(time.monotonic() - heard.at, 3), "abandoned_step": abandoned_step}
        write_event(self.store, "learner_left", "learner", **left)
        if self.lease is not None:
            self.lease.release()
        self.sink.close()
        log.warning("run %s left on a %s notice at step %d, %.2f s after it (the notice gave %s s)%s; its actors keep "
                    "running: relaunch with --resume", self.run_id, heard.source, self.step,
                    left["notice_to_checkpoint_s"], heard.deadline_s, ", the step under way abandoned"
                    if abandoned_step else "")
        return left

    def publish(self) -> dict:
        """Publish the current version, signed, with the relay tree over the peers alive now: in full,
        or as a sparse delta against the previous one (``publish.delta``; a keyframe first, so
        also the first publish after a resume)."""
        if self.publisher is None:
            self.publisher = Publisher(self.store, train=self.config.train, publish=self.config.publish,
                                       broadcast=self.config.broadcast,
                                       key=self.key, extra_files=self.learner.extra_files,
                                       store_site=self.config.store.site)
        tensors, meta = self.learner.policy_version_tensors()
        if self.spot_checker is not None:
            self._keep_for_spot_checks(tensors, meta)
        new = self.revoked - self._revocations_recorded
        if new:  # in the ledger before the version that revokes them: a resumed learner revokes them again
            write_event(self.store, "revoked", "learner", actors=sorted(new), version=self.step)
            self._revocations_recorded |= new
        if self.lease is not None:  # actors ignore versions of an older incarnation than the newest they saw
            meta = {**meta, "incarnation": self.lease.incarnation}
        manifest, self.last_publish = self.publisher.publish(self.step, tensors, meta, revoked=self.revoked)
        return manifest

    def _published_weights(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights actors run as ``version``, read back from its signed folder in ``policy/`` (checked against
        the run's key, a delta rebuilt through its chain, a LoRA adapter merged into its base): what the spot checker
        needs for a version it does not hold, as after a resume. None where the version is gone (collected: no
        rollout of it can still be used)."""
        from echo2.data.delta_chain import read_version
        from echo2.data.lora import merge_lora
        from echo2.data.weights import read_manifest, read_verified

        public = self.key.public_key()
        try:
            manifest = read_manifest(self.store, layout.policy_dir(version), public)
            if manifest.get("weights") != "lora":
                return read_version(self.store, version, public)[0]
            from safetensors.torch import load as st_load

            adapter = {k: v for e in manifest["files"] if e["kind"] == "shard"
                       for k, v in st_load(read_verified(self.store, layout.policy_dir(version), e)).items()}
            base, _ = read_version(self.store, int(manifest["base_version"]), public)
        except NotFound:
            return None
        return merge_lora(base, adapter, rank=int(manifest["lora_rank"]), alpha=float(manifest["lora_alpha"]))

    def _keep_for_spot_checks(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Give the spot checker the weights actors run as this version: a LoRA version publishes only its
        adapter, which actors merge into the base, so the spot checker gets the merge (as after a resume)."""
        self.spot_checker.published(self.step,
                                    tensors if meta.get("weights") != "lora" else self.learner.full_tensors())

    def checkpoint(self) -> None:
        if getattr(self.learner, "torn", False):  # partly updated weights are no step's: never signed as one
            raise RuntimeError(f"run {self.run_id}: the learner's weights are torn (an optimizer update was "
                               "interrupted); refusing to checkpoint them")
        if self.lease is not None:
            self.lease.renew()
        # only what completed steps settled: files chosen for a step still in flight are used again on resume
        state = {"settled": sorted(self.collector.settled), "used_hashes": sorted(self.collector.used_hashes),
                 "banned": self.collector.banned,
                 "history": self.history, "evals": self.evals, "wall_seconds": self.wall_seconds(),
                 "run_id": self.run_id}
        learner, t = self.learner, self.config.train
        # every rank writes its own shards (no weight or optimizer state is gathered); the manifest goes last
        meta = ({"weights": "lora", "base_version": 0, "lora_rank": t.lora_rank, "lora_alpha": t.lora_alpha}
                if learner.lora else {"weights": "full"})
        t0 = time.monotonic()
        save_checkpoint(self.store, self.step, learner.save_sharded, state, key=self.key,
                        extra_files=learner.extra_files, meta=meta)
        self.clock.checkpointed(time.monotonic() - t0)
        prune_checkpoints(self.store, self.config.train.keep_checkpoints, self.key.public_key())
        self.sink.sync()  # TensorBoard's event files into the store: a spot learner's disk goes with its machine

    def wall_seconds(self) -> float:
        return self.wall_before + time.time() - self.started

    def report_file(self, name: str) -> bytes | None:
        try:
            return self.store.get(layout.report_key(name))
        except NotFound:
            return None

    def cost_markdown(self) -> str:
        return (self.report_file("cost.md") or b"").decode()

    def finish(self) -> dict:
        """Record what was left unused, write ``reports/`` (summary.json last: it tells actors the run is over)."""
        self.sink.close()
        if not self.store.exists(layout.FINAL_CONSUMED):
            write_final(self.store, self.step, *self.collector.final_leftovers(self.step))
        summary = write_reports(self.store, ReportInputs(
            run_id=self.run_id, steps=self.step, wall_seconds=self.wall_seconds(), evals=self.evals,
            eval_metric=self.task.headline, staleness_bound=self.config.train.staleness, history=self.history,
            spot_check=self.spot_check_summary()))
        if self.lease is not None:
            self.lease.release()
        return summary

    @property
    def model_params_b(self) -> float | None:
        """The policy's size in billions of parameters (which GPUs it fits, how fast they sample it)."""
        model = getattr(self.learner, "model", None)
        return None if model is None else sum(p.numel() for p in model.parameters()) / 1e9

    @property
    def active_params_b(self) -> float | None:
        """Billions of parameters one token runs through (a mixture of experts decodes at this size's speed):
        the counted total scaled by the config's active share; None for a dense model or an unreadable config."""
        total = self.model_params_b
        config = getattr(getattr(self.learner, "model", None), "config", None)
        if total is None or config is None:
            return None
        try:
            config_total, config_active = params_from_config_dict(config.to_dict())
        except Echo2InputError:
            return None
        return None if config_active >= config_total else total * config_active / config_total

    @property
    def local_dir(self) -> Path:
        """Local files of the run (logs, TensorBoard): the run folder itself for a local store, else
        ./echo2-logs/<run>."""
        if self.store.url.startswith("file://"):
            return Path(self.store.url[len("file://") :])
        return Path(layout.REMOTE_LOCAL_DIR) / self.run_id

    @property
    def log_dir(self) -> Path:
        return self.local_dir / layout.LOGS
