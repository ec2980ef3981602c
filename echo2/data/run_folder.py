"""The life of a run folder ``{store}/runs/{id}/``: a new id, create, find the one to resume, open it
for resume, and move aside what a killed learner made after its last checkpoint.

Resume continues from the newest committed checkpoint c. Everything the dead learner made after
c belongs to a timeline that no longer exists: policy versions > c, rollouts generated with them,
ledger entries of steps > c, and checkpoint folders > c (a manifest-less one is a checkpoint the
learner was killed writing). What the learner wrote is moved, never deleted, to ``orphaned/<time>/``
(rollout files stay where they are, judged by the boundary the resume records: ``orphan_after``), with one
exception: an object the store refuses to copy or return to anyone (``store.is_unreadable_object``: a
GLACIER or customer-key-encrypted object, which anyone with write access to ``checkpoints/`` or
``policy/`` can plant; IAM should deny it, the learner does not rely on that) cannot be moved, and
left in place it would stop every resume (the new timeline writes the same keys) and every save of its
step. Such an object is deleted (``set_aside``), logged in one line with a record in its place under
``orphaned/``. If it was the learner's own (a lifecycle rule moved it to an archive class), it belonged
to the discarded timeline, which is kept only to be looked at, and it cannot be read: nothing the run
uses is lost. A rollout file is never deleted: it is quarantined by reference instead. A refusal of
the learner's credentials (``AccessDenied``) is not an unreadable object: it stops the resume.

``run.json`` is signed with the run's key (the manifest scheme, ``manifest.sign``), and a resume
checks that signature with the key it holds (``check_run_key``): the learner resumes only from the
record it wrote, so a ``run.json`` swapped in the store (another public key or relay CA, which actors
would then trust, or another config) stops the resume in one line instead of being carried on.
``weights_key`` is the key ``echo2 export`` checks weights with: the local run key when this machine
holds it (after the same check of ``run.json``), else ``run.json``'s public key, what actors trust.

``RunInfo`` is the one reading of ``run.json``'s plain fields (its config, the learner's market, where the store
lives) for the readers that only look: it checks no signature, so what must be trusted is checked as above first.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from echo2.data import layout
from echo2.data.audit import finite_number
from echo2.data.manifest import ManifestRejected, check_file_name, sign, verify_signature
from echo2.data.quarantine import by_reference as quarantine_by_reference
from echo2.data.relay_certs import RelayCA
from echo2.data.run_key import KEY_ENV, MissingRunKey, fingerprint, key_path, public_key_of, public_key_text, run_key
from echo2.data.site import store_site
from echo2.data.store import AlreadyExists, NotFound, ObjectStore, is_transient, is_unreadable_object
from echo2.errors import Echo2InputError

log = logging.getLogger("echo2.data")

MARKETS = ("on-demand", "spot")
"""The learner's markets (``learner.market``); anything else in a ``run.json`` reads as on-demand."""


@dataclass(frozen=True)
class RunInfo:
    """The plain fields of a ``run.json`` record, each read leniently: absent or of the wrong type reads as
    absent (None, or an empty dict). A view only: it verifies nothing, so a reader that must trust the record
    checks its signature first (``check_run_key``, ``weights_key``)."""

    created_at: float | None = None
    config: dict = field(default_factory=dict)
    """The run's resolved config as written (not validated: ``config_from_dict`` does that)."""

    @classmethod
    def of(cls, record: object) -> RunInfo:
        if not isinstance(record, dict):
            return cls()
        return cls(created_at=finite_number(record.get("created_at")), config=_dict(record.get("config")))

    @classmethod
    def read(cls, store: ObjectStore) -> RunInfo:
        """The run folder's ``run.json``; an empty view where there is none or it is not JSON (a folder being
        made, tests of one part alone): every reader here has a default for each field."""
        try:
            return cls.of(store.get_json(layout.RUN_JSON))
        except (NotFound, ValueError):
            return cls()

    def section(self, name: str) -> dict:
        """One section of the config (``train``, ``store``...), empty where absent or not an object."""
        return _dict(self.config.get(name))

    @property
    def learner_market(self) -> str:
        """``learner.market``, "on-demand" where absent or unknown (``train.market`` in a run created before the
        learner's fields left ``train``: ``echo2/config/train.py``'s ``MOVED``)."""
        market = self.section("learner").get("market", self.section("train").get("market"))
        return market if market in MARKETS else "on-demand"

    @property
    def store_site(self) -> tuple[str, str] | None:
        """Where the run's store lives (``store.provider``/``store.region``), as ``StoreConfig.site`` reads it."""
        section = self.section("store")
        return store_site(section.get("provider"), section.get("region"))


def _dict(value: object) -> dict:
    return value if isinstance(value, dict) else {}

def new_run_id(name: str) -> str:
    return f"{name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def find_resumable_run(runs: ObjectStore) -> str:
    """The newest run under ``runs/`` that has no summary yet."""
    candidates = []
    for key in runs.list():
        parts = key.split("/")
        if len(parts) == 2 and parts[1] == layout.RUN_JSON and not runs.exists(f"{parts[0]}/{layout.SUMMARY}"):
            candidates.append((runs.get_json(key).get("created_at", 0), parts[0]))
    if not candidates:
        raise Echo2InputError(f"--resume: no unfinished run under {runs.url}")
    return max(candidates)[1]


def read_run_record(runs: ObjectStore, run_id: str) -> dict:
    """``run.json`` of a run to resume; a clear error when there is none or the run has finished."""
    store = runs.child(run_id)
    try:
        record = store.get_json(layout.RUN_JSON)
    except NotFound:
        raise Echo2InputError(f"--resume: no run {run_id} under {runs.url}") from None
    if store.exists(layout.SUMMARY):
        raise Echo2InputError(f"run {run_id} has finished; nothing to resume")
    return record


def create_run(store: ObjectStore, run_id: str, config: dict, *, key: Ed25519PrivateKey,
               echo2_version: str, task_data: dict | None = None) -> dict:
    """Write ``run.json`` once: the resolved config, and the public half of the signing key with its
    fingerprint (actors verify versions with it; the private key stays with the learner), and the relay
    CA's certificate (peers verify each other's with it; the CA key is derived from the run key), and
    ``task_data``, the task's datasets as the learner resolved them into the run folder (``tasks/task_data.py``);
    signed with the run key, so a resumed learner knows it for its own (``check_run_key``)."""
    record = {"run_id": run_id, "created_at": time.time(), "echo2_version": echo2_version, "config": config,
              "public_key": public_key_text(key), "key_fingerprint": fingerprint(key),
              "relay_ca": RelayCA(key, run_id).certificate_pem()}
    if task_data:
        record["task_data"] = task_data
    record = sign(record, key)
    try:
        store.put_json(layout.RUN_JSON, record)
    except AlreadyExists:
        raise Echo2InputError(f"run {run_id} already exists at {store.url}; use --resume") from None
    return record


class RunRecordRejected(Echo2InputError):
    """``run.json`` is not the record this run's learner wrote (unsigned, altered, or signed by another key)."""


def check_run_key(record: dict, key: Ed25519PrivateKey | None) -> None:
    """Refuse to resume unless ``key`` is the run's and ``run.json`` is the record it signed.

    Actors verify every manifest with the public key in ``run.json``: a learner that made itself a
    new key would publish versions no actor accepts and wait for rollouts forever. And ``run.json``
    is in the store, where a learner must not take it on trust: one swapped for another public key or
    relay CA would hand the run's actors to whoever holds that key, so its signature must verify with
    the key the learner holds (a record without one, from an echo2 before signed records, is refused too).
    """
    run_id = record.get("run_id")
    if not isinstance(record.get("public_key"), str):
        raise MissingRunKey(f"run {run_id} was signed with an HMAC key (echo2 before Ed25519-signed "
                            "versions) or its run.json carries no public key: its actors cannot check versions "
                            "signed now; start a new run")
    where = f"${KEY_ENV} or {key_path(str(run_id))}"
    expected = record.get("key_fingerprint")
    if key is None:
        raise MissingRunKey(f"run {run_id} was signed with key {expected}, but there is no key at {where}; "
                            "restore the secrets file the run was started with")
    if public_key_text(key) != record["public_key"]:
        raise MissingRunKey(f"run {run_id} was signed with key {expected}, but the key at {where} is "
                            f"{fingerprint(key)}; restore the secrets file the run was started with (if it is the "
                            "right key, run.json was replaced in the store)")
    try:
        verify_signature(record, key.public_key())
    except ManifestRejected:
        raise RunRecordRejected(f"run.json of run {run_id} is not the record its learner wrote (its signature does "
                                f"not verify with the run's key {fingerprint(key)}): it was altered in the store, or "
                                "written by an echo2 before signed run records; refusing to resume") from None


def weights_key(record: dict) -> Ed25519PublicKey:
    """The key a run's weights are verified with outside the learner (``echo2 export``, ``echo2 eval``):
    the run key's public half where this machine holds the run key (``run.json`` checked against it by
    ``check_run_key``), else ``run.json``'s public key: what the run's actors trust, as good as the store."""
    try:  # the id names a file of the secrets folder: a plain name only
        run_id = check_file_name(record.get("run_id"))
    except ValueError as exc:
        raise RunRecordRejected(f"run.json names run id {exc}") from None
    try:
        key = run_key(run_id)
    except MissingRunKey:
        return public_key_of(record)
    check_run_key(record, key)
    return key.public_key()


def orphan_after(store: ObjectStore, step: int, *, rollouts: bool = True) -> list[str]:
    """Move everything of the lost timeline (after checkpoint ``step``) to ``orphaned/<time>/``; returns the keys.

    A move copies server-side and reads nothing. A rollout file the store cannot copy (an actor wrote it
    as GLACIER, say) is quarantined by reference instead (``data/quarantine.py``): it stays, is not
    among the keys returned, and the next ledger entry records it as quarantined. Any other object the
    store refuses to everyone is deleted (``set_aside``; the module's docstring says why) and not returned.

    Without ``rollouts`` (what a resume does) no rollout file is listed or moved: actors write ``rollouts/``, as
    many files as their credentials let them, so moving them would cost three requests a file before the run
    could go on. The resume records the lost timeline's boundary in its ledger event instead, and the collector
    judges each file by it when it meets it (``learner/timelines.py``); only what the learner itself wrote
    (versions, checkpoints, ledger entries) is moved.
    """
    dest = layout.orphaned_prefix(f"{time.time():.0f}")
    late = []
    prefixes = (layout.POLICY, layout.ROLLOUTS, layout.CHECKPOINTS) if rollouts else (layout.POLICY, layout.CHECKPOINTS)
    for prefix in prefixes:  # folders numbered by version or step
        for key in store.list(prefix):
            n = layout.version_of_folder_key(key, prefix)
            if n is not None and n > step:
                late.append(key)
    for key in store.list(layout.LEDGER_CONSUMED):
        s = layout.step_of_consumed_key(key)
        if s is not None and s > step:
            late.append(key)
    # a manifest first, so that an interrupted move never leaves a folder that looks committed
    late.sort(key=lambda k: (not k.endswith("/" + layout.MANIFEST), k))
    kept, dropped = [], []
    for key in late:
        if layout.parse_rollout_key(key) is None:
            if not set_aside(store, key, dest, f"the resume from step {step} could not move it to {dest}"):
                dropped.append(key)
            continue
        try:
            store.copy(key, dest + key)
        except Exception as exc:
            if is_transient(exc) or isinstance(exc, NotFound):
                raise  # the store is broken: say so
            quarantine_by_reference(store, key, f"unreadable: the resume from step {step} could not move it "
                                                f"to {dest}", exc)
            kept.append(key)
            continue
        store.delete(key)
    late = [k for k in late if k not in kept and k not in dropped]
    kept_folders = {k.rsplit("/", 1)[0] + "/" for k in kept}
    for folder in sorted({k.rsplit("/", 1)[0] + "/" for k in late if not k.startswith(layout.LEDGER_CONSUMED)}):
        # never a rollouts folder: an actor of the lost timeline may still commit there (the collector drops
        # such a file, recorded); deleting the folder would delete it unseen
        if (folder not in kept_folders  # a file quarantined by reference stays
                and not folder.startswith(layout.ROLLOUTS)):
            store.delete_prefix(folder)  # tidy the emptied folders (nothing writes there while the learner is down)
    return late


def set_aside(store: ObjectStore, key: str, dest: str, why: str) -> bool:
    """Move ``key`` (an object under a prefix only the learner writes) to ``dest + key``; True if moved.

    An object the store refuses to copy to anyone (``is_unreadable_object``) is deleted instead, logged
    in one line, and a record ``dest + key + ".deleted.json"`` says what it was (False): it cannot be
    kept for inspection, and left in place it would stop the resume or save that needs its key (see the
    module's docstring). Any other error propagates (``AccessDenied`` on the learner's own credentials
    is for the operator, never a reason to delete)."""
    try:
        store.copy(key, dest + key)
    except Exception as exc:
        if not is_unreadable_object(exc):
            raise
        size = store.size(key)
        store.put_json(dest + key + ".deleted.json", {"key": key, "size": size, "why": why, "at": time.time(),
                                                       "error": f"{type(exc).__name__}: {str(exc)[:300]}"},
                       if_absent=False)
        store.delete(key)
        log.error("deleted %s (%d bytes): the store refuses to copy or return it to anyone (%s), so it was not "
                  "written by this run's learner or cannot be read by it; %s", key, size, exc, why)
        return False
    store.delete(key)
    return True
