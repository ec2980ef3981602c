"""Reading math problems: a local JSONL or Parquet file, an fsspec URI of one, or a Hugging Face dataset.

``load_rows(source, ...)`` returns ``(question, gold)`` pairs in file order:
- ``path.jsonl`` / ``path.json`` (one JSON object per line) or ``path.parquet``, local or behind any
  fsspec URI (``s3://``, ``gs://``, ``memory://``, ``hf://datasets/ORG/NAME/FILE``);
- ``ORG/NAME``: a Hugging Face dataset id, or a local folder laid out as a dataset repo is (its ``README.md``
  configs, ``data/`` or ``SUBSET/SPLIT-*.parquet`` files): read by ``datasets.load_dataset`` as published, with
  the subset (``name``), split, revision and ``data_files`` given (``HubDataset``). The learner alone reads them
  (``task_data.py`` writes the rows into the run folder, where the actors read them: they never import
  ``datasets``).

Columns come from the config's mapping; a dotted name reaches into a struct (DAPO-17k's
``reward_model.ground_truth``), and a cell holding a chat (a list of ``{role, content}``) gives the
content of its last user message (DAPO-17k's ``prompt``). The gold answer is cut out of the answer
cell by ``gold_answer``.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from echo2.errors import Echo2InputError

_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class MathDataError(Echo2InputError):
    """A math dataset that cannot be read, or rows without the configured columns."""


def gold_answer(cell: str, answer_format: str) -> str:
    """The gold answer in an answer cell: ``gsm8k`` = after the last ``####`` (commas of thousands
    dropped), ``boxed`` = the last ``\\boxed{...}`` (braces matched), ``plain`` = the cell;
    ``auto`` = the first of these that applies."""
    cell = str(cell)
    if answer_format in ("gsm8k", "auto") and "####" in cell:
        return cell.rsplit("####", 1)[1].strip().replace(",", "")
    if answer_format in ("boxed", "auto") and "\\boxed" in cell:
        boxed = last_boxed(cell)
        if boxed is not None:
            return f"\\boxed{{{boxed}}}"
    if answer_format in ("gsm8k", "boxed"):
        raise MathDataError(f"answer {cell[:60]!r} has no "
                            f"{'####' if answer_format == 'gsm8k' else chr(92) + 'boxed{}'}")
    return cell.strip()


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def _cell(row: dict, column: str) -> Any:
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            raise MathDataError(f"a row has no column {column!r} (columns: {sorted(row)[:8]})")
        value = value[part]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        users = [m["content"] for m in value if m.get("role", "user") == "user"]
        value = users[-1] if users else value[-1]["content"]
    if value is None:
        raise MathDataError(f"a row has an empty {column!r}")
    return value


def _read_bytes(source: str, what: str = "math dataset") -> bytes:
    if "://" not in source:
        path = Path(source).expanduser()
        if not path.is_file():
            raise MathDataError(f"{what} {source} does not exist")
        return path.read_bytes()
    import fsspec

    try:
        with fsspec.open(source, "rb") as f:
            return f.read()
    except (OSError, ValueError, ImportError) as exc:
        raise MathDataError(f"cannot read {what} {source}: {type(exc).__name__}: {str(exc)[:200]}") from None


def _records(source: str, data: bytes, what: str = "math dataset") -> list[dict]:
    name = source.split("?", 1)[0].lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(io.BytesIO(data)).to_pylist()
    if name.endswith((".jsonl", ".json")):
        rows = []
        for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise MathDataError(f"{source} line {number} is not JSON") from None
        return rows
    raise MathDataError(f"{what} {source}: give a .jsonl, .json (JSON lines) or .parquet file, a dataset folder, "
                        "or ORG/NAME")


@dataclass(frozen=True)
class HubDataset:
    """What ``datasets.load_dataset`` is asked for: the id (or a local folder in a repo's layout), and the
    subset (its ``name``), split, revision (a branch, tag or commit; None = ``main``) and ``data_files``."""

    path: str
    split: str = "train"
    subset: str | None = None
    revision: str | None = None
    data_files: str | list[str] | None = None


def is_hub_dataset(source: str) -> bool:
    """Whether ``source`` is read by ``datasets.load_dataset``: a dataset id ``ORG/NAME`` that is not a local path,
    or a local folder (a dataset repo's layout). A file or a URI of one is read as it is."""
    if "://" in source:
        return False
    path = Path(source).expanduser()
    return path.is_dir() or (not path.exists() and _HF_ID.fullmatch(source) is not None)


def load_hub_dataset(ref: HubDataset, what: str = "math dataset"):
    """The split as ``datasets`` reads it (a ``datasets.Dataset``); one line naming the dataset on any failure."""
    try:
        import datasets
    except ImportError:
        raise MathDataError(f"{what} {ref.path} is read by the datasets package, which is the learner's (echo2's "
                            "learner extra): pip install datasets") from None
    try:
        return datasets.load_dataset(ref.path, name=ref.subset, split=ref.split, revision=ref.revision,
                                     data_files=ref.data_files)
    except Exception as exc:  # the hub's or the loader's own words: unknown id, subset, split, revision, gated
        message = " ".join(str(exc).split())[:400]
        where = ", ".join(f"{k} {v!r}" for k, v in (("subset", ref.subset), ("split", ref.split),
                                                     ("revision", ref.revision)) if v is not None)
        raise MathDataError(f"cannot load {what} {ref.path} ({where}): {type(exc).__name__}: {message}") from None


def dataset_records(source: str, *, hf_split: str = "train", hf_subset: str | None = None,
                    hf_revision: str | None = None, hf_data_files: str | list[str] | None = None,
                    what: str = "math dataset") -> Iterator[dict]:
    """Every row (an object) of ``source``, in order: a file, an fsspec URI of one, or a dataset of the Hugging Face
    hub or a local folder in its layout (the module docstring). ``what`` names the source in errors."""
    if is_hub_dataset(source):
        yield from load_hub_dataset(HubDataset(source, hf_split, hf_subset, hf_revision, hf_data_files), what)
        return
    for row in _records(source, _read_bytes(source, what), what):
        if not isinstance(row, dict):
            raise MathDataError(f"{source}: a row is not an object")
        yield row


def load_rows(source: str, *, question: str, answer: str, answer_format: str, hf_split: str = "train",
              hf_subset: str | None = None, hf_revision: str | None = None,
              hf_data_files: str | list[str] | None = None, limit: int | None = None) -> list[tuple[str, str]]:
    """``(question, gold)`` of every row of ``source`` (at most ``limit``), in order."""
    out: list[tuple[str, str]] = []
    for row in dataset_records(source, hf_split=hf_split, hf_subset=hf_subset, hf_revision=hf_revision,
                               hf_data_files=hf_data_files):
        out.append((str(_cell(row, question)).strip(), gold_answer(str(_cell(row, answer)), answer_format)))
        if limit is not None and len(out) >= limit:
            return out
    if not out:
        raise MathDataError(f"math dataset {source} has no rows")
    return out
