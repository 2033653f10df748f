"""Each checkpoint's key paths, so resume state is decided when it is used (show, validate,
promote) under the policy in force, not frozen at push.

`key_set` holds a set of DCP key paths (sorted FQNs) and the sidecar files beside the shards,
content-addressed by sha256: every step of a run shares one row, so `reg ls` classifies each
distinct set once, from its heads (the paths cut to 4 segments) and optimizer roots, both
derived from the keys when the row is written. `checkpoint_keys` ties a committed checkpoint to
its set and the layout it was pushed with (detected, or forced with --layout). Both are written
once, at commit (or once, from the stored `.metadata`, for a checkpoint committed before this
revision) and never change.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_TABLES = ("key_set", "checkpoint_keys")
_MESSAGE = "key paths are written once and never change"


def upgrade() -> None:
    op.create_table(
        "key_set",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("sha256", sa.String(length=64), nullable=False, unique=True),
        sa.Column("key_count", sa.Integer(), nullable=False),
        sa.Column("keys", sa.JSON(), nullable=False),
        sa.Column("sidecars", sa.JSON(), nullable=False),
        sa.Column("heads", sa.JSON(), nullable=False),
        sa.Column("optimizer_roots", sa.JSON(), nullable=False),
    )
    op.create_table(
        "checkpoint_keys",
        sa.Column("checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoint.id"), primary_key=True),
        sa.Column("key_set_id", sa.Integer(), sa.ForeignKey("key_set.id"), nullable=False),
        sa.Column("layout", sa.String(length=32), nullable=False),
    )
    op.create_index("ix_checkpoint_keys_key_set_id", "checkpoint_keys", ["key_set_id"])
    # The model path a validation loaded the model from (its model and probe checks, and its
    # tied weights, name tensors as that path left them); NULL before this revision.
    op.add_column("validation", sa.Column("model_path", sa.String(length=1024), nullable=True))
    if op.get_bind().dialect.name == "sqlite":
        for table in _TABLES:
            for event in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{event.lower()} BEFORE {event} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, '{_MESSAGE}'); END"
                )
        return
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_key_paths_guard() RETURNS trigger LANGUAGE plpgsql "
        f"AS $$ BEGIN RAISE EXCEPTION '{_MESSAGE}'; END $$"
    )
    for table in _TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_guard BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION reg_key_paths_guard()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for table in _TABLES:
            for event in ("update", "delete"):
                op.execute(f"DROP TRIGGER IF EXISTS {table}_no_{event}")
    else:
        for table in _TABLES:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_guard ON {table}")
        op.execute("DROP FUNCTION IF EXISTS reg_key_paths_guard()")
    op.drop_column("validation", "model_path")
    op.drop_table("checkpoint_keys")
    op.drop_table("key_set")
