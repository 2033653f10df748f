"""Object versions: the bucket version of every checkpoint and release file, where the store
keeps versions (NULL elsewhere, and for files recorded before this revision).

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


def upgrade() -> None:
    for table in ("checkpoint_file", "release_file"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("version", sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=True)
            )


def downgrade() -> None:
    for table in ("checkpoint_file", "release_file"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("version")
