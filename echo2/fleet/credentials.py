"""Scoped, expiring store credentials for one actor (docs/security.md).

An actor runs on a machine we do not own, so its store credentials must let it do its job and
nothing else. What an actor touches in the run root (read in ``rollout/actor.py``,
``broadcast/receiver.py``, ``broadcast/topology.py`` and ``data/ledger.py``):

- reads ``run.json`` (config, public key), ``policy/`` (``LATEST``, manifests, weight shards, and
  ``task-data/``: the task's Hugging Face datasets as the learner resolved them), ``ledger/consumed/``
  (flow control: which rollouts the learner settled) and ``reports/summary.json`` (whether the run has finished);
- lists ``rollouts/`` (its backlog) and ``ledger/consumed/``;
- writes its own rollout files ``rollouts/v<version>/<actor>-<seq>.arrow`` (create-if-absent,
  whose retry reads its own object back) and its relay record ``peers/<actor>.json``, which it
  deletes when it leaves; both only as objects the learner can read: in the ``STANDARD`` storage
  class (a ``GLACIER`` object answers a HEAD but no GET or copy) and without a customer-provided
  encryption key (SSE-C: reading needs the key the actor kept).

Everything else is the learner's: it cannot publish a version (``policy/``), forge or erase the
ledger, rewrite ``run.json``, write in another actor's name, or touch another run.

On AWS the learner holds a role whose permissions cover every actor of the bucket (``role_policy``)
and hands each actor an STS session of it narrowed by a session policy (``actor_policy``): AWS
grants the intersection, and the session expires. ``infra/iam/`` ships both documents as templates
generated from these functions (a test keeps them in sync). The GCS equivalent is documented there
only. Every ARN is built from ``data/layout.py``, the one module that spells keys.

An expelled actor (``FleetManager.expel``: caught lying) must not keep its session for the hours it has left: the
learner denies it at once (``SessionDenier``), with an inline policy on the role itself that denies every action to
that session's name (``aws:userid`` of an assumed role ends with ``:<session name>``) until the session would have
expired anyway. AWS evaluates a role's policies at every request, so the deny holds from the next one; the learner's
principal needs ``iam:GetRolePolicy`` and ``iam:PutRolePolicy`` on that role (``infra/iam/README.md``). AWS caps a
role's inline policies at 10,240 characters in all, about 40 denials at once; a denial past its session's expiry is
dropped at the next one.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from echo2.data import layout
from echo2.fleet.backends.base import FleetApiError

MIN_DURATION_S = 900
MAX_DURATION_S = 43200
"""STS bounds for ``DurationSeconds`` (the role's MaxSessionDuration may lower the upper one)."""

SESSION_POLICY_MAX_CHARS = 2048
"""AWS's limit on the plain text of an inline session policy."""

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.=-]+(/[A-Za-z0-9_.=-]+)*$")

# Placeholders of the shipped templates (infra/iam/*.json): sentinels that pass validation and
# occur nowhere else, swapped for ``{{NAME}}`` after the document is built.
_SENTINELS = {"BUCKET": "echo2-sentinel-bucket", "PREFIX": "echo2-sentinel-prefix/",
              "RUN_ID": "echo2-sentinel-run", "ACTOR_ID": "echo2-sentinel-actor"}


def _check(kind: str, value: str, pattern: re.Pattern[str]) -> None:
    """Names go into ARNs: ``*``, ``?`` or ``${...}`` would widen the grant, ``/`` or ``..`` move it."""
    if not pattern.match(value) or {".", ".."} & set(value.split("/")):
        raise ValueError(f"{kind} {value!r} cannot be scoped (allowed: {pattern.pattern})")


def run_root(prefix: str, run_id: str) -> str:
    """The run root inside the bucket, ``[<prefix>/]runs/<run>/`` (the store URL is ``s3://<bucket>/<prefix>``)."""
    prefix = prefix.strip("/")
    if prefix:
        _check("store prefix", prefix, _PREFIX_RE)
    return f"{prefix + '/' if prefix else ''}{layout.RUNS}/{run_id}/"


READABLE_WRITES = {"StringEqualsIfExists": {"s3:x-amz-storage-class": "STANDARD"},
                   "Null": {"s3:x-amz-server-side-encryption-customer-algorithm": "true"}}
"""The condition on an actor's ``PutObject``: no storage class other than ``STANDARD`` (none named is
``STANDARD``) and no SSE-C key, so every object it writes is one the learner can read and copy. A
condition on the grant rather than a Deny statement: nothing else grants ``PutObject`` there, so it
denies just as much (the learner quarantines whatever else reaches it, ``data/quarantine.py``)."""


def _statements(bucket: str, root: str, actor_glob: str) -> list[dict[str, Any]]:
    """The grant, for one actor (``actor_glob`` its id) or all (``*``); ``root`` ends with ``/``."""
    obj = f"arn:aws:s3:::{bucket}/{root}"
    return [
        {"Sid": "ReadRun", "Effect": "Allow", "Action": ["s3:GetObject"],
         "Resource": [obj + layout.RUN_JSON, obj + layout.POLICY + "*",
                      obj + layout.LEDGER_CONSUMED + "*", obj + layout.SUMMARY]},
        # Key names of the run are not secret from its members, and S3 answers a HEAD of a missing
        # key (``exists(summary.json)``) with 404 only to a caller who may list: 403 otherwise.
        {"Sid": "ListRun", "Effect": "Allow", "Action": ["s3:ListBucket"],
         "Resource": [f"arn:aws:s3:::{bucket}"],
         "Condition": {"StringLike": {"s3:prefix": [root + "*"]}}},
        # GetObject too: a create-if-absent that meets an object reads it back (FsspecStore.put).
        {"Sid": "WriteOwnRollouts", "Effect": "Allow",
         "Action": ["s3:PutObject", "s3:GetObject", "s3:AbortMultipartUpload"],
         "Resource": [obj + layout.rollout_key_glob(actor_glob)], "Condition": READABLE_WRITES},
        {"Sid": "OwnPeerRecord", "Effect": "Allow", "Action": ["s3:PutObject", "s3:DeleteObject"],
         "Resource": [obj + layout.peer_key(actor_glob)], "Condition": READABLE_WRITES},
    ]


def actor_policy(bucket: str, prefix: str, run_id: str, actor_id: str) -> dict[str, Any]:
    """The IAM policy document of one actor's credentials in run ``run_id`` of ``s3://bucket/prefix``.

    Read the run's config, policy versions and consumed ledger; list the run; write only this
    actor's rollout files and relay record. Raises ValueError for a name that would widen the grant.
    """
    _check("bucket", bucket, _BUCKET_RE)
    _check("run id", run_id, _NAME_RE)
    _check("actor id", actor_id, _NAME_RE)
    if not layout.valid_actor_id(actor_id):
        raise ValueError(f"actor id {actor_id!r} is not a valid actor id")
    return {"Version": "2012-10-17", "Statement": _statements(bucket, run_root(prefix, run_id), actor_id)}


def role_policy(bucket: str, prefix: str) -> dict[str, Any]:
    """The permissions of the role the learner assumes for actors: every actor of every run under
    ``s3://bucket/prefix``. A session gets the intersection with its ``actor_policy``, so the role
    must allow at least that much; anything it allows beyond is never reachable by an actor.
    """
    _check("bucket", bucket, _BUCKET_RE)
    root = run_root(prefix, "*")
    return {"Version": "2012-10-17", "Statement": _statements(bucket, root, "*")}


def compact(policy: dict[str, Any]) -> str:
    """The document as sent to STS: no whitespace, so it stays under ``SESSION_POLICY_MAX_CHARS``."""
    return json.dumps(policy, separators=(",", ":"))


# -- shipped templates (infra/iam/) ---------------------------------------------------------------
def _templated(doc: dict[str, Any]) -> str:
    text = json.dumps(doc, indent=2) + "\n"
    for name, sentinel in _SENTINELS.items():
        text = text.replace(sentinel, "{{" + name + "}}")
    return text


def actor_policy_template() -> str:
    """``infra/iam/actor-policy.json``: ``{{BUCKET}}``, ``{{PREFIX}}`` (the store prefix with a
    trailing ``/``, or empty), ``{{RUN_ID}}``, ``{{ACTOR_ID}}``."""
    s = _SENTINELS
    return _templated(actor_policy(s["BUCKET"], s["PREFIX"], s["RUN_ID"], s["ACTOR_ID"]))


def role_policy_template() -> str:
    """``infra/iam/actor-role-policy.json``: ``{{BUCKET}}`` and ``{{PREFIX}}`` as above."""
    return _templated(role_policy(_SENTINELS["BUCKET"], _SENTINELS["PREFIX"]))


def render_template(text: str, *, bucket: str, prefix: str, run_id: str = "", actor_id: str = "") -> dict[str, Any]:
    """Fill a shipped template (what an operator's script does with ``sed``), parsed."""
    prefix = prefix.strip("/")
    values = {"BUCKET": bucket, "PREFIX": prefix + "/" if prefix else "", "RUN_ID": run_id, "ACTOR_ID": actor_id}
    for name, value in values.items():
        text = text.replace("{{" + name + "}}", value)
    return json.loads(text)


# -- STS ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScopedCredentials:
    """What an actor gets: environment variables (delivered through the backend's secret channel,
    never a file or the store) and when they stop working. The secrets stay out of ``repr``."""

    actor_id: str
    expires_at: datetime
    env: dict[str, str] = field(repr=False)


def session_name(actor_id: str) -> str:
    """``RoleSessionName`` (shows in CloudTrail as the assumed-role ARN: which actor did what)."""
    return f"echo2-{actor_id}"[:64]


def scoped_credentials(sts_client: Any, role_arn: str, policy: dict[str, Any], actor_id: str,
                       duration_s: int) -> ScopedCredentials:
    """Assume ``role_arn`` narrowed by the session policy ``policy`` for ``duration_s`` seconds.

    ``sts_client`` is a boto3 STS client of the learner's principal (the role's trust policy names
    it). AWS enforces the intersection of the role's and the session's policy and the expiry.
    """
    if not MIN_DURATION_S <= duration_s <= MAX_DURATION_S:
        raise ValueError(f"duration_s must be within [{MIN_DURATION_S}, {MAX_DURATION_S}], got {duration_s}")
    doc = compact(policy)
    if len(doc) > SESSION_POLICY_MAX_CHARS:
        raise ValueError(f"session policy is {len(doc)} characters, over AWS's {SESSION_POLICY_MAX_CHARS}")
    reply = sts_client.assume_role(RoleArn=role_arn, RoleSessionName=session_name(actor_id), Policy=doc,
                                   DurationSeconds=int(duration_s))
    creds = reply["Credentials"]
    return ScopedCredentials(
        actor_id=actor_id,
        expires_at=creds["Expiration"],
        env={"AWS_ACCESS_KEY_ID": creds["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
             "AWS_SESSION_TOKEN": creds["SessionToken"]},
    )


DENY_POLICY_PREFIX = "echo2-expelled-"
"""The role's inline policy that denies a run's expelled actors: ``echo2-expelled-<run>``."""


def denial_statement(actor_id: str, until: float) -> dict[str, Any]:
    """Deny everything to ``actor_id``'s session of the role until ``until`` (seconds since the epoch): the
    condition on ``aws:userid`` names the session (``ROLEID:<session name>``), the one on time lets it lapse."""
    stamp = datetime.fromtimestamp(until, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"Sid": "Deny" + re.sub(r"[^A-Za-z0-9]", "", actor_id)[:100], "Effect": "Deny", "Action": "*",
            "Resource": "*", "Condition": {"StringLike": {"aws:userid": f"*:{session_name(actor_id)}"},
                                           "DateLessThan": {"aws:CurrentTime": stamp}}}


def _until(statement: dict) -> float | None:
    try:
        stamp = statement["Condition"]["DateLessThan"]["aws:CurrentTime"]
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


class SessionDenier:
    """Deny expelled actors' sessions of the credentials role at once (see the module docstring). ``iam_client``: a
    boto3 IAM client of the learner's principal (the tests give a test double, or moto's)."""

    def __init__(self, role_arn: str, run_id: str, *, iam_client: Any = None, endpoint_url: str | None = None,
                 session_s: float = MAX_DURATION_S, clock=time.time):
        self.role_name = role_arn.rsplit("/", 1)[-1]
        self.policy_name = f"{DENY_POLICY_PREFIX}{run_id}"[:128]
        self.session_s = session_s
        self.clock = clock
        if iam_client is None:
            import boto3

            iam_client = boto3.client("iam", endpoint_url=endpoint_url)
        self.iam = iam_client
        self.pending: list[str] = []
        """Actors whose denial AWS refused so far (``retry``)."""

    def request(self, actor_id: str) -> None:
        """Deny ``actor_id``'s session now, or as soon as AWS takes it (``retry``): never raises."""
        self.pending.append(actor_id)
        self.retry()

    def retry(self) -> None:
        """Deny the sessions still pending (every reconcile pass); a failure is logged and asked again later."""
        if not self.pending:
            return
        try:
            self.deny(list(self.pending))
        except Exception as exc:
            logging.getLogger("echo2.fleet").warning("could not deny the store sessions of %s yet (%s); asking "
                                                     "again at the next pass", ", ".join(self.pending), exc)
            return
        self.pending = []

    @classmethod
    def of_fleet(cls, config: Any, launch: Any) -> "SessionDenier | None":
        """The denier of a fleet that mints scoped store credentials (``fleet.credentials_role_arn``), else None."""
        role_arn = getattr(config, "credentials_role_arn", None)
        if not role_arn or launch is None:
            return None
        return cls(role_arn, launch.run_id, endpoint_url=getattr(config, "sts_endpoint_url", None),
                   session_s=getattr(config, "credentials_hours", MAX_DURATION_S / 3600) * 3600)

    def _current(self) -> list[dict]:
        try:
            reply = self.iam.get_role_policy(RoleName=self.role_name, PolicyName=self.policy_name)
        except Exception as exc:
            if type(exc).__name__ == "NoSuchEntityException" or "NoSuchEntity" in str(exc):
                return []
            raise
        doc = reply["PolicyDocument"]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        statements = doc.get("Statement", [])
        return statements if isinstance(statements, list) else [statements]

    def deny(self, actor_ids: list[str]) -> None:
        """Deny every session of ``actor_ids`` from now until it would expire (a resumed learner's denials of
        this run are kept: the policy is read first). FleetApiError when AWS should be asked again later."""
        now = self.clock()
        try:
            kept = {s.get("Sid"): s for s in self._current() if (_until(s) or 0) > now}
            for actor_id in actor_ids:
                statement = denial_statement(actor_id, now + self.session_s)
                kept[statement["Sid"]] = statement
            doc = {"Version": "2012-10-17", "Statement": list(kept.values())}
            self.iam.put_role_policy(RoleName=self.role_name, PolicyName=self.policy_name, PolicyDocument=compact(doc))
        except Exception as exc:
            if transient_aws_error(exc):
                raise FleetApiError(f"IAM could not deny the sessions of {', '.join(actor_ids)}: {exc}") from exc
            raise
        logging.getLogger("echo2.fleet").warning("denied the store sessions of %s (role %s, policy %s)",
                                                 ", ".join(actor_ids), self.role_name, self.policy_name)


THROTTLING_CODES = frozenset({"Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
                              "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
                              "SlowDown", "RequestTimeout", "RequestTimeoutException", "IDPCommunicationError",
                              "ServiceUnavailable", "InternalError"})
"""AWS error codes of a request worth repeating later (the others, AccessDenied first, are the setup's)."""


def transient_aws_error(exc: BaseException) -> bool:
    """Whether an AWS client error passes by itself: no connection, a timeout, a throttle, a 5xx."""
    try:
        from botocore.exceptions import ClientError, HTTPClientError
        from botocore.exceptions import ConnectionError as NoConnection
    except ImportError:
        return False
    if isinstance(exc, (NoConnection, HTTPClientError)):
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return exc.response.get("Error", {}).get("Code") in THROTTLING_CODES or status >= 500
    return False


def split_store_url(url: str, run_id: str) -> tuple[str, str]:
    """``s3://bucket/prefix/runs/<run>`` -> (bucket, prefix): what ``actor_policy`` scopes."""
    if not url.startswith("s3://"):
        raise ValueError(f"scoped credentials are minted for s3:// stores only, not {url!r} "
                         "(GCS: see infra/iam/README.md)")
    bucket, _, path = url[len("s3://"):].partition("/")
    tail = f"{layout.RUNS}/{run_id}"
    path = path.strip("/")
    if path != tail and not path.endswith("/" + tail):
        raise ValueError(f"{url!r} is not the root of run {run_id!r}")
    return bucket, path[: -len(tail)].strip("/")


def mint_actor_credentials(run_url: str, run_id: str, actor_id: str, *, role_arn: str, hours: float,
                           sts_endpoint_url: str | None = None, sts_client: Any = None) -> ScopedCredentials:
    """One actor's scoped, expiring S3 credentials for run ``run_id`` at ``run_url``."""
    bucket, prefix = split_store_url(run_url, run_id)
    if sts_client is None:
        import boto3

        sts_client = boto3.client("sts", endpoint_url=sts_endpoint_url)
    duration = int(min(max(hours * 3600, MIN_DURATION_S), MAX_DURATION_S))
    try:  # botocore has retried already (its own retry mode): one layer of retries, not two
        return scoped_credentials(sts_client, role_arn, actor_policy(bucket, prefix, run_id, actor_id), actor_id,
                                  duration)
    except Exception as exc:
        if transient_aws_error(exc):  # the manager launches this actor at its next pass
            raise FleetApiError(f"STS AssumeRole for {actor_id} failed: {type(exc).__name__}: {exc}") from exc
        raise


if __name__ == "__main__":  # regenerate the shipped templates: python -m echo2.fleet.credentials
    from echo2 import shipped

    out = shipped.path("iam")  # in a checkout (editable install): the repository's infra/iam
    out.mkdir(parents=True, exist_ok=True)
    (out / "actor-policy.json").write_text(actor_policy_template())
    (out / "actor-role-policy.json").write_text(role_policy_template())
    print(f"wrote {out}/actor-policy.json and actor-role-policy.json")
