"""An actor's side of sparse delta versions: the full, verified weights of every version it swaps to.

The reconstructor holds the weights of the newest version it rebuilt (a keyframe or a delta
run's version; plain full runs hold nothing). For each version the receiver hands over:

    a full version      its shards, checked against its tensor table when it has one (a keyframe)
    a delta version     applied to the held weights when they are its base version (the common
                        case: one delta per step, received through the relay)
    otherwise           rebuilt along the cheaper of two routes, counted in bytes to download
                        from the store (the manifests tell sizes before anything is fetched):
                        from the held version through the deltas after it, when it lies on the
                        target's chain, or from the chain's keyframe (the newest one at or before
                        the target) through every delta after it

Every step is checked against the signed table of the version it makes (sha256 of every tensor,
``echo2.data.delta.apply_delta``). A delta that does not rebuild its version from the held
weights (a delta missed without noticing, a corrupted base) is undone and refused, and the
version is rebuilt from its keyframe instead; only when no route works is ``DeltaRejected``
raised, and the caller keeps generating with what it had: an actor never runs weights that differ
from the learner's. The learner's garbage collection keeps every kept version's chain, so the
keyframe route exists for every version still worth fetching.

Held tensors are changed in place by the next delta, so the engine must copy what it is given
(``Engine.load_weights`` does).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from echo2.broadcast.protocol import SourceFailed, VersionBuffer
from echo2.data.delta import DeltaRejected
from echo2.data.delta_chain import apply_version, base_of, chain_manifests, full_tensors, is_delta, weight_bytes
from echo2.data.manifest import ManifestRejected
from echo2.data.store import StoreError

log = logging.getLogger("echo2.broadcast")

_ROUTE_FAILS = (DeltaRejected, ManifestRejected, StoreError, SourceFailed, OSError, KeyError)
"""What ends one route (a link gone, refused, unreadable, not rebuilding): the next is tried."""


class Reconstructor:
    def __init__(self, manifest_of: Callable[[int], dict], fetch: Callable[[int], VersionBuffer]):
        """``manifest_of(v)``: the signed manifest of version v (checked by the receiver);
        ``fetch(v)``: all of version v, every chunk verified against it (from the store)."""
        self.manifest_of = manifest_of
        self.fetch = fetch
        self.held: tuple[int, dict[str, torch.Tensor]] | None = None
        self.model_files: dict[str, bytes] | None = None
        """Model and tokenizer files of the newest keyframe fetched here (a delta carries none)."""
        self.route: str = ""
        """How the newest version was made, for the log: "full", "delta on v6", "from keyframe v4 (+3 deltas)"."""
        self.seconds: float = 0.0
        """How long the newest version took to rebuild (fetching older links included)."""

    def weights(self, manifest: dict, files: dict[str, bytes]) -> dict[str, torch.Tensor]:
        """Full weights of the version ``manifest`` describes, given its verified ``files``."""
        started = time.perf_counter()
        try:
            return self._weights(manifest, files)
        finally:
            self.seconds = time.perf_counter() - started

    def _weights(self, manifest: dict, files: dict[str, bytes]) -> dict[str, torch.Tensor]:
        version = manifest["version"]
        if not is_delta(manifest):
            tensors = full_tensors(manifest, files)
            self.held = (version, tensors) if "tensors" in manifest else None  # a keyframe: later deltas apply
            self.route = "full"
            return tensors
        base = base_of(manifest)
        if self.held is not None and self.held[0] == base:
            try:
                apply_version(self.held[1], manifest, files)
            except DeltaRejected as exc:  # undone by apply_version: held is still what it was, but not v{base}
                log.error("v%d refused: it does not rebuild from the v%d held here (%s); rebuilding from its keyframe",
                          version, base, exc)
                self.held = None
            else:
                self.held = (version, self.held[1])
                self.route = f"delta on v{base}"
                return self.held[1]
        return self._rebuild(manifest, files)

    def _rebuild(self, target: dict, target_files: dict[str, bytes]) -> dict[str, torch.Tensor]:
        version = target["version"]
        try:
            chain = chain_manifests(version, lambda v: target if v == version else self.manifest_of(v))
        except _ROUTE_FAILS as exc:
            raise DeltaRejected(f"v{version} cannot be rebuilt: its chain is not in the store ({exc})") from None
        versions = [m["version"] for m in chain]
        from_keyframe = sum(weight_bytes(m) for m in chain[:-1])
        routes = []
        if self.held is not None and self.held[0] in versions[:-1]:
            start = versions.index(self.held[0])
            routes.append(("held", sum(weight_bytes(m) for m in chain[start + 1 : -1]), start))
        routes.append(("keyframe", from_keyframe, 0))
        routes.sort(key=lambda r: r[1])
        failures = []
        for name, cost, start in routes:
            try:
                tensors = self._follow(chain, start, target_files, from_held=name == "held")
            except _ROUTE_FAILS as exc:
                failures.append(f"{name} route: {exc}")
                log.error("v%d: the %s route failed (%s)", version, name, exc)
                self.held = None
                continue
            deltas = len(chain) - 1 - start
            origin = f"v{versions[start]} held here" if name == "held" else f"keyframe v{versions[0]}"
            self.route = f"from {origin} (+{deltas} deltas, {cost / 2**20:.1f} MB fetched)"
            return tensors
        raise DeltaRejected(f"v{version} could not be rebuilt: {'; '.join(failures)}")

    def _follow(self, chain: list[dict], start: int, target_files: dict[str, bytes], *, from_held: bool):
        """Rebuild ``chain[-1]`` from ``chain[start]`` (held, or fetched: the keyframe), one verified link at a time."""
        if from_held:
            assert self.held is not None
            tensors = self.held[1]
        else:
            self.held = None  # not on this route: let it go before a full version arrives
            keyframe = self.fetch(chain[0]["version"])
            files = keyframe.files()
            tensors = full_tensors(chain[0], files)
            self.model_files = {e["name"]: files[e["name"]] for e in chain[0]["files"] if e["kind"] == "aux"}
            self.held = (chain[0]["version"], tensors)
        for manifest in chain[start + 1 :]:
            files = target_files if manifest is chain[-1] else self.fetch(manifest["version"]).files()
            apply_version(tensors, manifest, files)
            self.held = (manifest["version"], tensors)  # each link verified: a later failure restarts from here
        return tensors
