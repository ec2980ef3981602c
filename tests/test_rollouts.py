"""Rollout Arrow files: the schema round trip and every validation rule."""

import dataclasses
import math

import pandas as pd
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from echo2.data.rollouts import ROLLOUT_SCHEMA, InvalidRollouts, RolloutLimits, decode_rollouts, validate_rollouts
from helpers import make_rollouts, rollout_bytes

LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0))
OK = dict(run_id="run", actor_id="a", expected_version=3, learner_version=4, limits=LIMITS)


def test_round_trip_opens_with_pyarrow_and_pandas():
    data = rollout_bytes(3)
    table = ipc.open_file(pa.BufferReader(data)).read_all()
    assert table.schema.equals(ROLLOUT_SCHEMA, check_metadata=True)
    df = table.to_pandas()
    assert isinstance(df, pd.DataFrame) and len(df) == 4
    assert df["policy_version"].unique().tolist() == [3]
    assert list(df["completion_mask"][0]) == [1, 1, 1]
    validate_rollouts(decode_rollouts(data), **OK)


def _broken(**change):
    rollouts = make_rollouts()
    rollouts[1] = dataclasses.replace(rollouts[1], **change)
    return decode_rollouts(rollout_bytes(3, rollouts=rollouts))


@pytest.mark.parametrize("change, reason", [
    (dict(behavior_logprobs=[-0.1, -0.2]), "behavior_logprobs has 2 entries but the completion has 3"),
    (dict(behavior_logprobs=[-0.1, math.nan, -0.2]), "non-finite"),
    (dict(completion_token_ids=[4, 5, 100]), "outside the vocabulary"),
    (dict(prompt_token_ids=[-1, 2]), "outside the vocabulary"),
    (dict(reward=math.inf), "reward holds a non-finite"),
    (dict(completion_token_ids=[], behavior_logprobs=[], completion_mask=[]), "empty completion"),
    (dict(completion_mask=[1, 2, 1]), "completion_mask"),
])
def test_invalid_rows_are_named(change, reason):
    with pytest.raises(InvalidRollouts, match=reason):
        validate_rollouts(_broken(**change), **OK)


def test_wrong_run_future_version_and_folder_mismatch():
    table = decode_rollouts(rollout_bytes(3))
    with pytest.raises(InvalidRollouts, match="does not match this run"):
        validate_rollouts(table, **{**OK, "run_id": "other"})
    with pytest.raises(InvalidRollouts, match="from the future"):
        validate_rollouts(table, **{**OK, "learner_version": 2})
    with pytest.raises(InvalidRollouts, match="does not match its folder"):
        validate_rollouts(table, **{**OK, "expected_version": 2})


def test_group_sizes_and_garbage():
    table = decode_rollouts(rollout_bytes(3, group_size=3))
    with pytest.raises(InvalidRollouts, match="groups have sizes"):
        validate_rollouts(table, **{**OK, "limits": dataclasses.replace(LIMITS, max_completion_tokens=8)})
    with pytest.raises(InvalidRollouts, match="not a readable Arrow IPC file"):
        decode_rollouts(b"definitely not arrow")
    truncated = rollout_bytes(3)[:-40]
    with pytest.raises(InvalidRollouts):
        decode_rollouts(truncated)


def test_schema_drift_is_rejected():
    table = decode_rollouts(rollout_bytes(3)).drop_columns(["reward"])
    table = table.replace_schema_metadata(ROLLOUT_SCHEMA.metadata)
    with pytest.raises(InvalidRollouts, match="missing column reward"):
        validate_rollouts(table, **OK)
