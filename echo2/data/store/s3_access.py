"""Why an S3 bucket cannot be used, in one line that names the fix: no credentials, credentials S3 refuses, access
denied, or no such bucket. s3fs's ``exists`` answers False to all four, which would all read as a missing bucket."""

from __future__ import annotations

from echo2.data.store.base import StoreError

_REFUSED_CREDENTIALS = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                                  "TokenRefreshRequired", "InvalidClientTokenId"})
"""S3's error codes for credentials it does not accept (rather than credentials without the permission)."""


def _error_code(exc: BaseException) -> str | None:
    """S3's error code behind an exception s3fs translated (its ``__cause__`` is botocore's ``ClientError``)."""
    for candidate in (exc, exc.__cause__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
    return None


def check_bucket(fs, url: str, bucket: str) -> None:
    """Raise ``StoreError`` naming the fix when the bucket cannot be used: no credentials, credentials S3 refuses,
    access denied, no such bucket. s3fs's ``exists`` answers False to all four, which read as a missing bucket."""
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    try:
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
            return
        except PermissionError:
            # HEAD's 403 has no body: a listing's error code tells refused credentials from a denied access
            fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
            return
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise StoreError(f"store {url}: no AWS credentials found ({exc}): set AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run `aws configure` (`aws sso login`), or put "
                         "key and secret in store.options") from None
    except FileNotFoundError:
        raise StoreError(f"store {url}: bucket {bucket} does not exist: create it (aws s3 mb s3://{bucket}) or fix "
                         "store.url") from None
    except PermissionError as exc:
        code = _error_code(exc) or "AccessDenied"
        if code in _REFUSED_CREDENTIALS:
            raise StoreError(f"store {url}: S3 refused the credentials ({code}): check AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY or AWS_PROFILE (a session token may have expired: log in "
                             "again)") from None
        raise StoreError(f"store {url}: access to bucket {bucket} denied ({code}): the credentials in use need "
                         f"s3:ListBucket, s3:GetObject and s3:PutObject on it (infra/iam/README.md), or the bucket "
                         "is another account's") from None
