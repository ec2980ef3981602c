"""A training run as the learner sees it: create or resume the run folder, step, evaluate, report.

The Prefect flow (``flows/train.py``) drives this object; nothing here knows about Prefect.

Resume: the learner restarts from its newest checkpoint c. Everything the dead learner made
after c belongs to a timeline that no longer exists: policy versions > c, rollouts generated
with them, and ledger entries of steps > c. They are moved, not deleted, to
``orphaned/<time>/`` (nothing is lost), and the run continues from version c.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from echo2 import __version__
from echo2.data.run_key import run_key
from echo2.broadcast.topology import live_peers, plan
from echo2.config import Config
from echo2.data import layout
from echo2.data.ledger import CONSUMED_PREFIX, write_event
from echo2.data.store import AlreadyExists, NotFound, ObjectStore
from echo2.errors import Echo2InputError
from echo2.learner.checkpoint import checkpoint_steps, load_checkpoint, prune_checkpoints, save_checkpoint
from echo2.learner.collector import RolloutCollector, Selection
from echo2.learner.metrics import MetricsSink
from echo2.learner.evaluate import greedy_accuracy
from echo2.learner.learner import Learner
from echo2.learner.report import write_reports
from echo2.models import resolve_model
from echo2.tasks import make_task

log = logging.getLogger("echo2.learner")


def new_run_id(name: str) -> str:
    return f"{name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def find_resumable_run(runs: ObjectStore) -> str:
    """The newest run under ``runs/`` that has no summary yet."""
    candidates = []
    for key in runs.list():
        parts = key.split("/")
        if len(parts) == 2 and parts[1] == layout.RUN_JSON and not runs.exists(f"{parts[0]}/{layout.SUMMARY}"):
            candidates.append((runs.get_json(key).get("created_at", 0), parts[0]))
    if not candidates:
        raise Echo2InputError(f"--resume: no unfinished run under {runs.url}")
    return max(candidates)[1]


class LearnerRun:
    def __init__(self, config: Config, runs: ObjectStore, *, resume: bool):
        self.config = config
        self.started = time.time()
        if config.run.id is None:
            config.run.id = new_run_id(config.run.name)
        self.run_id = config.run.id
        self.store = runs.child(self.run_id)
        self.task = make_task(config.task)
        random.seed(config.run.seed)
        torch.manual_seed(config.run.seed)
        if config.train.num_threads:
            torch.set_num_threads(config.train.num_threads)
        self.learner = Learner(resolve_model(config.model.name), config.train,
                               temperature=config.rollout.temperature)
        self.key = run_key(self.run_id, create=True)  # signs manifests; never written to the store
        self.history: list[dict] = []
        self.evals: dict[str, dict] = {}
        self.wall_before = 0.0
        settled: set[str] = set()
        if resume:
            settled = self._resume()
        else:
            self._create()
        self.sink = MetricsSink(self.local_dir, self.run_id, config.model_dump(mode="json"))
        self.collector = RolloutCollector(
            self.store, run_id=self.run_id, staleness=config.train.staleness,
            groups_per_step=config.train.groups_per_step, group_size=config.rollout.group_size,
            vocab_size=self.learner.vocab_size, settled=settled,
        )

    # -- start -----------------------------------------------------------------------------
    def _create(self) -> None:
        record = {"run_id": self.run_id, "created_at": time.time(), "echo2_version": __version__,
                  "config": self.config.model_dump(mode="json")}
        try:
            self.store.put_json(layout.RUN_JSON, record)
        except AlreadyExists:
            raise Echo2InputError(f"run {self.run_id} already exists at {self.store.url}; use --resume") from None
        self.publish()  # version 0: the initial policy
        log.info("run %s created at %s", self.run_id, self.store.url)

    def _resume(self) -> set[str]:
        try:
            self.store.get_json(layout.RUN_JSON)
        except NotFound:
            raise Echo2InputError(f"--resume: no run {self.run_id} at {self.store.url}") from None
        if self.store.exists(layout.SUMMARY):
            raise Echo2InputError(f"run {self.run_id} has finished; nothing to resume")
        steps = checkpoint_steps(self.store)
        step = steps[-1] if steps else 0
        settled: set[str] = set()
        if steps:
            ckpt = load_checkpoint(self.store, step)
            if ckpt.adapter is not None:
                self.learner.load_adapter(ckpt.adapter)
            else:
                self.learner.model.load_state_dict(ckpt.tensors, strict=False)
                self.learner.model.tie_weights()
            self.learner.optimizer.load_state_dict(ckpt.optimizer["optimizer"])
            torch.set_rng_state(ckpt.optimizer["torch_rng"])
            random.setstate(ckpt.optimizer["py_rng"])
            settled = set(ckpt.state["settled"])
            self.history = ckpt.state["history"]
            self.evals = ckpt.state["evals"]
            self.wall_before = ckpt.state["wall_seconds"]
        self.learner.version = step
        moved = self._orphan_after(step)
        if self.store.exists(f"{layout.policy_dir(step)}/{layout.MANIFEST}"):
            self.store.put_pointer(layout.LATEST, json.dumps({"version": step}).encode())
        else:
            self.publish()
        write_event(self.store, "resume", "learner", step=step, orphaned=moved)
        log.info("run %s resumed from step %d (%d objects of the lost timeline moved to orphaned/)",
                 self.run_id, step, moved)
        return settled

    def _orphan_after(self, step: int) -> int:
        dest = f"orphaned/{time.time():.0f}"
        moved = 0
        for key in self.store.list("policy/") + self.store.list("rollouts/") + self.store.list(CONSUMED_PREFIX):
            parts = key.split("/")
            if parts[0] in ("policy", "rollouts"):
                v = layout.parse_version_dir(parts[1]) if len(parts) > 2 else None
                late = v is not None and v > step
            else:
                late = int(parts[-1].split("-")[1].split(".")[0]) > step
            if late:
                self.store.move(key, f"{dest}/{key}")
                moved += 1
        return moved

    # -- the loop --------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.learner.version

    def evaluate(self, label: str) -> dict:
        """Greedy held-out accuracy, recorded under ``label`` ("before"/"after")."""
        if label in self.evals:  # a resumed run keeps its first "before"
            return self.evals[label]
        t0 = time.time()
        result = greedy_accuracy(self.learner.model, self.learner.tokenizer, self.task,
                                 max_new_tokens=self.config.eval.max_new_tokens,
                                 batch_size=self.config.eval.batch_size)
        result["seconds"] = time.time() - t0
        result["at_step"] = self.step
        self.evals[label] = result
        self.sink.log_eval(label, self.step, result["accuracy"])
        log.info("eval %s (step %d): accuracy %.3f on %d held-out problems", label, self.step,
                 result["accuracy"], result["n"])
        return result

    def collect(self, should_abort=lambda: None) -> Selection:
        """Wait for enough fresh, valid rollouts for the next step; write its ledger entry."""
        return self.collector.collect(self.step + 1, self.step, timeout_s=self.config.train.rollout_timeout_s,
                                      should_abort=should_abort)

    def update(self, selection: Selection) -> dict:
        """One optimizer step on ``selection``; publish and checkpoint on schedule; returns metrics."""
        cfg = self.config.train
        t0 = time.time()
        metrics = self.learner.train_step(selection.tables)
        metrics.update(wait_seconds=selection.waited_s, dropped_stale=len(selection.dropped),
                       quarantined=len(selection.quarantined), time=time.time())
        is_last = self.step >= cfg.max_steps
        if self.step % cfg.publish_every == 0 or self.step % cfg.checkpoint_every == 0 or is_last:
            self.publish()
        if self.step % cfg.checkpoint_every == 0 or is_last:
            self.checkpoint()
        metrics["seconds"] = time.time() - t0 + selection.waited_s
        self.history.append(metrics)
        self.sink.log(self.step, metrics)
        return metrics

    def interrupted(self) -> None:
        """The run is being stopped (Ctrl-C, cancellation): checkpoint so that --resume continues here."""
        if self.step > 0 and self.step not in checkpoint_steps(self.store):
            self.checkpoint()
        write_event(self.store, "interrupted", "learner", step=self.step)
        log.warning("run %s interrupted at step %d; resume with --resume", self.run_id, self.step)

    def publish(self) -> dict:
        """Publish the current version, signed, with the relay tree over the peers alive now."""
        b = self.config.broadcast
        live = live_peers(self.store, max_age_s=b.peer_timeout_s) if b.mode == "relay" else {}
        relay = plan(live, self.step, fanout=b.fanout, roots=b.roots)
        return self.learner.publish(self.store, key=self.key, chunk_size=int(b.chunk_mb * 2**20), relay=relay)

    def checkpoint(self) -> None:
        state = {"settled": sorted(self.collector.settled), "history": self.history, "evals": self.evals,
                 "wall_seconds": self.wall_seconds(), "run_id": self.run_id}
        learner = self.learner
        save_checkpoint(self.store, self.step, learner.full_tensors(), learner.optimizer, state,
                        shard_mb=self.config.train.shard_mb, extra_files=learner.extra_files,
                        adapter=learner.adapter_tensors() if learner.lora else None)
        prune_checkpoints(self.store, self.config.train.keep_checkpoints)

    def wall_seconds(self) -> float:
        return self.wall_before + time.time() - self.started

    def report_file(self, name: str) -> bytes | None:
        try:
            return self.store.get(f"reports/{name}")
        except NotFound:
            return None

    def cost_markdown(self) -> str:
        return (self.report_file("cost.md") or b"").decode()

    def finish(self) -> dict:
        """Write ``reports/`` (summary.json last: it also tells actors the run is over)."""
        self.sink.close()
        return write_reports(self)

    @property
    def local_dir(self) -> Path:
        """Local files of the run (logs, TensorBoard): the run folder itself for a local store, else ./echo2-logs/<run>."""
        if self.store.url.startswith("file://"):
            return Path(self.store.url[len("file://") :])
        return Path("echo2-logs") / self.run_id

    @property
    def log_dir(self) -> Path:
        return self.local_dir / "logs"
