"""Guard committed checkpoints in the database, as 0005 guards releases: what the server's runtime
role (or anyone holding its credentials) can no longer do to a checkpoint row.

- a checkpoint moves only along its life: pending -> committed or sweeping (an abandoned
  upload), committed -> deleting -> deleted; nothing else (a committed row set back to pending,
  or to sweeping, would have its objects deleted as leftovers without a tombstone);
- a pinned checkpoint is never collected (GC keeps pins; only an unpin lets it go);
- the content columns of a committed checkpoint never change (digest of its manifest, sizes,
  world size, resume state, metrics, who pushed it and when, its step and run);
- `digests_reported_by` of a committed checkpoint only ever becomes NULL (the server's re-hash),
  never names someone else;
- only pending and sweeping rows are deleted (an upload that never committed); a committed
  checkpoint leaves a tombstone.

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_CONTENT = (
    "OLD.state <> 'pending' AND (NEW.manifest_sha256 IS DISTINCT FROM OLD.manifest_sha256"
    " OR NEW.manifest_version IS DISTINCT FROM OLD.manifest_version"
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
    "NOT ((OLD.state = 'pending' AND NEW.state IN ('pending', 'committed', 'sweeping'))"
    " OR (OLD.state = 'committed' AND NEW.state IN ('committed', 'deleting'))"
    " OR (OLD.state = 'deleting' AND NEW.state IN ('deleting', 'deleted'))"
    " OR (OLD.state IN ('sweeping', 'deleted') AND NEW.state = OLD.state))"
)
_GUARDS = (
    (
        "checkpoint_state_moves",
        _MOVES,
        "a checkpoint moves only pending -> committed|sweeping, committed -> deleting -> deleted",
    ),
    (
        "checkpoint_pinned_kept",
        "OLD.state = 'committed' AND NEW.state = 'deleting' AND OLD.pinned AND NEW.pinned",
        "a pinned checkpoint is never collected (unpin it first)",
    ),
    ("checkpoint_immutable", _CONTENT, "checkpoint content is immutable"),
    (
        "checkpoint_digests_only_rehashed",
        "OLD.state <> 'pending' AND NEW.digests_reported_by IS NOT NULL"
        " AND NEW.digests_reported_by IS DISTINCT FROM OLD.digests_reported_by",
        "digests_reported_by only becomes NULL, by the server re-hashing every byte",
    ),
)
_NO_DELETE = "OLD.state NOT IN ('pending', 'sweeping')"
_NO_DELETE_MESSAGE = "committed checkpoints are never deleted (GC leaves a tombstone)"


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name, when, message in _GUARDS:
            sql_when = when.format(cast="").replace("IS DISTINCT FROM", "IS NOT")
            op.execute(
                f"CREATE TRIGGER {name} BEFORE UPDATE ON checkpoint WHEN {sql_when} "
                f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
            )
        op.execute(
            f"CREATE TRIGGER checkpoint_no_delete BEFORE DELETE ON checkpoint WHEN {_NO_DELETE} "
            f"BEGIN SELECT RAISE(ABORT, '{_NO_DELETE_MESSAGE}'); END"
        )
        return
    checks = "".join(
        f"IF {when.format(cast='::text')} THEN RAISE EXCEPTION '{message}'; END IF; "
        for _, when, message in _GUARDS
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_checkpoint_guard() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN "
        f"IF TG_OP = 'DELETE' THEN IF {_NO_DELETE} THEN "
        f"RAISE EXCEPTION '{_NO_DELETE_MESSAGE}'; END IF; RETURN OLD; END IF; "
        f"{checks}RETURN NEW; END $$"
    )
    op.execute(
        "CREATE TRIGGER checkpoint_guard BEFORE UPDATE OR DELETE ON checkpoint "
        "FOR EACH ROW EXECUTE FUNCTION reg_checkpoint_guard()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name, _, _ in _GUARDS:
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TRIGGER IF EXISTS checkpoint_no_delete")
        return
    op.execute("DROP TRIGGER IF EXISTS checkpoint_guard ON checkpoint")
    op.execute("DROP FUNCTION IF EXISTS reg_checkpoint_guard()")
