"""What a run's training job reported as it went, and how each restore came about (for
`reg advise`, checkpoint economics from what the job really paid).

- `run.last_step`, `run.last_step_at`: the last step the job reported (`CheckpointManager`'s
  heartbeat), so the work lost to a failure is known.
- `run.train_seconds`, `run.gpu_seconds`: the job's time at risk, summed over its attempts up to
  each one's last heartbeat (wall seconds, and wall seconds x world size).
- `run.step_seconds`: the median training step time at the last heartbeat.
- `run.restart_planned_at`: a planned restart was announced (`reg run restart --planned`,
  `restore(planned=True)`): the next restore is not a failure.
- `run.attempt_ended_at`: the last attempt closed (`CheckpointManager.close`): the next restore
  continues the run and is not a failure.
- `checkpoint_restore.kind` (start | failure | planned | resume; NULL before this revision),
  `reached_step` (the run's last heartbeat step when a failure's restore was recorded),
  `train_seconds`, `gpu_seconds` (the run's exposure then) and `step_seconds`.

Plain ADD COLUMN: a batch rebuild would drop SQLite's guard triggers.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_RUN = (
    ("last_step", sa.BigInteger()),
    ("last_step_at", sa.Float()),
    ("train_seconds", sa.Float()),
    ("gpu_seconds", sa.Float()),
    ("step_seconds", sa.Float()),
    ("restart_planned_at", sa.Float()),
    ("attempt_ended_at", sa.Float()),
)
_RESTORE = (
    ("kind", sa.String(length=16)),
    ("reached_step", sa.BigInteger()),
    ("train_seconds", sa.Float()),
    ("gpu_seconds", sa.Float()),
    ("step_seconds", sa.Float()),
)


def upgrade() -> None:
    for name, kind in _RUN:
        op.add_column("run", sa.Column(name, kind, nullable=True))
    for name, kind in _RESTORE:
        op.add_column("checkpoint_restore", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(_RESTORE):
        op.drop_column("checkpoint_restore", name)
    for name, _ in reversed(_RUN):
        op.drop_column("run", name)
