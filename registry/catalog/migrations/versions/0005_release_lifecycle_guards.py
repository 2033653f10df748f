"""Close what the database owner could still do to a release and to the policy history:

- a release leaves `pending` once and never returns (setting one back to pending, forging its
  sha256 and setting it active again is refused);
- a yanked release is never un-yanked;
- every content column of a committed release is immutable, not only its digests (source ref,
  validation, options, dtype, tied groups, tensor count, creator and time);
- policy documents are append-only, like the audit log.

Plain triggers (SQLite) and the replaced plpgsql guard (PostgreSQL); the downgrade restores
0003's guard.

Revision ID: 0005
Revises: 0004
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_CONTENT_0003 = (
    "OLD.status <> 'pending' AND (NEW.sha256 IS DISTINCT FROM OLD.sha256 OR NEW.bytes <> OLD.bytes"
    " OR NEW.version <> OLD.version OR NEW.model_id <> OLD.model_id"
    " OR NEW.source_checkpoint_id <> OLD.source_checkpoint_id"
    " OR NEW.document_version IS DISTINCT FROM OLD.document_version)"
)
_MORE_CONTENT = (
    " OR NEW.source_ref IS DISTINCT FROM OLD.source_ref"
    " OR NEW.validation_id IS DISTINCT FROM OLD.validation_id"
    " OR NEW.options_key IS DISTINCT FROM OLD.options_key"
    " OR NEW.options{cast} IS DISTINCT FROM OLD.options{cast}"
    " OR NEW.tied{cast} IS DISTINCT FROM OLD.tied{cast}"
    " OR NEW.tensor_count IS DISTINCT FROM OLD.tensor_count"
    " OR NEW.dtype IS DISTINCT FROM OLD.dtype"
    " OR NEW.created_at IS DISTINCT FROM OLD.created_at"
    " OR NEW.created_by IS DISTINCT FROM OLD.created_by)"
)
_BACK_TO_PENDING = "OLD.status <> 'pending' AND NEW.status = 'pending'"
_UNYANKED = "OLD.status = 'yanked' AND NEW.status <> 'yanked'"


def _content(cast: str) -> str:
    return _CONTENT_0003.removesuffix(")") + _MORE_CONTENT.format(cast=cast)


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS release_immutable")
        _sqlite_guard("release_immutable", _content(""), "release content is immutable")
        _sqlite_guard(
            "release_never_pending_again",
            _BACK_TO_PENDING,
            "a committed release never returns to pending",
        )
        _sqlite_guard("release_never_unyanked", _UNYANKED, "a yanked release is never un-yanked")
        for verb in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER policy_document_no_{verb.lower()} BEFORE {verb} ON "
                f"policy_document BEGIN SELECT RAISE(ABORT, 'policy_document is append-only: "
                f"{verb} refused'); END"
            )
        return
    _postgres_guard(_content("::text"), extra=True)
    op.execute(
        "CREATE TRIGGER policy_document_append_only BEFORE UPDATE OR DELETE ON policy_document "
        "FOR EACH ROW EXECUTE FUNCTION reg_append_only()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name in (
            "release_never_pending_again",
            "release_never_unyanked",
            "policy_document_no_update",
            "policy_document_no_delete",
        ):
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TRIGGER IF EXISTS release_immutable")
        _sqlite_guard("release_immutable", _CONTENT_0003, "release content is immutable")
        return
    op.execute("DROP TRIGGER IF EXISTS policy_document_append_only ON policy_document")
    _postgres_guard(_CONTENT_0003, extra=False)


def _sqlite_guard(name: str, when: str, message: str) -> None:
    op.execute(
        f"CREATE TRIGGER {name} BEFORE UPDATE ON release WHEN "
        f"{when.replace('IS DISTINCT FROM', 'IS NOT')} "
        f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
    )


def _postgres_guard(content: str, *, extra: bool) -> None:
    checks = f"IF {content} THEN RAISE EXCEPTION 'release content is immutable'; END IF; "
    if extra:
        checks += (
            f"IF {_BACK_TO_PENDING} THEN "
            "RAISE EXCEPTION 'a committed release never returns to pending'; END IF; "
            f"IF {_UNYANKED} THEN RAISE EXCEPTION 'a yanked release is never un-yanked'; END IF; "
        )
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_release_immutable() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN "
        "IF TG_OP = 'DELETE' THEN IF OLD.status <> 'pending' THEN "
        "RAISE EXCEPTION 'releases are never deleted'; END IF; RETURN OLD; END IF; "
        f"{checks}RETURN NEW; END $$"
    )
