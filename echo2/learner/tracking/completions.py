"""A step's completions table: a few rows of the rollout files it trained on, decoded, for a person to read.

Rows are spread evenly over the step's rows (file by file, row by row), so a table shows several groups, and
several actors where more than one file went into the step, not one group's siblings. The same rows go to every
tracker and, one JSON object a line, to ``reports/completions/step-NNNNNN.jsonl`` in the run folder, through the
store: readable without any tracker, from any store (an S3 run's too).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from echo2.data import layout
from echo2.data.store import ObjectStore
from echo2.learner.tracking.base import COMPLETION_COLUMNS

_COLUMNS = ("actor_id", "policy_version", "reward", "finish_reason", "prompt_token_ids", "completion_token_ids")


def completion_rows(step: int, tables: list[pa.Table], tokenizer: Any, n: int) -> list[dict[str, Any]]:
    """``n`` rows (fewer if the step had fewer) of ``tables`` (the step's validated rollout files), decoded with
    ``tokenizer`` (special tokens left out), keyed by ``COMPLETION_COLUMNS``."""
    tables = [t.select(_COLUMNS).replace_schema_metadata(None) for t in tables if t.num_rows]  # per-file timings
    if not tables or n <= 0:
        return []
    rows = pa.concat_tables(tables)
    picked = np.unique(np.linspace(0, rows.num_rows - 1, num=min(n, rows.num_rows)).round().astype(np.int64))
    out = []
    for row in rows.take(pa.array(picked)).to_pylist():  # a handful of rows: Python objects are fine here
        out.append({"step": step, "actor_id": row["actor_id"], "version": int(row["policy_version"]),
                    "reward": float(row["reward"]), "finish_reason": row["finish_reason"],
                    "prompt": tokenizer.decode(row["prompt_token_ids"], skip_special_tokens=True),
                    "completion": tokenizer.decode(row["completion_token_ids"], skip_special_tokens=True)})
    return out


def write_completions(store: ObjectStore, step: int, rows: list[dict[str, Any]]) -> str:
    """``rows`` as ``reports/completions/step-NNNNNN.jsonl`` (replacing a lost timeline's file of the same step);
    returns the key."""
    key = layout.completions_key(step)
    text = "".join(json.dumps({c: row[c] for c in COMPLETION_COLUMNS}, ensure_ascii=False) + "\n" for row in rows)
    store.put(key, text.encode(), if_absent=False)
    return key


def markdown_table(rows: list[dict[str, Any]], max_chars: int = 2000) -> str:
    """``rows`` as a Markdown table (TensorBoard's text plugin renders one): a cell's ``|`` escaped, its line breaks
    as ``<br>``, and each text cut to ``max_chars``."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        if len(text) > max_chars:
            text = text[:max_chars] + "…"
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| " + " | ".join(COMPLETION_COLUMNS) + " |", "|" + " --- |" * len(COMPLETION_COLUMNS)]
    lines += ["| " + " | ".join(cell(row[c]) for c in COMPLETION_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)
