"""A user's own code in the task plane: a ``Task`` class (``task.name: plugin``) or a reward function
(``task.name: reward_fn``), named by an entry (``echo2/config/plugin_tasks.py``).

An entry is ``module.path:attribute``, imported as it reads, or a bare NAME looked up in the entry points that
installed packages declare: group ``echo2.tasks`` for task classes, ``echo2.rewards`` for reward functions
(``[project.entry-points."echo2.tasks"] my-task = "my_pkg.tasks:MyTask"``). Whatever goes wrong (no such module,
no such attribute, not a ``Task``, a plugin config that does not validate) is one ``PluginError`` line naming the
entry: ``make_task`` raises it on an actor or the learner, and ``check_task_plugin`` raises it at launch, before
anything starts.

A plugin class may declare ``Config``, a pydantic model: the task section's keys other than ``name`` and
``entry`` are validated by it (a key it has no field for is refused, as a built-in task's is, unless the model
itself allows extra keys) and the instance is the class's one argument. Without ``Config`` the section has no
other keys and the class is called with none.
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from echo2.config import ConfigError, PluginTaskConfig, RewardFnTaskConfig
from echo2.tasks.base import Task

TASK_GROUP = "echo2.tasks"
"""Entry-point group of task classes: ``task: {name: plugin, entry: NAME}`` finds NAME here."""
REWARD_GROUP = "echo2.rewards"
"""Entry-point group of reward functions: ``task: {name: reward_fn, reward: NAME}`` finds NAME here."""


class PluginError(ConfigError):
    """A task or reward entry that cannot be loaded, or a plugin's own config that does not validate."""


def entry_target(entry: str, group: str) -> str:
    """``module.path:attribute`` of ``entry``: itself, or the value of the entry point NAME in ``group``."""
    if ":" in entry:
        return entry
    found = metadata.entry_points(group=group, name=entry)
    if not found:
        known = sorted({ep.name for ep in metadata.entry_points(group=group)})
        raise PluginError(f"no installed package declares {entry!r} in the entry-point group {group} (found: "
                          f"{', '.join(known) if known else 'none'}); install the package that does, or write "
                          f"module.path:attribute")
    values = sorted({ep.value for ep in found})
    if len(values) > 1:
        raise PluginError(f"entry point {entry!r} of group {group} is declared twice, as {' and '.join(values)}: "
                          f"write the one meant as module.path:attribute")
    if ":" not in values[0]:
        raise PluginError(f"entry point {entry!r} of group {group} is {values[0]!r}: it must name an attribute "
                          f"(module.path:attribute)")
    return values[0]


def load_entry(entry: str, group: str, what: str) -> tuple[Any, str]:
    """The object ``entry`` names and its ``module.path:attribute``; ``what`` names the setting in errors."""
    target = entry_target(entry, group)
    module_name, attribute = target.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise PluginError(f"{what} {target}: no module named {missing!r} in this interpreter: install the package "
                          f"that has it here (and on the actors: fleet.extra_packages)") from None
    except Exception as exc:  # the user's module failed while it was imported: its own error, in one line
        raise PluginError(f"{what} {target}: importing {module_name} failed: {type(exc).__name__}: "
                          f"{_first_line(exc)}") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what} {target}: module {module_name} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj, target


def plugin_class(config: PluginTaskConfig) -> type[Task]:
    """The ``Task`` subclass ``task.entry`` names."""
    cls, target = load_entry(config.entry, TASK_GROUP, "task.entry")
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        raise PluginError(f"task.entry {target} is {_kind(cls)}, not a subclass of echo2.tasks.Task")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise PluginError(f"task.entry {target} leaves Task's {missing} unimplemented")
    declared = getattr(cls, "Config", None)
    if declared is not None and not (inspect.isclass(declared) and issubclass(declared, BaseModel)):
        raise PluginError(f"task.entry {target}: its Config is {_kind(declared)}, not a pydantic model")
    return cls


def plugin_options(cls: type[Task], config: PluginTaskConfig) -> BaseModel | None:
    """The plugin's own config: the task section's other keys validated by ``cls.Config`` (None: it has none)."""
    options = config.plugin_options()
    declared: type[BaseModel] | None = getattr(cls, "Config", None)
    where = f"task (plugin {cls.__module__}:{cls.__qualname__})"
    if declared is None:
        if options:
            raise PluginError(f"invalid config {where}: {', '.join(f'task.{k}' for k in sorted(options))}: unknown "
                              f"key (the plugin declares no Config)")
        return None
    if declared.model_config.get("extra") != "allow":  # a typo must not fall back to a default silently
        fields = set(declared.model_fields) | {f.alias for f in declared.model_fields.values() if f.alias}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise PluginError(f"invalid config {where}: {', '.join(f'task.{k}' for k in unknown)}: unknown key")
    try:
        return declared.model_validate(options)
    except ValidationError as exc:
        raise PluginError(f"invalid config {where}: {_validation_lines(exc)}") from None


def make_plugin_task(config: PluginTaskConfig) -> Task:
    cls = plugin_class(config)
    options = plugin_options(cls, config)
    task = cls() if options is None else cls(options)
    if not getattr(task, "name", None):  # what the run's summary and logs call the task
        task.name = config.entry
    return task


def reward_function(config: RewardFnTaskConfig) -> Callable[[str, str, Any], Any]:
    """The function ``task.reward`` names, checked to take ``(prompt, completion, answer)``."""
    function, target = load_entry(config.reward, REWARD_GROUP, "task.reward")
    if not callable(function) or inspect.isclass(function):
        raise PluginError(f"task.reward {target} is {_kind(function)}, not a function")
    try:
        inspect.signature(function).bind("prompt", "completion", "answer")
    except TypeError as exc:
        raise PluginError(f"task.reward {target} cannot be called as score(prompt, completion, answer): "
                          f"{exc}") from None
    except ValueError:
        pass  # a builtin without a signature: called as it is
    return function


def check_task_plugin(config: Any) -> list[str]:
    """At launch: import what a ``plugin`` or ``reward_fn`` task names and validate the plugin's own config, so
    that a bad entry stops the run in one line before anything starts. Returns the modules the actors must import
    too (none for a built-in task)."""
    if isinstance(config, PluginTaskConfig):
        cls = plugin_class(config)
        plugin_options(cls, config)
        return [entry_target(config.entry, TASK_GROUP).split(":", 1)[0]]
    if isinstance(config, RewardFnTaskConfig):
        reward_function(config)
        return [entry_target(config.reward, REWARD_GROUP).split(":", 1)[0]]
    return []


def _validation_lines(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(["task", *(str(p) for p in err["loc"])])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if "input" in err and err["type"] not in ("missing", "extra_forbidden") and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def _kind(obj: Any) -> str:
    return f"the class {obj.__qualname__}" if inspect.isclass(obj) else f"a {type(obj).__name__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
