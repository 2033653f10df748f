"""Whose word a checkpoint's digests are: `checkpoint.digests_reported_by` names the client that
reported them (a presigned push through `reg server` on S3: the bytes never passed through the
server), NULL where the registry hashed every byte itself. The server's re-hash (`reg verify`)
sets it back to NULL.

Plain ADD/DROP COLUMN: a batch rebuild would drop SQLite's guard triggers.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "checkpoint", sa.Column("digests_reported_by", sa.String(length=128), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("checkpoint", "digests_reported_by")
