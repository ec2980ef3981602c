"""Publishing policy versions and collecting the ones nobody can use any more.

A version is committed by its signed manifest (written last), then ``policy/LATEST`` moves to it.
The manifest carries the relay tree over the peers alive at publish time, and the actors whose relay
tokens are revoked (``data/relay_tokens.py``). Versions older than
t - S (no rollout of them can be used) are deleted beyond the newest ``keep_versions``; with LoRA
version 0 stays, since every adapter version applies to it.
"""

from __future__ import annotations

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.topology import live_peers, plan
from echo2.config import BroadcastConfig, TrainConfig
from echo2.data import layout
from echo2.data.store import ObjectStore
from echo2.data.weights import delete_folder, publish_version, published_versions


def publish(store: ObjectStore, version: int, tensors: dict[str, torch.Tensor], meta: dict, *,
            extra_files: dict[str, bytes], train: TrainConfig, broadcast: BroadcastConfig,
            key: Ed25519PrivateKey, revoked: set[str] | frozenset[str] = frozenset()) -> dict:
    """Commit ``version`` (signed with ``key``, the learner's Ed25519 key), move LATEST to it, collect
    garbage; returns the manifest. ``revoked``: actors whose relay tokens peers refuse from this version on."""
    live = live_peers(store, max_age_s=broadcast.peer_timeout_s) if broadcast.mode == "relay" else {}
    live = {actor: url for actor, url in live.items() if actor not in revoked}  # no children for a revoked actor
    relay = plan(live, version, fanout=broadcast.fanout, roots=broadcast.roots)
    manifest = publish_version(store, version, tensors, extra_files=extra_files, shard_mb=train.shard_mb,
                               chunk_size=int(broadcast.chunk_mb * 2**20), key=key, meta={"relay": relay, "revoked": sorted(revoked), **meta})
    collect_garbage(store, version, train)
    return manifest


def collect_garbage(store: ObjectStore, version: int, train: TrainConfig) -> None:
    """Delete versions no actor can still use (older than t - S) beyond the newest ``keep_versions``."""
    versions = published_versions(store)
    keep = set(versions[-train.keep_versions :])
    oldest_useful = version - train.staleness
    for v in versions:
        if train.lora_rank > 0 and v == 0:
            continue  # the base every adapter version applies to
        if v not in keep and v < oldest_useful:
            delete_folder(store, layout.policy_dir(v))
