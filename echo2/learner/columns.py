"""Rollout files (Arrow tables) -> a step's ``StepColumns``: offsets + values tensors, no Python lists.

An Arrow list column already is offsets + values. Each chunk of each file's column is read as its
offsets rebased to 0 (a sliced chunk's offsets start wherever the slice began; ``ListArray.flatten``
gives exactly the values the slice covers) plus its values, both through numpy into torch, and the
chunks of all files are concatenated with running offsets. No Python object is made per row or per
token: every column is one numpy array per chunk.

Groups: a group is one group_id of one file (two files never merge their groups of the same name);
groups are numbered 0..G-1 in order of first appearance, file by file.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from echo2.learner.packing import Ragged, StepColumns

__all__ = ["StepColumns", "step_columns"]


def step_columns(tables: list[pa.Table]) -> StepColumns:
    """The columns the step needs from ``tables`` (validated rollout files), in file then row order."""
    if not tables:
        raise ValueError("a step needs at least one rollout file")
    completion = _ragged([t.column("completion_token_ids") for t in tables])
    mask = _ragged([t.column("completion_mask") for t in tables])
    behavior = _ragged([t.column("behavior_logprobs") for t in tables])
    if not (torch.equal(mask.offsets, completion.offsets) and torch.equal(behavior.offsets, completion.offsets)):
        raise ValueError("completion_mask and behavior_logprobs must have one entry per completion token")
    groups, first = [], 0
    for table in tables:
        encoded = pc.dictionary_encode(table.column("group_id").combine_chunks())  # codes by first appearance
        groups.append(encoded.indices.to_numpy().astype(np.int64) + first)
        first += len(encoded.dictionary)
    return StepColumns(
        prompt=_ragged([t.column("prompt_token_ids") for t in tables]), completion=completion,
        completion_mask=mask.values, behavior_logprobs=behavior.values,
        reward=_flat([t.column("reward") for t in tables], np.float32),
        group_index=torch.from_numpy(np.concatenate(groups)),
        policy_version=_flat([t.column("policy_version") for t in tables], np.int64))


def _ragged(columns: list[pa.ChunkedArray]) -> Ragged:
    """One Ragged of the rows of every chunk of ``columns``, in order."""
    offsets, values, base = [np.zeros(1, dtype=np.int64)], [], 0
    for column in columns:
        for chunk in column.chunks:
            if chunk.null_count:
                raise ValueError(f"a list column has {chunk.null_count} null rows")
            own = chunk.offsets.to_numpy().astype(np.int64)
            offsets.append(own[1:] - own[0] + base)
            base += int(own[-1] - own[0])
            values.append(chunk.flatten().to_numpy(zero_copy_only=False))
    if not values:  # no chunk at all: an empty table
        dtype = columns[0].type.value_type.to_pandas_dtype()
        return Ragged(torch.zeros(1, dtype=torch.int64), torch.from_numpy(np.zeros(0, dtype=dtype)))
    # np.concatenate copies into one writable array: torch.from_numpy then shares it without a warning
    return Ragged(torch.from_numpy(np.concatenate(offsets)), torch.from_numpy(np.concatenate(values)))


def _flat(columns: list[pa.ChunkedArray], dtype) -> torch.Tensor:
    parts = [chunk.to_numpy(zero_copy_only=False).astype(dtype) for column in columns for chunk in column.chunks]
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
