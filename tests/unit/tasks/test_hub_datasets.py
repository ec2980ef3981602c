"""Hugging Face datasets as published, through ``datasets.load_dataset`` (``echo2/tasks/math_data.py``), resolved
once by the learner into the run folder, where the actors read them (``echo2/tasks/task_data.py``).

Nothing is fetched: each dataset is a local folder laid out as its hub repo is, which ``load_dataset`` reads by
path as it reads the repo (its ``README.md`` configs, or files alone), with the hub switched off
(``HF_HUB_OFFLINE``). GSM8K (openai/gsm8k): ``main/`` and ``socratic/`` subsets, ``train-00000-of-00001.parquet``
and ``test-...`` splits, columns ``question`` / ``answer`` ending in ``#### n``. DAPO-Math-17k
(BytedTsinghua-SIA/DAPO-Math-17k): one file ``data/dapo-math-17k.parquet``, ``prompt`` a chat (a list of
``{content, role}``), ``reward_model`` a struct holding ``ground_truth``, beside ``data_source``, ``ability`` and
``extra_info`` (the columns as public loaders of the published file read them; configurable either way)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from echo2.config import MathTaskConfig, load_config
from echo2.data import layout
from echo2.data.store import open_store
from echo2.tasks import make_task
from echo2.tasks.task_data import TaskDataRejected, freeze, localize

GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
# GSM8K, as its repo lays it out
"""


@pytest.fixture(autouse=True)
def offline_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets-cache"))


def gsm8k(root: Path) -> Path:
    """openai/gsm8k's layout: two subsets of two splits, ``#### n`` answers (thousands with commas)."""
    for subset in ("main", "socratic"):
        (root / subset).mkdir(parents=True)
        for split, n in (("train", 12), ("test", 5)):
            rows = {"question": [f"[{subset}/{split}] Ann has {i} apples and buys 1000 more. How many?"
                                 for i in range(n)],
                    "answer": [f"She has {i} + 1000 = {i + 1000} apples.\n#### {i + 1000:,}" for i in range(n)]}
            pq.write_table(pa.table(rows), root / subset / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(GSM8K_README)
    return root


def dapo(root: Path, n: int = 10) -> Path:
    """BytedTsinghua-SIA/DAPO-Math-17k's layout: ``data/dapo-math-17k.parquet``, a chat prompt, a struct answer."""
    (root / "data").mkdir(parents=True)
    rows = [{"data_source": "math_dapo",
             "prompt": [{"content": f"Solve the following math problem step by step. What is {i} squared?\n\n"
                                    "Remember to put your answer on its own line after \"Answer:\".", "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(i * i), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"id-{i}"}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), root / "data" / "dapo-math-17k.parquet")
    return root


def math_config(**fields) -> MathTaskConfig:
    return MathTaskConfig.model_validate({"name": "math", **fields})


def test_gsm8k_s_subset_and_splits_are_read_as_published(tmp_path):
    repo = gsm8k(tmp_path / "gsm8k")
    task = make_task(math_config(dataset=str(repo), hf_subset="main", hf_split="train", eval_dataset=str(repo),
                                 eval_size=5))
    questions = {p.meta["question"] for p in task.sample_train(random.Random(0), 30)}
    assert questions and all(q.startswith("[main/train]") for q in questions)
    assert [p.meta["question"][:12] for p in task.eval_set()] == ["[main/test] "] * 5  # eval_hf_split: test
    assert sorted(p.answer for p in task.eval_set()) == ["1000", "1001", "1002", "1003", "1004"]
    problem = task.problem("q3")
    assert problem.answer == "1003" and problem.meta["question"].startswith("[main/train] Ann has 3 apples")
    assert task.reward(problem, "so \\boxed{1003}")[0] == 1.0

    socratic = make_task(math_config(dataset=str(repo), hf_subset="socratic", eval_size=2))
    assert socratic.problem("q11").meta["question"].startswith("[socratic/train]")

    from echo2.tasks.math_data import MathDataError

    with pytest.raises(MathDataError, match=r"subset 'nope'.*nope"):  # the loader's own words, in one line
        make_task(math_config(dataset=str(repo), hf_subset="nope"))


def test_dapo_math_17k_s_chat_prompt_and_struct_answer(tmp_path):
    repo = dapo(tmp_path / "dapo")
    columns = {"question": "prompt", "answer": "reward_model.ground_truth"}
    task = make_task(math_config(dataset=str(repo), columns=columns, answer_format="plain", eval_size=3))
    problem = task.problem(next(p.id for p in task.sample_train(random.Random(1), 1)))
    index = int(problem.id[1:])
    assert problem.meta["question"].startswith(f"Solve the following math problem step by step. What is {index}")
    assert problem.answer == str(index * index)


def test_revision_and_data_files_reach_load_dataset(tmp_path, monkeypatch):
    import datasets

    calls = []
    real = datasets.load_dataset

    def recording(path, **kwargs):
        calls.append((path, kwargs))
        return real(path, **{**kwargs, "revision": None})  # a local folder has no revisions to choose from

    monkeypatch.setattr(datasets, "load_dataset", recording)
    repo = dapo(tmp_path / "dapo")
    make_task(math_config(dataset=str(repo), columns={"question": "prompt", "answer": "reward_model.ground_truth"},
                          hf_revision="v1.1", hf_data_files={"train": "data/*.parquet"}, eval_size=2))
    assert calls == [(str(repo), {"name": None, "split": "train", "revision": "v1.1",
                                  "data_files": {"train": "data/*.parquet"}})]


def test_local_files_and_uris_are_read_as_before(tmp_path):
    pq.write_table(pa.table({"question": [f"q{i}" for i in range(6)], "answer": [f"#### {i}" for i in range(6)]}),
                   tmp_path / "rows.parquet")
    task = make_task(math_config(dataset=str(tmp_path / "rows.parquet"), eval_size=2))
    assert task.problem(next(p.id for p in task.sample_train(random.Random(0), 1))).answer.isdigit()
    assert freeze(math_config(dataset=str(tmp_path / "rows.parquet")), open_store(str(tmp_path / "s"))) == {}


def test_the_run_folder_copy_is_what_everyone_reads_and_a_swapped_copy_is_refused(tmp_path, monkeypatch):
    import datasets

    repo = gsm8k(tmp_path / "gsm8k")
    config = math_config(dataset=str(repo), hf_subset="main", eval_dataset=str(repo), eval_size=5)
    store = open_store(str(tmp_path / "store")).child("runs/r1")
    record = freeze(config, store)
    assert set(record) == {"dataset", "eval_dataset"}
    assert record["dataset"]["split"] == "train" and record["eval_dataset"]["split"] == "test"
    assert record["dataset"]["rows"] == 12 and record["eval_dataset"]["rows"] == 5
    assert sorted(store.list(layout.TASK_DATA)) == sorted(layout.task_data_file(e["sha256"]) for e in record.values())
    learner_task = make_task(config)

    def no_hub(*args, **kwargs):
        raise AssertionError("an actor reached for the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    local = localize(config, record, store, tmp_path / "actor" / "task-data")
    assert Path(local.dataset).parent == tmp_path / "actor" / "task-data"
    actor_task = make_task(local)
    assert actor_task._rows == learner_task._rows
    assert [p.answer for p in actor_task.eval_set()] == [p.answer for p in learner_task.eval_set()]

    key = layout.task_data_file(record["dataset"]["sha256"])
    store.put(key, pq.read_table(Path(local.dataset)).slice(0, 3).to_pandas().to_parquet(), if_absent=False)
    with pytest.raises(TaskDataRejected, match="not the file run.json names"):
        localize(config, record, store, tmp_path / "actor2")


def test_the_learner_writes_the_rows_into_the_run_folder_and_the_actor_builds_its_task_from_them(
        tmp_path, monkeypatch, tiny_model):
    """A run end to end as far as both sides build the task: ``run.json`` records the copy, the actor reads it."""
    import datasets

    from echo2.data.relay_tokens import RELAY_TOKEN_ENV
    from echo2.learner.run import LearnerRun
    from echo2.rollout.actor import Actor

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv("ECHO2_RUN_KEY", raising=False)
    monkeypatch.setenv(RELAY_TOKEN_ENV, "e2rt1.not.checked-here")
    repo = gsm8k(tmp_path / "gsm8k")
    (tmp_path / "run.yaml").write_text(
        f"run: {{id: r1}}\nstore: {{url: {tmp_path / 'store'}}}\nmodel: {{name: {tiny_model}}}\n"
        f"task: {{name: math, dataset: {repo}, hf_subset: main, eval_dataset: {repo}, eval_size: 5}}\n"
        "eval: {before: false, after: false}\n")
    config = load_config(tmp_path / "run.yaml", [])
    runs = open_store(str(tmp_path / "store")).child(layout.RUNS)
    learner = LearnerRun(config, runs, resume=False)
    record = runs.child("r1").get_json(layout.RUN_JSON)
    assert record["task_data"]["dataset"]["path"] == str(repo) and record["config"]["task"]["dataset"] == str(repo)

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("an actor reached for the hub"))
    actor = Actor(runs.child("r1"), "a0", engine_factory=lambda model_dir, tokenizer: None)
    assert actor.task._rows == learner.task._rows and len(actor.task._rows) == 12
    assert [p.id for p in actor.task.eval_set()] == [p.id for p in learner.task.eval_set()]
