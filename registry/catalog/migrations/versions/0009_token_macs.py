"""Tokens the database cannot mint: `api_token.mac` is an HMAC under the server's audit key over
the token's id, principal, secret digest, expiry, creator and time; `reg server` refuses a token
without a valid one, so a row inserted by whoever holds the runtime role's credentials (or the
owner's) opens nothing. A token's content never changes, its revocation is one-way, and a
token row is never deleted (deleting a revoked row and inserting it again unrevoked, with its
valid MAC, would undo the revocation).

Tokens minted before this revision have no MAC and stop working behind the server: an operator
on the server host mints a new admin token with `reg server init --admin NAME`.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_CONTENT = (
    "NEW.id <> OLD.id OR NEW.principal <> OLD.principal OR NEW.secret_sha256 <> OLD.secret_sha256"
    " OR NEW.created_at <> OLD.created_at OR NEW.created_by <> OLD.created_by"
    " OR NEW.expires_at IS DISTINCT FROM OLD.expires_at OR NEW.mac IS DISTINCT FROM OLD.mac"
)
_UNREVOKED = (
    "OLD.revoked_at IS NOT NULL AND (NEW.revoked_at IS DISTINCT FROM OLD.revoked_at"
    " OR NEW.revoked_by IS DISTINCT FROM OLD.revoked_by)"
)
_NO_DELETE = "token records are never deleted (revoke instead)"
_GUARDS = (
    ("api_token_immutable", _CONTENT, "a token never changes"),
    ("api_token_stays_revoked", _UNREVOKED, "a revoked token stays revoked"),
)


def upgrade() -> None:
    op.add_column("api_token", sa.Column("mac", sa.String(length=64), nullable=True))
    if op.get_bind().dialect.name == "sqlite":
        for name, when, message in _GUARDS:
            sql_when = when.replace("IS DISTINCT FROM", "IS NOT")
            op.execute(
                f"CREATE TRIGGER {name} BEFORE UPDATE ON api_token WHEN {sql_when} "
                f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
            )
        op.execute(
            "CREATE TRIGGER api_token_no_delete BEFORE DELETE ON api_token "
            f"BEGIN SELECT RAISE(ABORT, '{_NO_DELETE}'); END"
        )
        return
    checks = "".join(
        f"IF {when} THEN RAISE EXCEPTION '{message}'; END IF; " for _, when, message in _GUARDS
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION reg_api_token_guard() RETURNS trigger LANGUAGE plpgsql "
        f"AS $$ BEGIN IF TG_OP = 'DELETE' THEN RAISE EXCEPTION '{_NO_DELETE}'; END IF; "
        f"{checks}RETURN NEW; END $$"
    )
    op.execute(
        "CREATE TRIGGER api_token_guard BEFORE UPDATE OR DELETE ON api_token "
        "FOR EACH ROW EXECUTE FUNCTION reg_api_token_guard()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name, _, _ in _GUARDS:
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TRIGGER IF EXISTS api_token_no_delete")
    else:
        op.execute("DROP TRIGGER IF EXISTS api_token_guard ON api_token")
        op.execute("DROP FUNCTION IF EXISTS reg_api_token_guard()")
    op.drop_column("api_token", "mac")
