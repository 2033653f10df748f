"""Object versions: the bucket version of every checkpoint and release file, of each
MANIFEST.json and release.json, where the store keeps versions (NULL elsewhere, and for objects
recorded before this revision).

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


def upgrade() -> None:
    for table, column in COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column(column, sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=True)
            )


def downgrade() -> None:
    for table, column in COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.drop_column(column)
