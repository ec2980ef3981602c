"""What the learner re-derives from the task for every rollout file, so an actor can neither train the
policy on text of its choosing nor claim rewards it did not earn.

- The prompt of every row must be exactly the tokens the task issues for its ``prompt_id`` (rendered
  with the learner's own tokenizer and chat template); a held-out or unknown id is refused.
- For a verifiable task, the learner re-scores every episode from its tokens through the task
  (``Task.score_episodes``) and the file's reward must equal it. Single-turn tasks decode the reply
  and score it (a completion_mask with environment tokens is refused: they write none). A multi-turn
  task replays the episode: poker re-deals the hand from the prompt id, replays it from the policy's
  tokens with its deterministic opponents, and refuses any environment text it would not write.
- A task whose scoring is costly re-scores a sample (``Task.rescore_fraction`` below 1: code, which runs
  programs): every episode of each actor's first file, and of every later file a share of its rows drawn
  with the learner's own unseeded RNG (``random.SystemRandom``), so an actor cannot tell which rows are
  checked; at most ``Task.rescore_max_rows`` (what the task's per-file budget holds). A lie in any row is
  found with the probability that row is drawn, and one found lie bans the actor for good, so lying in
  many files is found almost surely. The masks of the rows not drawn are still checked (a single-turn task
  writes no environment text).

Lies and honest disagreements. A refusal is a ``Dishonest`` file (an ``InvalidRollouts``) when no
honest actor could have written it: its content is well formed but its claims are false, so its actor
is banned, not only the file (``spot_check.py``). Two things look like a false claim but can come
from an honest actor, because actor and learner run the same code on different machines:

- a grading timeout (math): math-verify runs under ``task.grade_timeout_s`` on both sides, so a reply
  the actor graded just under the limit can time out on a busy learner, or the reverse; likewise a program
  (code) that finishes just under ``task.limits.wall_s`` on one machine and not on the other, and a program
  whose output is not the same from run to run (the learner runs a disagreeing program twice);
- a near tie (poker ``checkpoint`` opponent): the frozen policy decodes greedily, and where its two
  best logits are within ``tie_margin`` another machine's kernels may pick the other token, so the
  learner's replay parts from the actor's hand.

Each of these makes the file ungradable (the task raises ``Ungradable``: a reply the learner's grader
could not finish, a replay that parts from the file after a near tie; or the learner finds a prompt
that differs from a problem the task marks ``may_differ``, or a reward that differs from its own on a
row the actor marked ``ungraded``): the file is quarantined as ``InvalidRollouts``, never used, and
its actor keeps its standing. One such reply cannot be told from an honest accident, so it is
never a ban.

What does ban, besides a false claim, is cost no honest file has: grading one file is held to a budget
(math: ``task.grade_file_budget_s`` seconds and ``task.grade_file_max_timeouts`` replies that may time
out). The two rules agree because the budget is set above what honest accidents cost: an honest file
has at most a few replies that time out, each costs ``grade_timeout_s``, and the config requires
``grade_file_budget_s >= (grade_file_max_timeouts + 1) x grade_timeout_s``; a file of hanging replies
runs past it after ``grade_file_max_timeouts + 1`` of them (or a file of slow ones after
``grade_file_budget_s``), is not graded further, and raises ``OverGradingBudget`` (a ``Dishonest``): the
learner pays at most one budget per file, and the actor is banned, so its later files are quarantined
unread. Claiming the score a timeout gives (0) no longer passes a hanging reply: the file is set aside.

Cost: a chat template render per prompt (cached), then per row a decode and a regex (arithmetic),
one math-verify call in the grader process (math, about 2 ms), or a replayed hand (poker, about a
millisecond plus a cached hand-strength estimate per street against the equity player).
"""

from __future__ import annotations

import json
import math
import random

import pyarrow as pa

from echo2.data.rollouts import InvalidRollouts
from echo2.learner.spot_check import Dishonest
from echo2.tasks import ForgedEpisode, Problem, Task, UnknownProblem
from echo2.tasks.base import (
    REWARD_TOLERANCE,
    UNGRADED,
    GradingBudgetExceeded,
    Ungradable,
    check_single_turn_masks,
)


class OverGradingBudget(Dishonest):
    """Scoring the file cost more than the task's per-file budget: no honest actor writes such a file, so
    its actor is banned like one whose claims are false."""


class TaskVerifier:
    def __init__(self, task: Task, tokenizer, *, max_new_tokens: int, cache_size: int = 4096):
        """``max_new_tokens``: the run's rollout.max_new_tokens (a multi-turn episode's token budget)."""
        self.task = task
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.cache_size = cache_size
        self._prompts: dict[str, tuple[Problem, list[int]]] = {}
        self._rescored_actors: set[str] = set()
        """Actors a file of which was re-scored already (their first file is re-scored whole)."""
        self._rng = random.SystemRandom()  # never the run's seeded RNG: an actor must not predict the sample
        self.rows_seen = 0
        self.rows_rescored = 0

    def rows_to_rescore(self, actor_id: str, rows: int) -> list[int]:
        """The rows of one file of ``actor_id`` that the task re-scores (the module docstring)."""
        fraction, cap = self.task.rescore_fraction, self.task.rescore_max_rows
        first = actor_id not in self._rescored_actors
        self._rescored_actors.add(actor_id)
        take = rows if first or fraction >= 1 else math.ceil(fraction * rows)
        if cap is not None:
            take = min(take, cap)
        if take >= rows:
            return list(range(rows))
        return sorted(self._rng.sample(range(rows), max(take, 1)))

    def _issued(self, prompt_id: str) -> tuple[Problem, list[int]]:
        if prompt_id not in self._prompts:
            if len(self._prompts) >= self.cache_size:
                self._prompts.pop(next(iter(self._prompts)))
            try:
                problem = self.task.problem(prompt_id)
            except UnknownProblem as exc:
                raise Dishonest(f"prompt_id: {exc}") from None
            except Ungradable as exc:
                raise InvalidRollouts(f"ungradable, set aside (not held against the actor): {exc}") from None
            self._prompts[prompt_id] = (problem, self.task.prompt_tokens(self.tokenizer, problem))
        return self._prompts[prompt_id]

    def verify_claims(self, table: pa.Table) -> None:
        """Raise ``Dishonest`` if a prompt is not the task's, an episode is not one the task plays, a reward
        is not what the task gives, or the file is over its grading budget (``OverGradingBudget``); raise
        a plain ``InvalidRollouts`` if the task cannot score the file reliably (``Ungradable``)."""
        columns = table.select(["actor_id", "prompt_id", "prompt_token_ids", "completion_token_ids",
                                "completion_mask", "reward", "reward_detail"]).to_pydict()
        problems = []
        for row, (prompt_id, prompt) in enumerate(zip(columns["prompt_id"], columns["prompt_token_ids"])):
            problem, issued = self._issued(prompt_id)
            if prompt != issued:
                if problem.may_differ:
                    raise InvalidRollouts(f"ungradable, set aside (not held against the actor): row {row}: prompt "
                                          f"tokens are not those the task issues here for {prompt_id!r}, but "
                                          f"{problem.may_differ}")
                raise Dishonest(f"row {row}: prompt tokens are not those the task issues for {prompt_id!r}")
            problems.append(problem)
        if not self.task.verifiable:
            return
        rows = self.rows_to_rescore(columns["actor_id"][0] if columns["actor_id"] else "", len(problems))
        self.rows_seen += len(problems)
        self.rows_rescored += len(rows)
        try:
            if len(rows) < len(problems) and self.task.max_env_tokens == 0:
                drawn = set(rows)
                others = [r for r in range(len(problems)) if r not in drawn]
                check_single_turn_masks([columns["completion_mask"][r] for r in others], others)
            expected = self.task.score_episodes(
                self.tokenizer, [problems[r] for r in rows], [columns["completion_token_ids"][r] for r in rows],
                [columns["completion_mask"][r] for r in rows], self.max_new_tokens,
                claimed=[columns["reward"][r] for r in rows])
        except ForgedEpisode as exc:
            raise Dishonest(str(exc)) from None
        except GradingBudgetExceeded as exc:
            raise OverGradingBudget(str(exc)) from None
        except Ungradable as exc:
            raise InvalidRollouts(f"ungradable, set aside (not held against the actor): {exc}") from None
        set_aside = None  # a lie anywhere in the file bans, even beside a row the actor could not grade
        for row, score in zip(rows, expected):
            claimed = columns["reward"][row]
            if abs(score - claimed) > REWARD_TOLERANCE:
                ungraded = _ungraded_on_the_actor(columns["reward_detail"][row])
                if ungraded is None:
                    raise Dishonest(f"row {row}: reward {claimed:g} but the task scores the completion {score:g}")
                set_aside = set_aside or (f"ungradable, set aside (not held against the actor): row {row}: the actor "
                                          f"could not finish grading it ({ungraded[:60]}) and the task scores it "
                                          f"{score:g}, not {claimed:g}")
        if set_aside is not None:
            raise InvalidRollouts(set_aside)


def _ungraded_on_the_actor(detail: str) -> str | None:
    """The reason a row's ``reward_detail`` gives for the actor not finishing its score (``UNGRADED``), or None."""
    try:
        reason = json.loads(detail).get(UNGRADED)
    except (ValueError, AttributeError):  # validated JSON already; not an object: no such mark
        return None
    return None if reason is None else str(reason)
