"""Checkpoints at tiers: a step committed on its nodes' local disks first (tier 0),
copied to the store by a replicator (tier 1).

- `checkpoint.state` gains `local`: committed at tier 0 only. Its content (files, digests,
  world size, resume facts) is decided and immutable from then on, as a committed row's; the
  replicator's commit moves it to `committed`, setting only what the store decides (the
  manifest object's version). The guards of 0008 are replaced by the same guards with these
  moves: pending -> local, local -> committed | deleting (its every copy gone unreplicated).
- `checkpoint_tier`: which tiers hold a checkpoint, and on which nodes (one row per node at
  tier 0, its files and ranks; one row for the store at tier 1), and when a node evicted its
  copy.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_CONTENT = (
    "OLD.state <> 'pending' AND (NEW.manifest_sha256 IS DISTINCT FROM OLD.manifest_sha256"
    " OR (NEW.manifest_version IS DISTINCT FROM OLD.manifest_version AND NOT"
    " (OLD.state = 'local' AND NEW.state = 'committed' AND OLD.manifest_version IS NULL))"
    " OR NEW.bytes <> OLD.bytes OR NEW.file_count <> OLD.file_count"
    " OR NEW.tensor_count <> OLD.tensor_count OR NEW.tensor_bytes <> OLD.tensor_bytes"
    " OR NEW.world_size <> OLD.world_size OR NEW.run_id <> OLD.run_id OR NEW.step <> OLD.step"
    " OR NEW.world_size_inferred <> OLD.world_size_inferred OR NEW.resumable <> OLD.resumable"
    " OR NEW.missing_state{cast} IS DISTINCT FROM OLD.missing_state{cast}"
    " OR NEW.resume_classes{cast} IS DISTINCT FROM OLD.resume_classes{cast}"
    " OR NEW.metrics{cast} IS DISTINCT FROM OLD.metrics{cast}"
    " OR NEW.pushed_by <> OLD.pushed_by OR NEW.created_at <> OLD.created_at"
    " OR NEW.committed_at IS DISTINCT FROM OLD.committed_at)"
)
_MOVES = (
    "NOT ((OLD.state = 'pending' AND NEW.state IN ('pending', 'committed', 'sweeping', 'local'))"
    " OR (OLD.state = 'local' AND NEW.state IN ('local', 'committed', 'deleting'))"
    " OR (OLD.state = 'committed' AND NEW.state IN ('committed', 'deleting'))"
    " OR (OLD.state = 'deleting' AND NEW.state IN ('deleting', 'deleted'))"
    " OR (OLD.state IN ('sweeping', 'deleted') AND NEW.state = OLD.state))"
)
_MOVES_OLD = (
    "NOT ((OLD.state = 'pending' AND NEW.state IN ('pending', 'committed', 'sweeping'))"
    " OR (OLD.state = 'committed' AND NEW.state IN ('committed', 'deleting'))"
    " OR (OLD.state = 'deleting' AND NEW.state IN ('deleting', 'deleted'))"
    " OR (OLD.state IN ('sweeping', 'deleted') AND NEW.state = OLD.state))"
)
_CONTENT_OLD = _CONTENT.replace(
    " OR (NEW.manifest_version IS DISTINCT FROM OLD.manifest_version AND NOT"
    " (OLD.state = 'local' AND NEW.state = 'committed' AND OLD.manifest_version IS NULL))",
    " OR NEW.manifest_version IS DISTINCT FROM OLD.manifest_version",
)
_MOVES_MESSAGE = (
    "a checkpoint moves only pending -> committed|local|sweeping, local -> committed|deleting, "
    "committed -> deleting -> deleted"
)
_MOVES_MESSAGE_OLD = (
    "a checkpoint moves only pending -> committed|sweeping, committed -> deleting -> deleted"
)


def _guards(moves: str, moves_message: str, content: str) -> tuple[tuple[str, str, str], ...]:
    return (
        ("checkpoint_state_moves", moves, moves_message),
        (
            "checkpoint_pinned_kept",
            "OLD.state IN ('committed', 'local') AND NEW.state = 'deleting' AND OLD.pinned"
            " AND NEW.pinned",
            "a pinned checkpoint is never collected (unpin it first)",
        ),
        ("checkpoint_immutable", content, "checkpoint content is immutable"),
        (
            "checkpoint_digests_only_rehashed",
            "OLD.state <> 'pending' AND NEW.digests_reported_by IS NOT NULL"
            " AND NEW.digests_reported_by IS DISTINCT FROM OLD.digests_reported_by",
            "digests_reported_by only becomes NULL, by the server re-hashing every byte",
        ),
    )


_NO_DELETE = "OLD.state NOT IN ('pending', 'sweeping')"
_NO_DELETE_MESSAGE = "committed checkpoints are never deleted (GC leaves a tombstone)"


def _install(guards: tuple[tuple[str, str, str], ...]) -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name, when, message in guards:
            sql_when = when.format(cast="").replace("IS DISTINCT FROM", "IS NOT")
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
            op.execute(
                f"CREATE TRIGGER {name} BEFORE UPDATE ON checkpoint WHEN {sql_when} "
                f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
            )
        return
    checks = "".join(
        f"IF {when.format(cast='::text')} THEN RAISE EXCEPTION '{message}'; END IF; "
        for _, when, message in guards
    )
    # The trigger itself (0008) stays; its function is replaced.
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_checkpoint_guard() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN "
        f"IF TG_OP = 'DELETE' THEN IF {_NO_DELETE} THEN "
        f"RAISE EXCEPTION '{_NO_DELETE_MESSAGE}'; END IF; RETURN OLD; END IF; "
        f"{checks}RETURN NEW; END $$"
    )


def upgrade() -> None:
    op.create_table(
        "checkpoint_tier",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("tier", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("files", sa.JSON(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("evicted_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoint.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("checkpoint_id", "tier", "node"),
    )
    op.create_index(
        "ix_checkpoint_tier_checkpoint_id", "checkpoint_tier", ["checkpoint_id"], unique=False
    )
    _install(_guards(_MOVES, _MOVES_MESSAGE, _CONTENT))


def downgrade() -> None:
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT count(*) FROM checkpoint WHERE state = 'local'")).scalar():
        raise RuntimeError(
            "checkpoints at tier 0 only (state local) remain: the revision before 0016 has no "
            "such state; let them reach the store (or be collected) before downgrading"
        )
    _install(_guards(_MOVES_OLD, _MOVES_MESSAGE_OLD, _CONTENT_OLD))
    op.drop_index("ix_checkpoint_tier_checkpoint_id", table_name="checkpoint_tier")
    op.drop_table("checkpoint_tier")
