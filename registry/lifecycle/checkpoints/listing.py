"""`reg ls`: the listing fast path, on SQLAlchemy Core and plain SQL.

Scripts run `reg ls --json` often, over catalogs with tens of thousands of checkpoints; this
module avoids the ORM and sqlmodel altogether, so the listing costs about as much as importing
the libraries (bench/checkpoints.py measures it). Resume state is decided under the policy in
force from each distinct key set (the steps of a run share one), so a listing classifies a few
sets, not every row; a checkpoint whose key paths were never recorded shows its push-time verdict.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from registry.core.refs import CheckpointRef, check_name
from registry.core.timeutil import iso
from registry.lifecycle.checkpoints.resume_facts import missing_of

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

_CHECKPOINTS = """
SELECT c.id, c.step, c.world_size, c.state, c.bytes, c.resumable, c.missing_state, c.pinned,
       c.created_at, c.committed_at, c.upload_seconds, r.name, p.name,
       ck.key_set_id, ck.layout, ks.sha256
FROM checkpoint c JOIN run r ON r.id = c.run_id JOIN project p ON p.id = r.project_id
LEFT JOIN checkpoint_keys ck ON ck.checkpoint_id = c.id
LEFT JOIN key_set ks ON ks.id = ck.key_set_id
WHERE c.state IN ({states}) {where}
ORDER BY p.name, r.name, c.step
"""
# Rows are inserted in path order at commit, so id order is path order.
_FILES = "SELECT checkpoint_id, path, size, sha256 FROM checkpoint_file {where} ORDER BY id"
_SUMMARIES = "SELECT id, heads, optimizer_roots, sidecars FROM key_set WHERE id IN ({ids})"
_KEYS = "SELECT keys FROM key_set WHERE id = {p}"


def list_checkpoints(
    ctx: Context,
    run: str | None = None,
    project: str | None = None,
    *,
    include_deleted: bool = False,
) -> list[dict[str, Any]]:
    """Committed checkpoints (and tombstones with `include_deleted`) the caller may read."""
    # local: at tier 0 only, on its nodes' disks; lost: the same, with every copy gone
    states = ["committed", "local", "lost"]
    if include_deleted:
        states += ["deleting", "deleted"]
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
        resume = _verdicts(ctx, cursor, mark, rows)
        cursor.close()
    return [_view(row, files.get(row[0], []), resume.get((row[13], row[14]))) for row in rows]


def _verdicts(
    ctx: Context, cursor: Any, mark: str, rows: list[Any]
) -> dict[tuple[Any, Any], list[str]]:
    """(key_set_id, layout) -> the required classes it lacks under the policy in force, each
    distinct pair decided once, from the set's heads (resume_facts.missing_of)."""
    policy = ctx.policy.resume
    sets = {(r[13], r[14], r[15]) for r in rows if r[13] is not None}
    summaries: dict[int, tuple[list[str], list[str], list[str]]] = {}
    ids = sorted({s[0] for s in sets})
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        cursor.execute(_SUMMARIES.format(ids=", ".join([mark] * len(chunk))), chunk)
        for set_id, key_heads, roots, sidecars in cursor.fetchall():
            summaries[set_id] = (_json_list(key_heads), _json_list(roots), _json_list(sidecars))

    def keys_of(set_id: int) -> Callable[[], list[str]]:
        def read() -> list[str]:
            cursor.execute(_KEYS.format(p=mark), [set_id])
            return _json_list(cursor.fetchone()[0])

        return read

    return {
        (set_id, layout): missing_of(sha, layout, policy, summaries[set_id], keys_of(set_id))
        for set_id, layout, sha in sets
    }


def _json_list(value: Any) -> list[str]:
    return list(json.loads(value) if isinstance(value, str) else value)


def _view(
    row: tuple[Any, ...], files: list[dict[str, Any]], missing_now: list[str] | None
) -> dict[str, Any]:
    """One row as DESIGN §7's checkpoint shape (the same as `CheckpointView.to_json`), with
    the resume verdict decided now where the key paths are recorded."""
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
        _,
        layout,
        _,
    ) = row
    if state == "lost":  # no copy of it is left anywhere
        resumable = False
        missing = _json_list(missing or [])
    elif missing_now is not None:
        resumable, missing = not missing_now, missing_now
    else:
        missing = _json_list(missing or [])
    return {
        "ref": str(CheckpointRef(project_name, run_name, step)),
        "project": project_name,
        "run": run_name,
        "step": step,
        "world_size": ws,
        "state": state,
        "bytes": nbytes,
        "files": files,
        "layout": layout,
        "resumable": bool(resumable),
        "missing_state": list(missing or []),
        "pinned": bool(pinned),
        "created_at": iso(committed or created),
        "upload_seconds": upload,
    }
