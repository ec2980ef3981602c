"""The ``Task`` interface: what actors need to play episodes and score them, what the learner needs to
re-derive and re-score them, and what evaluation needs.

A task owns its episode. ``rollout_groups`` plays ``group_size`` episodes of each problem with a
``Sampler`` (the actor's engine, or evaluation's greedy decoder) and returns them as token
sequences: the prompt, then a completion in which ``completion_mask`` marks the tokens the policy
produced (1) and the environment's text between its turns (0). The default here is single-turn:
one sampled reply per episode, scored by ``reward``. A multi-turn task (poker) overrides
``rollout_groups`` and ``score_episode``.

The learner calls ``prompt_tokens(problem(prompt_id))`` to check that a rollout's prompt is one the
task issued, and ``score_episode`` to re-score it from its tokens alone; an episode whose environment
text is not what the task would have written raises ``ForgedEpisode``.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


class UnknownProblem(ValueError):
    """A prompt id that the task never issues for training."""


class ForgedEpisode(ValueError):
    """An episode the task could not have produced: environment text it would not write, turns it would cut."""


class Ungradable(ValueError):
    """The task cannot score an episode the same way on every machine: a reply whose grading ran out of
    time (on the learner or, per its ``reward_detail``, on the actor), a replay that parts from the file
    after a frozen opponent decided at a near tie. Not evidence of a lie: the file is set aside."""


class GradingBudgetExceeded(ValueError):
    """Scoring one file cost more than the task allows any file (time, or replies that hung the grader):
    no honest actor writes such a file."""


UNGRADED = "ungraded"
"""``reward_detail`` key that an actor-side score sets (to the reason) when the task could not finish
scoring the episode, e.g. math's grader timed out; the reward is then what the task gives an ungraded
reply. The learner, on a reward that differs from its own score, sets such a row's file aside instead
of banning its actor."""

REWARD_TOLERANCE = 1e-5
"""A claimed reward equals the learner's score when they differ by at most this."""


@dataclass(frozen=True)
class Problem:
    """One prompt with what its reward function needs."""

    id: str
    messages: tuple[dict[str, str], ...]
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    may_differ: str | None = field(default=None, compare=False)
    """Why another machine may issue this problem's prompt otherwise (a frozen opponent's near tie before
    the policy's first turn), or None: the learner sets aside, rather than bans, a file whose prompt
    differs from such a problem's."""


class Sample(Protocol):
    """One generated continuation (``echo2.rollout.engines.Completion`` is one)."""

    token_ids: list[int]
    """Generated tokens, including the end-of-sequence token when one was produced."""
    logprobs: list[float] | None
    """Behavior log-probability of each token (None from a sampler that does not compute them)."""
    finish_reason: str
    """"stop" (end-of-sequence produced) or "length" (cut at the token limit)."""


class Sampler(Protocol):
    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[Sample]:
        """One continuation of each prompt (token ids), at most ``max_new_tokens`` long."""


@dataclass
class Episode:
    """One episode as token sequences: what a rollout row holds, without the file's bookkeeping."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_mask: list[int]
    """1 = a token the policy produced, 0 = environment text."""
    behavior_logprobs: list[float] | None
    """Per completion token (0.0 on environment tokens); None when the sampler gave none."""
    reward: float
    reward_detail: dict[str, Any]
    finish_reason: str


class Task(ABC):
    name: str
    reward_range: tuple[float, float] = (0.0, 1.0)
    """Every reward lies in [low, high]; the learner rejects rollout files outside it."""
    verifiable: bool = True
    """The learner can re-score a completion itself (cheaply) and rejects files whose rewards disagree."""
    max_env_tokens: int = 0
    """Environment tokens a multi-turn episode may add to a completion (completion_mask = 0)."""
    headline: str = "accuracy"
    """The evaluation metric a run's summary reports as ``eval_before`` / ``eval_after``."""
    rescore_fraction: float = 1.0
    """Share of each rollout file's episodes the learner re-scores (``verify.py``): 1 = every one; below 1, a
    sample it draws with an RNG no actor can predict, and every episode of each actor's first file (a task whose
    scoring is costly: code runs programs)."""
    rescore_max_rows: int | None = None
    """Most episodes of one file the learner re-scores (what the task's per-file grading budget holds when every
    one costs the most it may); None = no limit."""

    @abstractmethod
    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training problems (never from the held-out set)."""

    @abstractmethod
    def problem(self, prompt_id: str) -> Problem:
        """The training problem named ``prompt_id``, re-derived from the task alone.

        The learner uses it to check that a rollout's prompt is one the task issued: an actor must not
        train the policy on text of its choosing, nor on the held-out set. Raises ``UnknownProblem``.
        """

    @abstractmethod
    def eval_set(self) -> list[Problem]:
        """The fixed held-out problems."""

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
        """Verifiable reward of a single-turn reply and a JSON-able detail of how it was judged."""

    # -- episodes --------------------------------------------------------------------------
    def prompt_tokens(self, tokenizer: Any, problem: Problem) -> list[int]:
        """The tokens the policy is prompted with (the chat rendered with the model's template)."""
        return prompt_token_ids(tokenizer, problem)

    def rewards(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[tuple[float, dict[str, Any]]]:
        """``reward`` of many replies at once (a task whose grader batches overrides it)."""
        return [self.reward(p, c) for p, c in zip(problems, completions)]

    def rollout_groups(self, sample: Sampler, tokenizer: Any, problems: Sequence[Problem], group_size: int,
                       max_new_tokens: int) -> list[list[Episode]]:
        """``group_size`` episodes of each problem. Single-turn: one reply each, all sampled in one call."""
        prompts = [self.prompt_tokens(tokenizer, p) for p in problems]
        flat = [prompt for prompt in prompts for _ in range(group_size)]
        samples = sample(flat, max_new_tokens)
        texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        scored = self.rewards([p for p in problems for _ in range(group_size)], texts)
        episodes = [Episode(prompt_token_ids=prompt, completion_token_ids=list(s.token_ids),
                            completion_mask=[1] * len(s.token_ids),
                            behavior_logprobs=None if s.logprobs is None else list(s.logprobs),
                            reward=reward, reward_detail=detail, finish_reason=s.finish_reason)
                    for prompt, s, (reward, detail) in zip(flat, samples, scored)]
        return [episodes[i * group_size:(i + 1) * group_size] for i in range(len(problems))]

    def rollout_group(self, sample: Sampler, tokenizer: Any, problem: Problem, group_size: int,
                      max_new_tokens: int) -> list[Episode]:
        """The ``group_size`` episodes of one problem (GRPO's group)."""
        return self.rollout_groups(sample, tokenizer, [problem], group_size, max_new_tokens)[0]

    def score_episodes(self, tokenizer: Any, problems: Sequence[Problem], completions: Sequence[list[int]],
                       masks: Sequence[list[int]], max_new_tokens: int,
                       claimed: Sequence[float] | None = None) -> list[float]:
        """The learner's re-scoring of one file's episodes from their tokens (``max_new_tokens``: the run's
        rollout.max_new_tokens; ``claimed``: the file's rewards, for a task that must know whether a
        replay's disagreement could be honest). Single-turn: every completion token is the policy's (a 0
        in the mask would be environment text this task never writes) and the reward is ``score_replies``
        of the decoded replies. Raises ``ForgedEpisode``, ``Ungradable``, ``GradingBudgetExceeded``."""
        return self.score_replies(problems, single_turn_replies(tokenizer, completions, masks))

    def score_replies(self, problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
        """The learner's scores of single-turn replies (one rollout file's): ``rewards`` by default. A task
        whose grading can run out of time overrides it to raise ``Ungradable`` / ``GradingBudgetExceeded``."""
        return [reward for reward, _ in self.rewards(problems, texts)]

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, greedy: Sampler, sampled: Sampler | None, tokenizer: Any, *, k: int,
                 max_new_tokens: int) -> dict[str, Any]:
        """Metrics on the held-out set: ``pass_at_1`` from one greedy reply per problem and, with a
        ``sampled`` sampler and k > 1, ``pass_at_k`` from k sampled replies (the unbiased estimator of
        Chen et al. 2021 with n = k: solved by at least one of the k). ``accuracy`` = ``pass_at_1``;
        ``pass_at_1_ci95_low`` / ``_high``: its Wilson score interval over the held-out problems (numbers, so the
        run's summary and its before -> after lines carry them, as poker's ``ci95_low`` / ``ci95_high``)."""
        problems = self.eval_set()
        greedy_groups = self.rollout_groups(greedy, tokenizer, problems, 1, max_new_tokens)
        solved = [_correct(g[0]) for g in greedy_groups]
        low, high = wilson_95(sum(solved), len(problems))
        out: dict[str, Any] = {"n": len(problems), "pass_at_1": sum(solved) / len(problems),
                               "pass_at_1_ci95_low": low, "pass_at_1_ci95_high": high}
        out["accuracy"] = out["pass_at_1"]
        if sampled is not None and k > 1:
            groups = self.rollout_groups(sampled, tokenizer, problems, k, max_new_tokens)
            hits = [sum(_correct(e) for e in g) for g in groups]
            out["pass_at_k"] = sum(pass_at_k(k, c, k) for c in hits) / len(problems)
            out["k"] = k
        out["samples"] = [{"problem": p.id, "completion": tokenizer.decode(g[0].completion_token_ids,
                                                                           skip_special_tokens=True)}
                          for p, g in list(zip(problems, greedy_groups))[:3]]
        return out


def single_turn_replies(tokenizer: Any, completions: Sequence[list[int]], masks: Sequence[list[int]]) -> list[str]:
    """The decoded replies of single-turn episodes; raises ``ForgedEpisode`` where a mask marks environment text
    (a 0), which a single-turn task never writes."""
    check_single_turn_masks(masks)
    return [tokenizer.decode(c, skip_special_tokens=True) for c in completions]


def check_single_turn_masks(masks: Sequence[list[int]], rows: Sequence[int] | None = None) -> None:
    """``ForgedEpisode`` where a single-turn episode's completion_mask holds a 0 (``rows``: the rows' numbers in
    their file, for the message)."""
    for i, mask in enumerate(masks):
        if any(m != 1 for m in mask):
            row = i if rows is None else rows[i]
            raise ForgedEpisode(f"row {row}: completion_mask marks environment text, which a single-turn task never "
                                f"writes")


def _correct(episode: Episode) -> bool:
    detail = episode.reward_detail
    return bool(detail["correct"]) if "correct" in detail else episode.reward >= 1.0 - 1e-9


def wilson_95(successes: int, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a share ``successes`` / ``n`` (sound near 0 and 1, unlike the normal one)."""
    if n <= 0:
        return 0.0, 1.0
    p, z = successes / n, 1.96
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def prompt_token_ids(tokenizer: Any, problem: Problem) -> list[int]:
    """Token ids of the problem's chat, rendered with the model's chat template, ready for the reply."""
    text = tokenizer.apply_chat_template(list(problem.messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
