"""Object stores by URL scheme; a backend's dependencies are imported only when it is used.

file:///path or /path    LocalStore (the embedded default)
s3://bucket/prefix       S3Store (boto3; AWS_ENDPOINT_URL for S3-compatible servers)
memory://name            MemoryStore (one per name per process; tests, trying things out)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from registry.errors import UsageError
from registry.storage.base import BaseStore, ObjectInfo, PutResult, Swept
from registry.storage.local import LocalStore
from registry.text import redact_url

if TYPE_CHECKING:
    from registry.core.config import S3Settings

__all__ = ["BaseStore", "ObjectInfo", "PutResult", "Swept", "open_store"]

# scheme -> (module, class), imported when a store of that scheme is opened
_SCHEMES = {
    "s3": ("registry.storage.s3", "S3Store"),
    "memory": ("registry.storage.memory", "MemoryStore"),
}


def open_store(
    url: str,
    *,
    release_lock: Callable[[], tuple[str, int]] | None = None,
    s3: S3Settings | None = None,
) -> BaseStore:
    """The store at `url`. `release_lock` gives the Object Lock (mode, days) for release
    objects, asked only when one is written to a store that supports locking (S3); `s3`: the
    S3 client's retries (else read from the environment when the first request is made)."""
    parsed = urlparse(url)
    if "@" in parsed.netloc:
        raise UsageError(
            f"the store URL {redact_url(url)!r} carries credentials; refused",
            "give S3 credentials through the AWS variables or profile, never in REG_STORE_URL "
            "(it is shown in output, logs and MLflow)",
        )
    if parsed.scheme in ("", "file"):
        path = unquote(parsed.path) if parsed.scheme == "file" else url
        return LocalStore(Path(path))
    if parsed.scheme not in _SCHEMES:
        raise UsageError(
            f"unsupported store URL {url!r}",
            "use file:///path, s3://bucket/prefix or memory://name in REG_STORE_URL",
        )
    module_name, class_name = _SCHEMES[parsed.scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # every backend's packages are reg's own dependencies
        raise UsageError(
            f"the {parsed.scheme} store cannot be loaded: {exc}",
            "the installation is incomplete; reinstall reg (pip install --force-reinstall)",
        ) from exc
    cls = getattr(module, class_name)
    if parsed.scheme == "s3":
        store: BaseStore = cls.from_url(url, release_lock=release_lock, settings=s3)
    else:
        store = cls.from_url(url)
    return store
