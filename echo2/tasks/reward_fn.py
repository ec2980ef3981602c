"""``reward_fn``: a dataset of prompts and the user's own ``score(prompt, completion, answer) -> float``.

The shortest way to train on one's own reward without writing a ``Task``: rows come from a JSONL / Parquet file,
an fsspec URI of one or a Hugging Face id (read as math's are, ``math_data.dataset_records``), the prompt and
answer from the configured columns; each reply is scored by the function ``task.reward`` names
(``plugins.reward_function``). Single-turn, so the learner scores every reply of every file again with the same
function (``Task.score_replies``) and bans an actor whose claimed reward differs: the function must give the same
number for the same arguments on every machine.

A call that raises, or returns something that is not a finite number within ``task.reward_range``, scores the
range's low end on both sides (the detail says why, and the first of each kind is logged): a reply crafted to
break the function gains nothing and stops nothing.

Held out: ``eval_size`` rows of ``eval_dataset`` (a seeded sample) when set, else ``eval_size`` rows of
``dataset`` set aside by a seeded shuffle; training never draws a held-out row, nor a row whose prompt is also
held out. Prompt ids: ``r<row>``; held-out problems get ids that ``problem()`` refuses.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from typing import Any

from echo2.config import RewardFnTaskConfig
from echo2.tasks.base import Problem, Task, UnknownProblem
from echo2.tasks.math_data import MathDataError, dataset_records
from echo2.tasks.plugins import reward_function

log = logging.getLogger("echo2.tasks")

_ROW_ID = re.compile(r"r(0|[1-9]\d{0,8})")
_HOLDOUT_SEED = "echo2-reward-fn-holdout"


class RewardFnTask(Task):
    name = "reward_fn"

    def __init__(self, config: RewardFnTaskConfig):
        self.config = config
        self.reward_range = tuple(config.reward_range)
        self.score = reward_function(config)
        self._logged: set[str] = set()
        self._rows = self._load(config.dataset, config.hf_split, config.limit)
        if config.eval_dataset is not None:
            held_rows = self._load(config.eval_dataset, config.eval_hf_split, None)
            chosen = sorted(random.Random(_HOLDOUT_SEED).sample(range(len(held_rows)),
                                                                min(config.eval_size, len(held_rows))))
            self._eval = [self._problem(f"eval-{i}", held_rows[i]) for i in chosen]
            held_out: set[int] = set()
        else:
            if config.eval_size >= len(self._rows):
                raise MathDataError(f"task.eval_size {config.eval_size} leaves no training prompts "
                                    f"({len(self._rows)} rows in {config.dataset})")
            order = list(range(len(self._rows)))
            random.Random(_HOLDOUT_SEED).shuffle(order)
            held_out = set(order[:config.eval_size])
            self._eval = [self._problem(f"eval-{i}", self._rows[i]) for i in sorted(held_out)]
        eval_prompts = {p.meta["prompt"] for p in self._eval}  # the user's words, before the instruction
        self._train_rows = [i for i in range(len(self._rows))
                            if i not in held_out and _last_user(self._rows[i][0]) not in eval_prompts]
        if not self._train_rows:
            raise MathDataError(f"every row of {config.dataset} is held out")
        self._train_set = frozenset(self._train_rows)

    # -- rows and problems ---------------------------------------------------------------------
    def _load(self, source: str, split: str, limit: int | None) -> list[tuple[tuple[dict[str, str], ...], Any]]:
        """(chat, answer) of every row of ``source``; the chat is the prompt as messages, before the system line
        and the instruction are added."""
        c = self.config.columns
        out = []
        for row in dataset_records(source, hf_split=split, hf_subset=self.config.hf_subset,
                                   hf_revision=self.config.hf_revision, hf_data_files=self.config.hf_data_files,
                                   what="reward_fn dataset"):
            chat = _chat(_cell(row, c.prompt), c.prompt)
            answer = None if c.answer is None else _cell(row, c.answer)
            out.append((chat, answer))
            if limit is not None and len(out) >= limit:
                break
        if not out:
            raise MathDataError(f"reward_fn dataset {source} has no rows")
        return out

    def _problem(self, prompt_id: str, row: tuple[tuple[dict[str, str], ...], Any]) -> Problem:
        chat, answer = row
        messages = list(chat)
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if self.config.instruction and users:  # the instruction follows the prompt's last user message
            last = users[-1]
            messages[last] = {"role": "user", "content": f"{messages[last]['content']}\n{self.config.instruction}"}
        if self.config.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system})
        return Problem(id=prompt_id, messages=tuple(messages), answer=answer,
                       meta={"prompt": _last_user(chat)})

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        return [self._problem(f"r{index}", self._rows[index])
                for index in (rng.choice(self._train_rows) for _ in range(n))]

    def problem(self, prompt_id: str) -> Problem:
        m = _ROW_ID.fullmatch(prompt_id)
        if m is None or int(m.group(1)) >= len(self._rows):
            raise UnknownProblem(f"prompt_id {prompt_id[:40]!r} is not a row 'r<n>' of {self.config.dataset}")
        index = int(m.group(1))
        if index not in self._train_set:
            raise UnknownProblem(f"prompt_id {prompt_id!r} is a held-out problem")
        return self._problem(prompt_id, self._rows[index])

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    # -- rewards -------------------------------------------------------------------------------
    def reward(self, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
        """The user's function on (prompt, reply, answer); the same on the actor and the learner."""
        low, high = self.reward_range
        try:
            value = self.score(problem.meta["prompt"], completion, problem.answer)
        except Exception as exc:  # a reply that breaks the function scores low, on every machine alike
            return self._failed(f"raised {type(exc).__name__}: {str(exc)[:200]}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return self._failed(f"returned {value!r:.80}, not a finite number")
        if not low <= value <= high:
            return self._failed(f"returned {value:g}, outside task.reward_range [{low:g}, {high:g}]")
        reward = float(value)
        return reward, {"correct": reward >= self.config.solved_at}

    def _failed(self, why: str) -> tuple[float, dict[str, Any]]:
        kind = why.split(":", 1)[0]
        if kind not in self._logged:  # once per kind: a broken function would otherwise log every reply
            self._logged.add(kind)
            log.warning("reward function %s %s; the reply scores task.reward_range's low end (logged once)",
                        self.config.reward, why)
        return float(self.reward_range[0]), {"correct": False, "error": why}


def _cell(row: dict, column: str) -> Any:
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            raise MathDataError(f"a row of the reward_fn dataset has no column {column!r} "
                                f"(columns: {sorted(row)[:8]})")
        value = value[part]
    return value


def _chat(cell: Any, column: str) -> tuple[dict[str, str], ...]:
    """A prompt cell as messages: text is one user message, a chat (a list of ``{role, content}``) is itself."""
    if isinstance(cell, str) and cell.strip():
        return ({"role": "user", "content": cell.strip()},)
    if isinstance(cell, list) and cell and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                               for m in cell):
        return tuple({"role": str(m.get("role", "user")), "content": m["content"]} for m in cell)
    raise MathDataError(f"a row's {column!r} is neither text nor a chat (a list of {{role, content}}): "
                        f"{json.dumps(cell, default=str)[:80]}")


def _last_user(chat: tuple[dict[str, str], ...]) -> str:
    users = [m["content"] for m in chat if m["role"] == "user"]
    return users[-1] if users else chat[-1]["content"]

