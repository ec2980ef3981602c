"""From YAML files, ``ECHO2_SET__`` variables and ``--set`` overrides to one raw config mapping, remembering where
each key was written, so that a bad key is reported at its file:line:column (or its variable, or ``--set``).

A file may name other files it builds on (``base: quickstart.yaml`` or a list, relative to the file): the bases
are merged in order, then the file itself over them. Mappings merge key by key; anything else (a list, a scalar)
is replaced whole; a section whose kind changes (``task.name``, ``fleet.backend``, ``rollout.engine.kind``...)
is replaced whole too, since the other kind's fields would be unknown keys.

Nothing here imports the config models: the model tree (``echo2.config.Config``) is passed in, which keeps this
module below ``echo2/config/__init__.py``.
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ValidationError

from echo2.config._base import ConfigError

ENV_PREFIX = "ECHO2_SET__"
"""``ECHO2_SET__TRAIN__MAX_STEPS=4`` is ``--set train.max_steps=4``. echo2 already reads other ``ECHO2_*``
variables (``ECHO2_RUN_ID``, ``ECHO2_CONFIG``, ``ECHO2_SETTINGS``, ``ECHO2_STORE_OPTIONS``...), some of which
look like a section and a field; only this prefix, which none of them starts with, means a config field."""

BASE_KEY = "base"
"""The top-level key naming the files a config file builds on."""

Positions = dict[tuple, str]
"""A key path (``("train", "lr")``) -> where it was written: ``file:line:column``, ``--set`` or ``$VARIABLE``."""


def _yaml_error(exc: yaml.YAMLError, source: str) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    context_mark = getattr(exc, "context_mark", None)
    if context and context_mark is not None and mark is not None and context_mark.line != mark.line:
        problem = f"{problem} ({context} at line {context_mark.line + 1})"
    elif context:
        problem = f"{problem} ({context})"
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    return ConfigError(f"{where}: {problem}")


def _walk_nodes(node: yaml.Node, path: tuple, source: str, positions: Positions) -> None:
    """Record where every key (and list item) of ``node`` is written; refuse a key written twice (PyYAML would
    keep the last one silently)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            mark = key_node.start_mark
            if key is None or key == "<<":
                continue  # a complex key or a merge key: no path of its own
            if key in seen:
                raise ConfigError(f"{source}:{mark.line + 1}:{mark.column + 1}: duplicate key "
                                  f"{'.'.join(map(str, (*path, key)))} (first at line {seen[key]})")
            seen[key] = mark.line + 1
            positions[(*path, key)] = f"{source}:{mark.line + 1}:{mark.column + 1}"
            _walk_nodes(value_node, (*path, key), source, positions)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            mark = item.start_mark
            positions[(*path, index)] = f"{source}:{mark.line + 1}:{mark.column + 1}"
            _walk_nodes(item, (*path, index), source, positions)


def read_yaml(path: Path, source: str) -> tuple[dict, Positions]:
    """One YAML file -> (its mapping, where each key is written). Problems: one ``ConfigError`` line that starts
    with ``file:line:column``."""
    if not path.is_file():
        raise ConfigError(f"config file {source} does not exist")
    loader = yaml.SafeLoader(path.read_text())
    try:
        node = loader.get_single_node()
        positions: Positions = {}
        if node is not None:
            _walk_nodes(node, (), source, positions)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source) from None
    finally:
        loader.dispose()
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {source} must hold a mapping at the top level")
    return data or {}, positions


def compose(path: Path, root: type[BaseModel], source: str | None = None,
            _chain: tuple[Path, ...] = ()) -> tuple[dict, Positions]:
    """A config file with its ``base:`` files merged under it (see the module docstring)."""
    source = source or str(path)
    resolved = path.resolve()
    if resolved in _chain:
        names = [*(p.name for p in _chain[_chain.index(resolved):]), path.name]
        raise ConfigError(f"config file {source}: base files form a cycle: {' -> '.join(names)}")
    data, positions = read_yaml(path, source)
    bases = data.pop(BASE_KEY, None)
    base_at = positions.pop((BASE_KEY,), source)
    positions = {k: v for k, v in positions.items() if k[:1] != (BASE_KEY,)}
    if bases is None:
        return data, positions
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"{base_at}: base must be a file name or a list of file names (relative to {source})")
    merged: dict = {}
    merged_at: Positions = {}
    for name in bases:
        base_path = path.parent / name
        if not base_path.is_file():
            raise ConfigError(f"{base_at}: base {name}: {base_path} does not exist")
        base_data, base_positions = compose(base_path, root, str(base_path), (*_chain, resolved))
        merged, merged_at = merge(merged, merged_at, base_data, base_positions, root)
    return merge(merged, merged_at, data, positions, root)


def merge(base: dict, base_at: Positions, over: dict, over_at: Positions,
          root: type[BaseModel]) -> tuple[dict, Positions]:
    """``over`` merged over ``base`` (neither is changed), and where each key of the result was written."""
    replaced: list[tuple] = []
    out = _merge(base, over, root, (), replaced)
    positions = dict(base_at)
    for prefix in replaced:  # what the base wrote under a replaced value is gone
        for key in [k for k in positions if k[:len(prefix)] == prefix]:
            del positions[key]
    positions.update(over_at)
    return out, positions


def _merge(base: dict, over: dict, root: type[BaseModel], path: tuple, replaced: list[tuple]) -> dict:
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict) and not _kind_changes(root, (*path, key), old, value):
            out[key] = _merge(old, value, root, (*path, key), replaced)
        else:
            out[key] = value
            replaced.append((*path, key))
    return out


def _kind_changes(root: type[BaseModel], path: tuple, old: dict, new: dict) -> bool:
    """Whether ``new`` names another member of a discriminated union than ``old`` (``task.name: math`` over an
    arithmetic task): then the section is replaced whole rather than merged."""
    tag = union_tag(root, path)
    if tag is None or tag not in new:
        return False
    return new[tag] != old.get(tag, _default_tag(root, path, tag))


def _default_tag(root: type[BaseModel], path: tuple, tag: str) -> Any:
    parent, _ = walk(root, path[:-1])
    for model in parent:
        field = model.model_fields.get(path[-1])
        if field is not None:
            default = field.get_default(call_default_factory=True)
            return getattr(default, tag, None) if not isinstance(default, dict) else default.get(tag)
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through ``Optional``, unions, ``Annotated``, lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        for model in _models_in(arg):
            if model not in found:
                found.append(model)
    return found


def _tags(model: type[BaseModel]) -> dict[str, Any]:
    """A union member's literal fields: ``{"name": ("math",)}``."""
    return {name: typing.get_args(field.annotation) for name, field in model.model_fields.items()
            if typing.get_origin(field.annotation) is Literal}


def walk(root: type[BaseModel], loc: tuple) -> tuple[list[type[BaseModel]], list]:
    """The models a key path (as pydantic reports it, union tags included) leads to, and the path as written in
    the file (without the tags)."""
    models: list[type[BaseModel]] = [root]
    written: list = []
    for part in loc:
        if isinstance(part, int):
            written.append(part)
            continue
        tag = _discriminator(models)
        if tag is not None:
            chosen = [m for m in models if _tags(m)[tag] == (part,)]
            if chosen:
                models = chosen  # the union's tag in pydantic's path: not written in the file
                continue
        field = next((m.model_fields[part] for m in models if part in m.model_fields), None)
        written.append(part)
        if field is None:
            return [], written
        models = _models_in(field.annotation)
    return models, written


def union_tag(root: type[BaseModel], path: tuple) -> str | None:
    """The discriminator field of the union at ``path`` (``task`` -> ``name``), None where it is no union."""
    models, _ = walk(root, path)
    return _discriminator(models)


def _discriminator(models: list[type[BaseModel]]) -> str | None:
    """The literal field that tells a union's members apart: one value each, a different one in every member
    (not a field such as ``dtype`` whose literal lists the same choices in each)."""
    if len(models) < 2:
        return None
    tags = [_tags(m) for m in models]
    for name in sorted(set.intersection(*(set(t) for t in tags))):
        values = [t[name] for t in tags]
        if all(len(v) == 1 for v in values) and len({v[0] for v in values}) == len(models):
            return name
    return None


def did_you_mean(root: type[BaseModel], loc: tuple) -> str | None:
    """The written path of the closest field name to an unknown key, or None."""
    models, written_parent = walk(root, loc[:-1])
    names = sorted({name for model in models for name in model.model_fields})
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return ".".join(map(str, [*written_parent, close[0]])) if close else None


def where(positions: Positions, root: type[BaseModel], loc: tuple, source: str) -> str:
    """Where the key at pydantic's ``loc`` was written: its own position, else its nearest written section's."""
    _, written = walk(root, loc)
    best = positions.get((), source)
    for end in range(1, len(written) + 1):
        best = positions.get(tuple(written[:end]), best)
    return best


def set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def parse_value(raw: str) -> Any:
    """A value as written after ``=``: a YAML scalar, list or mapping; text that is not YAML stays text."""
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        return raw


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> (``a.b``, value parsed as a YAML scalar/list/mapping)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    return key, parse_value(raw)


def environment_overrides(environ: Mapping[str, str] | None = None) -> list[tuple[str, Any, str]]:
    """``ECHO2_SET__SECTION__FIELD=value`` variables -> (``section.field``, value, ``$VARIABLE``), sorted by name.
    ``__`` separates the parts of the path (field names have single underscores); names are case-insensitive."""
    environ = os.environ if environ is None else environ
    found = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX):].lower().split("__")
        if not all(parts):
            raise ConfigError(f"${name}: write {ENV_PREFIX}SECTION__FIELD (e.g. {ENV_PREFIX}TRAIN__MAX_STEPS=4)")
        found.append((".".join(parts), parse_value(environ[name]), f"${name}"))
    return found


def apply_located(data: dict, positions: Positions, key: str, value: Any, origin: str) -> None:
    """Set ``key`` (dotted) to ``value`` in ``data``, remembering ``origin`` as where it was written."""
    set_path(data, key, value)
    path = tuple(key.split("."))
    for below in [k for k in positions if k[:len(path)] == path]:  # what a file wrote under it is gone
        del positions[below]
    positions[path] = origin


def format_validation_error(exc: ValidationError, source: str, root: type[BaseModel],
                            positions: Positions | None = None) -> str:
    """One line: each problem as ``where: key.path: what`` (``where`` a file:line:column, ``--set`` or a
    variable when known, else ``source``), with a close field name for an unknown key."""
    parts = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        shown = ".".join(str(p) for p in loc) or "(root)"
        msg = err["msg"]
        backend = None
        if loc[:1] == ("fleet",) and len(loc) > 2 and loc[1] in ("local", "skypilot"):
            # pydantic puts the union member's tag in the path; fleet's tags read like the fleet.local: and
            # fleet.skypilot: subsections of old, so name the field where it is written, and the backend beside
            backend = loc[1]
            shown = ".".join(["fleet", *(str(p) for p in loc[2:])])
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            suggestion = did_you_mean(root, loc)
            if suggestion:
                msg = f"unknown key (did you mean {suggestion}?)"
        elif "input" in err and err["type"] != "missing" and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        if backend:
            msg = f"{msg} (fleet.backend: {backend})"
        at = where(positions or {}, root, loc, source) if loc else source
        parts.append(f"{at}: {shown}: {msg}")
    return "invalid config " + "; ".join(parts)
