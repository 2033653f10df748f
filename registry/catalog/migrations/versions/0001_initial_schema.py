"""Initial schema, plus triggers that make the audit log append-only and releases immutable.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("actor", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("action", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("target", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("outcome", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("audit_event", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_event_action"), ["action"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_event_actor"), ["actor"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_event_ts"), ["ts"], unique=False)

    op.create_table(
        "lease",
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("holder", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("host", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("token", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("acquired_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "model",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("model", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_model_name"), ["name"], unique=True)

    op.create_table(
        "policy_document",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("text", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("applied_at", sa.Float(), nullable=False),
        sa.Column("applied_by", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("version"),
    )
    op.create_table(
        "project",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("project", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_project_name"), ["name"], unique=True)

    op.create_table(
        "alias_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("from_version", sa.Integer(), nullable=True),
        sa.Column("to_version", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("actor", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["model.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("alias_event", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_alias_event_model_id"), ["model_id"], unique=False)

    op.create_table(
        "run",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("resumed_from_step", sa.BigInteger(), nullable=True),
        sa.Column("resumed_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["project.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "name"),
    )
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_project_id"), ["project_id"], unique=False)

    op.create_table(
        "checkpoint",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("world_size_inferred", sa.Boolean(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("file_count", sa.Integer(), nullable=False),
        sa.Column("tensor_count", sa.Integer(), nullable=False),
        sa.Column("tensor_bytes", sa.BigInteger(), nullable=False),
        sa.Column("manifest_sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("resumable", sa.Boolean(), nullable=False),
        sa.Column("missing_state", sa.JSON(), nullable=False),
        sa.Column("resume_classes", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("pin_reason", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("pinned_by", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("committed_at", sa.Float(), nullable=True),
        sa.Column("pushed_by", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("upload_seconds", sa.Float(), nullable=True),
        sa.Column("claim_token", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("claim_host", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("claim_pid", sa.Integer(), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("deleted_at", sa.Float(), nullable=True),
        sa.Column("deleted_by", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("delete_reason", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "step"),
    )
    with op.batch_alter_table("checkpoint", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoint_run_id"), ["run_id"], unique=False)
        batch_op.create_index("ix_checkpoint_state", ["state"], unique=False)

    op.create_table(
        "checkpoint_file",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("path", sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoint.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("checkpoint_id", "path"),
    )
    with op.batch_alter_table("checkpoint_file", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_checkpoint_file_checkpoint_id"), ["checkpoint_id"], unique=False
        )

    op.create_table(
        "validation",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("device", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("device_name", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("torch_version", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("phases", sa.JSON(), nullable=False),
        sa.Column("checks", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoint.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("validation", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_validation_checkpoint_id"), ["checkpoint_id"], unique=False
        )

    op.create_table(
        "release",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("source_checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("source_ref", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("validation_id", sa.Integer(), nullable=True),
        sa.Column("options_key", sqlmodel.sql.sqltypes.AutoString(length=256), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("tensor_count", sa.Integer(), nullable=False),
        sa.Column("dtype", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("tied", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("status_reason", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("status_changed_at", sa.Float(), nullable=True),
        sa.Column("status_changed_by", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("claim_token", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("claim_host", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("claim_pid", sa.Integer(), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("stage", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["model.id"],
        ),
        sa.ForeignKeyConstraint(
            ["source_checkpoint_id"],
            ["checkpoint.id"],
        ),
        sa.ForeignKeyConstraint(
            ["validation_id"],
            ["validation.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("model_id", "version"),
    )
    with op.batch_alter_table("release", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_release_model_id"), ["model_id"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_release_source_checkpoint_id"), ["source_checkpoint_id"], unique=False
        )

    op.create_table(
        "alias",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("release_id", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("updated_by", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["model.id"],
        ),
        sa.ForeignKeyConstraint(
            ["release_id"],
            ["release.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("model_id", "name"),
    )
    with op.batch_alter_table("alias", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_alias_model_id"), ["model_id"], unique=False)

    op.create_table(
        "release_file",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("release_id", sa.Integer(), nullable=False),
        sa.Column("path", sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["release_id"],
            ["release.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("release_id", "path"),
    )
    with op.batch_alter_table("release_file", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_release_file_release_id"), ["release_id"], unique=False
        )

    _create_guards()


def downgrade() -> None:
    _drop_guards()
    with op.batch_alter_table("release_file", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_release_file_release_id"))

    op.drop_table("release_file")
    with op.batch_alter_table("alias", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alias_model_id"))

    op.drop_table("alias")
    with op.batch_alter_table("release", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_release_source_checkpoint_id"))
        batch_op.drop_index(batch_op.f("ix_release_model_id"))

    op.drop_table("release")
    with op.batch_alter_table("validation", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_validation_checkpoint_id"))

    op.drop_table("validation")
    with op.batch_alter_table("checkpoint_file", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoint_file_checkpoint_id"))

    op.drop_table("checkpoint_file")
    with op.batch_alter_table("checkpoint", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoint_state")
        batch_op.drop_index(batch_op.f("ix_checkpoint_run_id"))

    op.drop_table("checkpoint")
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_project_id"))

    op.drop_table("run")
    with op.batch_alter_table("alias_event", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alias_event_model_id"))

    op.drop_table("alias_event")
    with op.batch_alter_table("project", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_project_name"))

    op.drop_table("project")
    op.drop_table("policy_document")
    with op.batch_alter_table("model", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_model_name"))

    op.drop_table("model")
    op.drop_table("lease")
    with op.batch_alter_table("audit_event", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_event_ts"))
        batch_op.drop_index(batch_op.f("ix_audit_event_actor"))
        batch_op.drop_index(batch_op.f("ix_audit_event_action"))

    op.drop_table("audit_event")


_RELEASE_CHANGED = (
    "OLD.status <> 'pending' AND (NEW.sha256 IS DISTINCT FROM OLD.sha256 OR NEW.bytes <> OLD.bytes"
    " OR NEW.version <> OLD.version OR NEW.model_id <> OLD.model_id"
    " OR NEW.source_checkpoint_id <> OLD.source_checkpoint_id)"
)
_APPEND_ONLY = ("audit_event", "release_file", "alias_event")


def _create_guards() -> None:
    """Database-level guards: they hold even for the database owner and direct SQL."""
    if op.get_bind().dialect.name == "sqlite":
        for table in _APPEND_ONLY:
            for verb in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: {verb} refused'); END"
                )
        changed = _RELEASE_CHANGED.replace("IS DISTINCT FROM", "IS NOT")
        op.execute(
            f"CREATE TRIGGER release_immutable BEFORE UPDATE ON release WHEN {changed} "
            "BEGIN SELECT RAISE(ABORT, 'release content is immutable'); END"
        )
        op.execute(
            "CREATE TRIGGER release_no_delete BEFORE DELETE ON release "
            "WHEN OLD.status <> 'pending' "
            "BEGIN SELECT RAISE(ABORT, 'releases are never deleted'); END"
        )
        return
    op.execute(
        "CREATE FUNCTION reg_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP; END $$"
    )
    for table in _APPEND_ONLY:
        op.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION reg_append_only()"
        )
    op.execute(
        "CREATE FUNCTION reg_release_immutable() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF TG_OP = 'DELETE' THEN IF OLD.status <> 'pending' THEN "
        "RAISE EXCEPTION 'releases are never deleted'; END IF; RETURN OLD; END IF; "
        f"IF {_RELEASE_CHANGED} THEN RAISE EXCEPTION 'release content is immutable'; END IF; "
        "RETURN NEW; END $$"
    )
    op.execute(
        "CREATE TRIGGER release_immutable BEFORE UPDATE OR DELETE ON release "
        "FOR EACH ROW EXECUTE FUNCTION reg_release_immutable()"
    )


def _drop_guards() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for table in _APPEND_ONLY:
            for verb in ("update", "delete"):
                op.execute(f"DROP TRIGGER IF EXISTS {table}_no_{verb}")
        op.execute("DROP TRIGGER IF EXISTS release_immutable")
        op.execute("DROP TRIGGER IF EXISTS release_no_delete")
        return
    for table in _APPEND_ONLY:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_append_only ON {table}")
    op.execute("DROP TRIGGER IF EXISTS release_immutable ON release")
    op.execute("DROP FUNCTION IF EXISTS reg_append_only()")
    op.execute("DROP FUNCTION IF EXISTS reg_release_immutable()")
