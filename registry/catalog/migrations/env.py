"""Alembic environment: runs on the connection the catalog hands over (no alembic.ini)."""

from alembic import context

from registry.catalog.models import SQLModel

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
