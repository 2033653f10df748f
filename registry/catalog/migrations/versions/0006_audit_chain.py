"""The provable audit log (`registry.trust.audit_chain`): every audit event gets a random `uid` and
a `mac` (HMAC-SHA256 under the server's key, NULL where no key was at hand), and the new table
`audit_seal` chains the events a sealer took, block by block. Seals are append-only like the
events themselves: SQLite triggers, and PostgreSQL's `reg_append_only()` of 0001.

Plain ADD/DROP COLUMN: a batch rebuild of `audit_event` would drop its guard triggers on SQLite.
Events recorded before this revision keep `uid` and `mac` NULL (the genesis seal takes them).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("audit_event", sa.Column("uid", sa.String(length=32), nullable=True))
    op.add_column("audit_event", sa.Column("mac", sa.String(length=64), nullable=True))
    op.create_index("ix_audit_event_uid", "audit_event", ["uid"], unique=True)
    op.create_table(
        "audit_seal",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("prev_mac", sa.String(length=64), nullable=False),
        sa.Column("mac", sa.String(length=64), nullable=False),
        sa.Column("event_ids", sa.Text(), nullable=False),
        sa.Column("tags", sa.Text(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("total", sa.BigInteger(), nullable=False),
        sa.Column("low", sa.BigInteger(), nullable=False),
        sa.Column("high", sa.BigInteger(), nullable=False),
        sa.Column("sealed_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_audit_seal_low", "audit_seal", ["low"])
    op.create_index("ix_audit_seal_high", "audit_seal", ["high"])
    if op.get_bind().dialect.name == "sqlite":
        for verb in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER audit_seal_no_{verb.lower()} BEFORE {verb} ON audit_seal "
                f"BEGIN SELECT RAISE(ABORT, 'audit_seal is append-only: {verb} refused'); END"
            )
        return
    op.execute(
        "CREATE TRIGGER audit_seal_append_only BEFORE UPDATE OR DELETE ON audit_seal "
        "FOR EACH ROW EXECUTE FUNCTION reg_append_only()"
    )


def downgrade() -> None:
    op.drop_table("audit_seal")  # its triggers go with it
    op.drop_index("ix_audit_event_uid", table_name="audit_event")
    op.execute("ALTER TABLE audit_event DROP COLUMN mac")
    op.execute("ALTER TABLE audit_event DROP COLUMN uid")
