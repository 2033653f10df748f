"""What checkpoints cost the training job that wrote and read them.

- `checkpoint.save_costs`: how a save from the training loop went (`stall_seconds`, the time the
  loop was blocked; `persist_seconds`, from the save's start until the commit; bytes; each
  rank's write seconds and throughput). NULL for a checkpoint pushed from a directory.
- `checkpoint_restore`: one row per restore by `CheckpointManager.restore`, with its phases
  (metadata, fetch, load and reshard, first step when the loop reports it) and world size.
  Rows are only ever added.

Plain ADD COLUMN / CREATE TABLE: a batch rebuild would drop SQLite's guard triggers.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoint", sa.Column("save_costs", sa.JSON(), nullable=True))
    op.create_table(
        "checkpoint_restore",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoint.id"), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("phases", sa.JSON(), nullable=False),
    )
    op.create_index("ix_checkpoint_restore_checkpoint_id", "checkpoint_restore", ["checkpoint_id"])


def downgrade() -> None:
    op.drop_index("ix_checkpoint_restore_checkpoint_id", "checkpoint_restore")
    op.drop_table("checkpoint_restore")
    op.drop_column("checkpoint", "save_costs")
