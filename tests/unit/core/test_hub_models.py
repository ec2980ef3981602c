"""A Hugging Face model id as published (``echo2/models.py``): what ``snapshot_download`` is asked for, at which
revision, the commit a run records, and the hub's own words when it refuses.

No hub is reachable here: ``huggingface_hub``'s two calls (``HfApi.model_info``, ``snapshot_download``) are replaced
at that boundary by doubles that answer as the hub does, from a file list like a published repo's and a local
snapshot folder laid out as the Hugging Face cache lays one out (``.../snapshots/<commit>``). A gated repo with a
real account is not tested here (docs/tasks.md)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import huggingface_hub
import pytest
from huggingface_hub.errors import GatedRepoError, RevisionNotFoundError
from huggingface_hub.utils import filter_repo_objects

from echo2.errors import ModelNotFound
from echo2.models import hub_commit, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"

# the files of published repos: Llama-style (safetensors, a .bin copy, the maker's original/ checkpoint, other
# frameworks' weights), an older repo of .bin weights alone, and a tiktoken tokenizer
PUBLISHED = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model",
             "consolidated.safetensors", "model.gguf", "onnx/model.onnx", "onnx/model.onnx_data", "flax_model.msgpack",
             "tf_model.h5", "rust_model.ot", "model.tflite", "README.md", "LICENSE"]
BIN_ONLY = ["config.json", "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
TIKTOKEN = ["config.json", "model.safetensors", "tokenizer.tiktoken", "tokenization_kimi.py", "tokenizer_config.json"]


class _Hub:
    """The hub at the boundary: ``model_info`` answers from ``files`` at ``COMMIT``; ``snapshot_download`` records
    its arguments and returns ``snapshot`` (or raises ``error`` from both, as the hub does)."""

    def __init__(self, files: list[str], snapshot: Path | None = None, error: Exception | None = None):
        self.files, self.snapshot, self.error, self.calls = files, snapshot, error, []

    def model_info(self, repo_id, *, revision=None, **_):  # bound to the double: no HfApi self
        if self.error is not None:
            raise self.error
        return SimpleNamespace(sha=COMMIT, siblings=[SimpleNamespace(rfilename=f) for f in self.files])

    def snapshot_download(self, repo_id, **kwargs):
        self.calls.append((repo_id, kwargs))
        if self.error is not None:
            raise self.error
        return str(self.snapshot)

    def downloaded(self) -> set[str]:
        """What the last call would have fetched from ``files`` (the hub's own pattern filter)."""
        kwargs = self.calls[-1][1]
        return set(filter_repo_objects(self.files, allow_patterns=kwargs.get("allow_patterns"),
                                       ignore_patterns=kwargs.get("ignore_patterns")))


@pytest.fixture
def hub(monkeypatch, tmp_path):
    def install(files, snapshot=None, error=None):
        double = _Hub(files, snapshot or tmp_path, error)
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", double.model_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", double.snapshot_download)
        return double
    return install


def test_a_published_repo_is_downloaded_whole_less_the_formats_echo2_never_reads(hub):
    double = hub(PUBLISHED)
    resolve_model("org/llama-like", revision="v1.0")
    [(repo_id, kwargs)] = double.calls
    assert repo_id == "org/llama-like" and kwargs["revision"] == COMMIT  # the commit v1.0 named when asked
    assert kwargs.get("allow_patterns") is None  # no hand-made list of what a loader may need
    assert double.downloaded() == {
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja", "README.md", "LICENSE"}

    double = hub(TIKTOKEN)  # a tiktoken tokenizer and the code that reads it
    resolve_model("org/tiktoken")
    assert {"tokenizer.tiktoken", "tokenization_kimi.py", "model.safetensors"} <= double.downloaded()


def test_a_bin_only_repo_gets_its_bin_weights(hub):
    """Pickled weights are skipped only beside safetensors ones: here they are the weights."""
    double = hub(BIN_ONLY)
    resolve_model("org/old")
    assert double.downloaded() == set(BIN_ONLY)


def test_the_snapshot_s_chat_template_jinja_is_the_tokenizer_s_template(hub, tiny_model, tmp_path):
    """transformers 5 keeps a chat template in ``chat_template.jinja``: a snapshot with one is loaded with it."""
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / COMMIT
    shutil.copytree(tiny_model, snapshot)
    (snapshot / "chat_template.jinja").write_text(TEMPLATE)
    hub(["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"],
        snapshot)
    path = resolve_model("org/tiny", revision="main")
    assert path == snapshot and hub_commit(path) == COMMIT

    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "2 + 2?"}],
                                                                   tokenize=False)
    assert text == "[user] 2 + 2?\n"

    from echo2.data.weights import model_files

    assert model_files(path)["chat_template.jinja"] == TEMPLATE.encode()  # what travels to the actors


def _http_error(cls, status: int, message: str):
    request = httpx.Request("GET", "https://huggingface.co/api/models/org/gated/revision/main")
    return cls(message, response=httpx.Response(status, request=request))


def test_a_hub_refusal_is_one_line_with_the_model_the_revision_and_the_hub_s_message(hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub(PUBLISHED, error=_http_error(GatedRepoError, 401, "401 Client Error. (Request ID: Root=1-abc)\n\n"
                                     "Cannot access gated repo for url https://huggingface.co/org/gated.\n"
                                     "Access to model org/gated is restricted. You must have access to it."))
    with pytest.raises(ModelNotFound) as caught:
        resolve_model("org/gated", revision="v2")
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("model 'org/gated' at revision 'v2': GatedRepoError: 401 Client Error.")
    assert "Access to model org/gated is restricted" in line and "$HF_TOKEN is not set" in line

    monkeypatch.setenv("HF_TOKEN", "hf_" + "y" * 34)
    with pytest.raises(ModelNotFound, match=r"\$HF_TOKEN is set but has no access") as caught:
        resolve_model("org/gated")
    assert "at revision 'main'" in str(caught.value) and "hf_yyy" not in str(caught.value)

    hub(PUBLISHED, error=_http_error(RevisionNotFoundError, 404, "404 Client Error.\n\nInvalid rev id: nope"))
    with pytest.raises(ModelNotFound) as caught:
        resolve_model("org/model", revision="nope")
    assert "Invalid rev id: nope" in str(caught.value) and "HF_TOKEN" not in str(caught.value)


def test_a_revision_needs_a_hub_id():
    with pytest.raises(ModelNotFound, match="model.revision"):
        resolve_model("no-such-model", revision="main")


def test_the_run_records_the_commit_its_revision_named_and_a_resume_keeps_it(hub, tiny_model, tmp_path, monkeypatch):
    """``run.json`` holds the commit, so the learner's every load (other ranks, a resume) reads the same files even
    after the branch moved; a relaunch that still says ``model.revision=main`` (a learner job's every start)
    keeps it."""
    from echo2.config import load_config
    from echo2.data import layout
    from echo2.data.run_folder import create_run
    from echo2.data.run_key import run_key
    from echo2.data.store import open_store
    from echo2.launch import resolve_launch, resume_config

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    snapshot = tmp_path / "hub" / "snapshots" / COMMIT
    shutil.copytree(tiny_model, snapshot)
    double = hub(["config.json", "model.safetensors"], snapshot)
    (tmp_path / "run.yaml").write_text(f"model: {{name: org/tiny, revision: main}}\nstore: {{url: {tmp_path / 's'}}}\n")
    config = resolve_launch(tmp_path / "run.yaml", [], resume=False)
    assert config.model.revision == COMMIT and double.calls[-1][1]["revision"] == COMMIT

    runs = open_store(str(tmp_path / "s")).child(layout.RUNS)
    create_run(runs.child(config.run.id), config.run.id, config.model_dump(mode="json"),
               key=run_key(config.run.id, create=True), echo2_version="test")
    resumed = resume_config(runs, config.run.id, ["model.revision=main"])
    assert resumed.model.revision == COMMIT
    assert load_config(tmp_path / "run.yaml", []).model.revision == "main"  # the file itself is left alone
