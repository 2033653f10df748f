"""`reg ls`: the listing fast path, on SQLAlchemy Core and plain SQL.

Scripts run `reg ls --json` often, over catalogs with tens of thousands of checkpoints; this
module avoids the ORM and sqlmodel altogether, so the listing costs about as much as importing
the libraries (bench/checkpoints.py measures it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from registry.refs import CheckpointRef, check_name
from registry.timeutil import iso

if TYPE_CHECKING:
    from registry.context import Context

_CHECKPOINTS = """
SELECT c.id, c.step, c.world_size, c.state, c.bytes, c.resumable, c.missing_state, c.pinned,
       c.created_at, c.committed_at, c.upload_seconds, r.name, p.name
FROM checkpoint c JOIN run r ON r.id = c.run_id JOIN project p ON p.id = r.project_id
WHERE c.state IN ({states}) {where}
ORDER BY p.name, r.name, c.step
"""
# Rows are inserted in path order at commit, so id order is path order.
_FILES = "SELECT checkpoint_id, path, size, sha256 FROM checkpoint_file {where} ORDER BY id"


def list_checkpoints(
    ctx: Context,
    run: str | None = None,
    project: str | None = None,
    *,
    include_deleted: bool = False,
) -> list[dict[str, Any]]:
    """Committed checkpoints (and tombstones with `include_deleted`) the caller may read."""
    states = ["committed", "deleting", "deleted"] if include_deleted else ["committed"]
    where, params = "", list(states)
    if project is not None:
        where += " AND p.name = {p}"
        params.append(check_name(project, "project name"))
    if run is not None:
        where += " AND r.name = {p}"
        params.append(check_name(run, "run name"))
    with ctx.catalog.dbapi() as (conn, mark):
        # The DB-API cursor directly: SQLAlchemy's import and row objects would cost more than
        # the query itself.
        cursor = conn.cursor()
        sql = _CHECKPOINTS.format(states=", ".join([mark] * len(states)), where=where)
        cursor.execute(sql.replace("{p}", mark), params)
        rows = [r for r in cursor.fetchall()]
        readable = {p for p in {r[12] for r in rows} if ctx.principal.can_read(project=p)}
        rows = [r for r in rows if r[12] in readable]
        files: dict[int, list[dict[str, Any]]] = {}
        if rows:
            if len(rows) < 500:
                ids = [r[0] for r in rows]
                cursor.execute(
                    _FILES.format(where=f"WHERE checkpoint_id IN ({', '.join([mark] * len(ids))})"),
                    ids,
                )
            else:
                cursor.execute(_FILES.format(where=""))
            for cid, path, size, sha in cursor.fetchall():
                files.setdefault(cid, []).append({"path": path, "size": size, "sha256": sha})
        cursor.close()
    return [_view(row, files.get(row[0], [])) for row in rows]


def _view(row: tuple[Any, ...], files: list[dict[str, Any]]) -> dict[str, Any]:
    """One row as DESIGN §7's checkpoint shape (the same as `CheckpointView.to_json`)."""
    (
        _,
        step,
        ws,
        state,
        nbytes,
        resumable,
        missing,
        pinned,
        created,
        committed,
        upload,
        run_name,
        project_name,
    ) = row
    if isinstance(missing, str):
        missing = json.loads(missing) if missing != "[]" else []
    return {
        "ref": str(CheckpointRef(project_name, run_name, step)),
        "project": project_name,
        "run": run_name,
        "step": step,
        "world_size": ws,
        "state": state,
        "bytes": nbytes,
        "files": files,
        "resumable": bool(resumable),
        "missing_state": list(missing or []),
        "pinned": bool(pinned),
        "created_at": iso(committed or created),
        "upload_seconds": upload,
    }
