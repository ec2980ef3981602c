"""Key names of the run layout (docs/architecture.md, "Object store layout"): the only module that spells a key.

Keys are relative to the run root ``{store}/runs/{run_id}/`` unless said otherwise. The parse
helpers return None for a key outside the layout, so whatever an actor writes under an odd name
is simply not part of the run.
"""

from __future__ import annotations

import re

# -- the store: runs live under {store}/runs/ (relative to the store root) ------------------------
RUNS = "runs"

# -- the run root ---------------------------------------------------------------------------------
RUN_JSON = "run.json"
MANIFEST = "manifest.json"

POLICY = "policy/"
LATEST = "policy/LATEST"
ROLLOUTS = "rollouts/"
QUARANTINE = "quarantine/"
CHECKPOINTS = "checkpoints/"
PEERS = "peers/"
LEDGER_CONSUMED = "ledger/consumed/"
LEDGER_EVENTS = "ledger/events/"
LEDGER_EGRESS = "ledger/egress/"
"""Bytes each actor read from the store and from peers, as the learner last copied them (``fleet/bill/egress.py``)."""
TASK_DATA = "policy/task-data/"
"""Rows of the task's Hugging Face datasets, as the learner resolved them when it created the run (one Parquet file
each, named by its sha256, which ``run.json`` records): what actors read instead of the hub (``tasks/task_data.py``).
Under ``policy/``, which actors may read already (``fleet/credentials.py``); no version folder is named so."""
REPORTS = "reports/"
SUMMARY = "reports/summary.json"
COMPLETIONS = "reports/completions/"
"""Every ``logging.completions_every`` steps, a few completions the step trained on, decoded (``completions_key``)."""
ORPHANED = "orphaned/"
LOGS = "logs"  # local folder of the run (the run root on a local store) holding actor logs
TENSORBOARD = "tensorboard"
REMOTE_LOCAL_DIR = "echo2-logs"
"""For a remote store, the run's local files live under ./echo2-logs/<run>/."""

_VERSION_RE = re.compile(r"^v(\d{6,})$")
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_CONSUMED_RE = re.compile(r"^step-(\d{6,})(\.[a-z]+)?\.json$")
_ROLLOUT_RE = re.compile(r"^([A-Za-z0-9_.-]+)-(\d{6,})\.arrow$")
_ACTOR_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def version_name(version: int) -> str:
    return f"v{version:06d}"


def parse_version_dir(name: str) -> int | None:
    m = _VERSION_RE.match(name)
    return int(m.group(1)) if m else None


def policy_dir(version: int) -> str:
    return f"{POLICY}{version_name(version)}"


def manifest_key(folder: str) -> str:
    """The commit point of a weights folder (a policy version or a checkpoint)."""
    return f"{folder}/{MANIFEST}"


# -- rollouts -------------------------------------------------------------------------------------
def valid_actor_id(actor_id: str) -> bool:
    return bool(_ACTOR_ID_RE.match(actor_id)) and actor_id not in (".", "..")


def rollout_key(version: int, actor_id: str, seq: int) -> str:
    return f"{ROLLOUTS}{version_name(version)}/{actor_id}-{seq:06d}.arrow"


def rollout_key_glob(actor_id: str) -> str:
    """The keys ``rollout_key`` gives one actor, as an IAM / fnmatch pattern (``?`` = one character).

    For scoped store credentials. Fixed widths rather than ``*``: ``rollouts/*/a-*`` would also
    match ``rollouts/v000001/a-b-000001.arrow``, which parses as actor ``a-b``, so actor ``a``
    could write in another's name. With exactly six characters after ``<actor>-`` no other actor's
    key fits (that needs ``-`` and six digits, seven characters), and a ``/`` in a ``?`` gives a
    key outside the layout, which the learner ignores. Covers versions and sequence numbers below
    10**6 (``version_name`` and ``rollout_key`` pad to six digits).
    """
    return f"{ROLLOUTS}v??????/{actor_id}-??????.arrow"


def parse_rollout_key(key: str) -> tuple[int, str, int] | None:
    """``rollouts/v000042/a-000001.arrow`` -> (42, "a", 1); None for keys outside the layout."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] + "/" != ROLLOUTS:
        return None
    v = _VERSION_RE.match(parts[1])
    name = _ROLLOUT_RE.match(parts[2])
    if v is None or name is None:
        return None
    return int(v.group(1)), name.group(1), int(name.group(2))


def version_of_rollout_key(key: str) -> int | None:
    """``rollouts/v000042/a-000001.arrow`` -> 42 (None for keys outside the layout)."""
    parsed = parse_rollout_key(key)
    return parsed[0] if parsed else None


def quarantine_key(key: str) -> str:
    return f"{QUARANTINE}{key}"


def quarantine_reason_key(key: str) -> str:
    return f"{QUARANTINE}{key}.json"


def quarantined_of_reason_key(reason_key: str) -> str | None:
    """``quarantine/rollouts/v1/a-000001.arrow.json`` -> the original key ``rollouts/v1/a-000001.arrow``."""
    if not reason_key.startswith(QUARANTINE) or not reason_key.endswith(".arrow.json"):
        return None
    return reason_key[len(QUARANTINE) : -len(".json")]


# -- ledger ---------------------------------------------------------------------------------------
def consumed_key(step: int, amendment: str | None = None) -> str:
    """The ledger entry of step ``step``; an amendment (``quarantine``) corrects it after training."""
    suffix = f".{amendment}" if amendment else ""
    return f"{LEDGER_CONSUMED}step-{step:06d}{suffix}.json"


FINAL_CONSUMED = f"{LEDGER_CONSUMED}final.json"
"""What was still unused when the run finished (so every committed file is in the ledger)."""

COLLECTING = f"{LEDGER_CONSUMED}collecting.json"
"""The collection in progress, replaced in place while the learner waits (``put_pointer``): the files it
has judged so far that still lie in ``rollouts/`` and the actors whose files it found junk, so that the
actors' flow control stops counting them at once (``ledger.ConsumedIndex``). Not a ledger entry: the
step's entry records the same files when it is written."""


LEDGER_BANS = "ledger/bans/"
"""One record per banned actor (``ban_key``), written the moment the learner bans it: a resumed learner bans it
again, and the record stands for every later file of that actor (none is judged or moved one by one)."""

PUBLISHED_BYTES = "ledger/published-bytes.json"
"""What the run's versions weigh in all, as the learner's egress fold last counted them (``fleet/bill/egress.py``):
the most an actor could have read, which caps its byte counters."""


def ban_key(actor_id: str) -> str:
    """``ledger/bans/<actor>.json``; only for an actor id of the layout (``valid_actor_id``)."""
    if not valid_actor_id(actor_id):
        raise ValueError(f"not an actor id: {actor_id[:80]!r}")
    return f"{LEDGER_BANS}{actor_id}.json"


def step_of_consumed_key(key: str) -> int | None:
    """``ledger/consumed/step-000043.json`` (or an amendment of it) -> 43; None for other keys."""
    m = _CONSUMED_RE.match(key.rsplit("/", 1)[-1]) if key.startswith(LEDGER_CONSUMED) else None
    return int(m.group(1)) if m else None


def event_key(ts: float, actor_id: str, nonce: str) -> str:
    return f"{LEDGER_EVENTS}{ts:017.6f}-{actor_id}-{nonce}.json"


# -- checkpoints, peers, reports, orphans ---------------------------------------------------------
def checkpoint_dir(step: int) -> str:
    return f"{CHECKPOINTS}step-{step:06d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def peer_key(actor_id: str) -> str:
    return f"{PEERS}{actor_id}.json"


def actor_of_peer_key(key: str) -> str | None:
    """``peers/a0.json`` -> "a0"; None for anything else (a peer record must be named by its actor)."""
    if not key.startswith(PEERS) or not key.endswith(".json"):
        return None
    actor = key[len(PEERS) : -len(".json")]
    return actor if valid_actor_id(actor) else None


def report_key(name: str) -> str:
    return f"{REPORTS}{name}"


def completions_key(step: int) -> str:
    """``reports/completions/step-000010.jsonl``: step 10's completions table, one JSON object a row."""
    return f"{COMPLETIONS}step-{step:06d}.jsonl"


def tensorboard_key(name: str) -> str:
    """A TensorBoard event file of the learner's local folder ``TENSORBOARD`` (``name`` relative to it), copied
    into the run folder of a remote store."""
    return f"{TENSORBOARD}/{name}"


def orphaned_prefix(stamp: str) -> str:
    """Where resume moves what a killed learner made after its last checkpoint."""
    return f"{ORPHANED}{stamp}/"


def version_of_folder_key(key: str, prefix: str) -> int | None:
    """The number of the folder a key lies in: ``policy/v000042/x`` -> 42, ``checkpoints/step-000040/x`` -> 40."""
    if not key.startswith(prefix):
        return None
    parts = key[len(prefix) :].split("/")
    if len(parts) < 2:
        return None
    parse = parse_version_dir if prefix == POLICY or prefix == ROLLOUTS else parse_step_dir
    return parse(parts[0])


def task_data_file(sha256: str) -> str:
    """The run folder's copy of one resolved dataset (``TASK_DATA``)."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ValueError(f"not a sha256: {sha256[:80]!r}")
    return f"{TASK_DATA}{sha256}.parquet"
