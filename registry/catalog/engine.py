"""Open the catalog: SQLite (embedded default, WAL) or PostgreSQL; migrate on open when needed.

On PostgreSQL only the schema's owner migrates (`reg catalog migrate`); the least-privilege role
`reg server` runs as (`reg catalog grants`) finds a schema behind and says so in one line, before
any DDL it could only half-run.

Start-up matters (`reg ls` is run by scripts): on SQLite, opening a current catalog costs one
`SELECT` through the standard `sqlite3` module; SQLAlchemy is imported only when a command needs
a session, and alembic only when the schema is behind.

SQLite write transactions start with `BEGIN IMMEDIATE`, so a writer waits for the lock (busy
timeout) up front instead of failing when a read transaction later tries to upgrade.

PostgreSQL connections are pinged before use (a server restart leaves the pool's connections
dead), and once this process has reached the database, a new connection that is refused waits
for it to come back (a restart, a failover) for up to REG_CATALOG_RECONNECT seconds (default 30)
before the command fails with one line saying the catalog is unavailable. A catalog never
reached fails at once. A transaction whose connection dies under it is not replayed (it may have
committed): it fails with that one line, and the operations are safe to run again.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import CatalogLocked, RegistryError
from registry.text import redact, redact_url

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine
    from sqlmodel import Session

    from registry.core.config import CatalogSettings

HEAD_REVISION = "0020"
MIGRATIONS = Path(__file__).with_name("migrations")
_WRITE = contextvars.ContextVar("reg_catalog_write", default=False)


class Catalog:
    def __init__(
        self,
        url: str,
        *,
        busy_timeout_s: float = 30.0,
        reconnect_s: float = 30.0,
        ensure_schema: bool = True,
    ) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self.busy_timeout_s = busy_timeout_s
        self.reconnect_s = max(0.0, reconnect_s)
        self._engine: Engine | None = None
        self.sqlite_path = url.split("///", 1)[-1] if self.is_sqlite else None
        if self.sqlite_path and self.sqlite_path != ":memory:":
            Path(self.sqlite_path).parent.mkdir(parents=True, exist_ok=True)
            # Not world-readable (SQLite gives its -wal and -shm files the same mode).
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.sqlite_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640))
        if ensure_schema:
            with self._translate_errors():
                self._ensure_schema()

    @classmethod
    def of(cls, settings: CatalogSettings, *, ensure_schema: bool = True) -> Catalog:
        """The catalog the settings name."""
        return cls(
            settings.url,
            busy_timeout_s=settings.busy_timeout_s,
            reconnect_s=settings.reconnect_s,
            ensure_schema=ensure_schema,
        )

    def describe(self) -> str:
        if self.is_sqlite:
            return self.url
        return redact_url(self.engine.url.render_as_string(hide_password=True))

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._create_engine()
        return self._engine

    # -- sessions ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """A transaction: committed when the block ends, rolled back on any exception."""
        from sqlmodel import Session

        token = _WRITE.set(write)
        try:
            with self._translate_errors(), Session(self.engine, expire_on_commit=False) as s:
                yield s
                s.commit()
        finally:
            _WRITE.reset(token)

    @contextlib.contextmanager
    def dbapi(self) -> Iterator[tuple[Any, str]]:
        """A raw DB-API connection and its parameter mark, for read-only fast paths: on SQLite it
        is the standard `sqlite3` module, with no SQLAlchemy import at all."""
        with self._translate_errors():
            if self.is_sqlite:
                conn = self._sqlite_connect()
                try:
                    yield conn, "?"
                finally:
                    conn.close()
            else:
                raw = self.engine.raw_connection()
                try:
                    yield raw, "%s"
                except BaseException:
                    # Never hand a connection that failed back to the pool: resetting a dead
                    # one logs a traceback (the server restarted under it), and the next
                    # checkout reconnects anyway.
                    with contextlib.suppress(Exception):
                        raw.invalidate()
                    raise
                finally:
                    raw.close()

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()

    @contextlib.contextmanager
    def _translate_errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            raise self._translated(exc, str(exc)) from exc
        except Exception as exc:
            if _is_driver_operational(exc):  # a raw DB-API connection's (dbapi())
                raise self._translated(exc, str(exc)) from exc
            orig = getattr(exc, "orig", None)
            if orig is None or type(exc).__module__.split(".")[0] != "sqlalchemy":
                raise
            if type(exc).__name__ == "OperationalError":
                raise self._translated(exc, str(orig)) from exc
            if getattr(exc, "connection_invalidated", False):
                raise RegistryError(f"lost the catalog connection: {orig}", "retry") from exc
            raise

    def _translated(self, exc: BaseException, text: str) -> RegistryError:
        lowered = text.lower()
        if "locked" in lowered or "busy" in lowered:
            return CatalogLocked(
                f"the catalog {self.describe()} is locked by another process "
                f"(waited {self.busy_timeout_s:g}s)",
                "retry when it is done, or raise REG_BUSY_TIMEOUT",
            )
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return RegistryError(
            f"catalog {self.describe()} is unavailable: {first}",
            "check REG_CATALOG_URL and that the database is up",
        )

    # -- connections -------------------------------------------------------------------------
    def _sqlite_connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.sqlite_path or ":memory:",
            timeout=self.busy_timeout_s,
            isolation_level=None,
            check_same_thread=False,
        )
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        return conn

    def _create_engine(self) -> Engine:
        from sqlalchemy import create_engine, event

        if not self.is_sqlite:
            try:
                pg = create_engine(self.url, pool_pre_ping=True)
            except Exception as exc:  # bad URL or missing driver
                raise RegistryError(
                    redact(f"cannot open catalog {self.url!r}: {exc}"), "check REG_CATALOG_URL"
                ) from exc
            _wait_for_reconnects(pg, self.reconnect_s)
            event.listen(pg, "connect", _exact_floats)
            return pg
        engine = create_engine(self.url, creator=self._sqlite_connect)

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if _WRITE.get() else "BEGIN")

        return engine

    # -- schema ------------------------------------------------------------------------------
    def current_revision(self) -> str | None:
        if self.is_sqlite:
            conn = self._sqlite_connect()
            try:
                return str(conn.execute("SELECT version_num FROM alembic_version").fetchone()[0])
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return None
                raise
            except TypeError:  # no row
                return None
            finally:
                conn.close()
        from sqlalchemy.exc import DBAPIError

        with self.engine.connect() as pg:
            try:
                return pg.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
            except DBAPIError as exc:
                state = getattr(exc.orig, "sqlstate", None)
                if state == "42P01":  # undefined_table: nothing migrated yet
                    return None
                if state == "42501":  # insufficient_privilege
                    pg.rollback()
                    user = pg.exec_driver_sql("SELECT current_user").scalar()
                    raise RegistryError(
                        f"role {user} may not read the catalog {self.describe()}",
                        f"the catalog's owner should run `reg catalog grants {user}`",
                    ) from exc
                raise

    def migrate(self, to: str = "head") -> dict[str, Any]:
        """Bring the schema up to `to` (`reg catalog migrate`); the revision before and after.
        On PostgreSQL only a role that owns the schema's tables and may create in it migrates:
        any other stops here, before its first DDL could fail half-way."""
        with self._translate_errors():
            before = self.current_revision()
            target = HEAD_REVISION if to == "head" else to
            if before != target:
                _check_known(before)
                if not self.is_sqlite:
                    self._check_can_migrate(before)
                with self._migration_lock():
                    if self.is_sqlite:
                        # WAL is a property of the file: set once, under the lock, never while
                        # another connection may hold the file (switching modes then fails at
                        # once with BUSY).
                        conn = self._sqlite_connect()
                        try:
                            conn.execute("PRAGMA journal_mode = WAL")
                        finally:
                            conn.close()
                    if self.current_revision() != target:
                        self._upgrade(to)
            after = self.current_revision()
        return {"catalog": self.describe(), "before": before, "after": after, "head": HEAD_REVISION}

    def _ensure_schema(self) -> None:
        if self.current_revision() != HEAD_REVISION:
            self.migrate()

    def _check_can_migrate(self, current: str | None) -> None:
        """Ask PostgreSQL whether this role may run the DDL (CREATE in the schema, ownership of
        every relation in it) instead of trying and parsing the failure."""
        with self.engine.connect() as pg:
            user, schema, can_create, foreign = pg.exec_driver_sql(
                "SELECT current_user, current_schema(),"
                " coalesce(has_schema_privilege(current_schema(), 'CREATE'), false),"
                " (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                "  WHERE n.nspname = current_schema() AND c.relkind IN ('r','p','v','m','S','f')"
                "  AND NOT pg_has_role(c.relowner, 'USAGE'))"
            ).one()
        if can_create and not foreign:
            return
        why = (
            "no schema in its search_path exists"
            if schema is None
            else f"it does not own schema {schema}'s tables"
            if foreign
            else f"it may not create in schema {schema}"
        )
        state = "has no schema yet" if current is None else f"is at schema revision {current}"
        raise RegistryError(
            f"the catalog {self.describe()} {state}; this reg needs {HEAD_REVISION}, and role "
            f"{user} cannot migrate it ({why})",
            f"the catalog's owner should run `reg catalog migrate`, then "
            f"`reg catalog grants {user}`",
        )

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        """Only one process migrates; the others wait, then find the schema current."""
        if self.is_sqlite:
            if not self.sqlite_path or self.sqlite_path == ":memory:":
                yield
                return
            fd = os.open(f"{self.sqlite_path}.migrate.lock", os.O_CREAT | os.O_RDWR, 0o640)
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

    def _upgrade(self, to: str = "head") -> None:
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        token = _WRITE.set(True)
        try:
            with self.engine.connect() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, to)
                conn.commit()
        finally:
            _WRITE.reset(token)


def _exact_floats(dbapi_connection: Any, record: Any) -> None:
    """Floats read back exactly as written, whatever the server's or the role's
    `extra_float_digits` (0 rounds to 15 digits, the default before PostgreSQL 12): times are
    inside what audit events and signed facts sign, and a rounded one would fail every
    signature (an honest registry denied)."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET extra_float_digits = 3")
    finally:
        cursor.close()
    dbapi_connection.commit()


def _wait_for_reconnects(engine: Engine, wait_s: float) -> None:
    """Once a first connection succeeded, a refused new one is retried for `wait_s` seconds:
    the database restarting or failing over, not a wrong URL."""
    from sqlalchemy import event

    reached = threading.Event()

    @event.listens_for(engine, "connect")
    def _connected(dbapi_connection: Any, record: Any) -> None:
        reached.set()

    @event.listens_for(engine, "do_connect")
    def _connect(dialect: Any, record: Any, cargs: Any, cparams: Any) -> Any:
        if not reached.is_set():
            return None  # the dialect's own connect: a catalog never reached fails at once
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return dialect.connect(*cargs, **cparams)
            except dialect.loaded_dbapi.OperationalError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.25)


def _is_driver_operational(exc: BaseException) -> bool:
    return any(
        c.__name__ == "OperationalError" and c.__module__.split(".")[0] == "psycopg"
        for c in type(exc).__mro__
    )


def _check_known(revision: str | None) -> None:
    """A schema migrated by a newer reg: say so, instead of alembic's "Can't locate revision"."""
    if revision is None:
        return
    known = {p.name.split("_", 1)[0] for p in (MIGRATIONS / "versions").glob("[0-9]*_*.py")}
    if revision not in known:
        raise RegistryError(
            f"the catalog's schema is at revision {revision}, newer than this reg knows "
            f"(its newest is {HEAD_REVISION})",
            "upgrade reg to the version that migrated it",
        )
