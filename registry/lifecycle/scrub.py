"""`reg verify [--repair]`: re-hash an artifact's stored files against the catalog's records,
and on a versioned bucket restore each damaged one from the version its record names (after
proving that version still holds the recorded bytes). Repair is an admin action, audited."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from registry.transfer import repair_stored, verify_stored

if TYPE_CHECKING:
    from registry.context import Context
    from registry.formats.documents import FileRecord
    from registry.progress import Progress


def verify_files(
    ctx: Context,
    prefix: str,
    files: list[FileRecord],
    *,
    name: str,
    scope: dict[str, str],
    repair: bool,
    immutable: bool,
    progress: Progress | None,
) -> dict[str, Any]:
    """The verify report of one artifact (`name`, its files under `prefix`); `scope` is the
    project or model the repair is authorized on."""
    problems = verify_stored(
        ctx.store, prefix, files, label=f"verify {name}", workers=ctx.workers, progress=progress
    )
    out: dict[str, Any] = {
        "ok": not problems,
        "files": len(files),
        "bytes": sum(f.size for f in files),
        "problems": [p.to_json() for p in problems],
    }
    if not repair:
        return out
    out["repaired"] = []
    if problems:
        ctx.authorize("repair", target=name, **scope)
        repaired, left = repair_stored(ctx.store, prefix, files, problems, immutable=immutable)
        with ctx.catalog.session(write=True) as s:
            ctx.audit(s, "repair", name, repaired=repaired, left=len(left))
        after = verify_stored(
            ctx.store,
            prefix,
            [f for f in files if f.path in set(repaired)],
            label=f"verify {name}",
            workers=ctx.workers,
        )
        out.update(
            ok=not left and not after,
            repaired=[p for p in repaired if p not in {a.path for a in after}],
            problems=[p.to_json() for p in [*left, *after]],
        )
    return out
