"""An expelled actor loses its store session at once (``fleet/credentials.py``, ``SessionDenier``;
``FleetManager.expel``), not when its credentials expire hours later.

IAM is moto's, in this process (``mock_aws``: no cloud is reachable from here): it stores the role's inline policy as
AWS would and refuses a document AWS would refuse. The fleet's cloud is ``test_fleet.FakeCloud``, a test double of a
provider's API; an IAM that throttles is a test double too."""

from __future__ import annotations

import json

import boto3
import pytest
from fleet_shared import FakeCloud, manager
from moto import mock_aws

from echo2.fleet.credentials import DENY_POLICY_PREFIX, SessionDenier, session_name

ROLE = "echo2-actors"
TRUST = {"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow", "Principal": {"AWS": "arn:aws:iam::123456789012:root"}, "Action": "sts:AssumeRole"}]}


@pytest.fixture
def iam(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("iam")
        arn = client.create_role(RoleName=ROLE, AssumeRolePolicyDocument=json.dumps(TRUST))["Role"]["Arn"]
        yield client, arn


def _denied(client) -> dict[str, dict]:
    doc = client.get_role_policy(RoleName=ROLE, PolicyName=f"{DENY_POLICY_PREFIX}run-1")["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    return {s["Condition"]["StringLike"]["aws:userid"]: s for s in doc["Statement"]}


def test_an_expelled_actor_s_session_is_denied_at_once_and_a_later_expel_keeps_it(tmp_path, iam):
    client, arn = iam
    cloud = FakeCloud()
    fleet, _ = manager(tmp_path, cloud, actors=2)
    fleet.denier = SessionDenier(arn, "run-1", iam_client=client)
    fleet.start()
    first, second = (s.actor_id for s in fleet.slots)
    fleet.reconcile(expel={first: "behavior logprobs 1.5 nats off"})
    denied = _denied(client)
    assert list(denied) == [f"*:{session_name(first)}"]
    statement = denied[f"*:{session_name(first)}"]
    assert statement["Effect"] == "Deny" and statement["Action"] == "*" and statement["Resource"] == "*"
    assert "aws:CurrentTime" in statement["Condition"]["DateLessThan"]  # lapses once the session would have
    fleet.reconcile(expel={second: "rewards the task disowns"})
    assert set(_denied(client)) == {f"*:{session_name(first)}", f"*:{session_name(second)}"}
    assert first in fleet.revoked and second in fleet.revoked


class _ThrottledIam:
    """Test double of an IAM that throttles the first ``n`` writes, as AWS does under load."""

    def __init__(self, inner, n: int):
        self.inner, self.n = inner, n

    def get_role_policy(self, **kwargs):
        return self.inner.get_role_policy(**kwargs)

    def put_role_policy(self, **kwargs):
        if self.n:
            self.n -= 1
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": "Throttling", "Message": "Rate exceeded"},
                               "ResponseMetadata": {"HTTPStatusCode": 400}}, "PutRolePolicy")
        return self.inner.put_role_policy(**kwargs)


def test_a_denial_iam_refused_for_now_is_asked_again_at_the_next_pass(tmp_path, iam):
    client, arn = iam
    cloud = FakeCloud()
    fleet, _ = manager(tmp_path, cloud, actors=1)
    fleet.denier = SessionDenier(arn, "run-1", iam_client=_ThrottledIam(client, 2))  # this whole pass
    fleet.start()
    actor = fleet.slots[0].actor_id
    fleet.reconcile(expel={actor: "caught"})  # throttled: expelled all the same, the denial owed
    assert actor in fleet.revoked and actor not in {s.actor_id for s in fleet.slots}
    with pytest.raises(client.exceptions.NoSuchEntityException):
        client.get_role_policy(RoleName=ROLE, PolicyName=f"{DENY_POLICY_PREFIX}run-1")
    fleet.reconcile()
    assert list(_denied(client)) == [f"*:{session_name(actor)}"]
