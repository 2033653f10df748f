"""Release bytes that MLflow's own client downloads, behind MLflow's auth: the MLflow server
that `reg ui` runs proxies artifacts (`--serve-artifacts`) from `mlflow-artifacts/` in the reg
store, and a model version's source is `mlflow-artifacts:/<experiment>/releases/<model>/v<K>`.

An active release is published there; a yanked one is taken away, so nothing in MLflow resolves
to its bytes. What publishing costs:

- a local store: hard links into the same file system, no byte copied (a store whose
  `mlflow-artifacts/` lies on another file system is refused rather than silently copied);
- S3: a copy inside the bucket (CopyObject: no byte passes through reg, but the release's bytes
  are stored twice while it is active, since S3 has no links).

The experiment in the path is the model's releases experiment (`registry.mirror_names`), so
MLflow's auth app judges a download by READ on it, which follows reg's grants on the model.
Nobody but the mirror may write there: reg's admins get READ on it, not EDIT.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from registry.layout import RELEASE_DOCUMENT, release_prefix

if TYPE_CHECKING:
    from collections.abc import Sequence

    from registry.storage.base import BaseStore

ARTIFACTS = "mlflow-artifacts"  # the store prefix MLflow serves as its artifacts destination


@dataclass(frozen=True)
class Published:
    files: int
    bytes_linked: int  # shared with the release's own objects: no extra space
    bytes_copied: int  # stored a second time (S3)


def destination(store: BaseStore) -> str | None:
    """The `--artifacts-destination` of the MLflow server for this store; None where MLflow
    cannot reach it (an in-memory store)."""
    from registry.storage.local import LocalStore

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
    store: BaseStore,
    experiment_id: str,
    model: str,
    version: int,
    files: Sequence[tuple[str, int]],
) -> Published:
    """Make release `model:v<version>` (its `files`: path, size; release.json included) what
    the source serves. Idempotent: a published release is left as it is."""
    from registry.storage.local import LocalStore

    paths = sorted({path for path, _ in files} | {RELEASE_DOCUMENT})
    total = sum(size for _, size in files)
    if isinstance(store, LocalStore):
        _publish_local(store.root, _relative(experiment_id, model, version), model, version, paths)
        return Published(len(paths), total, 0)
    copy_within = getattr(store, "copy_within", None)
    if copy_within is None:
        return Published(0, 0, 0)  # an in-memory store: no MLflow server can read it
    target = f"{ARTIFACTS}/{_relative(experiment_id, model, version)}/"
    present = {info.key for info in store.list(target)}
    # release.json last: a folder that holds it holds everything
    ordered = [p for p in paths if p != RELEASE_DOCUMENT] + [RELEASE_DOCUMENT]
    copied = 0
    for path in ordered:
        if target + path not in present:
            copy_within(release_prefix(model, version) + path, target + path)
            copied += next((size for p, size in files if p == path), 0)
    return Published(len(paths), 0, copied)


def unpublish(store: BaseStore, experiment_id: str, model: str, version: int) -> int:
    """Take a release's published bytes away (a yank); the number of files removed."""
    from registry.storage.local import LocalStore

    relative = _relative(experiment_id, model, version)
    if isinstance(store, LocalStore):
        folder = store.root / ARTIFACTS / relative
        if not folder.exists():
            return 0
        gone = folder.with_name(f".{folder.name}.yanked-{uuid.uuid4().hex[:8]}")
        folder.rename(gone)  # one step: a download sees the whole folder or none
        count = sum(1 for p in gone.rglob("*") if p.is_file())
        shutil.rmtree(gone)
        return count
    keys = [info.key for info in store.list(f"{ARTIFACTS}/{relative}/")]
    if keys:
        store.delete_many(keys)
    return len(keys)


def _publish_local(root: Path, relative: str, model: str, version: int, paths: list[str]) -> None:
    folder = root / ARTIFACTS / relative
    if (folder / RELEASE_DOCUMENT).exists():
        return
    source = root / release_prefix(model, version)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        for path in paths:
            target = staging / path
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / path, target)
            except OSError as exc:
                from registry.errors import RegistryError

                raise RegistryError(
                    f"cannot link {source / path} into MLflow's artifacts: {exc.strerror}",
                    f"keep {root / ARTIFACTS} on the store's file system",
                ) from exc
        if folder.exists():
            shutil.rmtree(folder)  # a half publish of an earlier drain
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
