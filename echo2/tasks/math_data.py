"""Reading math problems: a local JSONL or Parquet file, an fsspec URI of one, or a Hugging Face dataset.

``load_rows(source, ...)`` returns ``(question, gold)`` pairs in file order:
- ``path.jsonl`` / ``path.json`` (one JSON object per line) or ``path.parquet``, local or behind any
  fsspec URI (``s3://``, ``gs://``, ``memory://``, ``hf://datasets/ORG/NAME/FILE``);
- ``ORG/NAME``: a Hugging Face dataset id, read as its Parquet files
  ``hf://datasets/ORG/NAME/[SUBSET/]SPLIT-*.parquet`` (or ``.../data/SPLIT-*``) when a hub is reachable.

Columns come from the config's mapping; a dotted name reaches into a struct (DAPO-17k's
``reward_model.ground_truth``), and a cell holding a chat (a list of ``{role, content}``) gives the
content of its last user message (DAPO-17k's ``prompt``). The gold answer is cut out of the answer
cell by ``gold_answer``.
"""

from __future__ import annotations

import io
import json
import re
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
    raise MathDataError(f"{what} {source}: give a .jsonl, .json (JSON lines) or .parquet file, or ORG/NAME")


def _hf_files(dataset_id: str, split: str, subset: str | None) -> list[str]:
    try:
        import fsspec

        fs = fsspec.filesystem("hf")
        base = f"datasets/{dataset_id}"
        patterns = ([f"{base}/{subset}/{split}-*.parquet"] if subset else []) + [
            f"{base}/data/{split}-*.parquet", f"{base}/{split}-*.parquet", f"{base}/*/{split}-*.parquet"]
        for pattern in patterns:
            files = sorted(fs.glob(pattern))
            if files:
                return [f"hf://{f}" for f in files]
    except Exception as exc:  # no hub, no huggingface_hub, an unknown id: one clear line either way
        raise MathDataError(f"cannot list Hugging Face dataset {dataset_id}: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from None
    raise MathDataError(f"Hugging Face dataset {dataset_id} has no Parquet files for split {split!r}"
                        + (f" of subset {subset!r}" if subset else ""))


def dataset_records(source: str, *, hf_split: str = "train", hf_subset: str | None = None,
                    what: str = "math dataset") -> Iterator[dict]:
    """Every row (an object) of ``source``, in order: a file, an fsspec URI of one, or a Hugging Face id's Parquet
    files (the module docstring). ``what`` names the source in errors."""
    is_local = "://" not in source and Path(source).expanduser().exists()
    files = [source] if is_local or "://" in source or not _HF_ID.fullmatch(source) else \
        _hf_files(source, hf_split, hf_subset)
    for f in files:
        for row in _records(f, _read_bytes(f, what), what):
            if not isinstance(row, dict):
                raise MathDataError(f"{f}: a row is not an object")
            yield row


def load_rows(source: str, *, question: str, answer: str, answer_format: str, hf_split: str = "train",
              hf_subset: str | None = None, limit: int | None = None) -> list[tuple[str, str]]:
    """``(question, gold)`` of every row of ``source`` (at most ``limit``), in order."""
    out: list[tuple[str, str]] = []
    for row in dataset_records(source, hf_split=hf_split, hf_subset=hf_subset):
        out.append((str(_cell(row, question)).strip(), gold_answer(str(_cell(row, answer)), answer_format)))
        if limit is not None and len(out) >= limit:
            return out
    if not out:
        raise MathDataError(f"math dataset {source} has no rows")
    return out
