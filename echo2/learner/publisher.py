"""Publishing policy versions and collecting the ones nobody can use any more.

A version is committed by its signed manifest (written last), then ``policy/LATEST`` moves to it.
The manifest carries the relay tree over the peers alive at publish time that the fleet launched
(``topology.relay_plan``: peer records are untrusted input, parents their children report failed are
planned around), and the actors whose relay tokens are revoked (``data/relay_tokens.py``): no revoked
actor gets children. The tree is one forest per (provider, region) the fleet placed actors in (the ledger's
launch events), with one root reading the store in each site the store is not in (``store_site``: the
run config's ``store.provider``/``store.region``). Within a site the forest is laid out by the up- and
download rates the peers report in their records, fast peers near the roots (``broadcast/forest.py``); a
report of a failed parent demotes it only if the plan this learner signed for the reported version (kept
here, or read back from ``policy/`` after a resume) had it among the reporter's sources. Each publish also
folds the byte counters actors report in their peer records into the ledger (``fleet/bill/egress.py``: the bill's
traffic; nothing here waits on them).
Versions older than t - S (no rollout of them can be used) are deleted beyond
the newest ``publish.keep_versions``; with LoRA version 0 stays, since every adapter version applies to it;
with sparse deltas every version a kept version's chain needs stays (``delta_chain.chain_closure``).

Sparse deltas (``publish.delta``, ``Publisher``): the learner keeps the tensors it last
published (exactly what actors hold) and publishes version v as a delta against them. A version
is a full keyframe instead when there is nothing to encode against (version 0, the first publish
after a resume), when ``keyframe_every`` versions have passed since the last keyframe, when the
tensors changed names, shapes or dtypes, or when the deltas since the keyframe plus this one would
outgrow a full version (so a late actor never downloads more than a keyframe and one full
version's worth of deltas). Before a delta is published the learner applies it to its own copy
and checks every tensor's sha256 against the table it signs: a delta that does not rebuild the
version bit for bit is never published (a keyframe goes out instead), and the rebuilt copy is
what the next delta is encoded against. Each publish returns its numbers (``publish_*``: full and
sent bytes, changed share, encode and apply seconds), which the run records per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.topology import REPORT_VERSIONS, LaunchedActors, relay_plan
from echo2.config import BroadcastConfig, PublishConfig, TrainConfig
from echo2.data import layout
from echo2.data.delta import DeltaRejected, NeedsKeyframe, apply_delta, encode_delta, tensor_table
from echo2.data.delta_chain import chain_closure
from echo2.data.run_folder import RunInfo
from echo2.data.store import NotFound, ObjectStore, StoreError
from echo2.data.weights import delete_folder, publish_delta_version, publish_version, published_versions
from echo2.fleet.bill.egress import EgressLedger, fold_counters

log = logging.getLogger("echo2.learner")


def _relay_plan(store: ObjectStore, version: int, broadcast: BroadcastConfig, revoked: Collection[str],
                fleet: LaunchedActors, store_site: tuple[str, str] | None = None,
                plans: Callable[[int], dict | None] | None = None) -> dict:
    """The relay section; ``fleet``: the actors the run's fleet launched (no other peer gets into the plan)
    and where it placed them, as last read; ``store_site``: the store's (provider, region), None if unknown;
    ``plans``: version -> the relay section signed for it (reports are checked against it). The rates the
    forest is laid out by are those of the peer records (``topology.relay_plan``, ``broadcast/forest.py``)."""
    if broadcast.mode != "relay":
        return {"fanout": broadcast.fanout, "roots": broadcast.roots, "peers": []}
    return relay_plan(store, version, fanout=broadcast.fanout, roots=broadcast.roots,
                      max_age_s=broadcast.peer_timeout_s, revoked=revoked, known=fleet.ids,
                      placement=fleet.placement, store_site=store_site, plans=plans)


def collect_garbage(store: ObjectStore, version: int, train: TrainConfig, publish: PublishConfig,
                    cache: dict[int, dict] | None = None) -> None:
    """Delete versions no actor can still use (older than t - S) beyond the newest ``keep_versions``,
    unless a kept version's delta chain runs through them."""
    versions = published_versions(store)
    keep = set(versions[-publish.keep_versions :]) | {v for v in versions if v >= version - train.staleness}
    if train.lora_rank > 0 and versions and versions[0] == 0:
        keep.add(0)  # the base every adapter version applies to
    keep = chain_closure(store, keep, cache)
    for v in versions:
        if v not in keep:
            delete_folder(store, layout.policy_dir(v))
            if cache is not None:
                cache.pop(v, None)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Publisher:
    """Publishes the learner's versions, as sparse deltas where ``publish.delta`` says so."""

    def __init__(self, store: ObjectStore, *, train: TrainConfig, broadcast: BroadcastConfig,
                 key: Ed25519PrivateKey, extra_files: dict[str, bytes], publish: PublishConfig | None = None,
                 store_site: tuple[str, str] | None = None):
        """``publish``: the run's ``publish`` section (None: its defaults); ``store_site``: where the store lives
        (``StoreConfig.site``); None: read from ``run.json``'s config."""
        self.store, self.train, self.broadcast, self.key, self.extra_files = store, train, broadcast, key, extra_files
        self.publish_config = publish if publish is not None else PublishConfig()
        self.store_site = store_site if store_site is not None else RunInfo.read(store).store_site
        self.egress = EgressLedger(store)
        """The actors' byte counters, folded into the ledger at each publish (the bill's traffic)."""
        self.last: tuple[int, dict[str, torch.Tensor]] | None = None
        """The newest published version and its tensors, as actors rebuild them (delta runs only)."""
        self.keyframe: int | None = None
        self.chain_bytes = 0
        """Delta bytes published since the newest keyframe."""
        self._manifests: dict[int, dict] = {}  # immutable once committed: garbage collection reads each once
        self.fleet = LaunchedActors(store)
        """Who may be in a relay plan: the actors the fleet launched, from the ledger."""
        self._plans: dict[int, dict | None] = {}
        """Relay sections of recent versions (read back from the store after a resume), for the reports."""

    def publish(self, version: int, tensors: dict[str, torch.Tensor], meta: dict,
                revoked: Collection[str] = ()) -> tuple[dict, dict]:
        """Commit ``version``; returns its manifest and its numbers (``publish_*``). ``revoked``: actors
        whose relay tokens peers refuse from this version on."""
        started = time.perf_counter()
        full_bytes = _nbytes(tensors)
        stats: dict = {"publish_full_bytes": full_bytes}
        self.fleet()  # who the fleet launched, and where: the ledger's new events
        self._plans = {v: p for v, p in self._plans.items() if v >= version - REPORT_VERSIONS - 1}
        relay = _relay_plan(self.store, version, self.broadcast, revoked, self.fleet, self.store_site, self._plan_of)
        meta = {**meta, "revoked": sorted(revoked)}
        try:
            manifest = self._commit(version, tensors, meta, full_bytes, stats, relay)
        except BaseException:
            self.last = None  # what actors hold is unknown now: the next version is a keyframe
            raise
        self._manifests[version] = manifest
        self._plans[version] = relay
        collect_garbage(self.store, version, self.train, self.publish_config, self._manifests)
        # after the commit, so the version does not wait; never raises on input
        fold_counters(self.store, self.fleet.ids, ledger=self.egress)
        stats["publish_seconds"] = time.perf_counter() - started
        return manifest, stats

    def _plan_of(self, version: int) -> dict | None:
        """The relay section this run signed for ``version`` (from the store once, after a resume); None if
        it has none (never published, collected). Only the learner writes ``policy/``: no peer can forge it.
        Only answers are remembered (a committed manifest, or none there): a store error is None for this
        publish alone and asked again at the next, or one dropped request would turn the reports of that
        version into no demotion for as long as they count."""
        if version not in self._plans:
            try:
                manifest = self.store.get_json(layout.manifest_key(layout.policy_dir(version)))
            except (NotFound, ValueError):  # none there, or committed and not JSON: asking again gives the same
                manifest = None
            except (StoreError, OSError) as exc:
                log.warning("the relay plan of v%d could not be read (%s); reports of it wait for the next publish",
                            version, exc)
                return None
            relay = manifest.get("relay") if isinstance(manifest, dict) else None
            self._plans[version] = relay if isinstance(relay, dict) else None
        return self._plans[version]

    def _commit(self, version: int, tensors: dict[str, torch.Tensor], meta: dict, full_bytes: int, stats: dict,
                relay: dict) -> dict:
        # a LoRA run publishes its base once, then adapters: nothing for a delta to encode against
        delta_run = self.publish_config.delta and self.train.lora_rank == 0 and meta.get("weights") == "full"
        delta, reason = None, None
        if delta_run:
            reason = self._keyframe_reason(version)
            if reason is None:
                delta, reason = self._encode(tensors, full_bytes, stats)
        if delta is not None:
            manifest = publish_delta_version(
                self.store, version, delta.files, chunk_size=self.broadcast.chunk_bytes(delta.nbytes), key=self.key,
                meta={"relay": relay, **meta, "weights": "delta", "base_version": self.last[0],
                      "keyframe": self.keyframe, "tensors": delta.table})
            self.last = (version, self.last[1])  # rebuilt in place by the self-check: the new version
            self.chain_bytes += delta.nbytes
            stats.update(publish_bytes=delta.nbytes, publish_keyframe=0)
            return manifest
        extra = {}
        if delta_run:
            log.info("v%d is a keyframe: %s", version, reason)
            extra = {"keyframe": version, "tensors": tensor_table(tensors)}
            self.last = (version, {k: v.detach().clone() for k, v in tensors.items()})  # never the live weights
            self.keyframe, self.chain_bytes = version, 0
            stats["publish_keyframe"] = 1
        manifest = publish_version(self.store, version, tensors, extra_files=self.extra_files,
                                   shard_mb=self.publish_config.shard_mb,
                                   chunk_size=self.broadcast.chunk_bytes(full_bytes), key=self.key,
                                   meta={"relay": relay, **meta, **extra})
        stats["publish_bytes"] = sum(e["size"] for e in manifest["files"] if e["kind"] == "shard")
        return manifest

    def _keyframe_reason(self, version: int) -> str | None:
        if self.last is None or self.keyframe is None:
            return "no previous version to encode against (version 0 or a resumed run)"
        if version - self.keyframe >= self.publish_config.keyframe_every:
            return f"{version - self.keyframe} versions since keyframe v{self.keyframe} (publish.keyframe_every)"
        return None

    def _encode(self, tensors: dict[str, torch.Tensor], full_bytes: int, stats: dict):
        """(delta, None) when a delta goes out, else (None, why a keyframe does); fills ``stats``."""
        assert self.last is not None
        base = self.last[1]
        t0 = time.perf_counter()
        try:
            delta = encode_delta(base, tensors, max_file_bytes=self.publish_config.shard_mb * 2**20)
        except NeedsKeyframe as exc:
            return None, str(exc)
        stats.update(publish_encode_seconds=time.perf_counter() - t0, publish_delta_bytes=delta.nbytes,
                     publish_changed_fraction=delta.changed_fraction)
        if self.chain_bytes + delta.nbytes > full_bytes:
            return None, (f"the deltas since keyframe v{self.keyframe} would outgrow a full version "
                          f"({(self.chain_bytes + delta.nbytes) / 2**20:.1f} MB > {full_bytes / 2**20:.1f} MB)")
        t0 = time.perf_counter()
        try:  # the actors' own apply, on the learner's copy of what they hold
            apply_delta(base, delta.files, delta.table)
        except DeltaRejected as exc:  # undone: base is still the previous version
            log.error("a delta that does not rebuild the version was not published (%s); publishing a keyframe", exc)
            return None, "the delta failed its own check"
        stats["publish_apply_seconds"] = time.perf_counter() - t0
        return delta, None
