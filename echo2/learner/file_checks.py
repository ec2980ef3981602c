"""Reading and checking one rollout file, as the collector does before it judges it (``collector.py``).

A file is read once, after its size check, and never past ``max_file_bytes`` (one bounded ranged read: a file
replaced by a bigger one is not read whole). Any error reading or decoding it makes it ``Malformed``, whatever
the error (a GLACIER object, one the store refuses, bytes that exhaust the decoder): only the store being down
(``store.is_transient``), or an error that reading the learner's own ``run.json`` shares, propagates, so an
outage never blames an honest file. Validation bounds everything the loss relies on (``data/rollouts.py``), the
task's verifier re-derives prompts and re-scores rewards (``verify.py``: ``Dishonest``, or ``UngradableFile``
where the task could not grade the file the same way everywhere), and the spot checker recomputes a sample of
behavior logprobs (``spot_check.py``).
"""

from __future__ import annotations

import pyarrow as pa

from echo2.data import layout
from echo2.data.rollouts import InvalidRollouts, decode_rollouts, policy_digest, validate_rollouts
from echo2.data.store import NotFound, is_transient
from echo2.learner.spot_check import Dishonest


class UngradableFile(InvalidRollouts):
    """The task could not score the file the same way on every machine (``tasks.base.Ungradable``, as the
    verifier reports it): set aside, not held against its actor unless it keeps happening."""


class Malformed(InvalidRollouts):
    """The file itself is wrong, as no honest actor's file is (unreadable, over the size limit, undecodable,
    failing validation, a byte copy): counts toward its actor's ban (``max_invalid_files``)."""


class FileChecks:
    """The collector's reading and checking of one file; uses its ``store``, ``run_id``, ``limits``,
    ``max_file_bytes``, ``verifier``, ``spot_checker`` and ``_digests``."""

    def _timeline_digest(self, version: int) -> str | None:
        """``rollouts.policy_digest`` of this timeline's manifest of ``version`` (None: none published). One
        learner's manifests are never replaced (only a resume does that, with a new collector): kept once read."""
        if version not in self._digests:
            try:
                self._digests[version] = policy_digest(self.store.get_json(
                    layout.manifest_key(layout.policy_dir(version))))
            except (NotFound, ValueError):
                return None
        return self._digests[version]

    # -- reading and judging one file ------------------------------------------------------------
    def _read(self, key: str) -> bytes:
        """The bytes of an actor's file, at most ``max_file_bytes`` of them: the size first (a HEAD),
        then one ranged read that stops one byte past the limit. Errors: see the module docstring."""
        try:
            size = self.store.size(key)
            if size > self.max_file_bytes:
                raise Malformed(f"file of {size} bytes is over the limit of {self.max_file_bytes}")
            data = self.store.get_range(key, 0, self.max_file_bytes + 1) if size else b""
        except (InvalidRollouts, NotFound):
            raise
        except Exception as exc:
            if is_transient(exc) or not self._store_answers():
                raise
            raise Malformed(f"unreadable: {type(exc).__name__}: {str(exc)[:200]}") from None
        if len(data) > self.max_file_bytes:  # replaced by a bigger object between the size check and the read
            raise Malformed(f"file of more than {self.max_file_bytes} bytes is over the limit")
        return data

    def _store_answers(self) -> bool:
        """Whether the store still answers the learner about its own ``run.json`` (there or not): if it
        does not, a failed read of an actor's file says nothing about the file."""
        try:
            self.store.size(layout.RUN_JSON)
        except NotFound:
            pass
        except Exception:  # any failure: the caller raises the file's error instead of blaming the file
            return False
        return True

    def _decode(self, data: bytes, actor_id: str, version: int, learner_version: int) -> pa.Table:
        try:
            return validate_rollouts(decode_rollouts(data), run_id=self.run_id, actor_id=actor_id,
                                     expected_version=version, learner_version=learner_version, limits=self.limits)
        except InvalidRollouts as exc:
            raise Malformed(str(exc)) from None
        except Exception as exc:  # a function of the actor's bytes alone (a MemoryError, say): the file's fault
            raise Malformed(f"undecodable: {type(exc).__name__}: {str(exc)[:200]}") from None

    def _check(self, data: bytes, version: int, actor_id: str, learner_version: int) -> pa.Table:
        """Validate one file's bytes; raises ``InvalidRollouts``."""
        table = self._decode(data, actor_id, version, learner_version)
        if self.verifier is not None:
            try:
                self.verifier.verify_claims(table)
            except Dishonest:
                raise
            except InvalidRollouts as exc:  # the verifier's only other refusal: the task could not grade it
                raise UngradableFile(str(exc)) from None
        if self.spot_checker is not None and self.spot_checker.wants(actor_id):
            self.spot_checker.check_logprobs(table, version, actor_id)
        return table

