"""Experiment tracking (``echo2/learner/tracking/``, ``MetricsSink``): the ``logging`` section, each tracker read
back from what its own library wrote (W&B offline, MLflow on a local SQLite store, TensorBoard's event files), the
completions table, and TensorBoard's event files copied into a store that is not the local folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2.config import ConfigError, LoggingConfig, load_config
from echo2.data import layout
from echo2.data.rollouts import Rollout, decode_rollouts, encode_rollouts
from echo2.data.store import open_store
from echo2.errors import Echo2InputError
from echo2.learner.metrics import MetricsSink
from echo2.learner.tracking import COMPLETION_COLUMNS, check_installed
from echo2.learner.tracking.completions import completion_rows, markdown_table


@pytest.fixture(scope="module")
def tokenizer():
    from echo2.bench.tiny_model import arithmetic_tokenizer

    return arithmetic_tokenizer()


def step_tables(tokenizer) -> list:
    """Two validated-looking rollout files of a step: actor a0 at version 1 and a1 at version 2, 4 rows each."""
    tables = []
    for actor, version in (("a0", 1), ("a1", 2)):
        rows = []
        for g in range(2):
            for s in range(2):
                completion = tokenizer.encode(f"{g + s}|{actor}\nend")
                rows.append(Rollout(prompt_id=f"p{g}", group_id=f"g{g}", sample_index=s,
                                    prompt_token_ids=tokenizer.encode(f"What is {g} + {s}?"),
                                    completion_token_ids=completion, behavior_logprobs=[-0.5] * len(completion),
                                    reward=float(s == 0), finish_reason="stop"))
        tables.append(decode_rollouts(encode_rollouts(rows, run_id="r", actor_id=actor, policy_version=version,
                                                      task="arithmetic")))
    return tables


# -- the config ------------------------------------------------------------------------------------------------
def test_logging_section_defaults_and_refuses_an_unknown_backend():
    config = load_config(None)
    assert config.logging.backends == ["tensorboard"] and config.logging.project == "echo2"
    assert config.logging.completions_every == 10 and config.logging.run_name is None
    with pytest.raises(ConfigError) as err:
        load_config(None, ["logging.backends=[tensorboard, wandbb]"])
    message = str(err.value)
    assert "\n" not in message and "logging.backends" in message
    assert "unknown backend 'wandbb' (did you mean wandb?)" in message and "tensorboard, wandb, mlflow" in message
    assert LoggingConfig(backends=["mlflow", "mlflow"]).backends == ["mlflow"]


def test_a_backend_whose_library_is_missing_stops_the_run_before_it_writes(monkeypatch, tmp_path):
    import importlib.util

    from echo2.learner.run import LearnerRun

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(Echo2InputError) as err:
        check_installed(LoggingConfig(backends=["tensorboard", "mlflow"]))
    assert str(err.value) == ("logging.backends names mlflow, but mlflow is not installed here: pip install "
                              "'echo2[tracking]' (or leave mlflow out of logging.backends)")
    config = load_config(None, ["logging.backends=[mlflow]", "run.id=nolib", f"store.url={tmp_path}"])
    with pytest.raises(Echo2InputError, match=r"pip install 'echo2\[tracking\]'"):
        LearnerRun(config, open_store(str(tmp_path)).child(layout.RUNS), resume=False)
    assert not (tmp_path / "runs" / "nolib").exists()  # nothing of the run was written


# -- the completions table -------------------------------------------------------------------------------------
def test_completion_rows_are_spread_over_the_step_and_decoded(tokenizer):
    rows = completion_rows(10, step_tables(tokenizer), tokenizer, 4)
    assert [(r["actor_id"], r["version"]) for r in rows] == [("a0", 1), ("a0", 1), ("a1", 2), ("a1", 2)]
    assert rows[0] == {"step": 10, "actor_id": "a0", "version": 1, "reward": 1.0, "finish_reason": "stop",
                       "prompt": "What is 0 + 0?", "completion": "0|a0\nend"}
    assert len(completion_rows(10, step_tables(tokenizer), tokenizer, 100)) == 8  # never more than the step had
    table = markdown_table(rows)
    assert table.splitlines()[0] == "| " + " | ".join(COMPLETION_COLUMNS) + " |"
    assert "0\\|a0<br>end" in table and len(table.splitlines()) == 6  # a cell's | and line break cannot break it


# -- every tracker, read back from what its library wrote ------------------------------------------------------
def _wandb_records(run_dir: Path) -> list:
    """Every record of an offline W&B run's ``.wandb`` file, parsed with wandb's own protobuf schema. wandb ships
    no Python reader of the file since its core moved to Go; the file is LevelDB's log format: a 7-byte header
    (ident, magic, version), then 32 KiB blocks of records, each a 7-byte header (crc32c, length, type: full,
    first, middle, last) and its bytes; a block's tail too short for a header is padding."""
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros: preallocated, never written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.e2e  # wandb starts its core process
def test_metrics_and_completions_reach_wandb_offline_mlflow_and_tensorboard(tokenizer, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts go to the working directory with a SQLite store
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    settings = LoggingConfig(backends=["tensorboard", "wandb", "mlflow"], project="echo2-test", tags=["t1"],
                             group="ablation", mlflow_tracking_uri=uri, completions_every=2, completions_rows=3)
    config = {"run": {"id": "trk"}, "train": {"lr": 1e-5}, "task": {"long": "x" * 9000}, "logging": {}}
    run_store = open_store(str(tmp_path / "store")).child("runs/trk")
    sink = MetricsSink(tmp_path / "local", "trk", config, settings=settings, store=run_store)
    tables = step_tables(tokenizer)
    for step in (1, 2):
        assert len(sink.log_completions(step, tables, tokenizer)) == (3 if step == 2 else 0)
        sink.log(step, {"reward": 0.25 * step, "loss": 1.0 / step, "publish_bytes": 100})
    sink.log_eval("after", 2, 0.5, {"pass_at_1": 0.5})
    sink.close()

    # the run folder: step 2's table only (completions_every=2), the same rows every tracker got
    assert run_store.list(layout.COMPLETIONS) == [layout.completions_key(2)]
    lines = [json.loads(x) for x in run_store.get(layout.completions_key(2)).decode().splitlines()]
    assert len(lines) == 3 and list(lines[0]) == list(COMPLETION_COLUMNS) and lines[0]["step"] == 2
    assert {x["actor_id"] for x in lines} == {"a0", "a1"}

    # MLflow: its file store, through its own client
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("echo2-test").experiment_id])
    assert run.info.run_name == "trk" and run.data.tags["echo2.run_id"] == "trk"
    assert run.data.tags["group"] == "ablation" and run.data.tags["t1"] == ""
    assert run.info.status == "FINISHED" and run.data.params["train.lr"] == "1e-05"
    assert 0 < len(run.data.params["task.long"]) < 9000  # cut to MLflow's longest param value
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/reward")] == \
        [(1, 0.25), (2, 0.5)]
    assert client.get_metric_history(run.info.run_id, "eval/accuracy_after")[0].value == 0.5
    artifact = Path(client.download_artifacts(run.info.run_id, "completions/step-000002.json", str(tmp_path / "dl")))
    table = json.loads(artifact.read_text())
    assert table["columns"] == list(COMPLETION_COLUMNS)
    assert [dict(zip(table["columns"], row)) for row in table["data"]] == lines

    # a resumed learner continues the same MLflow run (found by its tag), params as first logged
    again = MetricsSink(tmp_path / "local", "trk", {**config, "train": {"lr": 2e-5}}, settings=settings,
                        store=run_store)
    again.log(3, {"reward": 0.75})
    again.close()
    (run,) = client.search_runs([client.get_experiment_by_name("echo2-test").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/reward")] == [1, 2, 3]
    assert run.data.params["train.lr"] == "1e-05"

    # W&B offline: the runs' own .wandb logs (the resumed learner's W&B run has the same id: `wandb sync` joins them)
    run_dirs = sorted((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*-trk"))
    assert len(run_dirs) == 2
    records = [r for d in run_dirs for r in _wandb_records(d)]
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {(x.run_id, x.project, tuple(x.tags), x.run_group, x.display_name) for x in runs} == {
        ("trk", "echo2-test", ("t1",), "ablation", "trk")}
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["train/reward"]) for h in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert history[1]["eval/accuracy_after"] == 0.5 and history[0]["publish/bytes"] == 100
    (logged,) = [h for h in history if "completions/path" in h]
    assert logged["_step"] == 2 and logged["completions/_type"] == "table-file" and logged["completions/nrows"] == 3
    wandb_table = json.loads((run_dirs[0] / "files" / logged["completions/path"]).read_text())
    assert wandb_table["columns"] == list(COMPLETION_COLUMNS)
    assert [dict(zip(wandb_table["columns"], row)) for row in wandb_table["data"]] == lines

    # TensorBoard: scalars and the table as Markdown text, in the local folder and copied into the store
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "local" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    (text,) = events.Tensors("completions/text_summary")
    assert text.step == 2 and "| step | actor_id |" in text.tensor_proto.string_val[0].decode()


# -- TensorBoard's event files in the store ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", pytest.param("s3", marks=pytest.mark.e2e)])
def test_tensorboard_event_files_are_copied_into_a_remote_store(kind, tmp_path, request):
    import uuid

    store = open_store(f"memory://tb-{uuid.uuid4().hex}") if kind == "memory" else request.getfixturevalue("s3_store")
    run_store = store.child("runs/tb")
    local = tmp_path / "echo2-logs" / "tb"
    sink = MetricsSink(local, "tb", {}, settings=LoggingConfig(), store=run_store)
    sink.log(1, {"reward": 0.5})
    sink.sync()  # what a checkpoint does

    def copied() -> dict[str, bytes]:
        return {k: run_store.get(k) for k in run_store.list(layout.TENSORBOARD + "/")}

    def local_files() -> dict[str, bytes]:
        return {layout.tensorboard_key(p.relative_to(local / "tensorboard").as_posix()): p.read_bytes()
                for p in (local / "tensorboard").rglob("*") if p.is_file()}

    assert copied() == local_files() and len(copied()) == 1
    sink.log(2, {"reward": 0.75})
    sink.close()  # the end: the whole file again, grown
    assert copied() == local_files()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    down = tmp_path / "down"
    for key, data in copied().items():
        (down / key).parent.mkdir(parents=True, exist_ok=True)
        (down / key).write_bytes(data)
    events = EventAccumulator(str(down / layout.TENSORBOARD))
    events.Reload()
    assert [e.value for e in events.Scalars("train/reward")] == [0.5, 0.75]


def test_a_local_run_folder_is_not_copied_onto_itself(tmp_path):
    run_dir = tmp_path / "runs" / "loc"
    sink = MetricsSink(run_dir, "loc", {}, settings=LoggingConfig(), store=open_store(str(run_dir)))
    assert sink.trackers[0].mirror is None
    sink.log(1, {"reward": 0.5})
    sink.close()
    assert len(list((run_dir / "tensorboard").iterdir())) == 1
