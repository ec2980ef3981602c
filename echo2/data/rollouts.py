"""Rollout files: Arrow IPC, one row per completion (schema in docs/architecture.md, "Rollout file schema").

``encode_rollouts`` builds a file's bytes, ``decode_rollouts`` reads them back into a table and
``validate_rollouts`` checks everything the learner relies on before a row can reach the loss.

A file also names the policy it was generated with: ``POLICY_DIGEST_KEY`` in its schema metadata, the sha256 of
the version's signed manifest (``policy_digest``, over its canonical JSON: sorted keys, no spaces). A version
number is not an identity across a resume (a resumed learner publishes the numbers after its checkpoint again,
with other weights); the digest is, so the collector keeps an adopted actor's file of the new timeline and drops
one of the lost timeline (``collector.py``). Files written before the field existed have none.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

SCHEMA_VERSION = "1"

ROLLOUT_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("actor_id", pa.string()),
        ("policy_version", pa.int64()),
        ("task", pa.string()),
        ("prompt_id", pa.string()),
        ("group_id", pa.string()),
        ("sample_index", pa.int32()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_mask", pa.list_(pa.int8())),
        ("behavior_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float32()),
        ("reward_detail", pa.string()),
        ("finish_reason", pa.string()),
        ("generation_seconds", pa.float32()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ],
    metadata={"echo2.schema_version": SCHEMA_VERSION},
)


@dataclass
class Rollout:
    """One completion of one prompt, with what the learner needs to train on it."""

    prompt_id: str
    group_id: str
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    reward: float
    finish_reason: str
    reward_detail: dict[str, Any] = field(default_factory=dict)
    completion_mask: list[int] | None = None
    generation_seconds: float = 0.0


class InvalidRollouts(ValueError):
    """A rollout file failed validation; the message says why."""


LOGPROB_MAX = 1e-4
"""A log-probability is <= 0; a little float noise above 0 is tolerated."""
LOGPROB_FLOOR = -50.0
"""No sampled token has a log-probability below this (p < 2e-22): with behavior logprobs >= -50 the
ratio exp(log pi - log mu) stays below e^50 ~ 5e21, finite in fp32, so no accepted file can overflow
the loss (a forged -1e4 would make it inf and the gradient NaN)."""


@dataclass(frozen=True)
class RolloutLimits:
    """What an accepted rollout file may hold: the bounds the loss relies on."""

    vocab_size: int
    group_size: int
    max_completion_tokens: int
    """rollout.max_new_tokens plus the environment tokens a multi-turn task may interleave."""
    max_prompt_tokens: int
    reward_range: tuple[float, float]
    """The task's rewards lie in [low, high]; a reward near the float32 maximum would overflow the group std."""
    logprob_min: float = LOGPROB_FLOOR
    max_groups: int | None = None
    """The most groups one file may hold (the run's rollout.groups_per_batch: what an honest actor writes),
    so one file cannot bring more than its batch into a step; None: no limit."""


_CONTENT_COLUMNS = ("prompt_id", "sample_index", "prompt_token_ids", "completion_token_ids", "completion_mask",
                    "behavior_logprobs", "reward", "policy_version")


def content_hash(table: pa.Table) -> str:
    """sha256 of what training would use from a file, independent of row order, names and timestamps:
    the same rollouts committed twice under two names (or reordered) hash the same."""
    columns = table.select(list(_CONTENT_COLUMNS)).to_pydict()
    rows = sorted(json.dumps([columns[c][i] for c in _CONTENT_COLUMNS]) for i in range(table.num_rows))
    digest = hashlib.sha256()
    for row in rows:
        digest.update(row.encode())
        digest.update(b"\n")
    return digest.hexdigest()


POLICY_DIGEST_KEY = "echo2.policy_manifest_sha256"
"""Schema metadata key: the sha256 (hex) of the signed manifest of the policy version the file was generated with."""


def policy_digest(manifest: dict) -> str:
    """The identity of a policy version: the sha256 of its signed manifest's canonical JSON (signature included)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_policy_digest(data: bytes) -> str | None:
    """The policy digest a rollout file's schema names (None: none, or not a readable Arrow file; never raises)."""
    try:
        meta = ipc.open_file(pa.BufferReader(data)).schema.metadata or {}
    except Exception:
        return None
    value = meta.get(POLICY_DIGEST_KEY.encode())
    return value.decode("ascii", errors="replace") if value is not None and len(value) == 64 else None


MEASURED_PREFIX = "echo2.measured."
"""Schema metadata keys an actor may add with timings it measured (e.g. ``echo2.measured.dissemination_seconds``).
Informational only: the capacity fit reads them as finite floats or ignores them; training never does."""


def encode_rollouts(
    rollouts: list[Rollout], *, run_id: str, actor_id: str, policy_version: int, task: str,
    measured: dict[str, float] | None = None, policy_digest: str | None = None,
) -> bytes:
    now = datetime.now(timezone.utc)
    columns: dict[str, list] = {name: [] for name in ROLLOUT_SCHEMA.names}
    for r in rollouts:
        columns["run_id"].append(run_id)
        columns["actor_id"].append(actor_id)
        columns["policy_version"].append(policy_version)
        columns["task"].append(task)
        columns["prompt_id"].append(r.prompt_id)
        columns["group_id"].append(r.group_id)
        columns["sample_index"].append(r.sample_index)
        columns["prompt_token_ids"].append(r.prompt_token_ids)
        columns["completion_token_ids"].append(r.completion_token_ids)
        mask = r.completion_mask if r.completion_mask is not None else [1] * len(r.completion_token_ids)
        columns["completion_mask"].append(mask)
        columns["behavior_logprobs"].append(r.behavior_logprobs)
        columns["reward"].append(r.reward)
        columns["reward_detail"].append(json.dumps(r.reward_detail))
        columns["finish_reason"].append(r.finish_reason)
        columns["generation_seconds"].append(r.generation_seconds)
        columns["created_at"].append(now)
    schema = ROLLOUT_SCHEMA.with_metadata(
        {**ROLLOUT_SCHEMA.metadata, **{f"{MEASURED_PREFIX}{k}": repr(float(v)) for k, v in (measured or {}).items()},
         **({POLICY_DIGEST_KEY: policy_digest} if policy_digest else {})})
    table = pa.Table.from_pydict(columns, schema=schema)
    sink = io.BytesIO()
    with ipc.new_file(sink, schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def decode_rollouts(data: bytes) -> pa.Table:
    """Parse an Arrow IPC file; raises ``InvalidRollouts`` when it is not one we accept.

    The messages are read in order after the file's magic (the footer is not trusted), and a record
    batch with compressed buffers is refused before it is decoded: a compressed buffer declares its
    own uncompressed size, so a few MB of file could make the learner allocate many GB. Uncompressed
    buffers are views into ``data``, so decoding allocates about nothing.
    """
    if data[:6] != b"ARROW1":
        raise InvalidRollouts("not an Arrow IPC file (no ARROW1 magic)")
    try:
        reader = ipc.MessageReader.open_stream(pa.py_buffer(data)[8:])
        first = reader.read_next_message()
        if first.type != "schema":
            raise InvalidRollouts(f"the first message is a {first.type}, not the schema")
        schema = ipc.read_schema(first)
        batches = []
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                break
            if message.type != "record batch":
                raise InvalidRollouts(f"unexpected {message.type} message (rollout files have no dictionaries)")
            if _batch_is_compressed(message.metadata.to_pybytes()):
                raise InvalidRollouts("compressed record batches are not accepted")
            batches.append(ipc.read_record_batch(message, schema))
        # a whole file: its footer (parsed, never used to decode) lists the batches we read
        if ipc.open_file(pa.py_buffer(data)).num_record_batches != len(batches):
            raise InvalidRollouts("the file's footer does not list the record batches it holds")
        return pa.Table.from_batches(batches, schema)
    except InvalidRollouts:
        raise
    except StopIteration:
        raise InvalidRollouts("not a readable Arrow IPC file: no schema message") from None
    except _PARSE_ERRORS + (struct.error, IndexError) as exc:
        raise InvalidRollouts(f"not a readable Arrow IPC file: {type(exc).__name__}: {str(exc)[:200]}") from None


def _batch_is_compressed(meta: bytes) -> bool:
    """Whether an IPC RecordBatch message's flatbuffer (Message.fbs) sets ``RecordBatch.compression``.

    Message: field 1 = header_type (3 = RecordBatch), field 2 = header; RecordBatch: field 3 =
    compression. An out-of-bounds offset raises ``struct.error`` (an invalid file).
    """
    def table(pos: int) -> int:
        return pos + struct.unpack_from("<I", meta, pos)[0]

    def field(tab: int, index: int) -> int | None:
        vtable = tab - struct.unpack_from("<i", meta, tab)[0]
        size = struct.unpack_from("<H", meta, vtable)[0]
        slot = 4 + 2 * index
        offset = struct.unpack_from("<H", meta, vtable + slot)[0] if slot + 2 <= size else 0
        return tab + offset if offset else None

    message = table(0)
    header_type, header = field(message, 1), field(message, 2)
    if header_type is None or header is None or meta[header_type] != 3:
        raise InvalidRollouts("a record batch message without a record batch header")
    return field(table(header), 3) is not None


# what parsing bytes an attacker chose can raise (bad UTF-8 in names or strings, odd integer widths,
# JSON nested deep enough to exhaust the stack): each means "invalid file", never a learner crash
_PARSE_ERRORS = (pa.ArrowException, OSError, ValueError, UnicodeError, RecursionError, OverflowError)


def validate_rollouts(table: pa.Table, *, run_id: str, actor_id: str, expected_version: int, learner_version: int,
                      limits: RolloutLimits) -> pa.Table:
    """Check everything the learner relies on; return the table as ``ROLLOUT_SCHEMA`` (columns selected and cast).

    Raises ``InvalidRollouts`` naming the first problem. A table that passes cannot make the loss or
    its gradient non-finite: every logprob, reward and length is inside ``limits``.
    """
    try:
        return _validate(table, run_id=run_id, actor_id=actor_id, expected_version=expected_version,
                         learner_version=learner_version, limits=limits)
    except InvalidRollouts:
        raise
    except _PARSE_ERRORS as exc:
        raise InvalidRollouts(f"unreadable content: {type(exc).__name__}: {str(exc)[:200]}") from None


def _validate(table: pa.Table, *, run_id: str, actor_id: str, expected_version: int, learner_version: int,
              limits: RolloutLimits) -> pa.Table:
    meta = table.schema.metadata or {}
    version = meta.get(b"echo2.schema_version")
    if version != SCHEMA_VERSION.encode():
        raise InvalidRollouts(f"schema version {version!r}, expected {SCHEMA_VERSION!r}")
    for f in ROLLOUT_SCHEMA:
        if f.name not in table.schema.names:
            raise InvalidRollouts(f"missing column {f.name}")
        if table.schema.get_all_field_indices(f.name) != [table.schema.get_field_index(f.name)]:
            raise InvalidRollouts(f"column {f.name} appears more than once")
    # extra columns are ignored and the order is ours; a type that casts losslessly is accepted
    try:
        table = table.select(ROLLOUT_SCHEMA.names).cast(ROLLOUT_SCHEMA, safe=True)
        table.validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise InvalidRollouts(f"columns do not fit the schema: {str(exc).splitlines()[0][:200]}") from None
    # the actor's timings (MEASURED_PREFIX) ride along, short ones only: the ledger records them for the fit
    table = table.replace_schema_metadata({**ROLLOUT_SCHEMA.metadata, **{
        k: v for k, v in meta.items() if k.startswith(MEASURED_PREFIX.encode()) and len(k) <= 64 and len(v) <= 64}})
    if table.num_rows == 0:
        raise InvalidRollouts("file has no rows")
    for name in ROLLOUT_SCHEMA.names:
        column = table.column(name)
        if column.null_count:
            raise InvalidRollouts(f"column {name} has null values")
        if pa.types.is_list(column.type) and pc.list_flatten(column).null_count:
            raise InvalidRollouts(f"column {name} has null values inside its lists")

    _check_identity(table, run_id=run_id, actor_id=actor_id, expected_version=expected_version,
                    learner_version=learner_version)
    _check_lengths_and_bounds(table, limits)
    _check_groups(table, limits)
    return table


def _check_identity(table: pa.Table, *, run_id: str, actor_id: str, expected_version: int,
                    learner_version: int) -> None:
    runs = set(table.column("run_id").unique().to_pylist())
    if runs != {run_id}:
        raise InvalidRollouts(f"run_id {sorted(runs)[:3]} does not match this run {run_id!r}")
    actors = set(table.column("actor_id").unique().to_pylist())
    if actors != {actor_id}:
        raise InvalidRollouts(f"actor_id {sorted(actors)[:3]} does not match the file's actor {actor_id!r}")
    versions = set(table.column("policy_version").unique().to_pylist())
    if versions != {expected_version}:
        raise InvalidRollouts(f"policy_version {sorted(versions)[:3]} does not match its folder v{expected_version}")
    if expected_version > learner_version:
        raise InvalidRollouts(f"policy_version {expected_version} is from the future (learner is at {learner_version})")


def _first(bad: np.ndarray) -> int:
    return int(np.nonzero(bad)[0][0])


def _check_lengths_and_bounds(table: pa.Table, limits: RolloutLimits) -> None:
    comp_len = pc.list_value_length(table.column("completion_token_ids")).to_numpy()
    for name in ("completion_mask", "behavior_logprobs"):
        lens = pc.list_value_length(table.column(name)).to_numpy()
        if not np.array_equal(lens, comp_len):
            row = _first(lens != comp_len)
            raise InvalidRollouts(f"row {row}: {name} has {lens[row]} entries but the completion has "
                                  f"{comp_len[row]} tokens")
    if (comp_len == 0).any():
        raise InvalidRollouts(f"row {_first(comp_len == 0)}: empty completion")
    if (comp_len > limits.max_completion_tokens).any():
        row = _first(comp_len > limits.max_completion_tokens)
        raise InvalidRollouts(f"row {row}: completion of {comp_len[row]} tokens, more than the run's limit "
                              f"{limits.max_completion_tokens}")
    prompt_len = pc.list_value_length(table.column("prompt_token_ids")).to_numpy()
    if (prompt_len == 0).any():
        raise InvalidRollouts(f"row {_first(prompt_len == 0)}: empty prompt")
    if (prompt_len > limits.max_prompt_tokens).any():
        row = _first(prompt_len > limits.max_prompt_tokens)
        raise InvalidRollouts(f"row {row}: prompt of {prompt_len[row]} tokens, more than {limits.max_prompt_tokens}")

    for name in ("prompt_token_ids", "completion_token_ids"):
        ids = pc.list_flatten(table.column(name)).to_numpy()
        bad = (ids < 0) | (ids >= limits.vocab_size)
        if bad.any():
            raise InvalidRollouts(f"{name} holds token id {int(ids[bad][0])} outside the vocabulary "
                                  f"[0, {limits.vocab_size})")
    mask = pc.list_flatten(table.column("completion_mask")).to_numpy()
    if not np.isin(mask, (0, 1)).all():
        raise InvalidRollouts("completion_mask holds values other than 0 and 1")
    parents = pc.list_parent_indices(table.column("completion_mask")).to_numpy()
    trained = np.bincount(parents, weights=mask, minlength=table.num_rows)
    if (trained == 0).any():
        raise InvalidRollouts(f"row {_first(trained == 0)}: no token of the completion is the policy's (mask all 0)")
    logprobs = pc.list_flatten(table.column("behavior_logprobs")).to_numpy()
    if not np.isfinite(logprobs).all():
        raise InvalidRollouts("behavior_logprobs holds a non-finite log-probability")
    if (logprobs > LOGPROB_MAX).any() or (logprobs < limits.logprob_min).any():
        bad = logprobs[(logprobs > LOGPROB_MAX) | (logprobs < limits.logprob_min)][0]
        raise InvalidRollouts(f"behavior_logprobs holds {bad:g}, outside [{limits.logprob_min:g}, 0]")
    rewards = table.column("reward").to_numpy()
    if not np.isfinite(rewards).all():
        raise InvalidRollouts("reward holds a non-finite value")
    lo, hi = limits.reward_range
    if (rewards < lo).any() or (rewards > hi).any():
        bad = rewards[(rewards < lo) | (rewards > hi)][0]
        raise InvalidRollouts(f"reward {bad:g} is outside the task's range [{lo:g}, {hi:g}]")
    for detail in table.column("reward_detail").to_pylist():
        try:
            json.loads(detail)
        except (ValueError, RecursionError):
            raise InvalidRollouts(f"reward_detail is not JSON: {detail[:60]!r}") from None


def _check_groups(table: pa.Table, limits: RolloutLimits) -> None:
    """Every group: exactly G rows, sample_index 0..G-1 once each, one prompt (id and tokens); at most
    ``limits.max_groups`` groups."""
    group_size = limits.group_size
    stats = table.group_by("group_id").aggregate([
        ("sample_index", "count"), ("sample_index", "count_distinct"), ("sample_index", "min"),
        ("sample_index", "max"), ("prompt_id", "count_distinct")])
    if limits.max_groups is not None and stats.num_rows > limits.max_groups:
        raise InvalidRollouts(f"file holds {stats.num_rows} groups, more than a batch's {limits.max_groups} "
                              f"(rollout.groups_per_batch)")
    sizes = set(stats.column("sample_index_count").to_pylist())
    if sizes != {group_size}:
        raise InvalidRollouts(f"groups have sizes {sorted(sizes)[:5]}, expected {group_size} "
                              "(a group_id is one group of one file)")
    if (set(stats.column("sample_index_count_distinct").to_pylist()) != {group_size}
            or min(stats.column("sample_index_min").to_pylist()) != 0
            or max(stats.column("sample_index_max").to_pylist()) != group_size - 1):
        raise InvalidRollouts(f"sample_index is not 0..{group_size - 1} once each within every group")
    if set(stats.column("prompt_id_count_distinct").to_pylist()) != {1}:
        raise InvalidRollouts("a group mixes completions of different prompt_ids")
    prompts: dict[str, list[int]] = {}
    for gid, tokens in zip(table.column("group_id").to_pylist(), table.column("prompt_token_ids").to_pylist()):
        if prompts.setdefault(gid, tokens) != tokens:
            raise InvalidRollouts(f"group {gid[:40]!r} mixes different prompt tokens")
