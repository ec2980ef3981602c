"""``echo2 bench machine``: this machine's profile for a run config, what ``echo2 plan --from-run`` predicts a
local run of that config with, measured without running it.

For the config's model and shapes it measures:

- **decode**: seconds per generated position of one actor's batch (``rollout.groups_per_batch`` x
  ``rollout.group_size`` rows, ``rollout.num_threads`` threads, the transformers engine), with the end token made
  unreachable so that every row runs to ``rollout.max_new_tokens``; and of the held-out evaluation's greedy batch
  on the learner (``eval.batch_size`` rows, ``eval.max_new_tokens``);
- **the learner's step**: wall seconds of the real ``Learner.step_on_columns`` (the run's ``train`` section) on a
  step of ``train.groups_per_step`` groups at two completion lengths, a quarter and all of ``max_new_tokens``, fitted
  as ``fixed + per_token x tokens`` (tokens the model runs on: each group's prompt once, as the learner packs it);
- **the prompt**: the median token count of 16 of the task's prompts through the model's chat template;
- **loading**: seconds to resolve and load the model as a process of the run does;
- **publishing and checkpoints**: the learner's real publish of a version after a step (through ``Publisher``, a
  delta where the config publishes deltas) and one checkpoint, into a store in a temporary folder;

each of decode and the step both alone and *contended*: while ``fleet.actors`` child processes decode as the run's
actors would (the learner's step timed meanwhile, the children's batches timed meanwhile). On one machine a run's
actors and learner share the cores; a run's phases overlap for part of the time, which the planner works out
(``fleet/planner/run_check.py``). Weights do not change speed: the model's own weights are used, and its outputs
are not read.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch

DECODE_REPEATS = 3
STEP_REPEATS = 2


def _engine(model_dir: Path, batch: int, threads: int | None):
    from transformers import AutoConfig

    from echo2.rollout.engines.transformers import TransformersEngine

    if threads:
        torch.set_num_threads(threads)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    # an end token no row can sample: every row decodes to the limit, so a batch's time is its longest row's
    engine = TransformersEngine(model_dir, eos_token_id=vocab + 7, pad_token_id=0, batch_size=batch, device="cpu")
    engine.load_weights(_weights(model_dir))
    return engine


def _weights(model_dir: Path):
    from safetensors.torch import load_file

    for path in sorted(model_dir.glob("*.safetensors")):
        yield from load_file(path).items()


def _decode_seconds(engine, prompt_tokens: int, groups: int, group_size: int, max_new_tokens: int) -> float:
    from echo2.rollout.engines.base import SamplingParams

    prompts = [[100 + g] * prompt_tokens for g in range(groups)]
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(n=group_size, max_new_tokens=max_new_tokens, temperature=1.0, seed=0))
    return time.perf_counter() - start


def _decoder(model_dir: str, shape: tuple, threads: int, ready, stop, out) -> None:
    """A child standing in for one actor: decodes batches of the run's shape until told to stop, reporting each."""
    parent = os.getppid()
    engine = _engine(Path(model_dir), shape[1] * shape[2], threads)
    ready.set()
    while not stop.is_set() and os.getppid() == parent:  # a killed bench leaves no child decoding
        out.put((time.perf_counter(), _decode_seconds(engine, *shape)))


def _fit(points: list[list]) -> tuple[float, float]:
    """fixed, per_token of a line through two (tokens, seconds) points (medians of each length's repeats)."""
    (x0, y0), (x1, y1) = points
    per_token = max(0.0, (y1 - y0) / (x1 - x0))
    return max(0.0, y0 - per_token * x0), per_token


def _learner_points(learner, *, groups: int, group_size: int, prompt_tokens: int, lengths: list[int],
                    vocab: int) -> list[list]:
    from echo2.bench.learner_steps import computed_tokens, make_columns

    points = []
    for length in lengths:
        columns = make_columns(prompt_tokens, [length] * (groups * group_size), group_size, vocab, seed=length)
        times = []
        for _ in range(STEP_REPEATS):
            start = time.perf_counter()
            learner.step_on_columns(columns)
            times.append(time.perf_counter() - start)
        points.append([computed_tokens(learner, columns), statistics.median(times)])
    return points


def publish_and_checkpoint_seconds(learner, config, columns) -> tuple[float, float]:
    """Seconds of the learner's real publish of a version after a step (a delta where the config publishes deltas,
    the previous version a keyframe) and of one checkpoint, each into a store in a temporary folder."""
    import tempfile

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.data.store import open_store
    from echo2.learner.checkpoint import save_checkpoint
    from echo2.learner.publisher import Publisher

    key = Ed25519PrivateKey.generate()
    with tempfile.TemporaryDirectory(prefix="echo2-bench-machine-") as folder:
        store = open_store(folder)
        publisher = Publisher(store, train=config.train, publish=config.publish, broadcast=config.broadcast,
                              key=key, extra_files=learner.extra_files, store_site=("bench", "bench"))
        publisher.publish(0, *learner.policy_version_tensors())
        learner.step_on_columns(columns)
        start = time.perf_counter()
        publisher.publish(1, *learner.policy_version_tensors())
        publish = time.perf_counter() - start
        start = time.perf_counter()
        save_checkpoint(store, 1, learner.save_sharded, {"history": []}, key=key, extra_files=learner.extra_files,
                        meta={"weights": "full"})
        return publish, time.perf_counter() - start


def prompt_tokens_of(config, model_dir: Path) -> int:
    """Median token count of 16 training prompts of the config's task, rendered as the actors render them."""
    import random

    from transformers import AutoTokenizer

    from echo2.tasks import make_task

    task = make_task(config.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = task.sample_train(random.Random(0), 16)
    return int(statistics.median(len(task.prompt_tokens(tokenizer, p)) for p in problems))


def measure_machine(config, progress=lambda line: None) -> dict:
    """The profile of this machine for ``config`` (a ``RunConfig``); see the module docstring."""
    from transformers import AutoConfig

    from echo2.learner.distributed import learner_options, make_learner
    from echo2.models import resolve_model

    start = time.perf_counter()
    model_dir = resolve_model(config.model.name)
    r, t, e = config.rollout, config.train, config.eval
    prompt = prompt_tokens_of(config, model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    learner = make_learner(model_dir, t, temperature=r.temperature, **learner_options(config))
    load_seconds = time.perf_counter() - start
    progress(f"model loaded in {load_seconds:.1f}s; prompt {prompt} tokens")
    lengths = [max(1, r.max_new_tokens // 4), r.max_new_tokens]
    step_shape = dict(groups=t.groups_per_step, group_size=r.group_size, prompt_tokens=prompt, lengths=lengths,
                      vocab=vocab)
    _learner_points(learner, **{**step_shape, "lengths": lengths[:1]})  # warm-up: allocator, optimizer state
    alone = _learner_points(learner, **step_shape)
    progress(f"learner alone: {alone}")

    shape = (prompt, r.groups_per_batch, r.group_size, r.max_new_tokens)
    actors = config.fleet.actors if isinstance(config.fleet.actors, int) else 1
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(actors)]
    children = [ctx.Process(target=_decoder, args=(str(model_dir), shape, r.num_threads, ready, stop, out),
                            daemon=True) for ready in readies]
    for child in children:
        child.start()
    try:
        for ready, child in zip(readies, children):
            while not ready.wait(1.0):
                if not child.is_alive():
                    raise RuntimeError(f"a decoding child exited with {child.exitcode} before it was ready")
        began = time.perf_counter()
        contended = _learner_points(learner, **step_shape)
        ended = time.perf_counter()
    finally:
        stop.set()
        for child in children:
            child.join(timeout=120)
            if child.is_alive():
                child.kill()
    batches = []
    while not out.empty():
        finished, seconds = out.get()
        if finished - seconds >= began and finished <= ended:  # wholly inside the learner's contended steps
            batches.append(seconds)
    progress(f"learner contended: {contended}; {len(batches)} actor batches meanwhile")
    from echo2.bench.learner_steps import make_columns

    publish, checkpoint = publish_and_checkpoint_seconds(
        learner, config, make_columns(prompt, [r.max_new_tokens] * (t.groups_per_step * r.group_size), r.group_size,
                                      vocab, seed=1))
    progress(f"publish {publish:.2f}s, checkpoint {checkpoint:.2f}s")
    del learner

    engine = _engine(model_dir, r.groups_per_batch * r.group_size, r.num_threads)
    decode_alone = statistics.median(_decode_seconds(engine, *shape) for _ in range(DECODE_REPEATS))
    torch.set_num_threads(os.cpu_count() or 1)
    eval_rows = min(e.batch_size, getattr(config.task, "eval_size", e.batch_size))
    eval_engine = _engine(model_dir, eval_rows, None)
    eval_seconds = _decode_seconds(eval_engine, prompt, eval_rows, 1, e.max_new_tokens)
    fixed_alone, per_token_alone = _fit(alone)
    fixed_cont, per_token_cont = _fit(contended)
    return {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": str(torch.__version__), "measured": dt.date.today().isoformat()},
        "config": config.run.name, "model": config.model.name, "load_seconds": load_seconds,
        "prompt_tokens": prompt,
        "decode": {"rows": r.groups_per_batch * r.group_size, "threads": r.num_threads,
                   "max_new_tokens": r.max_new_tokens, "actors": actors,
                   "seconds_per_position_alone": decode_alone / r.max_new_tokens,
                   "seconds_per_position_contended": (statistics.median(batches) / r.max_new_tokens
                                                      if batches else None)},
        "eval_decode": {"rows": eval_rows, "max_new_tokens": e.max_new_tokens,
                        "seconds_per_position": eval_seconds / e.max_new_tokens},
        "publish_seconds": publish, "checkpoint_seconds": checkpoint,
        "learner": {"groups": t.groups_per_step, "points_alone": alone, "points_contended": contended,
                    "fixed_seconds_alone": fixed_alone, "seconds_per_token_alone": per_token_alone,
                    "fixed_seconds_contended": fixed_cont, "seconds_per_token_contended": per_token_cont},
    }
