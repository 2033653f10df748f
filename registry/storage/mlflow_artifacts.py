"""Release bytes that MLflow's own client downloads, behind MLflow's auth: the MLflow server
that `reg ui` runs proxies artifacts (`--serve-artifacts`) from `mlflow-artifacts/` in the reg
store, and a model version's source is `mlflow-artifacts:/<experiment>/releases/<model>/v<K>`.

An active release is published there; a yanked one is taken away (by the yank itself, and again
by every drain), so nothing in MLflow resolves to its bytes. What publishing costs:

- a local store: hard links into the same file system, no byte copied (a store whose
  `mlflow-artifacts/` lies on another file system is refused rather than silently copied);
- S3: a copy inside the bucket (CopyObject of the recorded object version: no byte passes
  through reg, but the release's bytes are stored twice while it is active: S3 has no links).

What is served is checked, not trusted: a local file must be the release object itself (the same
inode), an S3 copy must carry the recorded sha256 and size; anything else in the folder is
removed and the folder published again. `reconcile` removes what no active release explains
(a yanked release, an experiment id the tracking store no longer has, a crashed publish's
leftovers). The experiment in the path is the model's releases experiment
(`registry.catalog.mlflow_names`), so MLflow's auth app judges a download by READ on it.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from registry.core.layout import RELEASE_DOCUMENT, release_prefix
from registry.errors import RegistryError
from registry.storage.local import LocalStore

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from registry.storage.base import BaseStore

ARTIFACTS = "mlflow-artifacts"  # the store prefix MLflow serves as its artifacts destination
_SERVED = re.compile(r"(\d+)/releases/([^/]+)/v([1-9][0-9]*)$")
SHA256_METADATA = "reg-sha256"


@dataclass(frozen=True)
class ServedFile:
    path: str
    size: int
    sha256: str
    version: str | None = None  # the object version on a versioned bucket


def destination(store: BaseStore) -> str | None:
    """The `--artifacts-destination` of the MLflow server for this store; None where MLflow
    cannot reach it (an in-memory store)."""
    if isinstance(store, LocalStore):
        return (store.root / ARTIFACTS).as_uri()
    url = getattr(store, "url", "")
    if url.startswith("s3://"):
        return f"{url.rstrip('/')}/{ARTIFACTS}"
    return None


def source_uri(experiment_id: str, model: str, version: int) -> str:
    """A model version's source: fixed by its number, before the bytes exist."""
    return f"mlflow-artifacts:/{_relative(experiment_id, model, version)}"


def _relative(experiment_id: str, model: str, version: int) -> str:
    return f"{experiment_id}/releases/{model}/v{version}"


def publish(
    store: BaseStore, experiment_id: str, model: str, version: int, files: Sequence[ServedFile]
) -> int:
    """Make release `model:v<version>` (its `files`, release.json included) exactly what the
    source serves. Idempotent; returns the bytes stored a second time (S3 copies)."""
    relative = _relative(experiment_id, model, version)
    if isinstance(store, LocalStore):
        _publish_local(store.root, relative, release_prefix(model, version), files)
        return 0
    copy_within = getattr(store, "copy_within", None)
    if copy_within is None:
        return 0  # an in-memory store: no MLflow server can read it
    return _publish_copies(store, copy_within, relative, release_prefix(model, version), files)


def unpublish_everywhere(store: BaseStore, model: str, version: int) -> int:
    """Take a release's served bytes away under every experiment id (a yank needs no MLflow to
    know which); the number of files removed. Raises when one cannot be removed."""
    removed = 0
    for relative in _served(store):
        match = _SERVED.fullmatch(relative)
        if match is not None and match[2] == model and int(match[3]) == version:
            removed += _remove(store, relative)
    return removed


def reconcile(store: BaseStore, keep: Callable[[str, str, int], bool]) -> int:
    """Remove every served folder `keep(experiment_id, model, version)` does not vouch for, and
    what a crashed publish or yank left; the number of files removed."""
    removed = 0
    for relative in _served(store):
        match = _SERVED.fullmatch(relative)
        if match is None or not keep(match[1], match[2], int(match[3])):
            removed += _remove(store, relative)
    return removed


# -- local stores: hard links ----------------------------------------------------------------------


def _publish_local(
    root: Path, relative: str, source_prefix: str, files: Sequence[ServedFile]
) -> None:
    folder = root / ARTIFACTS / relative
    source = root / source_prefix
    wanted = {f.path for f in files}
    if folder.is_dir() and _same_files(folder, source, wanted):
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        for path in sorted(wanted):
            target = staging / path
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / path, target)
            except OSError as exc:
                raise RegistryError(
                    f"cannot link {source / path} into MLflow's artifacts: {exc.strerror}",
                    f"keep {root / ARTIFACTS} on the store's file system",
                ) from exc
        if folder.exists():
            _discard(folder)  # not the release's own files: replaced whole
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _same_files(folder: Path, source: Path, wanted: set[str]) -> bool:
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()}
    if present != wanted:
        return False
    try:
        return all(os.path.samefile(folder / path, source / path) for path in wanted)
    except OSError:
        return False


def _discard(folder: Path) -> int:
    """Rename away in one step (a download sees the whole folder or none), then delete; the
    files removed (none when a concurrent yank or drain removed it first)."""
    gone = folder.with_name(f".{folder.name}.gone-{uuid.uuid4().hex[:8]}")
    try:
        folder.rename(gone)
    except FileNotFoundError:
        return 0
    if not gone.is_dir() or gone.is_symlink():
        gone.unlink()
        return 1
    count = sum(1 for p in gone.rglob("*") if not p.is_dir())
    shutil.rmtree(gone)
    return count


# -- S3: copies in the bucket ----------------------------------------------------------------------


def _publish_copies(
    store: BaseStore,
    copy_within: Callable[..., None],
    relative: str,
    source_prefix: str,
    files: Sequence[ServedFile],
) -> int:
    target = f"{ARTIFACTS}/{relative}/"
    head = getattr(store, "head_response", None)
    wanted = {target + f.path for f in files}
    extra = [info.key for info in store.list(target) if info.key not in wanted]
    if extra:
        _delete(store, extra)
    copied = 0
    # release.json last: a folder that holds it holds everything
    for f in sorted(files, key=lambda f: (f.path == RELEASE_DOCUMENT, f.path)):
        served = head(target + f.path) if head is not None else None
        meta = (served or {}).get("Metadata") or {}
        if served and served["ContentLength"] == f.size and meta.get(SHA256_METADATA) == f.sha256:
            continue
        copy_within(
            source_prefix + f.path,
            target + f.path,
            version=f.version,
            metadata={SHA256_METADATA: f.sha256},
        )
        copied += f.size
    return copied


# -- both ------------------------------------------------------------------------------------------


def _served(store: BaseStore) -> list[str]:
    """The served folders, as `<id>/releases/<model>/v<K>` (or anything else found there)."""
    if isinstance(store, LocalStore):
        base = store.root / ARTIFACTS
        if not base.is_dir():
            return []
        found = list(base.glob("*/releases/*/*")) + list(base.glob("*/releases/*/.*"))
        return sorted(str(p.relative_to(base)) for p in found)
    if getattr(store, "copy_within", None) is None:
        return []
    folders = set()
    for info in store.list(f"{ARTIFACTS}/"):
        parts = info.key.split("/")[1:]
        # a release's folder, or (anything else found there) the object itself
        folders.add("/".join(parts[:4]) if len(parts) > 4 else "/".join(parts))
    return sorted(folders)


def _remove(store: BaseStore, relative: str) -> int:
    if isinstance(store, LocalStore):
        folder = store.root / ARTIFACTS / relative
        return _discard(folder) if folder.exists() else 0
    prefix = f"{ARTIFACTS}/{relative}"
    keys = [i.key for i in store.list(prefix) if i.key == prefix or i.key.startswith(prefix + "/")]
    _delete(store, keys)
    return len(keys)


def _delete(store: BaseStore, keys: list[str]) -> None:
    if not keys:
        return
    _, errors = store.delete_many(keys)
    if errors:
        key, why = next(iter(errors.items()))
        raise RegistryError(
            f"could not remove {len(errors)} served file(s) from {ARTIFACTS}/, e.g. {key}: {why}",
            "MLflow may still serve them: fix the store's permissions, then `reg mlflow sync`",
        )
