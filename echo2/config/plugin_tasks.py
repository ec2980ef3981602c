"""Task sections for a user's own code (``task.name``: plugin, reward_fn; ``echo2/tasks/plugins.py``).

Both name Python code by an *entry*: ``module.path:attribute``, or a bare NAME that is looked up among the
installed packages' entry points (``[project.entry-points."echo2.tasks"]`` for a task class,
``"echo2.rewards"`` for a reward function). The code itself is imported by the task plane (``make_task`` and the
launch check), never here: a config loads without importing anything of the user's.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from echo2.config._base import _Section

_MODULE_ATTRIBUTE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_ENTRY_POINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_entry(value: str) -> str:
    """An entry as the module docstring spells it: ``module.path:attribute`` or an entry point's NAME."""
    value = value.strip()
    if ":" in value:
        if not _MODULE_ATTRIBUTE.fullmatch(value):
            raise ValueError(f"{value!r} is not module.path:attribute")
    elif not _ENTRY_POINT_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is neither module.path:attribute nor an entry point's name")
    return value


class PluginTaskConfig(_Section):
    # The task section's other keys are the plugin's own fields: kept here as they are written, validated by the
    # plugin's ``Config`` class when the plugin is loaded (``echo2/tasks/plugins.py``), unknown ones refused there.
    model_config = ConfigDict(extra="allow")

    name: Literal["plugin"]
    """``plugin``: a ``Task`` subclass of the user's own package (``echo2/tasks/plugins.py``; docs/tasks.md, "Your
    own task"). Every actor and the learner import it: install it there (``fleet.extra_packages``)."""
    entry: str
    """The task class: ``my_pkg.tasks:MyTask``, or the NAME a package declares under
    ``[project.entry-points."echo2.tasks"]``. Its ``Config`` class attribute (a pydantic model), when it has one,
    validates this section's other keys and is passed to the class; without one the section has no other keys."""

    @field_validator("entry")
    @classmethod
    def _entry_is_spelt_right(cls, value: str) -> str:
        return check_entry(value)

    def plugin_options(self) -> dict[str, Any]:
        """The section's keys other than ``name`` and ``entry``: the plugin's own config, as written."""
        return dict(self.model_extra or {})


class RewardFnColumnsConfig(_Section):
    prompt: str = "prompt"
    """Column holding the prompt: text, or a chat (a list of ``{role, content}``, used as the conversation; the
    reward function gets its last user message). A dotted name reaches into a struct (``extra.question``)."""
    answer: str | None = "answer"
    """Column holding what the reward function compares against (any JSON value: text, a number, a list...),
    passed to it as it is; None = no reference (the function gets None)."""


class RewardFnTaskConfig(_Section):
    name: Literal["reward_fn"]
    """``reward_fn`` (``echo2/tasks/reward_fn.py``): single-turn prompts from a dataset, each reply scored by
    the user's ``score(prompt, completion, answer) -> float``; the learner scores every reply again."""
    reward: str
    """The reward function: ``my_pkg.rewards:score``, or the NAME a package declares under
    ``[project.entry-points."echo2.rewards"]``. Called as ``score(prompt, completion, answer)`` with the prompt
    text, the reply's text and the answer cell; it must return a number in ``reward_range`` and give the same
    number for the same arguments on every machine (the learner's own call is what an actor's claim is checked
    against). A call that raises, or returns something else, scores ``reward_range``'s low end (logged)."""
    dataset: str
    """Where the prompts come from: a local ``.jsonl`` / ``.parquet`` file, an fsspec URI of one (``s3://``,
    ``gs://``, ``memory://``, ``hf://datasets/ORG/NAME/FILE``), or a Hugging Face dataset (an id ``ORG/NAME`` or a
    local folder in a repo's layout; ``hf_split``, ``hf_subset``, ``hf_revision``, ``hf_data_files``). A file or URI
    is read by the actors too: give one every actor can open; a Hugging Face dataset is read by the learner alone,
    which writes its rows into the run folder for the actors."""
    columns: RewardFnColumnsConfig = Field(default_factory=RewardFnColumnsConfig)
    """Which columns hold the prompt and the answer."""
    hf_split: str = "train"
    """With a Hugging Face dataset: the split of ``dataset`` that is read."""
    hf_subset: str | None = None
    """With a Hugging Face dataset: the subset (``load_dataset``'s ``name``)."""
    hf_revision: str | None = None
    """With a Hugging Face dataset: the branch, tag or commit (None = ``main``), for ``dataset`` and ``eval_dataset``
    alike."""
    hf_data_files: str | list[str] | dict[str, str | list[str]] | None = None
    """With a Hugging Face dataset: ``load_dataset``'s ``data_files`` (patterns inside the repo, or a mapping of split
    names to them) where the repo's own configs do not say which files make a split; None = the repo's."""
    limit: int | None = Field(None, ge=1)
    """Read at most this many rows of ``dataset`` (None = all)."""
    eval_dataset: str | None = None
    """Held-out prompts from another file, URI or Hugging Face id (``eval_hf_split``); None = ``eval_size`` rows
    of ``dataset`` held out by a seeded shuffle. Training never draws a row whose prompt is held out."""
    eval_hf_split: str = "test"
    """With ``eval_dataset`` a Hugging Face dataset: the split read for evaluation."""
    eval_size: int = Field(50, ge=1)
    """Held-out prompts for evaluation (a seeded sample of ``eval_dataset`` when set)."""
    system: str | None = None
    """A system message put before every prompt (None = none)."""
    instruction: str = ""
    """Appended to every prompt's last user message (a new line apart): how to answer. Empty = the prompt alone."""
    reward_range: tuple[float, float] = (0.0, 1.0)
    """Every reward lies in [low, high]: the learner refuses rollout files outside it, and a call of the reward
    function that fails scores ``low``."""
    solved_at: float = 1.0
    """Evaluation's ``pass_at_1`` counts a reply as solved when its reward is at least this."""

    @field_validator("reward")
    @classmethod
    def _reward_is_spelt_right(cls, value: str) -> str:
        return check_entry(value)

    @field_validator("reward_range")
    @classmethod
    def _range_is_an_interval(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not low < high:
            raise ValueError(f"[{low:g}, {high:g}] must have low < high")
        return value
