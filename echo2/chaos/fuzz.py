"""Hostile rollout files: valid ones mutated in every way the learner's validation must catch.

``cases(n, seed)`` draws ``n`` files over the kinds below (each kind in turn, its parameters from a
seeded generator: which row, which byte, which value), built from a valid file of the tiny model's
arithmetic task, each for its own actor (a dishonest file bans its actor, which must not hide the next
file's own reason). Every case says what the learner must do with it: quarantine it (with a reason
that contains ``expect``) or drop it as a duplicate. ``tests/e2e/test_chaos.py`` draws the same kinds
with hypothesis.

Two kinds are about the object rather than its bytes, and are written with ``plant_local`` or
``plant_s3``: ``unreadable`` is a valid file stored as GLACIER (S3 answers its HEAD, and 403 to every
GET or copy; a local file cannot be made unreadable to root, so ``LOCAL_KINDS`` leaves it out), and
``huge_sparse`` is a file of several GB (a sparse file on a local store; on S3, where a large object
is not cheap, ``S3_HUGE_BYTES``). Each must be set aside without being read whole.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from echo2.data.rollouts import InvalidRollouts, Rollout, decode_rollouts, encode_rollouts


@dataclass(frozen=True)
class Case:
    kind: str
    actor: str
    version: int
    data: bytes
    expect: str
    """A substring of the quarantine reason, or ``duplicate`` (dropped: the content was used already)."""
    storage_class: str = "STANDARD"
    """``GLACIER`` (``unreadable``): HEAD works, GET is 403 (on S3; see ``plant_s3``)."""
    size: int = 0
    """When over ``len(data)``: the object is ``data`` followed by zeros up to this many bytes (``huge_sparse``)."""


def honest(problems, tokenizer, *, group_size: int, salt: int) -> list[Rollout]:
    """A valid file's rows: every group's completions are the answer or a wrong number, rewarded as the task does."""
    from echo2.tasks import prompt_token_ids

    rows = []
    for g, problem in enumerate(problems):
        prompt = prompt_token_ids(tokenizer, problem)
        for s in range(group_size):
            text = str(problem.answer if s % 2 == 0 else problem.answer + 1 + salt)
            ids = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
            rows.append(Rollout(prompt_id=problem.id, group_id=f"g{g}", sample_index=s, prompt_token_ids=prompt,
                                completion_token_ids=ids, behavior_logprobs=[-1.0] * len(ids),
                                reward=float(s % 2 == 0), finish_reason="stop"))
    return rows


def _flipped(kind: str, actor: str, version: int, good: bytes, rng: random.Random) -> Case:
    """``good`` with 1-31 flipped bits. A flip can land where the parser reads nothing (padding, unused
    metadata): the file is then the good rows again, which a step already used (a duplicate). One that
    still parses to other rows may be a plausible file (a logprob moved in its last bit) that no check
    can call hostile: such draws are drawn again, so each case has one right answer."""
    original = decode_rollouts(good)
    for _ in range(100):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 32)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        try:
            table = decode_rollouts(bytes(data))
        except InvalidRollouts:
            return Case(kind, actor, version, bytes(data), "")
        if table.equals(original):
            return Case(kind, actor, version, bytes(data), "duplicate")
    return Case(kind, actor, version, good[: len(good) // 2], "")


def _encode(rows, run_id, actor, version, **kw) -> bytes:
    return encode_rollouts(rows, run_id=run_id, actor_id=actor, policy_version=version, task="arithmetic", **kw)


def _table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


KINDS = ("drop_column", "mismatched_lengths", "nan_logprob", "inf_logprob", "positive_logprob", "token_out_of_vocab",
         "negative_token", "future_version", "huge_file", "truncated_arrow", "garbage", "flipped_bytes",
         "reward_out_of_range", "wrong_reward", "wrong_run", "other_actor", "short_group", "duplicate",
         "unreadable", "huge_sparse")
LOCAL_KINDS = tuple(k for k in KINDS if k != "unreadable")
"""What a local store can hold (root reads a file whatever its mode)."""
SPARSE_BYTES = 3 * 2**30
"""``huge_sparse`` on a local store: 3 GiB that take no disk (a sparse file)."""
S3_HUGE_BYTES = 8 * 2**20
"""``huge_sparse`` on S3: moderately large (written for real), still eight times the tests' 1 MiB limit."""


def plant_local(c: Case, path: Path) -> None:
    """Write case ``c`` as the file ``path`` (``huge_sparse``: extended, sparse, to its size)."""
    if c.storage_class != "STANDARD":
        raise ValueError(f"a local store cannot hold a {c.storage_class} object ({c.kind}): use plant_s3")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(c.data)
    if c.size > len(c.data):
        os.truncate(path, c.size)


def plant_s3(c: Case, client, bucket: str, key: str) -> None:
    """Write case ``c`` with boto3 ``client`` (its storage class as given; ``huge_sparse`` at ``S3_HUGE_BYTES``)."""
    body = c.data + bytes(max(0, min(c.size, S3_HUGE_BYTES) - len(c.data))) if c.size else c.data
    client.put_object(Bucket=bucket, Key=key, Body=body, StorageClass=c.storage_class)


def case(kind: str, i: int, rng: random.Random, *, rows: list[Rollout], run_id: str, version: int, vocab: int,
         max_file_bytes: int, used_data: bytes) -> Case:
    """Case ``i`` of ``kind``; ``used_data``: a file a step already used (for ``duplicate``)."""
    actor = f"a0fz-{i:04d}"  # sorts before the honest actors' files: the collector meets every one of them
    r = rng.randrange(len(rows))

    def mutate(**fields) -> list[Rollout]:
        return [dataclasses.replace(x, **fields) if j == r else x for j, x in enumerate(rows)]

    good = _encode(rows, run_id, actor, version)
    if kind == "drop_column":
        table = pa.ipc.open_file(pa.BufferReader(good)).read_all()
        column = rng.choice(["reward", "behavior_logprobs", "completion_mask", "prompt_id"])
        return Case(kind, actor, version, _table_bytes(table.drop_columns([column])), column)
    if kind == "mismatched_lengths":
        x = rows[r]
        return Case(kind, actor, version, _encode(mutate(behavior_logprobs=x.behavior_logprobs[:-1] or [-1.0, -1.0]),
                                                  run_id, actor, version), "")
    if kind in ("nan_logprob", "inf_logprob", "positive_logprob"):
        bad = {"nan_logprob": math.nan, "inf_logprob": -math.inf, "positive_logprob": 3.0}[kind]
        lp = list(rows[r].behavior_logprobs)
        lp[rng.randrange(len(lp))] = bad
        return Case(kind, actor, version, _encode(mutate(behavior_logprobs=lp), run_id, actor, version), "logprob")
    if kind in ("token_out_of_vocab", "negative_token"):
        ids = list(rows[r].completion_token_ids)
        ids[rng.randrange(len(ids))] = (vocab + rng.randrange(1, 10**6) if kind == "token_out_of_vocab"
                                        else -rng.randrange(1, 99))
        return Case(kind, actor, version, _encode(mutate(completion_token_ids=ids), run_id, actor, version), "token")
    if kind == "future_version":
        ahead = version + rng.randrange(50, 500)
        return Case(kind, actor, ahead, _encode(rows, run_id, actor, ahead), "future")
    if kind == "huge_file":
        pad = rng.randbytes(max_file_bytes + 1024)
        return Case(kind, actor, version, good + pad, "over the limit")
    if kind == "huge_sparse":  # a valid file's bytes, then zeros to several GB
        return Case(kind, actor, version, good, "over the limit", size=SPARSE_BYTES + rng.randrange(2**20))
    if kind == "unreadable":  # a valid file no GET can read: whatever the reason says, it must not be used
        return Case(kind, actor, version, good, "", storage_class="GLACIER")
    if kind == "truncated_arrow":
        return Case(kind, actor, version, good[: rng.randrange(8, len(good) - 8)], "")
    if kind == "garbage":
        return Case(kind, actor, version, rng.randbytes(rng.randrange(1, 4096)), "")
    if kind == "flipped_bytes":
        return _flipped(kind, actor, version, good, rng)
    if kind == "reward_out_of_range":
        return Case(kind, actor, version, _encode(mutate(reward=rng.choice([5.0, -3.0, 1e9])), run_id, actor, version),
                    "reward")
    if kind == "wrong_reward":  # a reward the completion did not earn: the task re-scores it
        return Case(kind, actor, version, _encode(mutate(reward=1.0 - rows[r].reward), run_id, actor, version),
                    "reward")
    if kind == "wrong_run":
        return Case(kind, actor, version, _encode(rows, f"{run_id}-other", actor, version), "run")
    if kind == "other_actor":  # written in another actor's name
        return Case(kind, actor, version, _encode(rows, run_id, "a-victim", version), "actor")
    if kind == "short_group":
        return Case(kind, actor, version, _encode([x for j, x in enumerate(rows) if j != r], run_id, actor, version),
                    "group")
    if kind == "duplicate":  # the content of a file a step already used, committed again under this name
        data, used_version = reowned(used_data, actor)
        return Case(kind, actor, used_version, data, "duplicate")
    raise ValueError(kind)


def reowned(data: bytes, actor: str) -> tuple[bytes, int]:
    """A committed file's content in another actor's name (what a copy under that actor's key must say),
    and the version it was generated with (the folder the copy goes to)."""
    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    column = table.schema.get_field_index("actor_id")
    table = table.set_column(column, "actor_id", pa.array([actor] * table.num_rows, pa.string()))
    return _table_bytes(table), int(table.column("policy_version")[0].as_py())


def cases(n: int, seed: int, kinds: tuple[str, ...] = KINDS, **context) -> list[Case]:
    rng = random.Random(seed)
    return [case(kinds[i % len(kinds)], i, rng, **context) for i in range(n)]
