"""``echo2 export``: a run's published version or checkpoint as a ``from_pretrained`` folder, only one the run's
key signed (``download_weights``, which ``echo2 eval`` uses for a run's weights folder too).

Which key. Where this machine holds the run's key (``$ECHO2_RUN_KEY`` or the secrets file) its public half verifies
everything; elsewhere only ``run.json``'s public key can, and ``run.json`` is in the store: whoever can write the
store can replace it and sign what they like. A policy version is what actors already trust on that key, but a
checkpoint's DCP metadata is unpickled (``learner/checkpoint_files.py``), so a checkpoint verified only by
``run.json``'s own key is refused in one line unless ``--trust-run-json-key`` says that the store is trusted.

What it writes. ``--dtype`` (default float32: the learner's master weights, exactly; bfloat16 halves the folder and
is what most models on the Hub ship) casts every weight and sets ``config.json``'s dtype to match. ``--adapter-only``
writes a LoRA run's adapter alone, as peft does, instead of merging it into its base. ``--push-to-hub REPO`` adds a
model card (``README.md``: the run's config, steps, held-out metrics before and after with their intervals) and
uploads the folder with ``$HF_TOKEN`` (``hub.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from echo2.cli import hub
from echo2.cli.common import fail, store_options_from_env
from echo2.errors import Echo2InputError


def export(
    run: str = typer.Argument(..., help="Run root (path or URL of STORE/runs/ID)."),
    dest: Path = typer.Argument(..., help="Directory to write a Hugging Face model into."),
    step: Optional[int] = typer.Option(None, "--step", help="Checkpoint or policy version N (default: latest policy)."),
    trust_run_json_key: bool = typer.Option(
        False, "--trust-run-json-key", help="Export a checkpoint that only the store's own run.json key verifies "
                                            "(this machine holds no key of the run): trusts whoever can write it."),
    dtype: str = typer.Option("float32", "--dtype", help=f"Weights dtype: {', '.join(hub.DTYPES)} (config.json's "
                                                         "dtype set to match). float32 keeps the trained weights "
                                                         "exactly; bfloat16 is half the size."),
    adapter_only: bool = typer.Option(False, "--adapter-only", help="A LoRA run: write its adapter alone "
                                                                   "(peft's format), not merged into the base."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", metavar="REPO",
                                              help="Also write a model card (README.md) and upload the folder "
                                                   "to this Hugging Face model repo (token: $HF_TOKEN)."),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: create the repo private."),
) -> None:
    """Export a published version or checkpoint as a from_pretrained-loadable directory: only one the
    run's key signed, every file checked against its manifest (else one line, exit 2)."""
    if dtype not in hub.DTYPES:
        fail(f"--dtype {dtype!r}: choose one of {', '.join(hub.DTYPES)}")
    token = hub.hub_token()
    if push_to_hub and not token:  # before minutes of downloading, not after
        fail(f"--push-to-hub needs a Hugging Face token with write access in ${hub.TOKEN_ENV}")
    if private and not push_to_hub:
        fail("--private is for --push-to-hub")
    from echo2.data import layout
    from echo2.data.delta import DeltaRejected
    from echo2.data.manifest import ManifestRejected
    from echo2.data.run_folder import RunInfo
    from echo2.data.store import NotFound, StoreError, open_store
    from echo2.data.weights import CorruptWeights, latest_version

    created = not dest.exists()
    try:  # every manifest read names plain files of its folder only, or is refused (ManifestRejected)
        store = open_store(run, store_options_from_env())
        latest = step is None
        if latest:
            step = latest_version(store)
            if step is None:
                fail(f"{run} has no published policy version")
        candidates = [layout.checkpoint_dir(step), layout.policy_dir(step)]
        if latest and not trust_run_json_key and _key_not_here(store):  # the latest version, not its checkpoint
            candidates.reverse()
        for prefix in candidates:
            if store.exists(f"{prefix}/{layout.MANIFEST}"):
                break
        else:
            fail(f"{run} has neither checkpoint {step} nor policy version {step}")
        if adapter_only:
            manifest = export_adapter(store, prefix, dest, dtype=dtype, trust_run_json_key=trust_run_json_key)
        else:
            manifest = download_weights(store, prefix, dest, trust_run_json_key=trust_run_json_key)
            hub.cast_folder(dest, dtype)
        if push_to_hub:
            config = RunInfo.of(store.get_json(layout.RUN_JSON)).config
            card = hub.model_card(repo=push_to_hub, config=config, summary=_summary(store), exported=prefix,
                                  steps_trained=manifest.get("step", manifest.get("version", step)), dtype=dtype,
                                  adapter_only=adapter_only)
            (dest / "README.md").write_text(card)
    except (StoreError, NotFound, ManifestRejected, DeltaRejected, CorruptWeights, Echo2InputError) as exc:
        if created:  # the files that verified before one did not are no model: leave no folder of them
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
        fail(str(exc))
    typer.echo(f"exported {prefix} ({len(manifest['files'])} files, verified) to {dest}"
               + (" as its LoRA adapter" if adapter_only else "") + f", {dtype}")
    if push_to_hub:
        try:
            hub.upload_folder(push_to_hub, dest, private=private, token=token)
        except Exception as exc:  # noqa: BLE001 - any refusal of the Hub (token, name, network) is one line
            why = (str(exc).splitlines() or [""])[0][:300]
            fail(f"upload of {dest} to {push_to_hub} failed ({type(exc).__name__}: {why}); the export is complete in "
                 f"{dest}", code=1)
        typer.echo(f"uploaded {dest} to https://huggingface.co/{push_to_hub}" + (" (private)" if private else ""))


def download_weights(store, prefix: str, dest: Path, *, trust_run_json_key: bool = False) -> dict:
    """A weights folder of a run (checkpoint or policy version) as a ``from_pretrained`` folder at ``dest``,
    every byte checked against its manifest, and every manifest against the run's key (``run_folder.weights_key``:
    a folder the run's learner did not sign is refused, ManifestRejected); an adapter version is folded into its
    base. A checkpoint that only ``run.json``'s own key verifies is refused unless ``trust_run_json_key`` (see the
    module docstring). Returns the manifest."""
    from echo2.data import layout
    from echo2.data.weights import download, iter_tensors, merge_into_folder

    public_key = _verifying_key(store, prefix, trust_run_json_key)
    if prefix.startswith(layout.CHECKPOINTS):  # every rank's shards, put together here (checkpoint.py)
        from echo2.learner.checkpoint import export_checkpoint

        return export_checkpoint(store, _checkpoint_step(store, prefix), dest, public_key)
    manifest = download(store, prefix, dest, public_key=public_key)
    if manifest.get("weights") == "lora":
        adapter = {k: v for k, v in iter_tensors(store, prefix, manifest)}
        download(store, layout.policy_dir(manifest["base_version"]), dest, public_key=public_key)
        merge_into_folder(dest, adapter, rank=manifest["lora_rank"], alpha=manifest["lora_alpha"])
    if manifest.get("weights") == "delta":  # a sparse delta: rebuilt through its chain, every link verified
        from echo2.data.delta_chain import read_version
        from echo2.data.weights import save_as_indexed

        tensors, keyframe = read_version(store, manifest["version"], public_key)
        download(store, layout.policy_dir(keyframe["version"]), dest, kinds=("aux",), public_key=public_key)
        save_as_indexed(dest, tensors)
    for extra in ("optimizer.pt", "trainer_state.json", "adapter.safetensors"):  # learner state, not the model
        (dest / extra).unlink(missing_ok=True)
    return manifest


def export_adapter(store, prefix: str, dest: Path, *, dtype: str, trust_run_json_key: bool = False) -> dict:
    """A LoRA run's adapter at checkpoint or policy version ``prefix``, alone, as a peft adapter folder at ``dest``
    (``hub.write_adapter``), verified as ``download_weights`` verifies a folder. A run without LoRA has no adapter,
    and version 0 of a LoRA run is its base: both refused in one line. Returns the manifest."""
    from echo2.data import layout
    from echo2.data.run_folder import RunInfo
    from echo2.data.weights import download, iter_tensors, read_manifest

    public_key = _verifying_key(store, prefix, trust_run_json_key)
    run = RunInfo.of(store.get_json(layout.RUN_JSON))
    config = run.config
    if not run.section("train").get("lora_rank"):
        raise Echo2InputError(f"{store.url} has no adapter to export: the run trained every weight (train.lora_rank "
                              "0); export the model without --adapter-only")
    if prefix.startswith(layout.CHECKPOINTS):
        from echo2.learner.checkpoint import checkpoint_weights, load_checkpoint

        ckpt = load_checkpoint(store, _checkpoint_step(store, prefix), public_key)
        manifest = ckpt.manifest
        # peft's parameter names carry the adapter's name ("default"); its state dict, which peft loads, does not
        adapter = {k.replace(".default.", "."): v for k, v in checkpoint_weights(store, ckpt).items()}
    else:
        manifest = read_manifest(store, prefix, public_key)
        adapter = dict(iter_tensors(store, prefix, manifest)) if manifest.get("weights") == "lora" else {}
    if manifest.get("weights") != "lora":
        raise Echo2InputError(f"{prefix} is the base model of the LoRA run, before any step: no adapter yet; export a "
                              "later --step")
    import tempfile

    with tempfile.TemporaryDirectory() as base:  # the base's config and tokenizer: the tokenizer goes beside
        download(store, layout.policy_dir(manifest["base_version"]), Path(base), kinds=("aux",), public_key=public_key)
        hub.write_adapter(dest, adapter, rank=manifest["lora_rank"], alpha=manifest["lora_alpha"],
                          base_model=hub.base_model_id(config), dtype=dtype, tokenizer_from=Path(base))
    return manifest


def _verifying_key(store, prefix: str, trust_run_json_key: bool):
    """The key that verifies the run's weights (``run_folder.weights_key``); a checkpoint that only ``run.json``'s
    own key verifies is refused unless ``trust_run_json_key`` (see the module docstring)."""
    from echo2.data import layout
    from echo2.data.run_folder import RunRecordRejected, weights_key
    from echo2.data.store import NotFound

    try:
        public_key = weights_key(store.get_json(layout.RUN_JSON))
    except (NotFound, ValueError):
        raise RunRecordRejected(f"{store.url} has no readable {layout.RUN_JSON}: not a run folder, so there is no key "
                                "to check its weights with") from None
    if prefix.startswith(layout.CHECKPOINTS):
        from echo2.data.manifest import ManifestRejected

        run_id = _run_id_without_key(store.get_json(layout.RUN_JSON))
        if run_id is not None and not trust_run_json_key:
            raise ManifestRejected(f"{prefix} can be verified only with the key in the store's own {layout.RUN_JSON} "
                                   f"(this machine holds no key of run {run_id}), which whoever writes the store can "
                                   "replace: set ECHO2_RUN_KEY or add the run's key file, or pass --trust-run-json-key")
    return public_key


def _checkpoint_step(store, prefix: str) -> int:
    from echo2.data import layout
    from echo2.data.store import NotFound

    step = layout.parse_step_dir(prefix.rsplit("/", 1)[-1])
    if step is None:
        raise NotFound(f"{store.url}/{prefix} is not a checkpoint folder (checkpoints/step-N)")
    return step


def _summary(store) -> dict | None:
    """The run's ``reports/summary.json``; None before the run has finished."""
    from echo2.data import layout
    from echo2.data.store import NotFound

    try:
        summary = store.get_json(layout.SUMMARY)
    except (NotFound, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _key_not_here(store) -> bool:
    """Whether this machine holds no key of the run in ``store`` (False where ``run.json`` cannot be read: the
    export then says why in one line)."""
    from echo2.data import layout
    from echo2.data.store import NotFound

    try:
        return _run_id_without_key(store.get_json(layout.RUN_JSON)) is not None
    except (NotFound, ValueError, AttributeError):
        return False


def _run_id_without_key(record: dict) -> str | None:
    """The run's id where this machine holds no key of it (weights are then verified by ``run.json``'s own key);
    None where it holds one (``run_folder.weights_key`` then checks ``run.json`` against it)."""
    from echo2.data.manifest import check_file_name
    from echo2.data.run_key import MissingRunKey, run_key

    try:
        run_id = check_file_name(record.get("run_id"))
    except ValueError:
        return str(record.get("run_id"))[:64]
    try:
        run_key(run_id)
    except MissingRunKey:
        return run_id
    return None
