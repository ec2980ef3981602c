"""A plugin task: ``task: {name: plugin, entry: say-word, word: yes, eval_size: 4}``.

The policy is asked to say a word (``Config.word``) n times; reward 1 when the reply holds it at least n times.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from echo2.tasks import Problem, Task, UnknownProblem


class SayWordTask(Task):
    name = "say-word"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        word: str = "yes"
        """The word to say."""
        eval_size: int = Field(4, ge=1, le=9)
        """Held-out counts (1..eval_size); training asks for more."""

    def __init__(self, config: Config):
        self.config = config

    def _problem(self, n: int) -> Problem:
        text = f"Say the word {self.config.word} {n} times."
        return Problem(id=f"say{n}", messages=({"role": "user", "content": text},), answer=n)

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        return [self._problem(rng.randint(self.config.eval_size + 1, 20)) for _ in range(n)]

    def problem(self, prompt_id: str) -> Problem:
        count = prompt_id.removeprefix("say")
        if not count.isdigit() or str(int(count)) != count or not self.config.eval_size < int(count) <= 20:
            raise UnknownProblem(f"prompt_id {prompt_id[:40]!r} is not a training problem")
        return self._problem(int(count))

    def eval_set(self) -> list[Problem]:
        return [self._problem(n) for n in range(1, self.config.eval_size + 1)]

    def reward(self, problem: Problem, completion: str) -> tuple[float, dict]:
        said = completion.lower().split().count(self.config.word.lower())
        return (1.0 if said >= problem.answer else 0.0), {"said": said}
