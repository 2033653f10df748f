"""`reg server`: bearer tokens (only their secrets' sha256 is stored) and the validations a
validator attested through the server (the only ones its GPU gate accepts).

Plain ADD/DROP COLUMN: a batch rebuild of `validation` would cost nothing here, but keeping one
way of changing tables keeps the guard triggers of the other tables out of harm's way.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_token",
        sa.Column("id", sa.String(length=32), primary_key=True),
        sa.Column("principal", sa.String(length=256), nullable=False, index=True),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("created_by", sa.String(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=True),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.Column("revoked_by", sa.String(), nullable=True),
        sa.Column("last_used_at", sa.Float(), nullable=True),
    )
    op.add_column(
        "validation",
        sa.Column("attested", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.execute("ALTER TABLE validation DROP COLUMN attested")
    op.drop_table("api_token")
