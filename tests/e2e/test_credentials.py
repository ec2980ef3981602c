"""Per-actor scoped store credentials (echo2/fleet/credentials.py): the policy, its shipped template,
and its enforcement by moto's IAM.

moto 5.2.5 facts these tests rest on (../shared/NOTES.md, "moto 5.2.5"): session policies are stored
and ignored, role inline policies are enforced once ``/moto-api/reset-auth`` turns auth on, and
``IAMPolicy(doc).is_action_permitted`` evaluates a document. moto turns an IAM wildcard into a regex
by replacing ``*`` with ``.*`` only: ``.`` stays a regex dot and ``?`` (one character in IAM, used by
the rollout pattern) breaks the regex. ``aws_wildcards`` replaces that one matcher with AWS's
documented semantics (``*`` any run of characters, ``?`` exactly one, the rest literal); the rest of
moto's evaluation (actions, statements, roles, STS, auth) is moto's own. moto ignores the
``StringLike`` condition on ``s3:prefix``; ``test_list_condition`` checks it separately. moto evaluates
only ``StringEquals`` conditions, and only on the values a caller hands ``is_action_permitted`` (its
S3 server hands none): ``aws_conditions`` adds AWS's documented ``StringEqualsIfExists`` and ``Null``
to its table, so the document's conditions on ``PutObject`` (storage class, SSE-C) are evaluated.
"""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from echo2.data import layout
from echo2.fleet import credentials as C

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "rl-bucket"


def _aws_match(pattern: str, value: str):
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, re.DOTALL)


@pytest.fixture
def aws_wildcards(monkeypatch):
    from moto.iam.access_control import IAMPolicyStatement

    monkeypatch.setattr(IAMPolicyStatement, "_match", staticmethod(_aws_match))


@pytest.fixture
def aws_conditions(monkeypatch):
    """AWS's ``StringEqualsIfExists`` and ``Null`` in moto's condition table. moto checks each key a
    request carries against the operator and skips the keys it lacks, which is what ``...IfExists``
    means, and what ``Null: "true"`` (the key is absent) needs once any carried value fails it."""
    from moto.iam import policy_conditions

    def null(expected, actual):  # called only for a key the request carries: it is not null
        return str(expected).lower() == "false"

    monkeypatch.setitem(policy_conditions.CONDITION_OPERATIONS, "StringEqualsIfExists",
                        policy_conditions.string_equals_operation)
    monkeypatch.setitem(policy_conditions.CONDITION_OPERATIONS, "Null", null)


def _arn(prefix: str, run: str, key: str) -> str:
    return f"arn:aws:s3:::{BUCKET}/{C.run_root(prefix, run)}{key}"


# -- (a) the document, evaluated by moto's IAMPolicy ----------------------------------------------
@pytest.mark.parametrize("prefix", ["", "root", "deep/store"])
def test_policy_evaluated(aws_wildcards, aws_conditions, prefix):
    from moto.iam.access_control import IAMPolicy, PermissionResult

    policy = IAMPolicy(json.dumps(C.actor_policy(BUCKET, prefix, "r1", "a")))

    def allowed(action: str, key: str, run: str = "r1", headers: dict | None = None) -> bool:
        return policy.is_action_permitted(action, _arn(prefix, run, key),
                                          incoming_condition_values=headers) == PermissionResult.PERMITTED

    own = layout.rollout_key(42, "a", 7)
    assert allowed("s3:PutObject", own)
    assert allowed("s3:GetObject", own)  # a retried create-if-absent reads its own object back
    assert allowed("s3:PutObject", layout.peer_key("a"))
    assert allowed("s3:DeleteObject", layout.peer_key("a"))
    for key in (layout.RUN_JSON, layout.LATEST, layout.manifest_key(layout.policy_dir(3)),
                f"{layout.policy_dir(3)}/shard-0000.safetensors", layout.consumed_key(5), layout.SUMMARY):
        assert allowed("s3:GetObject", key), key

    denied_puts = [
        layout.rollout_key(42, "b", 7),            # another actor's rollouts
        layout.rollout_key(42, "a-b", 7),          # forged under actor "a-b", which the pattern must not cover
        "rollouts/v000042/a-b-000007.arrow",
        layout.peer_key("b"),
        layout.LATEST, layout.manifest_key(layout.policy_dir(43)),    # cannot publish weights
        f"{layout.policy_dir(43)}/shard-0000.safetensors",
        layout.RUN_JSON,
        layout.consumed_key(5), layout.FINAL_CONSUMED, layout.event_key(1.0, "a", "x"),  # the ledger
        layout.quarantine_key(own), layout.SUMMARY, layout.manifest_key(layout.checkpoint_dir(40)),
        layout.orphaned_prefix("t") + own,
    ]
    for key in denied_puts:
        assert not allowed("s3:PutObject", key), key
    assert not allowed("s3:PutObject", own, run="r2")  # another run
    assert not allowed("s3:PutObject", layout.peer_key("a"), run="r2")
    assert not allowed("s3:GetObject", layout.RUN_JSON, run="r2")
    assert not allowed("s3:GetObject", layout.LATEST, run="r2")
    for key in (layout.peer_key("b"), own, layout.RUN_JSON, layout.LATEST, layout.consumed_key(5)):
        assert not allowed("s3:DeleteObject", key), key
    for key in (layout.rollout_key(1, "b", 1), layout.manifest_key(layout.checkpoint_dir(40)),
                layout.event_key(1.0, "b", "x")):
        assert not allowed("s3:GetObject", key), key
    # only objects the learner can read and copy: STANDARD (or no class named), no customer-provided key
    for key in (own, layout.peer_key("a")):
        assert allowed("s3:PutObject", key, headers={"s3:x-amz-storage-class": "STANDARD"}), key
        for storage_class in ("GLACIER", "DEEP_ARCHIVE", "GLACIER_IR", "STANDARD_IA", "REDUCED_REDUNDANCY"):
            assert not allowed("s3:PutObject", key,
                               headers={"s3:x-amz-storage-class": storage_class}), (key, storage_class)
        assert not allowed("s3:PutObject", key,
                           headers={"s3:x-amz-server-side-encryption-customer-algorithm": "AES256"}), key
    assert policy.is_action_permitted("s3:ListBucket", f"arn:aws:s3:::{BUCKET}") == PermissionResult.PERMITTED
    assert policy.is_action_permitted("s3:ListBucket", "arn:aws:s3:::other-bucket") != PermissionResult.PERMITTED
    assert policy.is_action_permitted("s3:DeleteBucket", f"arn:aws:s3:::{BUCKET}") != PermissionResult.PERMITTED


def test_list_condition():
    """moto ignores StringLike: the ``s3:prefix`` values are matched here with AWS's wildcard rules."""
    doc = C.actor_policy(BUCKET, "root", "r1", "a")
    [statement] = [s for s in doc["Statement"] if "s3:ListBucket" in s["Action"]]
    patterns = statement["Condition"]["StringLike"]["s3:prefix"]

    def listable(prefix: str) -> bool:
        return any(_aws_match(p, prefix) for p in patterns)

    for folder in (layout.ROLLOUTS, layout.LEDGER_CONSUMED, layout.POLICY, layout.PEERS):
        assert listable(f"root/runs/r1/{folder}")
    assert listable("root/runs/r1/reports/summary.json/")  # s3fs's directory probe after a HEAD 404
    for prefix in ("", "root/", "root/runs/", "root/runs/r2/rollouts/", "root/runs/r10/", "other/runs/r1/"):
        assert not listable(prefix), prefix


def test_rollout_glob_is_exactly_one_actor():
    glob = layout.rollout_key_glob("a")
    assert _aws_match(glob, layout.rollout_key(0, "a", 0)) and _aws_match(glob, layout.rollout_key(999999, "a", 999999))
    for other in ("b", "a-b", "a-", "a.b", "ab"):
        for v, s in ((0, 0), (1, 1), (12, 123456)):
            key = layout.rollout_key(v, other, s)
            assert not _aws_match(glob, key) or layout.parse_rollout_key(key)[1] == "a", key
    # whatever six characters fill the pattern, the key is "a"'s own or outside the layout
    for filler in ("b-0001", "-00000", "/x/y/z", "000001"):
        key = f"{layout.ROLLOUTS}v000001/a-{filler}.arrow"
        parsed = layout.parse_rollout_key(key)
        assert _aws_match(glob, key) and (parsed is None or parsed[1] == "a"), key


@pytest.mark.parametrize("bad", ["*", "a*", "a?", "${aws:username}", "a/b", "..", ".", "", "x" * 65])
def test_names_that_would_widen_the_grant_are_refused(bad):
    with pytest.raises(ValueError):
        C.actor_policy(BUCKET, "", "r1", bad)
    with pytest.raises(ValueError):
        C.actor_policy(BUCKET, "", bad, "a")
    if bad not in ("a/b", "", "x" * 65):  # fine inside a store prefix
        with pytest.raises(ValueError):
            C.actor_policy(BUCKET, f"p/{bad}", "r1", "a")


def test_session_policy_fits_sts_limit():
    """A realistic worst case (63-character bucket, nested prefix, long ids) stays under 2048 characters."""
    doc = C.compact(C.actor_policy("b" * 63, "team-rl/echo2/store", "r" * 40, "actor12-" + "f" * 24))
    assert len(doc) <= C.SESSION_POLICY_MAX_CHARS, len(doc)


# -- the shipped templates ------------------------------------------------------------------------
def test_shipped_templates_in_sync():
    """Regenerate with ``.venv/bin/python -m echo2.fleet.credentials``."""
    assert (ROOT / "infra/iam/actor-policy.json").read_text() == C.actor_policy_template()
    assert (ROOT / "infra/iam/actor-role-policy.json").read_text() == C.role_policy_template()


@pytest.mark.parametrize("prefix", ["", "root", "deep/store"])
def test_templates_render_to_the_function(prefix, aws_wildcards):
    from moto.iam.access_control import IAMPolicy, PermissionResult

    text = (ROOT / "infra/iam/actor-policy.json").read_text()
    rendered = C.render_template(text, bucket=BUCKET, prefix=prefix, run_id="r1", actor_id="a")
    assert rendered == C.actor_policy(BUCKET, prefix, "r1", "a")
    role = C.render_template((ROOT / "infra/iam/actor-role-policy.json").read_text(), bucket=BUCKET, prefix=prefix)
    assert role == C.role_policy(BUCKET, prefix)
    # the role covers every actor's grant: each resource of the session policy is allowed by the role
    role_eval = IAMPolicy(json.dumps(role))
    for statement in rendered["Statement"]:
        for action in statement["Action"]:
            for resource in statement["Resource"]:
                concrete = resource.replace("?", "0")
                assert role_eval.is_action_permitted(action, concrete) == PermissionResult.PERMITTED, (action, concrete)


# -- STS call -------------------------------------------------------------------------------------
class _FakeSts:
    def __init__(self):
        self.calls = []

    def assume_role(self, **kwargs):
        self.calls.append(kwargs)
        return {"Credentials": {"AccessKeyId": "AK", "SecretAccessKey": "SK", "SessionToken": "TOK",
                                "Expiration": datetime(2030, 1, 1)}}


def test_scoped_credentials_call():
    sts, policy = _FakeSts(), C.actor_policy(BUCKET, "", "r1", "a")
    creds = C.scoped_credentials(sts, "arn:aws:iam::123456789012:role/echo2-actor", policy, "a", 3600)
    [call] = sts.calls
    assert call == {"RoleArn": "arn:aws:iam::123456789012:role/echo2-actor", "RoleSessionName": "echo2-a",
                    "Policy": C.compact(policy), "DurationSeconds": 3600}
    assert creds.env == {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_SESSION_TOKEN": "TOK"}
    assert creds.expires_at == datetime(2030, 1, 1)
    assert "SK" not in repr(creds) and "TOK" not in repr(creds)
    for bad in (899, 43201):
        with pytest.raises(ValueError):
            C.scoped_credentials(sts, "arn:aws:iam::123456789012:role/x", policy, "a", bad)
    with pytest.raises(ValueError):
        C.scoped_credentials(sts, "arn:aws:iam::123456789012:role/x", {"Statement": ["x" * 3000]}, "a", 900)


# -- (b) enforcement by moto's server -------------------------------------------------------------
@pytest.fixture
def auth_server(monkeypatch, aws_wildcards):
    """An in-process moto server of its own, with IAM auth switched on for the test and off after.

    moto keeps the auth switch and its backends per process, shared by every in-process server, so
    the previous setting is put back at teardown (the session's ``s3_server`` runs without auth).
    """
    from moto import settings
    from moto.server import ThreadedMotoServer

    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    assert host == "127.0.0.1"
    try:
        yield f"http://{host}:{port}"
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
        server.stop()


def _client(service, endpoint, env=None):
    import boto3

    keys = {}
    if env:
        keys = dict(aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                    aws_session_token=env.get("AWS_SESSION_TOKEN"))
    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1", **keys)


def _seed_and_enable_auth(endpoint: str, bucket: str, prefix: str, actor: str) -> tuple[dict, str]:
    """As the (trusted) learner with auth off: the run's objects, a user for the learner, a role
    whose inline policy is the actor's scoped document; then auth on. Returns (user env, role ARN)."""
    s3, iam = _client("s3", endpoint), _client("iam", endpoint)
    s3.create_bucket(Bucket=bucket)
    for run in ("r1", "r2"):
        root = C.run_root(prefix, run)
        for key in (layout.RUN_JSON, layout.LATEST, layout.manifest_key(layout.policy_dir(1)),
                    layout.consumed_key(1), layout.rollout_key(1, "b", 1)):
            s3.put_object(Bucket=bucket, Key=root + key, Body=b'{"version": 1}')
    user = f"fleet-{uuid.uuid4().hex[:6]}"
    user_arn = iam.create_user(UserName=user)["User"]["Arn"]
    iam.put_user_policy(UserName=user, PolicyName="admin", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"AWS": user_arn},
                                                     "Action": "sts:AssumeRole"}]}
    role = f"echo2-actor-{uuid.uuid4().hex[:6]}"
    role_arn = iam.create_role(RoleName=role, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    # moto enforces a role's inline policy but not a session policy: the role itself is the scope here
    iam.put_role_policy(RoleName=role, PolicyName="scope",
                        PolicyDocument=json.dumps(C.actor_policy(bucket, prefix, "r1", actor)))
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                 headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).read()
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}, role_arn


def test_enforced_by_moto(auth_server):
    from botocore.exceptions import ClientError

    bucket, prefix = f"echo2-{uuid.uuid4().hex[:8]}", "root"
    learner, role_arn = _seed_and_enable_auth(auth_server, bucket, prefix, "a")
    with pytest.raises(ClientError) as exc:  # auth is on: the default keys are unknown
        _client("s3", auth_server).list_objects_v2(Bucket=bucket)
    assert exc.value.response["Error"]["Code"] == "InvalidAccessKeyId"

    creds = C.scoped_credentials(_client("sts", auth_server, learner), role_arn,
                                 C.actor_policy(bucket, prefix, "r1", "a"), "a", 900)
    assert creds.env["AWS_SESSION_TOKEN"] and isinstance(creds.expires_at, datetime)
    s3 = _client("s3", auth_server, creds.env)

    def key(k: str, run: str = "r1") -> str:
        return C.run_root(prefix, run) + k

    s3.put_object(Bucket=bucket, Key=key(layout.rollout_key(1, "a", 1)), Body=b"x", IfNoneMatch="*")
    s3.put_object(Bucket=bucket, Key=key(layout.peer_key("a")), Body=b"{}")
    s3.delete_object(Bucket=bucket, Key=key(layout.peer_key("a")))
    assert s3.get_object(Bucket=bucket, Key=key(layout.RUN_JSON))["Body"].read()
    assert s3.get_object(Bucket=bucket, Key=key(layout.LATEST))["Body"].read()
    s3.get_object(Bucket=bucket, Key=key(layout.consumed_key(1)))
    s3.list_objects_v2(Bucket=bucket, Prefix=key(layout.ROLLOUTS))

    def denied(call, **kw):
        with pytest.raises(ClientError) as exc:
            call(Bucket=bucket, **kw)
        assert exc.value.response["Error"]["Code"] == "AccessDenied", (call, kw)

    for k in (key(layout.rollout_key(1, "b", 2)), key(layout.rollout_key(1, "a-b", 2)), key(layout.peer_key("b")),
              key(layout.LATEST), key(layout.manifest_key(layout.policy_dir(2))), key(layout.RUN_JSON),
              key(layout.consumed_key(2)), key(layout.event_key(1.0, "a", "x")),
              key(layout.rollout_key(1, "a", 1), run="r2"), key(layout.peer_key("a"), run="r2"), "elsewhere/x"):
        denied(s3.put_object, Key=k, Body=b"x")
    denied(s3.get_object, Key=key(layout.RUN_JSON, run="r2"))
    denied(s3.get_object, Key=key(layout.rollout_key(1, "b", 1)))
    denied(s3.delete_object, Key=key(layout.rollout_key(1, "b", 1)))
    denied(s3.delete_object, Key=key(layout.LATEST))


@pytest.mark.e2e
def test_actor_store_calls_work_with_scoped_credentials(auth_server):
    """What the actor really does, through FsspecStore (s3fs) with the scoped keys: all pass; a
    learner-only write fails."""
    from echo2.broadcast import topology
    from echo2.data.ledger import ConsumedIndex, pending_rollouts
    from echo2.data.store import open_store

    bucket, prefix = f"echo2-{uuid.uuid4().hex[:8]}", "root"
    learner, role_arn = _seed_and_enable_auth(auth_server, bucket, prefix, "a")
    creds = C.scoped_credentials(_client("sts", auth_server, learner), role_arn,
                                 C.actor_policy(bucket, prefix, "r1", "a"), "a", 900)
    store = open_store(f"s3://{bucket}/{C.run_root(prefix, 'r1')}", {
        "endpoint_url": auth_server, "key": creds.env["AWS_ACCESS_KEY_ID"],
        "secret": creds.env["AWS_SECRET_ACCESS_KEY"], "token": creds.env["AWS_SESSION_TOKEN"],
        "skip_instance_cache": True})
    assert store.get_json(layout.RUN_JSON) == {"version": 1}
    assert not store.exists(layout.SUMMARY)
    assert store.get(layout.LATEST)
    ConsumedIndex(store).refresh()
    assert pending_rollouts(store, set()) == [(1, layout.rollout_key(1, "b", 1))]
    store.put(layout.rollout_key(1, "a", 2), b"rows")
    topology.register(store, "a", "https://127.0.0.1:1", 1)
    topology.unregister(store, "a")
    with pytest.raises(PermissionError, match="Access Denied"):  # S3's AccessDenied, as s3fs raises it
        store.put_pointer(layout.LATEST, b'{"version": 99}')
    with pytest.raises(PermissionError, match="Access Denied"):
        store.put(layout.rollout_key(1, "b", 2), b"forged")


def test_shared_s3_server_still_without_auth(s3_store):
    """Runs after the enforcement tests (file order): the session's moto server takes the default keys again."""
    s3_store.put("probe", b"ok")
    assert s3_store.get("probe") == b"ok"
