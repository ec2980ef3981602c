"""What the learner re-derives from the task for every rollout file, so an actor can neither train the
policy on text of its choosing nor claim rewards it did not earn.

- The prompt of every row must be exactly the tokens the task issues for its ``prompt_id`` (rendered
  with the learner's own tokenizer and chat template); a held-out or unknown id is refused.
- For a verifiable task, the learner re-scores every episode from its tokens through the task
  (``Task.score_episodes``) and the file's reward must equal it. Single-turn tasks decode the reply
  and score it (a completion_mask with environment tokens is refused: they write none). A multi-turn
  task replays the episode: poker re-deals the hand from the prompt id, replays it from the policy's
  tokens with its deterministic opponents, and refuses any environment text it would not write.

Each refusal here is a ``Dishonest`` file (an ``InvalidRollouts``): the content is well formed but its
claims are false, so its actor is banned, not only the file (``behavior_audit.py``).

Cost: a chat template render per prompt (cached), then per row a decode and a regex (arithmetic),
one math-verify call in the grader process (math, about 2 ms), or a replayed hand (poker, about a
millisecond plus a cached hand-strength estimate per street against the equity player).
"""

from __future__ import annotations

import pyarrow as pa

from echo2.learner.behavior_audit import Dishonest
from echo2.tasks import ForgedEpisode, Problem, Task, UnknownProblem

REWARD_TOLERANCE = 1e-5


class TaskVerifier:
    def __init__(self, task: Task, tokenizer, *, max_new_tokens: int, cache_size: int = 4096):
        """``max_new_tokens``: the run's rollout.max_new_tokens (a multi-turn episode's token budget)."""
        self.task = task
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.cache_size = cache_size
        self._prompts: dict[str, tuple[Problem, list[int]]] = {}

    def _issued(self, prompt_id: str) -> tuple[Problem, list[int]]:
        if prompt_id not in self._prompts:
            if len(self._prompts) >= self.cache_size:
                self._prompts.pop(next(iter(self._prompts)))
            try:
                problem = self.task.problem(prompt_id)
            except UnknownProblem as exc:
                raise Dishonest(f"prompt_id: {exc}") from None
            self._prompts[prompt_id] = (problem, self.task.prompt_tokens(self.tokenizer, problem))
        return self._prompts[prompt_id]

    def check(self, table: pa.Table) -> None:
        """Raise ``Dishonest`` if a prompt is not the task's, an episode is not one the task plays,
        or a reward is not what the task gives."""
        columns = table.select(["prompt_id", "prompt_token_ids", "completion_token_ids", "completion_mask",
                                "reward"]).to_pydict()
        problems = []
        for row, (prompt_id, prompt) in enumerate(zip(columns["prompt_id"], columns["prompt_token_ids"])):
            problem, issued = self._issued(prompt_id)
            if prompt != issued:
                raise Dishonest(f"row {row}: prompt tokens are not those the task issues for {prompt_id!r}")
            problems.append(problem)
        if not self.task.verifiable:
            return
        try:
            expected = self.task.score_episodes(self.tokenizer, problems, columns["completion_token_ids"],
                                                columns["completion_mask"], self.max_new_tokens)
        except ForgedEpisode as exc:
            raise Dishonest(str(exc)) from None
        for row, (claimed, score) in enumerate(zip(columns["reward"], expected)):
            if abs(score - claimed) > REWARD_TOLERANCE:
                raise Dishonest(f"row {row}: reward {claimed:g} but the task scores the completion {score:g}")
