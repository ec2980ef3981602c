"""``echo2 export``: a run's published version or checkpoint as a ``from_pretrained`` folder, only one the run's
key signed (``download_weights``, which ``echo2 eval`` uses for a run's weights folder too).

Which key. Where this machine holds the run's key (``$ECHO2_RUN_KEY`` or the secrets file) its public half verifies
everything; elsewhere only ``run.json``'s public key can, and ``run.json`` is in the store: whoever can write the
store can replace it and sign what they like. A policy version is what actors already trust on that key, but a
checkpoint's DCP metadata is unpickled (``learner/sharded.py``), so a checkpoint verified only by ``run.json``'s own
key is refused in one line unless ``--trust-run-json-key`` says that the store is trusted."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from echo2.cli.common import fail, store_options_from_env
from echo2.errors import Echo2InputError


def export(
    run: str = typer.Argument(..., help="Run root (path or URL of STORE/runs/ID)."),
    dest: Path = typer.Argument(..., help="Directory to write a Hugging Face model into."),
    step: Optional[int] = typer.Option(None, "--step", help="Checkpoint or policy version N (default: latest policy)."),
    trust_run_json_key: bool = typer.Option(
        False, "--trust-run-json-key", help="Export a checkpoint that only the store's own run.json key verifies "
                                            "(this machine holds no key of the run): trusts whoever can write it."),
) -> None:
    """Export a published version or checkpoint as a from_pretrained-loadable directory: only one the
    run's key signed, every file checked against its manifest (else one line, exit 2)."""
    from echo2.data import layout
    from echo2.data.delta import DeltaRejected
    from echo2.data.manifest import ManifestRejected
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
                manifest = download_weights(store, prefix, dest, trust_run_json_key=trust_run_json_key)
                break
        else:
            fail(f"{run} has neither checkpoint {step} nor policy version {step}")
    except (StoreError, NotFound, ManifestRejected, DeltaRejected, CorruptWeights, Echo2InputError) as exc:
        if created:  # the files that verified before one did not are no model: leave no folder of them
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
        fail(str(exc))
    typer.echo(f"exported {prefix} ({len(manifest['files'])} files, verified) to {dest}")


def download_weights(store, prefix: str, dest: Path, *, trust_run_json_key: bool = False) -> dict:
    """A weights folder of a run (checkpoint or policy version) as a ``from_pretrained`` folder at ``dest``,
    every byte checked against its manifest, and every manifest against the run's key (``run_folder.weights_key``:
    a folder the run's learner did not sign is refused, ManifestRejected); an adapter version is folded into its
    base. A checkpoint that only ``run.json``'s own key verifies is refused unless ``trust_run_json_key`` (see the
    module docstring). Returns the manifest."""
    from echo2.data import layout
    from echo2.data.run_folder import RunRecordRejected, weights_key
    from echo2.data.store import NotFound
    from echo2.data.weights import download, iter_tensors, merge_into_folder

    try:
        public_key = weights_key(store.get_json(layout.RUN_JSON))
    except (NotFound, ValueError):
        raise RunRecordRejected(f"{store.url} has no readable {layout.RUN_JSON}: not a run folder, so there is no key "
                                "to check its weights with") from None
    if prefix.startswith(layout.CHECKPOINTS):  # every rank's shards, put together here (checkpoint.py)
        from echo2.data.manifest import ManifestRejected
        from echo2.learner.checkpoint import export_checkpoint

        run_id = _run_id_without_key(store.get_json(layout.RUN_JSON))
        if run_id is not None and not trust_run_json_key:
            raise ManifestRejected(f"{prefix} can be verified only with the key in the store's own {layout.RUN_JSON} "
                                   f"(this machine holds no key of run {run_id}), which whoever writes the store can "
                                   "replace: set ECHO2_RUN_KEY or add the run's key file, or pass --trust-run-json-key")

        step = layout.parse_step_dir(prefix.rsplit("/", 1)[-1])
        if step is None:
            raise NotFound(f"{store.url}/{prefix} is not a checkpoint folder (checkpoints/step-N)")
        return export_checkpoint(store, step, dest, public_key)
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
