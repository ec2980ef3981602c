"""Spot checks of what actors claim about their own policy: behavior log-probabilities recomputed.

Everything an actor writes is checked where the learner can check it cheaply and exactly: prompts
are re-derived and rewards re-scored for every file (``verify.py``). What is left is the behavior
log-probabilities: the loss divides by them (the ratio pi/mu), so an actor that lies about them
steers the update (a too-low mu inflates the ratio of the tokens it chose). Recomputing them for every
file would cost a forward pass per file; instead a sample is recomputed, and an actor caught once is
out for good:

    the first file of every actor, and every further file with probability ``trust.spot_check_fraction``
        (drawn from the learner's own unseeded RNG, so an actor cannot tell which files are checked)
    recompute log mu(token) of the file's policy tokens under the version the file claims, with the
        weights the learner published as that version (kept for the S + 1 newest versions; one it does not hold, as
        after a resume, read back from its signed folder in the store: ``load``), as the learner
        computes them (``Learner.behavior_gap``): on the learner's device, in its compute dtype, with a frozen
        copy of the model that holds one version at a time (sharded over the ranks like the policy), the file's
        rows packed into micro-batches of ``train.micro_batch_tokens`` (``packing.py``), log-probabilities by
        ``PolicyLogprobs`` (chunked, no full logits)
    gap = mean |claimed - recomputed| over the file's policy tokens
    gap > ``trust.spot_check_max_gap``: the file is quarantined and its actor banned (``Dishonest``): the
        collector quarantines every later file of it unread, the flow has the fleet retire and replace
        it, and the next version revokes its relay token

The threshold must pass honest actors whose numbers differ from the learner's: another kernel, another
batch shape, bf16 weights, a bf16 learner. An fp32 actor of the transformers engine differs from an fp32 learner
by about 1e-6 nats per token, a bf16 one by a few hundredths (tests/unit/learner/test_spot_check.py); the default 0.15
is several times the bf16 gap and well under what a lie that moves the ratio must change.
Rewards need no sampling: every one is re-scored already, and a file whose rewards, prompts or episodes
the task disowns bans its actor the same way (``verify.py`` raises ``Dishonest`` for those).
"""

from __future__ import annotations

import logging
import random
from typing import Callable

import pyarrow as pa
import torch

from echo2.data.rollouts import InvalidRollouts
from echo2.learner.columns import step_columns
from echo2.learner.packing import StepColumns

log = logging.getLogger("echo2.learner")

GapOf = Callable[[int, dict, StepColumns, int], tuple[float, int]]
"""``Learner.behavior_gap``: (version, its weights, a file's columns, token budget) -> (sum of gaps, tokens)."""


class Dishonest(InvalidRollouts):
    """The file is well formed but its claims are false: its actor is banned, not only the file."""


class SpotChecker:
    def __init__(self, gap_of: GapOf, *, fraction: float, max_gap: float, keep_versions: int,
                 micro_batch_tokens: int = 8192, load: Callable[[int], dict | None] | None = None):
        """``load(version)``: the weights actors ran as a version this checker does not hold (after a resume it holds
        only the checkpoint's), read back from the store's signed folder; None where the version is gone."""
        self.gap_of = gap_of
        self.load = load
        self.fraction = fraction
        self.max_gap = max_gap
        self.keep_versions = keep_versions
        self.micro_batch_tokens = micro_batch_tokens
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        """The weights published as each of the newest versions (what an honest actor sampled with)."""
        self.checked_actors: set[str] = set()
        self.sampled = 0
        self.seen = 0
        self.largest_pass = 0.0
        """The largest gap of a file that passed (how close honest actors came to the threshold)."""
        self._rng = random.SystemRandom()  # never the run's seeded RNG: an actor must not predict the sample

    def published(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep what version ``version`` published (the learner's copies, never its live weights, so kept as they
        are); drop versions no file may claim any more."""
        self.versions[version] = tensors
        for v in sorted(self.versions)[: -self.keep_versions]:
            del self.versions[v]

    def wants(self, actor_id: str) -> bool:
        self.seen += 1
        return actor_id not in self.checked_actors or self._rng.random() < self.fraction

    def check_logprobs(self, table: pa.Table, version: int, actor_id: str) -> float | None:
        """The file's gap (None when its version is gone from the store too: no rollout of it can still be used);
        raises ``Dishonest`` over the threshold."""
        weights = self.versions.get(version)
        if weights is None and self.load is not None:
            weights = self.load(version)
            if weights is not None:
                self.versions[version] = weights  # kept like a published one (the newest keep_versions stay)
                for v in sorted(self.versions)[: -self.keep_versions]:
                    self.versions.pop(v)
        if weights is None:
            return None
        self.sampled += 1
        self.checked_actors.add(actor_id)
        total, count = self.gap_of(version, weights, step_columns([table]), self.micro_batch_tokens)
        gap = total / max(count, 1)
        if gap > self.max_gap:
            raise Dishonest(f"actor {actor_id}: behavior logprobs are {gap:.3f} nats/token from what version {version} "
                            f"gives (spot check threshold {self.max_gap:g})")
        self.largest_pass = max(self.largest_pass, gap)
        log.debug("spot-checked a file of %s at v%d: gap %.2e", actor_id, version, gap)
        return gap
