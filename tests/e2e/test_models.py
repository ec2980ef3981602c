"""Model resolution: local directory, the embedded GGUF default (converted once), clear errors."""

import pytest

from echo2.errors import ModelNotFound
from echo2.models import DEFAULT_MODEL, resolve_model

pytestmark = pytest.mark.e2e


def test_local_directory(tiny_model):
    assert resolve_model(str(tiny_model)) == tiny_model.resolve()


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        resolve_model("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_embedded_default_is_converted_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_CACHE", str(tmp_path))
    path = resolve_model(DEFAULT_MODEL)
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    mtime = (path / "model.safetensors").stat().st_mtime
    assert resolve_model(DEFAULT_MODEL) == path
    assert (path / "model.safetensors").stat().st_mtime == mtime  # cached, not converted again

    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    assert config.vocab_size == 49152 and getattr(config, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2  # <|im_end|>, as the GGUF says

    # A cache an older conversion wrote (no marker, or an older one) is not trusted: it is converted again.
    from echo2.models import _CONVERSION_VERSION, _conversion_version

    assert _conversion_version(path) == _CONVERSION_VERSION
    (path / "echo2-conversion.json").write_text('{"version": 1}')
    assert _conversion_version(path) != _CONVERSION_VERSION
    (path / "echo2-conversion.json").unlink()
    assert _conversion_version(path) is None
