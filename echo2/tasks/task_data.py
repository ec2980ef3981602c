"""The task's Hugging Face datasets, resolved once by the learner and read by everyone from the run folder.

A task's ``dataset`` or ``eval_dataset`` may name a dataset of the Hugging Face hub (or a local folder in a repo's
layout), which ``datasets.load_dataset`` reads (``math_data.HubDataset``). Only the learner has ``datasets`` (the
learner extra) and a way to the hub; actors run on machines we do not own, often without either, and must draw the
very rows the learner re-derives their prompts from. So when the learner creates a run it reads each such dataset
once (``freeze``), writes its rows as one Parquet file into the run folder, ``task-data/<sha256>.parquet``
(``layout.task_data_file``), and records what it read in ``run.json`` (signed with the run key): the id, subset,
split, revision and ``data_files`` asked for, and the file's sha256 and rows. The learner, on this start and every
resume, and every actor build the task from those files (``localize``): the config the task gets names a local copy
of each, checked against the sha256 ``run.json`` signed, so no branch that moved on the hub since and no file an
actor could swap changes what anyone reads. Files and fsspec URIs are read where they are, by everyone, as before.
"""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path
from typing import Any

from echo2.data import layout
from echo2.data.store import AlreadyExists, ObjectStore
from echo2.errors import Echo2InputError
from echo2.tasks.math_data import HubDataset, is_hub_dataset, load_hub_dataset

log = logging.getLogger(__name__)

FIELDS = ("dataset", "eval_dataset")
"""The task config fields that may name a Hugging Face dataset."""


class TaskDataRejected(Echo2InputError):
    """The run folder's copy of a dataset is missing, or not the file ``run.json`` names."""


def hub_datasets(task: Any) -> dict[str, HubDataset]:
    """The fields of a task config that name a Hugging Face dataset, with what ``load_dataset`` is asked for. The
    evaluation split is ``eval_hf_split`` where the task has one, else ``hf_split``."""
    if not hasattr(task, "hf_split"):  # arithmetic, poker, a plugin: no dataset of the hub
        return {}
    out = {}
    for field in FIELDS:
        source = getattr(task, field, None)
        if isinstance(source, str) and is_hub_dataset(source):
            split = task.hf_split if field == "dataset" else getattr(task, "eval_hf_split", task.hf_split)
            out[field] = HubDataset(source, split, task.hf_subset, getattr(task, "hf_revision", None),
                                    getattr(task, "hf_data_files", None))
    return out


def freeze(task: Any, store: ObjectStore) -> dict[str, dict]:
    """Read each Hugging Face dataset of ``task`` (the learner, creating the run) and write its rows into the run
    folder ``store``; returns ``run.json``'s ``task_data``: per field, what was asked for and the file written."""
    out: dict[str, dict] = {}
    for field, ref in hub_datasets(task).items():
        dataset = load_hub_dataset(ref, what=f"task.{field}")
        buffer = io.BytesIO()
        dataset.to_parquet(buffer)  # the split's own Arrow types, rows in the order the task numbers them
        data = buffer.getvalue()
        sha = hashlib.sha256(data).hexdigest()
        try:
            store.put(layout.task_data_file(sha), data)
        except AlreadyExists:  # content-addressed: the same rows, written by an earlier field or start
            pass
        out[field] = {"path": ref.path, "subset": ref.subset, "split": ref.split, "revision": ref.revision,
                      "data_files": ref.data_files, "sha256": sha, "rows": len(dataset)}
        log.info("task.%s: %s (%s) resolved to %d rows, %s", field, ref.path, ref.split, len(dataset),
                 layout.task_data_file(sha))
    return out


def localize(task: Any, task_data: dict[str, dict], store: ObjectStore, folder: Path) -> Any:
    """``task`` with each field ``task_data`` records pointing at a local copy of the run folder's file (under
    ``folder``), checked against its sha256; a field the record does not name is left as it is."""
    if not task_data:
        return task
    changes = {}
    for field, entry in task_data.items():
        if field not in FIELDS or not isinstance(entry, dict):
            raise TaskDataRejected(f"run.json's task_data names {field!r}, not a dataset field of the task")
        sha = str(entry.get("sha256", ""))
        try:
            key = layout.task_data_file(sha)
        except ValueError as exc:
            raise TaskDataRejected(f"run.json's task_data.{field}: {exc}") from None
        path = folder / f"{sha}.parquet"
        if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            try:
                data = store.get(key)
            except Exception as exc:  # NotFound, a store error: the run cannot be played without its problems
                raise TaskDataRejected(f"task.{field}: the run folder's copy {key} cannot be read "
                                       f"({type(exc).__name__}: {exc})") from None
            if hashlib.sha256(data).hexdigest() != sha:
                raise TaskDataRejected(f"task.{field}: {key} is not the file run.json names (sha256 differs)")
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        changes[field] = str(path)
    return task.model_copy(update=changes)
