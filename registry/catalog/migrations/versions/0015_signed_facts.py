"""Facts the catalog cannot forge: what `reg server` decides from is signed with its
audit key, like tokens (0009) and audit events (0006).

- `fact_mac`: append-only (triggers, as `audit_seal`), one row per signature: `kind` (policy,
  validation, model), the signed row's id and an HMAC under the server's key over that row's id
  and content (`registry.trust.signed_facts`). Written in the transaction that writes the row, or
  later by `reg catalog sign` for rows that predate this revision. No unique key: a forged
  signature cannot block the real one, which is simply another row.
- `model.project`: the project that owns the model, the one it was first released from
  (`policies.access`: a grant that leaves `models` out covers the models its projects own).
  Filled here from each model's first release; models without a release stay NULL (owner
  unknown: only a grant on every project, or naming the model, covers them).

- `audit_seal`: a seal is inserted only as the chain's next link (seq = the head's + 1, at
  least 1, prev_mac = the head's MAC): a row written around the sealer cannot sit below the
  chain (seq 0 or less, taken as covering events it never sealed) or far above it.
- `run`: a run's name and project never change (the code never renames one): a store prefix is
  built from names, and a renamed run with a decoy in its place would point GC at another
  run's objects.

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


_NOT_NEXT = (
    "NEW.seq < 1 OR NEW.seq <> (SELECT COALESCE(MAX(seq), 0) + 1 FROM audit_seal)"
    " OR NEW.prev_mac <> COALESCE((SELECT mac FROM audit_seal ORDER BY seq DESC LIMIT 1),"
    " '0000000000000000000000000000000000000000000000000000000000000000')"
)
_NOT_NEXT_MESSAGE = "a seal is only ever the chain''s next link"
_RENAMED = "NEW.name <> OLD.name OR NEW.project_id <> OLD.project_id"
_RENAMED_MESSAGE = "a run keeps its name and project"


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
        op.execute(
            f"CREATE TRIGGER audit_seal_next_link BEFORE INSERT ON audit_seal WHEN {_NOT_NEXT} "
            f"BEGIN SELECT RAISE(ABORT, '{_NOT_NEXT_MESSAGE}'); END"
        )
        op.execute(
            f"CREATE TRIGGER run_name_kept BEFORE UPDATE ON run WHEN {_RENAMED} "
            f"BEGIN SELECT RAISE(ABORT, '{_RENAMED_MESSAGE}'); END"
        )
        return
    op.execute(
        "CREATE TRIGGER fact_mac_append_only BEFORE UPDATE OR DELETE ON fact_mac "
        "FOR EACH ROW EXECUTE FUNCTION reg_append_only()"
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_audit_seal_next_link() RETURNS trigger LANGUAGE plpgsql "
        f"AS $$ BEGIN IF {_NOT_NEXT} THEN RAISE EXCEPTION '{_NOT_NEXT_MESSAGE}'; END IF; "
        "RETURN NEW; END $$"
    )
    op.execute(
        "CREATE TRIGGER audit_seal_next_link BEFORE INSERT ON audit_seal "
        "FOR EACH ROW EXECUTE FUNCTION reg_audit_seal_next_link()"
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_run_name_kept() RETURNS trigger LANGUAGE plpgsql "
        f"AS $$ BEGIN IF {_RENAMED} THEN RAISE EXCEPTION '{_RENAMED_MESSAGE}'; END IF; "
        "RETURN NEW; END $$"
    )
    op.execute(
        "CREATE TRIGGER run_name_kept BEFORE UPDATE ON run "
        "FOR EACH ROW EXECUTE FUNCTION reg_run_name_kept()"
    )


def downgrade() -> None:
    op.drop_table("fact_mac")  # its triggers go with it
    op.execute("ALTER TABLE model DROP COLUMN project")
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS audit_seal_next_link")
        op.execute("DROP TRIGGER IF EXISTS run_name_kept")
        return
    op.execute("DROP TRIGGER IF EXISTS audit_seal_next_link ON audit_seal")
    op.execute("DROP FUNCTION IF EXISTS reg_audit_seal_next_link()")
    op.execute("DROP TRIGGER IF EXISTS run_name_kept ON run")
    op.execute("DROP FUNCTION IF EXISTS reg_run_name_kept()")
