"""Facts the catalog cannot forge (issue 32): what `reg server` decides from is signed with its
audit key, like tokens (0009) and audit events (0006).

- `fact_mac`: append-only (triggers, as `audit_seal`), one row per signature: `kind` (policy,
  validation, model), the signed row's id and an HMAC under the server's key over that row's id
  and content (`registry.signed_facts`). Written in the transaction that writes the row, or
  later by `reg catalog sign` for rows that predate this revision. No unique key: a forged
  signature cannot block the real one, which is simply another row.
- `model.project`: the project that owns the model, the one it was first released from
  (`policies.access`: a grant that leaves `models` out covers the models its projects own).
  Filled here from each model's first release; models without a release stay NULL (owner
  unknown: only a grant on every project, or naming the model, covers them).

Plain ADD COLUMN: a batch rebuild would drop SQLite's guard triggers.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_OWNER = (
    "UPDATE model SET project = (SELECT p.name FROM release r"
    " JOIN checkpoint c ON c.id = r.source_checkpoint_id"
    " JOIN run ON run.id = c.run_id JOIN project p ON p.id = run.project_id"
    " WHERE r.model_id = model.id ORDER BY r.version LIMIT 1)"
)


def upgrade() -> None:
    op.create_table(
        "fact_mac",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("row_id", sa.BigInteger(), nullable=False),
        sa.Column("mac", sa.String(length=64), nullable=False),
        sa.Column("signed_at", sa.Float(), nullable=False),
        sa.Column("signed_by", sa.String(), nullable=False),
    )
    op.create_index("ix_fact_mac_kind_row", "fact_mac", ["kind", "row_id"])
    op.add_column("model", sa.Column("project", sa.String(length=128), nullable=True))
    op.execute(_OWNER)
    if op.get_bind().dialect.name == "sqlite":
        for verb in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER fact_mac_no_{verb.lower()} BEFORE {verb} ON fact_mac "
                f"BEGIN SELECT RAISE(ABORT, 'fact_mac is append-only: {verb} refused'); END"
            )
        return
    op.execute(
        "CREATE TRIGGER fact_mac_append_only BEFORE UPDATE OR DELETE ON fact_mac "
        "FOR EACH ROW EXECUTE FUNCTION reg_append_only()"
    )


def downgrade() -> None:
    op.drop_table("fact_mac")  # its triggers go with it
    op.execute("ALTER TABLE model DROP COLUMN project")
