"""How a validation restored the checkpoint, and on which driver.

- `validation.mode`: `streamed` (world size 1, every chunk checked in bounded batches) or
  `sharded` (the model restored as the factory's parallelize shards it). Rows from before are
  `whole` (every tensor loaded at once, world size 1) or `resharded` (Shard(0) placements
  guessed), backfilled here.
- `validation.driver`: the GPU driver's version from nvidia-smi; NULL on CPU.

Plain ADD COLUMN: a batch rebuild would drop SQLite's guard triggers.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("validation", sa.Column("mode", sa.String(length=16), nullable=True))
    op.add_column("validation", sa.Column("driver", sa.String(length=64), nullable=True))
    op.execute(
        "UPDATE validation SET mode = CASE WHEN world_size = 1 THEN 'whole' ELSE 'resharded' END"
    )


def downgrade() -> None:
    op.drop_column("validation", "driver")
    op.drop_column("validation", "mode")
