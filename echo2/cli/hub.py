"""What ``echo2 export`` does beyond fetching verified weights: the dtype of the folder it writes, a LoRA run's
adapter alone in peft's format, the model card, and the upload to the Hugging Face Hub.

The upload is ``upload_folder``, the one function here that talks to the network (tests replace it). Nothing here
imports torch, safetensors, peft or huggingface_hub at module level: the CLI loads this with every command."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's file name for an adapter's weights (``peft.utils.SAFETENSORS_WEIGHTS_NAME``)."""
PEFT_PREFIX = "base_model.model."
"""The prefix of every key of peft's adapter state dict (``get_peft_model_state_dict``)."""
TOKEN_ENV = "HF_TOKEN"
EMBEDDED_BASE = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""The Hub id of a model echo2 names otherwise (the embedded default is a GGUF of that model): a card's
``base_model`` must be a Hub id."""
CONFIG_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
"""The base model's own files: an adapter folder holding them would look like a full model to transformers."""


def cast_folder(folder: Path, dtype: str) -> None:
    """Every floating tensor of the folder's safetensors files in ``dtype`` (one file at a time), and the dtype
    its ``config.json`` declares set to match: transformers loads a folder in the dtype its config names
    (``torch_dtype``, which transformers 5 writes as ``dtype``), so a config that disagrees with the weights
    silently converts them on load."""
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(path)
        cast = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
        if any(v.dtype != cast[k].dtype for k, v in tensors.items()):  # else the file is already right
            save_file(cast, path, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in cast.values())
    index = folder / "model.safetensors.index.json"
    if index.exists():
        record = json.loads(index.read_text())
        record.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(record, indent=2))
    config = folder / "config.json"
    if config.exists():
        record = json.loads(config.read_text())
        record["torch_dtype"] = dtype
        if "dtype" in record or "torch_dtype" in record:  # transformers 5's name for it, beside the older one
            record["dtype"] = dtype
        config.write_text(json.dumps(record, indent=2) + "\n")


def write_adapter(dest: Path, adapter: dict, *, rank: int, alpha: float, base_model: str | None,
                  dtype: str, tokenizer_from: Path | None = None) -> None:
    """A LoRA adapter as peft writes one (``adapter_config.json`` by peft's ``LoraConfig.save_pretrained``,
    ``adapter_model.safetensors`` with peft's key names), loadable by ``PeftModel.from_pretrained`` on its base;
    the base's tokenizer files beside it. The module kinds it adapts are read from its keys, so the config names
    exactly what was trained. Written without building the base model: peft's ``PeftModel.save_pretrained``
    would need the whole base in memory only to pick out these tensors."""
    import shutil

    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    modules = sorted({k.split(".")[-3] for k in adapter if k.endswith(".lora_A.weight")})
    if not modules:
        raise ValueError("the adapter has no lora_A weights")
    dest.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0, bias="none",
               task_type="CAUSAL_LM", base_model_name_or_path=base_model).save_pretrained(str(dest))
    target = getattr(torch, dtype)
    save_file({(k if k.startswith(PEFT_PREFIX) else PEFT_PREFIX + k): v.to(target).contiguous()
               for k, v in adapter.items()}, dest / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    if tokenizer_from is not None:
        for path in tokenizer_from.iterdir():
            if path.is_file() and path.name not in CONFIG_FILES and not path.name.endswith((".safetensors", ".pt")):
                shutil.copyfile(path, dest / path.name)


def base_model_id(config: dict) -> str | None:
    """The Hub id of the run's base model, or None where it was a local folder (no Hub id to name)."""
    name = str((config.get("model") or {}).get("name") or "")
    if name in EMBEDDED_BASE:
        return EMBEDDED_BASE[name]
    if "/" in name and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists():
        return name
    return None


def model_card(*, repo: str, config: dict, summary: dict | None, exported: str, steps_trained: int | None,
               dtype: str, adapter_only: bool) -> str:
    """The README.md of an exported model: front matter the Hub reads (base model, tags, library), the run's
    config in brief, the steps trained, the held-out metric before and after with the intervals the run
    computed, and how to load it."""
    from echo2.learner.report import score_interval

    base = base_model_id(config)
    front = ["---", *([f"base_model: {base}"] if base else []), "tags:", "- echo2", "- grpo", "- rl",
             f"library_name: {'peft' if adapter_only else 'transformers'}", "---", ""]
    train, rollout, task = (config.get(k) or {} for k in ("train", "rollout", "task"))
    model_name = (config.get("model") or {}).get("name", "?")
    lora = train.get("lora_rank") or 0
    rows = [("base model", base or f"{model_name} (a local folder)"), ("task", task.get("name", "?")),
            ("run", (config.get("run") or {}).get("id", "?")), ("exported", exported),
            ("steps trained", "?" if steps_trained is None else str(steps_trained)),
            ("weights", (f"LoRA adapter, rank {lora}, alpha {train.get('lora_alpha')}" if adapter_only
                         else f"LoRA rank {lora} merged into the base" if lora else "full fine-tuning")
             + f", {dtype}"),
            ("learning rate", train.get("lr", "?")), ("staleness bound S", train.get("staleness", "?")),
            ("group size x groups per step", f"{rollout.get('group_size', '?')} x {train.get('groups_per_step', '?')}"),
            ("max new tokens", rollout.get("max_new_tokens", "?")), ("temperature", rollout.get("temperature", "?"))]
    if summary:
        rows.append(("wall time", f"{float(summary.get('wall_seconds') or 0):.0f} s over every attempt"))
        if summary.get("cost_usd") is not None:
            rows.append(("cost", "no priced resources" if summary.get("cost_priced") is False
                         else f"${summary['cost_usd']:.4f}"))
    lines = [*front, f"# {repo.rsplit('/', 1)[-1]}", "",
             f"{base or model_name} post-trained with reinforcement learning (GRPO, bounded staleness) by echo2.", "",
             "## Run", "", "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
             "## Held-out evaluation", "", *_evaluation_lines(summary, score_interval),
             *_other_step(summary, steps_trained), "",
             "## How to load", "", "```python", *_load_lines(repo, base, dtype, adapter_only), "```", ""]
    return "\n".join(lines)


def _evaluation_lines(summary: dict | None, score_interval) -> list[str]:
    if not summary:
        return ["The run has no summary (it has not finished): no held-out metrics to report."]
    metric = summary.get("eval_metric") or "accuracy"
    name = "greedy accuracy (pass@1)" if metric == "accuracy" else metric
    evals = summary.get("eval_metrics") or {}
    rows = []
    for label, key, when in (("before", "eval_before", "before training"),
                             ("after", "eval_after", f"after training (step {summary.get('steps')})")):
        value = summary.get(key)
        if value is None:
            continue
        interval = score_interval(evals.get(label), metric)
        rows.append(f"| {when} | {value:.3f} | "
                    + ("n/a" if interval is None else f"[{interval[0]:.3f}, {interval[1]:.3f}]") + " |")
    if not rows:
        return ["The run evaluated nothing on its held-out set."]
    return [f"On {summary.get('eval_n', '?')} held-out problems of the task, with the run's 95% intervals:",
            "", f"| | {name} | 95% interval |", "| --- | ---: | --- |", *rows]


def _other_step(summary: dict | None, steps_trained: int | None) -> list[str]:
    """A note where the export is not the step the run's last evaluation scored."""
    if not summary or steps_trained is None or summary.get("steps") in (None, steps_trained):
        return []
    return ["", f"This export is step {steps_trained}; the evaluation after training is of step {summary['steps']}."]


def _load_lines(repo: str, base: str | None, dtype: str, adapter_only: bool) -> list[str]:
    if adapter_only:
        return ["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
                f'model = AutoPeftModelForCausalLM.from_pretrained("{repo}")  # loads {base or "its base"} too',
                f'tokenizer = AutoTokenizer.from_pretrained("{repo}")']
    return ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f'model = AutoModelForCausalLM.from_pretrained("{repo}", dtype="{dtype}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}")']


def hub_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def upload_folder(repo: str, folder: Path, *, private: bool, token: str) -> Any:
    """Create the model repository ``repo`` if it is not there (private with ``private``: the Hub sets that only
    at creation) and upload ``folder`` to it in one commit."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
    return api.upload_folder(repo_id=repo, folder_path=str(folder), repo_type="model",
                             commit_message="echo2 export")
