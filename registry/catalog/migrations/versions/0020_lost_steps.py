"""Lost tier-0 steps.

- `checkpoint.state` gains `lost`: a step committed at tier 0 only whose every node copy was gone
  before it reached the store. It was never durable: nothing can restore or copy it. The guards
  of 0016 are replaced by the same guards with two moves more: local -> lost, and lost ->
  pending, a new attempt at the step (the only move that may change a row's content: the new
  attempt starts from an empty row).
- The rows that describe a step's content (`checkpoint_file`, `checkpoint_keys`,
  `checkpoint_tier`) may be deleted only while their checkpoint is pending: what a new attempt
  at a lost step clears. A committed checkpoint's files stay as they were.

Revision ID: 0020
Revises: 0019
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_CONTENT = (
    "OLD.state <> 'pending' AND NOT (OLD.state = 'lost' AND NEW.state = 'pending')"
    " AND (NEW.manifest_sha256 IS DISTINCT FROM OLD.manifest_sha256"
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
    " OR (OLD.state = 'local' AND NEW.state IN ('local', 'committed', 'deleting', 'lost'))"
    " OR (OLD.state = 'lost' AND NEW.state IN ('lost', 'pending'))"
    " OR (OLD.state = 'committed' AND NEW.state IN ('committed', 'deleting'))"
    " OR (OLD.state = 'deleting' AND NEW.state IN ('deleting', 'deleted'))"
    " OR (OLD.state IN ('sweeping', 'deleted') AND NEW.state = OLD.state))"
)
_MOVES_MESSAGE = (
    "a checkpoint moves only pending -> committed|local|sweeping, local -> committed|deleting|"
    "lost, lost -> pending, committed -> deleting -> deleted"
)
# 0016's, for the downgrade.
_CONTENT_OLD = _CONTENT.replace(" AND NOT (OLD.state = 'lost' AND NEW.state = 'pending')", "")
_MOVES_OLD = _MOVES.replace(" OR (OLD.state = 'lost' AND NEW.state IN ('lost', 'pending'))", "")
_MOVES_OLD = _MOVES_OLD.replace(", 'deleting', 'lost'))", ", 'deleting'))")
_MOVES_MESSAGE_OLD = (
    "a checkpoint moves only pending -> committed|local|sweeping, local -> committed|deleting, "
    "committed -> deleting -> deleted"
)
_KEYS_MESSAGE = "key paths are written once and never change"  # 0010's
_CHILDREN = ("checkpoint_file", "checkpoint_keys", "checkpoint_tier")
_CHILD_DELETE = (
    "(SELECT state FROM checkpoint WHERE id = OLD.checkpoint_id) IS DISTINCT FROM 'pending'"
)
_CHILD_MESSAGE = (
    "the content rows of a checkpoint are deleted only while it is pending (a new attempt)"
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
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_checkpoint_guard() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN "
        f"IF TG_OP = 'DELETE' THEN IF {_NO_DELETE} THEN "
        f"RAISE EXCEPTION '{_NO_DELETE_MESSAGE}'; END IF; RETURN OLD; END IF; "
        f"{checks}RETURN NEW; END $$"
    )


def upgrade() -> None:
    _install(_guards(_MOVES, _MOVES_MESSAGE, _CONTENT))
    # `checkpoint_keys` (0010) refused every UPDATE and DELETE: it keeps refusing updates,
    # and a delete is judged as the other content rows' are.
    if _sqlite():
        op.execute("DROP TRIGGER IF EXISTS checkpoint_keys_no_delete")
    else:
        op.execute("DROP TRIGGER IF EXISTS checkpoint_keys_guard ON checkpoint_keys")
        op.execute(
            "CREATE TRIGGER checkpoint_keys_guard BEFORE UPDATE ON checkpoint_keys "
            "FOR EACH ROW EXECUTE FUNCTION reg_key_paths_guard()"
        )
    if _sqlite():
        for table in _CHILDREN:
            op.execute(
                f"CREATE TRIGGER {table}_kept BEFORE DELETE ON {table} "
                f"WHEN {_CHILD_DELETE.replace('IS DISTINCT FROM', 'IS NOT')} "
                f"BEGIN SELECT RAISE(ABORT, '{_CHILD_MESSAGE}'); END"
            )
        return
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_checkpoint_content_kept() RETURNS trigger "
        f"LANGUAGE plpgsql AS $$ BEGIN IF {_CHILD_DELETE} THEN "
        f"RAISE EXCEPTION '{_CHILD_MESSAGE}'; END IF; RETURN OLD; END $$"
    )
    for table in _CHILDREN:
        op.execute(
            f"CREATE TRIGGER {table}_kept BEFORE DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION reg_checkpoint_content_kept()"
        )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.exec_driver_sql("SELECT count(*) FROM checkpoint WHERE state = 'lost'").scalar():
        raise RuntimeError(
            "lost checkpoints remain: the revision before 0020 has no such state; save those "
            "steps again (or let them be) before downgrading"
        )
    for table in _CHILDREN:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_kept" + ("" if _sqlite() else f" ON {table}"))
    if _sqlite():
        op.execute(
            "CREATE TRIGGER checkpoint_keys_no_delete BEFORE DELETE ON checkpoint_keys "
            f"BEGIN SELECT RAISE(ABORT, '{_KEYS_MESSAGE}'); END"
        )
    else:
        op.execute("DROP FUNCTION IF EXISTS reg_checkpoint_content_kept()")
        op.execute("DROP TRIGGER IF EXISTS checkpoint_keys_guard ON checkpoint_keys")
        op.execute(
            "CREATE TRIGGER checkpoint_keys_guard BEFORE UPDATE OR DELETE ON checkpoint_keys "
            "FOR EACH ROW EXECUTE FUNCTION reg_key_paths_guard()"
        )
    _install(_guards(_MOVES_OLD, _MOVES_MESSAGE_OLD, _CONTENT_OLD))


def _sqlite() -> bool:
    return bool(op.get_bind().dialect.name == "sqlite")
