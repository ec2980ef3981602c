"""Rollout files: Arrow IPC, one row per completion (schema in DESIGN.md).

``encode_rollouts`` builds a file's bytes, ``decode_rollouts`` reads them back into a table and
``validate_rollouts`` checks everything the learner relies on before a row can reach the loss.
"""

from __future__ import annotations

import io
import json
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


def encode_rollouts(
    rollouts: list[Rollout], *, run_id: str, actor_id: str, policy_version: int, task: str
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
    table = pa.Table.from_pydict(columns, schema=ROLLOUT_SCHEMA)
    sink = io.BytesIO()
    with ipc.new_file(sink, ROLLOUT_SCHEMA) as writer:
        writer.write_table(table)
    return sink.getvalue()


def decode_rollouts(data: bytes) -> pa.Table:
    """Parse an Arrow IPC file; raises ``InvalidRollouts`` when it is not one."""
    try:
        return ipc.open_file(pa.BufferReader(data)).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise InvalidRollouts(f"not a readable Arrow IPC file: {exc}") from None


def validate_rollouts(
    table: pa.Table,
    *,
    run_id: str,
    expected_version: int,
    learner_version: int,
    vocab_size: int,
    group_size: int | None = None,
) -> None:
    """Raise ``InvalidRollouts`` naming the first problem found; return None for a usable file."""
    meta = table.schema.metadata or {}
    version = meta.get(b"echo2.schema_version")
    if version != SCHEMA_VERSION.encode():
        raise InvalidRollouts(f"schema version {version!r}, expected {SCHEMA_VERSION!r}")
    for f in ROLLOUT_SCHEMA:
        if f.name not in table.schema.names:
            raise InvalidRollouts(f"missing column {f.name}")
        got = table.schema.field(f.name).type
        if not got.equals(f.type):
            raise InvalidRollouts(f"column {f.name} has type {got}, expected {f.type}")
    if table.num_rows == 0:
        raise InvalidRollouts("file has no rows")
    for name in ROLLOUT_SCHEMA.names:
        if table.column(name).null_count:
            raise InvalidRollouts(f"column {name} has null values")

    runs = set(table.column("run_id").to_pylist())
    if runs != {run_id}:
        raise InvalidRollouts(f"run_id {sorted(runs)} does not match this run {run_id!r}")
    versions = set(table.column("policy_version").to_pylist())
    if versions != {expected_version}:
        raise InvalidRollouts(f"policy_version {sorted(versions)} does not match its folder v{expected_version}")
    if expected_version > learner_version:
        raise InvalidRollouts(f"policy_version {expected_version} is from the future (learner is at {learner_version})")

    comp = table.column("completion_token_ids")
    comp_len = pc.list_value_length(comp).to_numpy(zero_copy_only=False)
    for name in ("completion_mask", "behavior_logprobs"):
        lens = pc.list_value_length(table.column(name)).to_numpy(zero_copy_only=False)
        if not np.array_equal(lens, comp_len):
            row = int(np.nonzero(lens != comp_len)[0][0])
            raise InvalidRollouts(f"row {row}: {name} has {lens[row]} entries but the completion has {comp_len[row]} tokens")
    if (comp_len == 0).any():
        raise InvalidRollouts(f"row {int(np.nonzero(comp_len == 0)[0][0])}: empty completion")
    prompt_len = pc.list_value_length(table.column("prompt_token_ids")).to_numpy(zero_copy_only=False)
    if (prompt_len == 0).any():
        raise InvalidRollouts(f"row {int(np.nonzero(prompt_len == 0)[0][0])}: empty prompt")

    for name in ("prompt_token_ids", "completion_token_ids"):
        ids = pc.list_flatten(table.column(name)).to_numpy(zero_copy_only=False)
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            raise InvalidRollouts(f"{name} holds token id {int(ids[bad][0])} outside the vocabulary [0, {vocab_size})")
    logprobs = pc.list_flatten(table.column("behavior_logprobs")).to_numpy(zero_copy_only=False)
    if not np.isfinite(logprobs).all() or (logprobs > 1e-4).any():
        raise InvalidRollouts("behavior_logprobs holds a non-finite or positive log-probability")
    mask = pc.list_flatten(table.column("completion_mask")).to_numpy(zero_copy_only=False)
    if not np.isin(mask, (0, 1)).all():
        raise InvalidRollouts("completion_mask holds values other than 0 and 1")
    rewards = table.column("reward").to_numpy()
    if not np.isfinite(rewards).all():
        raise InvalidRollouts("reward holds a non-finite value")
    for detail in table.column("reward_detail").to_pylist():
        try:
            json.loads(detail)
        except ValueError:
            raise InvalidRollouts(f"reward_detail is not JSON: {detail[:60]!r}") from None
    if group_size is not None:
        counts = pc.value_counts(table.column("group_id"))
        sizes = set(counts.field("counts").to_pylist())
        if sizes != {group_size}:
            raise InvalidRollouts(f"groups have sizes {sorted(sizes)}, expected {group_size}")

