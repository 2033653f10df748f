"""The catalog on SQLite and PostgreSQL: migrations on open, database-level guards."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from registry import audit
from registry.catalog.engine import HEAD_REVISION, Catalog


def test_migrations_run_once_and_reopen_is_cheap(catalog_url):
    first = Catalog(catalog_url)
    assert first.current_revision() == HEAD_REVISION
    first.dispose()
    again = Catalog(catalog_url)
    assert again.current_revision() == HEAD_REVISION
    again.dispose()


def test_audit_log_is_append_only_even_for_direct_sql(catalog_url):
    cat = Catalog(catalog_url)
    with cat.session(write=True) as s:
        audit.record(s, "alice", "push", "r@step1")
    for statement in ("UPDATE audit_event SET actor = 'mallory'", "DELETE FROM audit_event"):
        with pytest.raises(DBAPIError, match="append-only"), cat.engine.begin() as conn:
            conn.execute(text(statement))
    with cat.session() as s:
        assert [e["actor"] for e in audit.query(s)] == ["alice"]
    cat.dispose()


def test_sqlite_catalog_uses_wal(tmp_path):
    cat = Catalog(f"sqlite:///{tmp_path / 'c.db'}")
    with cat.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    cat.dispose()


def test_unreachable_catalog_is_a_clear_error():
    from registry.errors import RegistryError

    with pytest.raises(RegistryError, match="unavailable"):
        Catalog("postgresql+psycopg://postgres@127.0.0.1:1/none")
