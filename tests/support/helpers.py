"""Builders for rollout files used by several tests."""

import time

from echo2.data import layout
from echo2.data.rollouts import Rollout, encode_rollouts

T0 = 1_800_000_000.0
"""The ``clock`` fixture's first time (conftest.py): a fixed moment for hand-built ledgers."""


def new_run(path, config: dict | None = None, summary: dict | None = None):
    """A local store at ``path`` holding a run.json (created at T0) and, given, a summary."""
    from echo2.data.store import open_store

    store = open_store(str(path))
    store.put_json(layout.RUN_JSON, {"run_id": path.name, "created_at": T0, "config": config or {}})
    if summary is not None:
        store.put_json(layout.SUMMARY, summary)
    return store


def make_rollouts(n_groups=2, group_size=2, *, vocab=100, reward=lambda g, s: float(s == 0), logprob=-0.5, salt=""):
    """``salt`` makes the content differ (files with the same content are used once)."""
    out = []
    for g in range(n_groups):
        for s in range(group_size):
            out.append(Rollout(prompt_id=f"p{g}{salt}", group_id=f"g{g}", sample_index=s, prompt_token_ids=[1, 2, 3],
                               completion_token_ids=[4, 5, min(6, vocab - 1)], behavior_logprobs=[logprob] * 3,
                               reward=reward(g, s), finish_reason="stop", reward_detail={"ok": True}))
    return out


def step_files(*, completion, behavior, reward=lambda f, g, s: float((g + s + f) % 3 == 0), salt="") -> list:
    """A learner step's two rollout files (Arrow tables) of 3 groups of 4 over a 300-token vocabulary: row i of
    file f completes with ``completion(f, i)`` (token ids), whose token k the sampler gave ``behavior(k)``, and
    is rewarded ``reward(f, group, sample)``; ``salt`` makes files of different steps differ."""
    import pyarrow as pa

    out = []
    for f in range(2):
        rows = make_rollouts(n_groups=3, group_size=4, vocab=300, salt=f"{salt}-{f}",
                             reward=lambda g, s: reward(f, g, s), logprob=-1.2)
        for i, r in enumerate(rows):
            r.completion_token_ids = completion(f, i)
            r.behavior_logprobs = [behavior(k) for k in range(len(r.completion_token_ids))]
        data = encode_rollouts(rows, run_id="run", actor_id="a", policy_version=0, task="arithmetic")
        out.append(pa.ipc.open_file(pa.BufferReader(data)).read_all())
    return out


def rollout_bytes(version, *, run_id="run", rollouts=None, actor="a", **kw):
    return encode_rollouts(rollouts if rollouts is not None else make_rollouts(**kw), run_id=run_id,
                           actor_id=actor, policy_version=version, task="arithmetic")


def commit_rollouts(store, version, seq, *, actor="a", run_id="run", data=None, **kw):
    key = layout.rollout_key(version, actor, seq)
    kw.setdefault("salt", f"-{version}-{actor}-{seq}")
    store.put(key, data if data is not None else rollout_bytes(version, run_id=run_id, actor=actor, **kw))
    return key


def put_glacier(s3_store, key: str, data: bytes) -> None:
    """Commit ``data`` at ``key`` of an S3 store as an actor can with its own credentials: a PutObject with
    ``StorageClass=GLACIER`` (moto then answers HEAD, and refuses GET and CopyObject, as S3 does)."""
    import boto3

    bucket, _, root = s3_store.root.partition("/")
    boto3.client("s3", endpoint_url=s3_store.options["endpoint_url"], region_name="us-east-1").put_object(
        Bucket=bucket, Key=f"{root}/{key}", Body=data, StorageClass="GLACIER")


def ledger_audit(store):
    """Every committed rollout file of a run, and how the ledger accounts for it: the rules of
    ``echo2 audit`` (echo2/data/audit.py), plus a file not settled yet counting as a problem.

    Returns (problems, counts): a problem is a file the ledger shows zero or several times (an
    amendment that quarantines a used file does not count twice), or an orphaned file it shows at all.
    """
    from echo2.data.audit import audit_run

    result = audit_run(store)
    problems = list(result["problems"])
    problems += [f"{result['pending']} committed files not settled by the ledger"] if result["pending"] else []
    dropped = {k: v for k, v in result["dropped"].items() if k != "orphaned"}
    return problems, {"files": result["committed"] - result["orphaned"], "orphaned": result["orphaned"],
                      "used": result["used"], "dropped": sum(dropped.values()), "quarantined": result["quarantined"]}


def reap_session(proc) -> None:
    """SIGKILL what is left of a process started with ``start_new_session=True`` (its whole session:
    Prefect's ephemeral server outlives a SIGKILLed learner), then reap the process itself."""
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def reap_tagged(tag: str) -> int:
    """SIGKILL every process whose environment holds ``ECHO2_TEST_TAG=tag``: what a run left in sessions of
    its own (torchrun starts each rank in a new session, so a SIGKILLed rank 0's Prefect server is not in
    the session ``reap_session`` kills). Returns how many were killed."""
    from echo2.chaos.runner import kill_by_environment

    return kill_by_environment("ECHO2_TEST_TAG", tag)


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.2 s until it holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def teach_sums(model_dir, dest, *, steps: int, lr: float = 1e-2, every_problem: bool = False):
    """``model_dir``'s model taught to answer the arithmetic task's sums by ``steps`` supervised steps on
    100 problems, saved (with its tokenizer) to ``dest``: its rollout groups then carry a reward signal,
    so a learner's steps really change weights. Returns ``dest``.

    ``every_problem``: taught on every problem a run can draw (a run holds out at least one) instead of 100
    draws from the training problems of the default held-out set, which leave a run's other problems
    untaught: never answered, their groups carry no signal."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2.config import ArithmeticTaskConfig
    from echo2.tasks import make_task, prompt_token_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only waits on a second thread
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        if every_problem:
            task = make_task(ArithmeticTaskConfig(eval_size=1))
            held = {p.id for p in task.eval_set()}
            problems = [task.problem(f"{a}+{b}") for a in range(10) for b in range(10) if f"{a}+{b}" not in held]
        else:
            problems = make_task(ArithmeticTaskConfig()).sample_train(random.Random(0), 100)
        prompts = [prompt_token_ids(tokenizer, p) for p in problems]
        answers = [tokenizer.encode(str(p.answer), add_special_tokens=False) + [tokenizer.eos_token_id]
                   for p in problems]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers))
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
        labels = torch.full_like(ids, -100)
        for i, (p, a) in enumerate(zip(prompts, answers)):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for _ in range(steps):
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest
