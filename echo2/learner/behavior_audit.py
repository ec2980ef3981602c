"""Spot checks of what actors claim about their own policy: behavior log-probabilities recomputed.

Everything an actor writes is checked where the learner can check it cheaply and exactly: prompts
are re-derived and rewards re-scored for every file (``verify.py``). What is left is the behavior
log-probabilities: the loss divides by them (the ratio pi/mu), so an actor that lies about them
steers the update (a too-low mu inflates the ratio of the tokens it chose). Recomputing them for every
file would cost a forward pass per file; instead a sample is recomputed, and an actor caught once is
out for good:

    the first file of every actor, and every further file with probability ``train.audit_fraction``
        (drawn from the learner's own unseeded RNG, so an actor cannot tell which files are checked)
    recompute log mu(token) of the file's policy tokens under the version the file claims, with the
        weights the learner published as that version (kept for the S + 1 newest versions), in fp32,
        as the learner computes them: the file's rows packed into micro-batches of ``train.micro_batch_tokens``
        (``packing.py``), log-probabilities by ``PolicyLogprobs`` (chunked, no full logits)
    gap = mean |claimed - recomputed| over the file's policy tokens
    gap > ``train.audit_max_gap``: the file is quarantined and its actor banned (``Dishonest``): the
        collector quarantines every later file of it unread, the flow has the fleet retire and replace
        it, and the next version revokes its relay token

The threshold must pass honest actors whose numbers differ from the learner's: another kernel, another
batch shape, bf16 weights. Measured here (tests/test_behavior_audit.py, the chaos suite): an fp32 actor
of the transformers engine differs by about 1e-6 nats per token, a bf16 one by a few hundredths; the
default 0.15 is several times the bf16 gap and well under what a lie that moves the ratio must change.
Rewards need no sampling: every one is re-scored already, and a file whose rewards, prompts or episodes
the task disowns bans its actor the same way (``verify.py`` raises ``Dishonest`` for those).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pyarrow as pa
import torch

from echo2.data.rollouts import InvalidRollouts
from echo2.learner.columns import step_columns
from echo2.learner.logprobs import PolicyLogprobs
from echo2.learner.packing import assemble_packed, pack_by_tokens

log = logging.getLogger("echo2.learner")


class Dishonest(InvalidRollouts):
    """The file is well formed but its claims are false: its actor is banned, not only the file."""


class BehaviorAuditor:
    def __init__(self, model_dir: Path, *, fraction: float, max_gap: float, temperature: float, keep_versions: int,
                 micro_batch_tokens: int = 8192, chunk_tokens: int = 1024):
        self.model_dir = model_dir
        self.fraction = fraction
        self.max_gap = max_gap
        self.temperature = temperature
        self.keep_versions = keep_versions
        self.micro_batch_tokens = micro_batch_tokens
        self.chunk_tokens = chunk_tokens
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        """The weights published as each of the newest versions (what an honest actor sampled with)."""
        self.audited_actors: set[str] = set()
        self.sampled = 0
        self.seen = 0
        self.largest_pass = 0.0
        """The largest gap of a file that passed (how close honest actors came to the threshold)."""
        self._rng = random.SystemRandom()  # never the run's seeded RNG: an actor must not predict the sample
        self._model = None
        self._model_version: int | None = None

    def published(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep what version ``version`` published; drop versions no file may claim any more."""
        self.versions[version] = {k: v.detach().clone() for k, v in tensors.items()}
        for v in sorted(self.versions)[: -self.keep_versions]:
            del self.versions[v]

    def wants(self, actor_id: str) -> bool:
        self.seen += 1
        return actor_id not in self.audited_actors or self._rng.random() < self.fraction

    def check(self, table: pa.Table, version: int, actor_id: str) -> float | None:
        """The file's gap (None when its version is no longer held); raises ``Dishonest`` over the threshold."""
        weights = self.versions.get(version)
        if weights is None:
            return None
        self.sampled += 1
        self.audited_actors.add(actor_id)
        gap = self.gap(table, self._model_of(version, weights))
        if gap > self.max_gap:
            raise Dishonest(f"actor {actor_id}: behavior logprobs are {gap:.3f} nats/token from what version {version} "
                            f"gives (audit threshold {self.max_gap:g})")
        self.largest_pass = max(self.largest_pass, gap)
        log.debug("audited a file of %s at v%d: gap %.2e", actor_id, version, gap)
        return gap

    @torch.no_grad()
    def gap(self, table: pa.Table, model: torch.nn.Module) -> float:
        """Mean |claimed - recomputed| behavior logprob over the policy tokens of ``table``."""
        columns = step_columns([table])
        policy = PolicyLogprobs(model, temperature=self.temperature, chunk_tokens=self.chunk_tokens)
        no_advantages = torch.zeros(columns.num_rows)
        total, count = 0.0, 0
        for pack in pack_by_tokens(columns.sequence_lengths().tolist(), self.micro_batch_tokens):
            batch = assemble_packed(columns, pack, no_advantages)
            recomputed = policy(batch.input_ids, batch.targets, position_ids=batch.position_ids, where=batch.mask > 0)
            total += ((recomputed - batch.behavior_logprobs).abs() * batch.mask).sum().item()
            count += int(batch.mask.sum().item())
        return total / max(count, 1)

    def _model_of(self, version: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        if self._model_version != version:
            # strict=False for tied weights a state dict leaves out; a tensor the model does not have (a
            # LoRA adapter's, say) must not be skipped silently: the audit would run against other weights
            unknown = self._model.load_state_dict({k: v.float() for k, v in weights.items()},
                                                  strict=False).unexpected_keys
            if unknown:
                raise ValueError(f"the weights kept for version {version} are not the model's: {len(unknown)} "
                                 f"unknown tensors such as {unknown[0]!r} (a LoRA adapter must be merged first)")
            self._model.tie_weights()
            self._model_version = version
        return self._model
