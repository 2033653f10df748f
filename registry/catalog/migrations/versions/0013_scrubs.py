"""When every stored byte of a checkpoint or release was last re-hashed, and what that found
(`reg verify`, scheduled scrubs with `reg verify --all`).

- `checkpoint.verified_at`, `release.verified_at`: the time of the last complete re-hash.
- `checkpoint.verify_findings`, `release.verify_findings`: its problems, a JSON list of
  {path, problem}; empty when every file matched.

Neither is a content column: the guards of 0005 and 0008 leave them alone. Plain ADD COLUMN: a
batch rebuild would drop SQLite's guard triggers.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("checkpoint", "release"):
        op.add_column(table, sa.Column("verified_at", sa.Float(), nullable=True))
        op.add_column(table, sa.Column("verify_findings", sa.JSON(), nullable=True))


def downgrade() -> None:
    for table in ("checkpoint", "release"):
        op.drop_column(table, "verify_findings")
        op.drop_column(table, "verified_at")
