"""Read-only lookups on plain DB-API: on SQLite no SQLAlchemy import at all, for paths whose
start-up matters (a push decides whether to start copying before the catalog layer loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog

_STEP = """
SELECT c.state, c.lease_until FROM checkpoint c
JOIN run r ON r.id = c.run_id JOIN project p ON p.id = r.project_id
WHERE p.name = {p} AND r.name = {p} AND c.step = {p}
"""


def step_state(
    catalog: Catalog, project: str, run: str, step: int
) -> tuple[str, float | None] | None:
    """(state, lease_until) of project/run@step, or None when the step has no row."""
    with catalog.dbapi() as (conn, mark):
        cursor = conn.cursor()
        cursor.execute(_STEP.replace("{p}", mark), (project, run, step))
        row = cursor.fetchone()
        cursor.close()
    return None if row is None else (str(row[0]), row[1])
