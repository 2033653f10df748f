"""Open the catalog: SQLite (embedded default, WAL) or PostgreSQL; migrate on open when needed.

Start-up matters (`reg ls` is run by scripts): when the schema is current, opening costs one
`SELECT` of the alembic version and never imports alembic.

SQLite write transactions start with `BEGIN IMMEDIATE`, so a writer waits for the lock (busy
timeout) up front instead of failing when a read transaction later tries to upgrade.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlmodel import Session

from registry.errors import CatalogLocked, RegistryError

HEAD_REVISION = "0001"
MIGRATIONS = Path(__file__).with_name("migrations")
_WRITE = contextvars.ContextVar("reg_catalog_write", default=False)


class Catalog:
    def __init__(self, url: str, *, busy_timeout_s: float = 30.0) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self.busy_timeout_s = busy_timeout_s
        self.engine = self._create_engine()
        with self._translate_errors():
            self._ensure_schema()

    def describe(self) -> str:
        return self.engine.url.render_as_string(hide_password=True)

    # -- sessions ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """A transaction: committed when the block ends, rolled back on any exception."""
        token = _WRITE.set(write)
        try:
            with self._translate_errors(), Session(self.engine, expire_on_commit=False) as s:
                yield s
                s.commit()
        finally:
            _WRITE.reset(token)

    def dispose(self) -> None:
        self.engine.dispose()

    @contextlib.contextmanager
    def _translate_errors(self) -> Iterator[None]:
        try:
            yield
        except OperationalError as exc:
            text = str(exc.orig).lower()
            if "locked" in text or "busy" in text:
                raise CatalogLocked(
                    f"the catalog {self.describe()} is locked by another process "
                    f"(waited {self.busy_timeout_s:g}s)",
                    "retry when it is done, or raise REG_BUSY_TIMEOUT",
                ) from exc
            raise RegistryError(
                f"catalog {self.describe()} is unavailable: {str(exc.orig).strip().splitlines()[0]}",
                "check REG_CATALOG_URL and that the database is up",
            ) from exc
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise RegistryError(f"lost the catalog connection: {exc.orig}", "retry") from exc
            raise

    # -- engine ------------------------------------------------------------------------------
    def _create_engine(self) -> Engine:
        if not self.is_sqlite:
            try:
                return create_engine(self.url, pool_pre_ping=True)
            except Exception as exc:  # bad URL or missing driver
                raise RegistryError(f"cannot open catalog {self.url!r}: {exc}",
                                    "check REG_CATALOG_URL") from exc
        path = self.url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(self.url, connect_args={"timeout": self.busy_timeout_s})
        busy_ms = int(self.busy_timeout_s * 1000)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout = {busy_ms}")
            cur.execute("PRAGMA synchronous = FULL")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):  # type: ignore[no-untyped-def]
            conn.exec_driver_sql("BEGIN IMMEDIATE" if _WRITE.get() else "BEGIN")

        return engine

    # -- schema ------------------------------------------------------------------------------
    def current_revision(self) -> str | None:
        with self.engine.connect() as conn:
            try:
                return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
            except DBAPIError as exc:
                if "alembic_version" in str(exc.orig) or "no such table" in str(exc.orig):
                    return None
                raise

    def _ensure_schema(self) -> None:
        if self.current_revision() == HEAD_REVISION:
            return
        with self._migration_lock():
            if self.is_sqlite:
                # WAL is a property of the file: set once, under the lock, never while another
                # connection may hold the file (switching modes then fails at once with BUSY).
                raw = self.engine.raw_connection()  # outside any transaction, as WAL needs
                try:
                    raw.cursor().execute("PRAGMA journal_mode = WAL")
                finally:
                    raw.close()
            if self.current_revision() != HEAD_REVISION:
                self._upgrade()

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        """Only one process migrates; the others wait, then find the schema current."""
        if self.is_sqlite:
            path = self.url.split("///", 1)[-1]
            if not path or path == ":memory:":
                yield
                return
            fd = os.open(f"{path}.migrate.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)
        else:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("SELECT pg_advisory_lock(7311)")
                try:
                    yield
                finally:
                    conn.exec_driver_sql("SELECT pg_advisory_unlock(7311)")
                    conn.commit()

    def _upgrade(self) -> None:
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        token = _WRITE.set(True)
        try:
            with self.engine.connect() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
                conn.commit()
        finally:
            _WRITE.reset(token)
