"""The release workflow.

- `alias_request`, `alias_decision`: moves of protected aliases asked for, and the approvals,
  rejections and cancellations of them. Append-only (triggers, as `fact_mac`): a request's
  state is derived from its decisions and its expiry, never updated.
- `alias_event.request_id`, `requested_by`, `approved_by`: a protected alias's history names
  who asked and who approved. Plain ADD COLUMNs: 0001's append-only triggers stay.
- `webhook_cursor`, `webhook_delivery`: the outbox's events fanned out to each webhook
  subscriber, one delivery row per subscriber and event, retried until a 2xx reply; behind the
  server each body carries a MAC (`body_mac`).
- `outbox_event.uid`, `mac`: an event's own id (the webhook's) and, behind the server, its MAC.

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_APPEND_ONLY = ("alias_request", "alias_decision")


def upgrade() -> None:
    op.create_table(
        "alias_request",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("model_id", sa.Integer(), sa.ForeignKey("model.id"), nullable=False),
        sa.Column("alias", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("release_id", sa.Integer(), sa.ForeignKey("release.id"), nullable=False),
        sa.Column("requested_by", sa.String(), nullable=False),
        sa.Column("requested_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("approvals_needed", sa.Integer(), nullable=False),
        sa.Column("rule", sa.String(length=128), nullable=False),
    )
    op.create_index("ix_alias_request_model_id", "alias_request", ["model_id"])
    op.create_table(
        "alias_decision",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("request_id", sa.Integer(), sa.ForeignKey("alias_request.id"), nullable=False),
        sa.Column("decision", sa.String(length=16), nullable=False),
        sa.Column("by", sa.String(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        # no UNIQUE (request, by, decision): a row written around the server, which the
        # server ignores, must not block the genuine decision of the same name
    )
    op.create_index("ix_alias_decision_request_id", "alias_decision", ["request_id"])
    for table in _APPEND_ONLY:
        if op.get_bind().dialect.name == "sqlite":
            for verb in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: {verb} refused'); END"
                )
        else:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION reg_append_only()"
            )
    op.add_column("alias_event", sa.Column("request_id", sa.Integer(), nullable=True))
    op.add_column("alias_event", sa.Column("requested_by", sa.String(), nullable=True))
    op.add_column("alias_event", sa.Column("approved_by", sa.String(), nullable=True))
    op.add_column("outbox_event", sa.Column("uid", sa.String(length=32), nullable=True))
    op.add_column("outbox_event", sa.Column("mac", sa.String(length=64), nullable=True))
    op.create_table(
        "webhook_cursor",
        sa.Column("subscriber", sa.String(length=64), primary_key=True),
        sa.Column("outbox_id", sa.BigInteger(), nullable=False),
        sa.Column("since", sa.Float(), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
    )
    op.create_table(
        "webhook_delivery",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("subscriber", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("outbox_id", sa.BigInteger(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("body_mac", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.Float(), nullable=False),
        sa.Column("last_error", sa.String(), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.UniqueConstraint("subscriber", "event_id"),
    )
    op.create_index("ix_webhook_delivery_due", "webhook_delivery", ["status", "next_attempt_at"])


def downgrade() -> None:
    op.drop_table("webhook_delivery")
    op.drop_table("webhook_cursor")
    for column in ("mac", "uid"):
        op.drop_column("outbox_event", column)
    for column in ("approved_by", "requested_by", "request_id"):
        op.drop_column("alias_event", column)  # no table rebuild: its triggers stay
    for table in reversed(_APPEND_ONLY):
        op.drop_table(table)  # its triggers go with it
