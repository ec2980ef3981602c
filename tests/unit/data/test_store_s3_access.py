"""An S3 store that cannot be used says why, in one line naming the fix: no credentials, credentials S3 refuses,
access denied, or no such bucket (s3fs's ``exists`` answers False to all four). Against moto's server on
loopback, which checks credentials only while ``moto.settings.INITIAL_NO_AUTH_ACTION_COUNT`` is 0."""

import uuid

import pytest

from echo2.data.store import StoreError
from echo2.data.store.fsspec_store import FsspecStore


def _check(url: str, endpoint: str) -> str:
    store = FsspecStore(url, {"endpoint_url": endpoint})
    with pytest.raises(StoreError) as err:
        store.check()
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.fixture
def bucket(s3_server, moto_credentials):
    import boto3

    name = f"echo2-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def test_a_missing_bucket_is_named_with_how_to_make_it(s3_server, moto_credentials):
    message = _check("s3://no-such-echo2-bucket/x", s3_server)
    assert "bucket no-such-echo2-bucket does not exist" in message
    assert "aws s3 mb s3://no-such-echo2-bucket" in message


def test_no_credentials_is_not_a_missing_bucket(s3_server, bucket, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    message = _check(f"s3://{bucket}/x", s3_server)
    assert "no AWS credentials found" in message and "does not exist" not in message
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_PROFILE" in message


@pytest.fixture
def moto_checks_credentials(monkeypatch):
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)


def test_refused_credentials_are_named(s3_server, bucket, monkeypatch, moto_checks_credentials):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    message = _check(f"s3://{bucket}/x", s3_server)
    assert "refused the credentials" in message and "InvalidAccessKeyId" in message
    assert "does not exist" not in message


def test_access_denied_names_the_permissions_needed(s3_server, bucket, monkeypatch):
    import boto3
    import moto.settings

    iam = boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1")
    user = f"nobody-{uuid.uuid4().hex[:6]}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]  # a user of no policy: every S3 call is denied
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    message = _check(f"s3://{bucket}/x", s3_server)
    assert f"access to bucket {bucket} denied" in message and "s3:ListBucket" in message
    assert "does not exist" not in message
