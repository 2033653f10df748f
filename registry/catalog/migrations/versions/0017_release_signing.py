"""Signed releases.

- `signing_key_event`: each signing key's life (created with its PEM public key, retired,
  revoked); a key's state is its latest event. The private key is never in the catalog.
- `release_signature`: which key signed a release, and the sha256 of its `model.sig` and of
  its provenance statement; one per release.

Both append-only (triggers, as `fact_mac`).

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_TABLES = ("signing_key_event", "release_signature")


def upgrade() -> None:
    op.create_table(
        "signing_key_event",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("event", sa.String(length=16), nullable=False),
        sa.Column("public_pem", sa.Text(), nullable=True),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("by", sa.String(), nullable=False),
    )
    op.create_index("ix_signing_key_event_key_id", "signing_key_event", ["key_id"])
    op.create_table(
        "release_signature",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("release_id", sa.Integer(), sa.ForeignKey("release.id"), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("provenance_sha256", sa.String(length=64), nullable=False),
        sa.Column("signed_at", sa.Float(), nullable=False),
        sa.Column("signed_by", sa.String(), nullable=False),
        sa.UniqueConstraint("release_id"),
    )
    op.create_index("ix_release_signature_release_id", "release_signature", ["release_id"])
    for table in _TABLES:
        if op.get_bind().dialect.name == "sqlite":
            for verb in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: {verb} refused'); END"
                )
        else:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION reg_append_only()"
            )


def downgrade() -> None:
    for table in reversed(_TABLES):
        op.drop_table(table)  # its triggers go with it
