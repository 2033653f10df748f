"""Object stores by URL scheme; a backend's dependencies are imported only when it is used."""

from __future__ import annotations

import importlib
from pathlib import Path
from urllib.parse import unquote, urlparse

from registry.errors import UsageError
from registry.storage.base import ObjectInfo, ObjectStore, PutResult

__all__ = ["ObjectInfo", "ObjectStore", "PutResult", "open_store"]

_SCHEMES = {
    "s3": ("registry.storage.s3", "S3Store", "pip install boto3"),
}


def open_store(url: str) -> ObjectStore:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        from registry.storage.local import LocalStore

        path = unquote(parsed.path) if parsed.scheme == "file" else url
        return LocalStore(Path(path))
    if parsed.scheme not in _SCHEMES:
        raise UsageError(
            f"unsupported store URL {url!r}",
            "use file:///path or s3://bucket/prefix in REG_STORE_URL",
        )
    module_name, class_name, install = _SCHEMES[parsed.scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(
            f"the {parsed.scheme} store needs a missing package: {exc}", install
        ) from exc
    store: ObjectStore = getattr(module, class_name).from_url(url)
    return store
