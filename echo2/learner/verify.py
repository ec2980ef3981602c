"""What the learner re-derives from the task for every rollout file, so an actor can neither train the
policy on text of its choosing nor claim rewards it did not earn.

- The prompt of every row must be exactly the tokens the task issues for its ``prompt_id`` (rendered
  with the learner's own tokenizer and chat template); a held-out or unknown id is refused.
- For a verifiable task, the learner re-scores every completion from its tokens and the file's
  reward must equal it.

Both are cheap for arithmetic and math (a chat template render per prompt, cached; a decode and a
regex per completion).
"""

from __future__ import annotations

import pyarrow as pa

from echo2.data.rollouts import InvalidRollouts
from echo2.tasks import Problem, Task, UnknownProblem, prompt_token_ids

REWARD_TOLERANCE = 1e-5


class TaskVerifier:
    def __init__(self, task: Task, tokenizer, cache_size: int = 4096):
        self.task = task
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._prompts: dict[str, tuple[Problem, list[int]]] = {}

    def _issued(self, prompt_id: str) -> tuple[Problem, list[int]]:
        if prompt_id not in self._prompts:
            if len(self._prompts) >= self.cache_size:
                self._prompts.pop(next(iter(self._prompts)))
            try:
                problem = self.task.problem(prompt_id)
            except UnknownProblem as exc:
                raise InvalidRollouts(f"prompt_id: {exc}") from None
            self._prompts[prompt_id] = (problem, prompt_token_ids(self.tokenizer, problem))
        return self._prompts[prompt_id]

    def check(self, table: pa.Table) -> None:
        """Raise ``InvalidRollouts`` if a prompt is not the task's or a reward is not what the task gives."""
        columns = table.select(["prompt_id", "prompt_token_ids", "completion_token_ids", "reward"]).to_pydict()
        for row, (prompt_id, prompt, completion, reward) in enumerate(zip(*columns.values())):
            problem, issued = self._issued(prompt_id)
            if prompt != issued:
                raise InvalidRollouts(f"row {row}: prompt tokens are not those the task issues for {prompt_id!r}")
            if self.task.verifiable:
                text = self.tokenizer.decode(completion, skip_special_tokens=True)
                expected, _ = self.task.reward(problem, text)
                if abs(expected - reward) > REWARD_TOLERANCE:
                    raise InvalidRollouts(f"row {row}: reward {reward:g} but the task scores the completion {expected:g}")
