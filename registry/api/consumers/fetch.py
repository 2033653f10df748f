"""`Registry.fetch_release`, once for both registries: resolve the ref, then the reg cache or
the Hugging Face hub cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from registry.api.consumers import hf_cache as hub
from registry.api.consumers import release_cache
from registry.api.consumers.common import resolve
from registry.api.results import ReleaseFetched, ReleaseSummary
from registry.errors import UsageError

if TYPE_CHECKING:
    from registry.api.contract import Registry
    from registry.core.progress import Progress
    from registry.core.refs import ReleaseRef

_SUMMARY = frozenset(f.name for f in dataclasses.fields(ReleaseSummary) if f.name[0] != "_")


def fetch_release(
    registry: Registry,
    ref: str | ReleaseRef,
    *,
    public_key: str | None = None,
    cache_dir: str | Path | None = None,
    hf_cache: str | Path | None = None,
    progress: Progress | None = None,
) -> ReleaseFetched:
    if cache_dir is not None and hf_cache is not None:
        raise UsageError(
            "cache_dir and hf_cache name two different caches", "give one of them (or neither)"
        )
    target = resolve(registry, ref)
    revision = None
    if hf_cache is not None:
        where = Path(hf_cache).expanduser().absolute()
        path, cached, revision = hub.fetch(registry, target, where, public_key, progress)
    else:
        root = Path(cache_dir).expanduser().absolute() if cache_dir else registry.settings.cache_dir
        path, cached = release_cache.fetch(registry, target, root, public_key, progress)
    shown = {k: v for k, v in target.details.to_json().items() if k in _SUMMARY}
    return ReleaseFetched.from_json(
        {
            **shown,
            "path": str(path),
            "cached": cached,
            "signature_verified": public_key is not None,
            **({"hf_revision": revision} if revision else {}),
        }
    )
