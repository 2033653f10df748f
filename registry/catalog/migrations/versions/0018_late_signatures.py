"""Signatures added after promotion (`reg sign-release`).

`release_signature.added_bytes`: the bytes of the files the signing added to a release that
was committed without them (its provenance statement, model card and `model.sig`). A release's
own `bytes` counts what its promotion committed and never changes (0005's guard), so the size of
its `release.json` is `bytes` less the files it committed: `registry.lifecycle.releases
.stored_files` subtracts the added ones first. 0 for a release signed at promotion.

A plain ADD COLUMN (no table rebuild, so SQLite's append-only triggers stay).

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "release_signature",
        sa.Column("added_bytes", sa.BigInteger(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("release_signature", "added_bytes")
