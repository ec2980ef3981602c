"""The actor's one call for policy weights: the newest received version, ready to load.

    Actor._follow_policy -> WeightSource.poll -> PolicyReceiver.poll       (receiver.py: signed, verified files)
                                              -> Reconstructor.weights     (reconstruct.py: deltas, keyframes)
                                              -> merge_lora, the LoRA base (data/lora.py; one cache, here)

The path runs one way: the actor asks, this module decodes, ``echo2.data`` parses and checks; nothing
here knows the engine beyond whether it applies adapters itself (``native_lora``, passed in). What
``poll`` hands over (a ``ReadyVersion``), by what the version's signed manifest says:

    "weights": "full"           its shards' tensors
    a keyframe or a delta       the full weights rebuilt, every tensor checked bit for bit against the signed
                                table (``reconstruct.py``); no route rebuilt it: ``VersionRejected``
    "weights": "lora"           the adapter merged into its base version's full weights; for an engine that
                                applies adapters itself, the adapter alone, and the base's full weights too
                                when the engine does not hold that base yet

The base of an adapter is fetched once (``PolicyReceiver.fetch_blocking``: its manifest signed, every
chunk checked) and kept while adapters are merged here (``_base``); for a native-LoRA engine only which
base it holds is remembered (``holds``). That assumes the caller loads every version it is handed, as
the actor does (an engine that fails to load ends the actor).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load

from echo2.broadcast.receiver import PolicyReceiver
from echo2.broadcast.reconstruct import Reconstructor
from echo2.data.delta import DeltaRejected
from echo2.data.lora import merge_lora

log = logging.getLogger("echo2.broadcast")


class VersionRejected(DeltaRejected):
    """A version received whole and verified that cannot be made into weights to load (no route rebuilt
    a delta): the caller keeps the weights it has."""

    def __init__(self, version: int, reason: str):
        super().__init__(f"v{version}: {reason}")
        self.version = version
        self.reason = reason


@dataclass
class Adapter:
    """A LoRA adapter version for an engine that applies it itself (``Engine.load_lora``)."""

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float


@dataclass
class ReadyVersion:
    """A policy version ready to load: ``weights`` (if any) first, then ``adapter`` (if any) on top."""

    version: int
    manifest: dict
    """Its signed manifest (``created_at``: when the learner published it)."""
    weights: dict[str, torch.Tensor] | None
    """Full weights: the version's own (merged with its base for an adapter merged here, rebuilt for a
    delta), or an adapter's base that a native-LoRA engine does not hold yet; None: nothing to load."""
    adapter: Adapter | None
    """For a native-LoRA engine: the adapter to apply on top of its base."""
    model_files: dict[str, bytes]
    """Model and tokenizer files to build an engine from: this version's, or its keyframe's for a delta."""
    received_at: float
    """When the receiver handed the version over (the start of its swap: decoding, then loading)."""
    route: str
    """How it was made, for the log: "full", "delta on v6", "from keyframe v4 (+3 deltas, ...)"."""
    rebuild_seconds: float
    """How long a delta took to rebuild (0 for a full or LoRA version)."""
    fetch_seconds: float | None
    """How long its transfer took, from the start of the fetch to the last chunk verified."""


class WeightSource:
    def __init__(self, receiver: PolicyReceiver, *, lora: bool):
        """``receiver``: the actor's, which this source now owns (``close``); ``lora``: the run trains an
        adapter (``train.lora_rank > 0``), so a full version may be the base later adapters merge into."""
        self.receiver = receiver
        self.lora = lora
        self.reconstructor = Reconstructor(receiver.manifest, receiver.fetch_blocking)
        """Rebuilds sparse delta versions from what it holds or from a keyframe, each link verified."""
        self._base: tuple[int, dict[str, torch.Tensor]] | None = None
        """(version, full weights) that adapter versions are merged into, where the engine does not apply them."""
        self.holds: int | None = None
        """The full version whose weights were handed over last, unmerged (None: a merged adapter version)."""

    def poll(self, *, native_lora: bool) -> ReadyVersion | None:
        """The newest version received whole and verified since the last call, ready to load (None: none
        yet; the receiver goes on fetching in the background). ``native_lora``: the engine applies adapters
        itself. VersionRejected when no route rebuilds a delta version: keep the weights held."""
        buffer = self.receiver.poll()
        if buffer is None:
            return None
        received_at = time.time()
        manifest, files = buffer.manifest, buffer.files()
        route, rebuild_seconds = "full", 0.0
        adapter = None
        try:
            if manifest.get("weights") == "lora":
                weights, adapter = self._adapter(manifest, files, native_lora)
            elif manifest.get("weights") == "delta" or "tensors" in manifest:  # a delta run's delta or keyframe
                weights = self.reconstructor.weights(manifest, files)
                route, rebuild_seconds = self.reconstructor.route, self.reconstructor.seconds
                self.holds = manifest["version"]
            else:
                weights = _shard_tensors(manifest, files)
                if self.lora and not native_lora:
                    self._base = (manifest["version"], weights)  # later adapter versions merge into it
                self.holds = manifest["version"]
        except DeltaRejected as exc:
            raise VersionRejected(buffer.version, str(exc)) from None
        aux = {e["name"]: files[e["name"]] for e in manifest["files"] if e["kind"] == "aux"}
        return ReadyVersion(version=buffer.version, manifest=manifest, weights=weights, adapter=adapter,
                            model_files=aux or self.reconstructor.model_files or {}, received_at=received_at,
                            route=route, rebuild_seconds=rebuild_seconds,
                            fetch_seconds=self.receiver.last_fetch_seconds)

    def _adapter(self, manifest: dict, files: dict[str, bytes],
                 native_lora: bool) -> tuple[dict[str, torch.Tensor] | None, Adapter | None]:
        """(full weights, adapter) to load for an adapter version: merged here, or for a native-LoRA engine
        the adapter, with its base's weights when the engine does not hold that base yet."""
        adapter = Adapter(_shard_tensors(manifest, files), rank=manifest["lora_rank"], alpha=manifest["lora_alpha"])
        base_version = manifest["base_version"]
        if native_lora:
            weights = None if self.holds == base_version else self._base_weights(base_version, manifest["version"])
            self.holds = base_version
            return weights, adapter
        base = self._base_weights(base_version, manifest["version"])
        self._base = (base_version, base)
        self.holds = None  # the engine will hold merged weights, not the base
        return merge_lora(base, adapter.tensors, rank=adapter.rank, alpha=adapter.alpha), None

    def _base_weights(self, base_version: int, for_version: int) -> dict[str, torch.Tensor]:
        """The full weights of an adapter's base version: kept from before, or fetched from the store
        (signed manifest, every chunk verified). A base is a plain full version (a LoRA run publishes no
        deltas): anything else is refused rather than decoded."""
        if self._base is not None and self._base[0] == base_version:
            return self._base[1]
        log.info("fetching base v%d for adapter v%d", base_version, for_version)
        base = self.receiver.fetch_blocking(base_version)
        if base.manifest.get("weights", "full") != "full" or "tensors" in base.manifest:
            raise DeltaRejected(f"adapter v{for_version} names base v{base_version}, which is not a plain full version")
        return _shard_tensors(base.manifest, base.files())

    def close(self) -> None:
        self.receiver.close()


def _shard_tensors(manifest: dict, files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """The tensors of a version's shards (verified bytes: safetensors, never pickle)."""
    return {k: v for e in manifest["files"] if e["kind"] == "shard" for k, v in st_load(files[e["name"]]).items()}
