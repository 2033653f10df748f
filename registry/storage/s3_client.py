"""The boto3 client the S3 store uses, and what its errors mean to the registry.

boto3 itself is imported when the first client is made, so opening a store costs nothing for a
command that never touches it. `translate` turns botocore's errors into the registry's (one line,
an exit code); `retryable` says which ones a part upload retries.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import botocore.loaders
import botocore.session
from botocore.config import Config
from botocore.exceptions import ClientError

from registry.core.config import Settings
from registry.errors import NotFound, RegistryError, UsageError

if TYPE_CHECKING:
    from registry.core.config import S3Settings


def new_client(settings: S3Settings | None = None) -> Any:
    """A client with the settings' retries (`None`: the environment's, read now)."""
    import boto3  # here, not at import: opening a store must not cost boto3's import

    s3 = settings or Settings.from_env().s3
    config = Config(
        # AWS_MAX_ATTEMPTS, the SDKs' own setting, lowers the 10 attempts where a dead endpoint
        # should be reported quickly rather than ridden out.
        retries={
            "mode": s3.retry_mode,
            "max_attempts": s3.max_attempts,
        },
        max_pool_connections=32,
        s3={"addressing_style": "path"},
        # Requests are SigV4 anyway; presigned URLs would be SigV2 without this, and SigV2
        # signs no headers (If-None-Match and checksums would not bind).
        signature_version="s3v4",
        connect_timeout=10,
        read_timeout=60,
    )

    # A session of its own (credentials and settings are read from this moment's environment),
    # over the process's one data loader: a fresh loader parses botocore's S3 model and
    # endpoint rules again, 0.1-0.2 s a client here; a warm one makes a client in 15-20 ms.
    core = botocore.session.get_session()
    core.register_component("data_loader", _data_loader())
    return boto3.session.Session(botocore_session=core).client("s3", config=config)


@functools.cache
def _data_loader() -> Any:
    """botocore's loader of its JSON models, which caches what it has read (read-only data)."""
    return botocore.loaders.create_loader()


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        return error_code(exc) in (
            "SlowDown",
            "500",
            "502",
            "503",
            "504",
            "InternalError",
            "ServiceUnavailable",
            "RequestTimeout",
            "ThrottlingException",
        )
    return True  # connection errors


def translate(exc: BaseException, key: str) -> RegistryError:
    if isinstance(exc, ClientError):
        code = error_code(exc)
        if code in ("NoSuchKey", "404", "NotFound"):
            return NotFound(f"object {key} is missing from the store")
        if code == "NoSuchUpload":  # completed or aborted already
            return NotFound(f"no multipart upload of {key} is in progress")
        if code in ("NoSuchVersion", "405", "MethodNotAllowed"):  # 405: a delete marker
            return NotFound(
                f"the recorded version of {key} is gone from the bucket",
                "a bucket copy or replication gives objects new version ids; "
                "`reg verify` shows what is left",
            )
        if code in ("NoSuchBucket",):
            return UsageError(f"S3 bucket does not exist: {exc}", "check REG_STORE_URL")
        if code in ("AccessDenied", "403", "AllAccessDisabled"):
            return RegistryError(
                f"S3 refused access to {key or 'the bucket'}: {code}",
                "check the credentials and the bucket policy",
            )
        return RegistryError(
            f"S3 error on {key or 'the bucket'}: {code}: "
            f"{exc.response.get('Error', {}).get('Message', '')}",
            "retry; a failed operation leaves nothing half-visible",
        )
    return RegistryError(
        f"cannot reach S3 for {key or 'the bucket'}: {exc}",
        "check AWS_ENDPOINT_URL and the network; retry",
    )


def content_type(key: str) -> str:
    """The Content-Type an object is stored with: reg's documents are JSON."""
    return "application/json" if key.endswith(".json") else "application/octet-stream"
