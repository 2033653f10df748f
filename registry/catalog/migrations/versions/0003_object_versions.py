"""Object versions: the bucket version of every checkpoint and release file, of each
MANIFEST.json and release.json, where the store keeps versions (NULL elsewhere, and for objects
recorded before this revision). A committed release's document version is immutable like the
rest of its content: the release guard trigger now covers it.

Plain ADD/DROP COLUMN (SQLite >= 3.35 and PostgreSQL): a batch rebuild of the table would drop
the guard triggers on SQLite.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = (
    ("checkpoint_file", "version"),
    ("release_file", "version"),
    ("checkpoint", "manifest_version"),
    ("release", "document_version"),
)

_CHANGED_0001 = (
    "OLD.status <> 'pending' AND (NEW.sha256 IS DISTINCT FROM OLD.sha256 OR NEW.bytes <> OLD.bytes"
    " OR NEW.version <> OLD.version OR NEW.model_id <> OLD.model_id"
    " OR NEW.source_checkpoint_id <> OLD.source_checkpoint_id)"
)
_CHANGED_0003 = _CHANGED_0001.removesuffix(")") + (
    " OR NEW.document_version IS DISTINCT FROM OLD.document_version)"
)


def upgrade() -> None:
    for table, column in COLUMNS:
        op.add_column(
            table,
            sa.Column(column, sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=True),
        )
    _release_guard(_CHANGED_0003)


def downgrade() -> None:
    _release_guard(_CHANGED_0001)  # first: SQLite refuses to drop a column a trigger names
    for table, column in COLUMNS:
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")


def _release_guard(changed: str) -> None:
    """Replace the trigger that refuses changes to a committed release's content."""
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS release_immutable")
        op.execute(
            "CREATE TRIGGER release_immutable BEFORE UPDATE ON release WHEN "
            f"{changed.replace('IS DISTINCT FROM', 'IS NOT')} "
            "BEGIN SELECT RAISE(ABORT, 'release content is immutable'); END"
        )
        return
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_release_immutable() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN "
        "IF TG_OP = 'DELETE' THEN IF OLD.status <> 'pending' THEN "
        "RAISE EXCEPTION 'releases are never deleted'; END IF; RETURN OLD; END IF; "
        f"IF {changed} THEN RAISE EXCEPTION 'release content is immutable'; END IF; "
        "RETURN NEW; END $$"
    )
