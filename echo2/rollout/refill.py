"""Refill (``rollout.refill``): the actor generates one stream per policy version instead of one batch at a time,
so a batch's slowest completions no longer hold the engine while it waits for them.

    stream (the actor's policy version v):
        whenever the engine has room for a group and the previous batch's problems are all in, ask the actor
            whether a batch may start (``may_start``: the checks the actor makes before a batch: not stopping,
            no newer version ready to load, flow control with the batches in flight counted as waiting);
            if so draw groups_per_batch problems, as a batch would, and hand their prompts to the engine
        the engine (``Engine.generate_stream``) starts each group as an earlier one finishes and hands back each
            group when its G completions are done; the task scores it (its own ``rollout_groups``, replayed)
        every groups_per_batch finished groups, in the order they finished: one batch for the actor to commit
    once ``may_start`` says no, nothing more is taken: the groups in flight finish and are committed (problems
    are taken a batch at a time, so whole batches finish), and the stream ends

Versions: weights change only between streams (the actor swaps after one ends), so every completion of a stream
was sampled from v's weights and every file it commits is v's (policy_version, policy_digest); a version that
lands mid-stream waits for the groups in flight, at most about one batch's turn, as it waited for the batch in
flight before. The staleness check and the backlog bound run before every batch, as they did.

Which tasks: a single-turn task (``Task.rollout_groups`` not overridden) samples one reply per episode from the
prompt ``Task.prompt_tokens`` gives, so its prompts are known before sampling and its episodes can be built
after: the task's own ``rollout_groups`` runs on each finished group with a sampler that returns what the engine
sampled for that prompt and refuses any other (``_Replay``). A multi-turn task (poker) picks each prompt from the
last reply; the actor keeps it batch by batch.
"""

from __future__ import annotations

import itertools
import random
import time
from contextlib import closing
from typing import Any, Callable, Iterator

from echo2.config import RolloutConfig
from echo2.rollout.engines import Completion, Engine, SamplingParams
from echo2.tasks import Episode, Problem, Task

Played = list[tuple[Problem, list[Episode]]]
"""One batch: each problem with its G scored episodes."""


def refillable(task: Task) -> bool:
    """Whether the task's episodes are single replies to prompts known before sampling (see the module docstring)."""
    return type(task).rollout_groups is Task.rollout_groups


class _Replay:
    """The sampler the task gets for one finished group: the engine's completions of that group's prompt."""

    def __init__(self, prompt: list[int], completions: list[Completion]):
        self.prompt, self.completions = prompt, completions

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[Completion]:
        if len(prompts) != len(self.completions) or any(list(p) != self.prompt for p in prompts):
            raise RuntimeError("the task asked for other prompts than the ones it gave: it cannot be refilled "
                               "(set rollout.refill: false)")
        return self.completions


def stream_batches(engine: Engine, task: Task, tokenizer: Any, rng: random.Random, cfg: RolloutConfig,
                   may_start: Callable[[int], bool]) -> Iterator[tuple[Played, float]]:
    """Each batch of the stream, when its last group is done, with its generation seconds: from the stream's start
    or the previous batch's hand-over (its commit) to this batch's last group (with batches overlapping, the actor's
    time per batch, which is what the capacity fit and the measured speeds read). ``may_start(in_flight)``: whether
    the actor may start another batch, ``in_flight`` batches being taken and not yet handed over."""
    per, n = cfg.groups_per_batch, cfg.group_size
    taken: dict[int, tuple[Problem, list[int]]] = {}
    in_flight = 0

    def source() -> Iterator[tuple[int, list[int]]]:
        nonlocal in_flight
        keys = itertools.count()
        while may_start(in_flight):
            in_flight += 1
            for problem in task.sample_train(rng, per):
                key, prompt = next(keys), list(task.prompt_tokens(tokenizer, problem))
                taken[key] = (problem, prompt)
                yield key, prompt

    params = SamplingParams(n=n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    done: Played = []
    mark = time.time()
    with closing(engine.generate_stream(source(), params, window=per)) as stream:
        for key, completions in stream:
            problem, prompt = taken.pop(key)
            episodes = task.rollout_groups(_Replay(prompt, completions), tokenizer, [problem], n, cfg.max_new_tokens)[0]
            done.append((problem, episodes))
            if len(done) == per:
                batch, done = done, []
                in_flight -= 1
                yield batch, time.time() - mark
                mark = time.time()
    if done or taken:
        raise RuntimeError(f"the engine's stream ended with {len(done)} groups done and {len(taken)} in flight "
                           f"of an unfinished batch")
