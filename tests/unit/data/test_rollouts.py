"""Rollout Arrow files: the schema round trip and every validation rule."""

import dataclasses
import math

import pandas as pd
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from helpers import make_rollouts, rollout_bytes

from echo2.data.rollouts import ROLLOUT_SCHEMA, InvalidRollouts, RolloutLimits, decode_rollouts, validate_rollouts

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
    with pytest.raises(InvalidRollouts, match="not an Arrow IPC file"):
        decode_rollouts(b"definitely not arrow")
    truncated = rollout_bytes(3)[:-40]
    with pytest.raises(InvalidRollouts):
        decode_rollouts(truncated)


def test_schema_drift_is_rejected():
    table = decode_rollouts(rollout_bytes(3)).drop_columns(["reward"])
    table = table.replace_schema_metadata(ROLLOUT_SCHEMA.metadata)
    with pytest.raises(InvalidRollouts, match="missing column reward"):
        validate_rollouts(table, **OK)


LONG = [-0.5] * 9


@pytest.mark.parametrize("change, reason", [
    (dict(behavior_logprobs=[-1e4, -0.2, -0.2]), "outside \\[-50, 0\\]"),
    (dict(reward=3.0e38), "outside the task's range"),
    (dict(reward=-0.5), "outside the task's range"),
    (dict(completion_mask=[0, 0, 0]), "no token of the completion is the policy's"),
    (dict(completion_token_ids=[4] * 9, behavior_logprobs=LONG, completion_mask=[1] * 9),
     "more than the run's limit 8"),
    (dict(prompt_token_ids=[1] * 17), "more than 16"),
    (dict(sample_index=0), "sample_index is not 0..1"),
    (dict(prompt_id="p1"), "mixes completions of different prompt_ids"),
    (dict(prompt_token_ids=[1, 2, 4]), "mixes different prompt tokens"),
])
def test_what_the_loss_relies_on_is_bounded(change, reason):
    with pytest.raises(InvalidRollouts, match=reason):
        validate_rollouts(_broken(**change), **OK)


def test_actor_id_must_match_the_file_key():
    with pytest.raises(InvalidRollouts, match="does not match the file's actor"):
        validate_rollouts(decode_rollouts(rollout_bytes(3)), **{**OK, "actor_id": "b"})


def test_nulls_inside_lists_are_refused():
    table = decode_rollouts(rollout_bytes(3))
    i = table.schema.get_field_index("behavior_logprobs")
    values = table.column(i).to_pylist()
    values[1][1] = None
    table = table.set_column(i, ROLLOUT_SCHEMA.field("behavior_logprobs"), pa.array(values, pa.list_(pa.float32())))
    with pytest.raises(InvalidRollouts, match="null values inside its lists"):
        validate_rollouts(table, **OK)


def test_extra_and_reordered_columns_are_selected_and_cast():
    table = decode_rollouts(rollout_bytes(3))
    names = list(reversed(table.column_names))
    odd = table.select(names).append_column("evil", pa.array([1] * table.num_rows))
    odd = odd.set_column(odd.schema.get_field_index("sample_index"), "sample_index",
                         pa.array(table.column("sample_index").to_pylist(), pa.int64()))
    odd = odd.replace_schema_metadata(ROLLOUT_SCHEMA.metadata)
    clean = validate_rollouts(odd, **OK)
    assert clean.schema.equals(ROLLOUT_SCHEMA) and clean.num_rows == table.num_rows
    overflow = odd.set_column(odd.schema.get_field_index("sample_index"), "sample_index",
                              pa.array([2**40] * table.num_rows, pa.int64()))
    with pytest.raises(InvalidRollouts, match="do not fit the schema"):
        validate_rollouts(overflow, **OK)


def test_no_mutation_of_a_file_crashes_the_validator():
    """Bytes flipped at random (seeded): every outcome is a usable table or InvalidRollouts, never another error.
    Before, bad UTF-8 and odd integer widths escaped as UnicodeDecodeError / ArrowNotImplementedError."""
    import random

    from echo2.data.rollouts import content_hash

    base = rollout_bytes(3)
    rng = random.Random(0)
    outcomes = {"ok": 0, "invalid": 0}
    for _ in range(1500):
        data = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            content_hash(validate_rollouts(decode_rollouts(bytes(data)), **OK))
            outcomes["ok"] += 1
        except InvalidRollouts:
            outcomes["invalid"] += 1
    assert outcomes["invalid"] > 1000 and outcomes["ok"] > 0


def test_deeply_nested_reward_detail_is_invalid_not_a_crash():
    rollouts = make_rollouts()
    rollouts[0] = dataclasses.replace(rollouts[0], reward_detail={})
    table = decode_rollouts(rollout_bytes(3, rollouts=rollouts))
    i = table.schema.get_field_index("reward_detail")
    deep = ["[" * 100_000 + "]" * 100_000] * table.num_rows
    table = table.set_column(i, ROLLOUT_SCHEMA.field("reward_detail"), pa.array(deep, pa.string()))
    with pytest.raises(InvalidRollouts, match="reward_detail"):
        validate_rollouts(table, **OK)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_compressed_batches_are_refused_before_they_are_decoded(codec):
    """A compressed buffer declares its own uncompressed size: a small file could claim many GB."""
    import io

    table = decode_rollouts(rollout_bytes(3))
    sink = io.BytesIO()
    with ipc.new_file(sink, table.schema, options=ipc.IpcWriteOptions(compression=codec)) as writer:
        writer.write_table(table)
    with pytest.raises(InvalidRollouts, match="compressed record batches are not accepted"):
        decode_rollouts(sink.getvalue())
