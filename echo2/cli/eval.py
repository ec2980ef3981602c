"""``echo2 eval``: held-out metrics of a model, or of a run's weights folder (verified, ``export.download_weights``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from echo2.cli.common import fail, quiet_transformers, store_options_from_env
from echo2.errors import Echo2InputError


def eval_policy(
    model: str = typer.Argument(..., help="A model (local folder, Hugging Face id, smollm2-135m-instruct) or a run's "
                                          "weights folder: RUN/checkpoints/step-N or RUN/policy/vN."),
    task: Optional[str] = typer.Option(None, "--task",
                                       help="arithmetic, math, poker or code (default: the config's task)."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML config whose task and eval sections are used."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: --set eval.k=8 (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    trust_run_json_key: bool = typer.Option(
        False, "--trust-run-json-key", help="Evaluate a checkpoint that only the store's own run.json key verifies "
                                            "(this machine holds no key of the run): trusts whoever can write it."),
) -> None:
    """Held-out metrics of a model or checkpoint: pass@1 (greedy) and pass@k (eval.k samples); poker:
    bb/100 per opponent with a 95% interval over duplicate deals, and the illegal-action rate."""
    import tempfile

    from echo2.config import apply_overrides, config_from_dict, load_config

    quiet_transformers()
    try:
        cfg = load_config(config)
        data = cfg.model_dump(mode="json")
        if task is not None and data["task"]["name"] != task:
            data["task"] = {"name": task}  # another task than the config's: its defaults
        cfg = config_from_dict(apply_overrides(data, set_ or []), str(config or "(defaults)"))
        with tempfile.TemporaryDirectory(prefix="echo2-eval-") as tmp:
            result = _evaluate_model(model, cfg, Path(tmp), trust_run_json_key=trust_run_json_key)
    except Echo2InputError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    from echo2.learner.evaluate import flat_metrics

    table = Table(title=f"{cfg.task.name}: {model}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in flat_metrics(result).items():
        table.add_row(key, f"{value:.4g}")
    Console().print(table)


def _evaluate_model(model: str, cfg, tmp: Path, *, trust_run_json_key: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2.cli.export import download_weights
    from echo2.data import layout
    from echo2.data.manifest import ManifestRejected
    from echo2.data.store import NotFound, StoreError, open_store
    from echo2.data.weights import CorruptWeights
    from echo2.devices import resolve_device, resolve_dtype
    from echo2.learner.evaluate import evaluate_policy
    from echo2.models import resolve_model
    from echo2.tasks import make_task

    folder = model.rstrip("/")
    parent, _, name = folder.rpartition("/")
    run_root, _, kind = parent.rpartition("/")
    if kind in (layout.CHECKPOINTS.rstrip("/"), layout.POLICY.rstrip("/")) and run_root:
        try:
            store = open_store(run_root, store_options_from_env())
            if not store.exists(f"{kind}/{name}/{layout.MANIFEST}"):
                fail(f"{model} is not a committed weights folder (no {layout.MANIFEST})")
            download_weights(store, f"{kind}/{name}", tmp, trust_run_json_key=trust_run_json_key)
        except (StoreError, NotFound, ManifestRejected, CorruptWeights) as exc:
            fail(str(exc))
        model_dir = tmp
    else:
        model_dir = resolve_model(model, revision=cfg.model.revision if model == cfg.model.name else None)
    task = make_task(cfg.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # on the learner's device in its compute dtype, as the run's own evaluations (learner.device, train.dtype)
    device = resolve_device(cfg.learner.device)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(cfg.train.dtype, device),
                                                  device_map=str(device), use_kernels=False)
    e = cfg.eval
    result = evaluate_policy(policy, tokenizer, task, max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
                             k=e.k, temperature=e.temperature)
    return {"model": model, "task": task.name, **result}
