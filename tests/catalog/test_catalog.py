"""The catalog on SQLite and PostgreSQL: migrations on open, database-level guards."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from registry.catalog.engine import HEAD_REVISION, Catalog
from registry.trust import audit


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


def _migrate(cat: Catalog, target: str, down: bool = False) -> None:
    from alembic import command
    from alembic.config import Config

    from registry.catalog.engine import MIGRATIONS

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with cat.engine.connect() as conn:
        cfg.attributes["connection"] = conn
        (command.downgrade if down else command.upgrade)(cfg, target)
        conn.commit()


def test_the_object_version_migration_keeps_the_guards_both_ways(catalog_url):
    """0003 adds the version columns without rebuilding tables (which would drop SQLite's
    guard triggers), and its downgrade leaves the guards in place too."""
    cat = Catalog(catalog_url)
    guards = _triggers(cat)
    assert {"release_immutable", "release_file_no_delete"} <= guards or {
        "release_immutable",
        "release_file_append_only",
    } <= guards
    with cat.session(write=True) as s:
        audit.record(s, "alice", "push", "r@step1")
    _migrate(cat, "0002", down=True)
    added = (
        ADDED_BY_0005 | ADDED_BY_0006 | ADDED_BY_0008 | ADDED_BY_0009 | ADDED_BY_0010
        | ADDED_BY_0015 | ADDED_BY_0017 | ADDED_BY_0019 | ADDED_BY_0020
    )  # fmt: skip
    assert _triggers(cat) == guards - added
    _migrate(cat, "head")
    assert cat.current_revision() == HEAD_REVISION and _triggers(cat) == guards
    with pytest.raises(DBAPIError, match="append-only"), cat.engine.begin() as conn:
        conn.execute(text("DELETE FROM audit_event"))
    with cat.engine.connect() as conn:
        assert conn.execute(text("SELECT actor FROM audit_event")).scalars().all() == ["alice"]
    cat.dispose()


ADDED_BY_0005 = {
    "release_never_pending_again",
    "release_never_unyanked",
    "policy_document_no_update",
    "policy_document_no_delete",
    "policy_document_append_only",
}
ADDED_BY_0006 = {"audit_seal_no_update", "audit_seal_no_delete", "audit_seal_append_only"}
ADDED_BY_0009 = {
    "api_token_immutable",
    "api_token_stays_revoked",
    "api_token_no_delete",
    "api_token_guard",
}
ADDED_BY_0010 = {
    "key_set_no_update",
    "key_set_no_delete",
    "checkpoint_keys_no_update",
    "checkpoint_keys_no_delete",
    "key_set_guard",
    "checkpoint_keys_guard",
}
ADDED_BY_0017 = {
    f"{table}_{guard}"
    for table in ("signing_key_event", "release_signature")
    for guard in ("no_update", "no_delete", "append_only")
}
ADDED_BY_0019 = {  # requests of protected aliases and the decisions on them
    f"{table}_{guard}"
    for table in ("alias_request", "alias_decision")
    for guard in ("no_update", "no_delete", "append_only")
}
# a content row goes only with a new attempt at a lost tier-0 step
ADDED_BY_0020 = {"checkpoint_file_kept", "checkpoint_keys_kept", "checkpoint_tier_kept"}
ADDED_BY_0015 = {
    "fact_mac_no_update",
    "fact_mac_no_delete",
    "fact_mac_append_only",
    "audit_seal_next_link",
    "run_name_kept",
}
ADDED_BY_0008 = {
    "checkpoint_state_moves",
    "checkpoint_pinned_kept",
    "checkpoint_immutable",
    "checkpoint_digests_only_rehashed",
    "checkpoint_no_delete",
    "checkpoint_guard",
}


def _triggers(cat: Catalog) -> set[str]:
    with cat.engine.connect() as conn:
        if cat.is_sqlite:
            sql = "SELECT name FROM sqlite_master WHERE type = 'trigger'"
        else:
            sql = (
                "SELECT tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE NOT t.tgisinternal AND n.nspname = current_schema()"
            )
        return set(conn.execute(text(sql)).scalars().all())


def test_a_committed_checkpoint_is_guarded_by_the_database(reg, ckpts):
    """What the server's runtime role could otherwise do to a checkpoint row:
    set it back to pending or to sweeping (its objects would be deleted as leftovers, with no
    tombstone), collect a pinned one, rewrite its content (resume state and metrics feed the
    promotion gate and retention), claim its digests were re-hashed by someone, delete it."""
    reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
    reg.pin("r@step2", reason="baseline")
    moves = "moves only"
    for statement, said in (
        ("UPDATE checkpoint SET state = 'pending'", moves),
        ("UPDATE checkpoint SET state = 'pending', lease_until = 0", moves),
        ("UPDATE checkpoint SET state = 'sweeping'", moves),
        ("UPDATE checkpoint SET state = 'deleted'", moves),
        ("UPDATE checkpoint SET state = 'anything'", moves),
        ("UPDATE checkpoint SET state = 'lost'", moves),  # only a tier-0 step is ever lost
        ("UPDATE checkpoint SET state = 'deleting'", "pinned checkpoint is never collected"),
        ("UPDATE checkpoint SET manifest_sha256 = 'x'", "immutable"),
        ("UPDATE checkpoint SET bytes = 1", "immutable"),
        ("UPDATE checkpoint SET pushed_by = 'mallory'", "immutable"),
        ("UPDATE checkpoint SET step = 3", "immutable"),
        ("UPDATE checkpoint SET resumable = NOT resumable", "immutable"),
        ("UPDATE checkpoint SET missing_state = '[\"rng\"]'", "immutable"),
        ("UPDATE checkpoint SET metrics = '{\"probe_loss\": 0.0}'", "immutable"),
        ("UPDATE checkpoint SET created_at = 0", "immutable"),
        ("UPDATE checkpoint SET digests_reported_by = 'mallory'", "only becomes NULL"),
        ("DELETE FROM checkpoint", "never deleted"),
        # its key paths decide its resume state at every use (migration 0010)
        ("UPDATE key_set SET keys = '[]'", "written once"),
        ("UPDATE checkpoint_keys SET layout = 'torchtitan'", "written once"),
        ("DELETE FROM checkpoint_keys", "only while it is pending"),
        ("DELETE FROM checkpoint_file", "only while it is pending"),
        ("DELETE FROM key_set", "written once"),
    ):
        with pytest.raises(DBAPIError, match=said), reg.catalog.engine.begin() as conn:
            conn.execute(text(statement))
    # What the registry itself changes still changes: a pin, and GC's way to a tombstone.
    reg.unpin("r@step2")
    with reg.catalog.engine.begin() as conn:
        conn.execute(text("UPDATE checkpoint SET state = 'deleting'"))
        conn.execute(text("UPDATE checkpoint SET state = 'deleted'"))
    for back in ("committed", "deleting", "pending"):
        with pytest.raises(DBAPIError, match=moves), reg.catalog.engine.begin() as conn:
            conn.execute(text(f"UPDATE checkpoint SET state = '{back}'"))
