"""Least privilege for the role `reg server` runs as on PostgreSQL (`reg catalog grants ROLE`).

The owner role migrates (`reg catalog migrate`); the runtime role gets exactly what the runtime
code needs: history (audit log, audit seals, alias history, policy documents) it may append to and
read, never rewrite; rows it deletes only where the code deletes; no DDL, TRUNCATE, TRIGGER or
REFERENCES anywhere. `RULES` is the whole mapping, and it fails closed: a relation in the schema
without a rule makes `grants` refuse, so a future migration can neither silently get nothing (the
server fails at run time) nor anything by default.

Everything is revoked first, so a re-run removes what an earlier one or a person granted; then
the role's effective privileges are read back from PostgreSQL (`has_*_privilege`, which sees
grants to PUBLIC and to roles it belongs to) and must equal the rules, or nothing is committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from registry.catalog.engine import Catalog
from registry.errors import NotFound, PermissionDenied, RegistryError, UsageError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sqlalchemy.engine import Connection

    from registry.catalog.engine import Catalog
    from registry.core.config import Settings

READ_APPEND = ("SELECT", "INSERT")
READ_WRITE = ("SELECT", "INSERT", "UPDATE")

# table -> the privileges the runtime role holds on it; nothing else, ever.
RULES: dict[str, tuple[str, ...]] = {
    # History: appended to and read, never rewritten (triggers refuse it even to the owner).
    "audit_event": READ_APPEND,
    "audit_seal": READ_APPEND,  # the HMAC chain's anchors (migration 0006)
    "alias_event": READ_APPEND,
    "policy_document": READ_APPEND,
    "fact_mac": READ_APPEND,  # signatures of policies, validations, model owners (0015)
    "release_signature": READ_APPEND,  # who signed a release, with which key (0017)
    # The release workflow (0019): requests of protected aliases and the decisions on them,
    # derived, never rewritten.
    "alias_request": READ_APPEND,
    "alias_decision": READ_APPEND,
    # Signing keys' life: `reg server init` and an operator's `reg keys` on the server's host
    # (beside the private keys, which the server holds anyway) append; no route writes them.
    "signing_key_event": READ_APPEND,
    # Written once, read after: nothing in the code updates them.
    "project": READ_APPEND,
    "model": READ_APPEND,
    "release_file": READ_APPEND,
    "validation": READ_APPEND,
    "key_set": READ_APPEND,  # a checkpoint's key paths (migration 0010; triggers: never changed)
    "checkpoint_restore": READ_APPEND,  # the training loop's restores (migration 0011)
    # Which tiers hold a checkpoint (migration 0016): written by the tier-0 and tier-1 commits,
    # an eviction sets `evicted_at`.
    "checkpoint_tier": (*READ_WRITE, "DELETE"),
    # A checkpoint's content rows: written once at its commit; deleted only by a new attempt at
    # a lost tier-0 step, while its row is pending again (0020's triggers refuse any other).
    "checkpoint_file": (*READ_APPEND, "DELETE"),
    "checkpoint_keys": (*READ_APPEND, "DELETE"),
    # Updated in place: a run's resume point, an alias's target, the outbox's progress, a
    # token's revocation and last use.
    "run": READ_WRITE,
    "alias": READ_WRITE,
    "outbox_event": READ_WRITE,
    "api_token": READ_WRITE,
    # Rows the code deletes: GC drops an abandoned push's row once its objects are gone and
    # rebuild replaces a dead pending claim (checkpoint); rebuild replaces a dead pending
    # promotion (release: a trigger refuses deleting any other); leases are released.
    "checkpoint": (*READ_WRITE, "DELETE"),
    "release": (*READ_WRITE, "DELETE"),
    "lease": (*READ_WRITE, "DELETE"),
    # Webhook deliveries (0019): fanned out from the outbox, their attempts updated in place.
    "webhook_cursor": READ_WRITE,
    "webhook_delivery": READ_WRITE,
    "alembic_version": ("SELECT",),  # read at every open; only the owner migrates
}

# What is checked to be absent beyond the rules (MAINTAIN exists from PostgreSQL 17).
TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
_COLUMN_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "REFERENCES")
_TABLE_KINDS = "'r','p','v','m','f'"  # tables, partitioned tables, views, foreign tables
# Everything whose owner can undo the grants: the database (DROP DATABASE), the schema (DROP any
# table in it), its relations, its functions (the trigger functions: CREATE OR REPLACE).
_OWNERS = f"""
SELECT kind, name, pg_has_role(CAST(:role AS oid), owner, 'MEMBER'),
       pg_has_role(current_user, owner, 'USAGE') FROM (
  SELECT 'database' AS kind, d.datname::text AS name, d.datdba AS owner
    FROM pg_database d WHERE d.datname = current_database()
  UNION ALL SELECT 'schema', n.nspname::text, n.nspowner
    FROM pg_namespace n WHERE n.nspname = current_schema()
  UNION ALL SELECT 'table', c.relname::text, c.relowner
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = current_schema() AND c.relkind IN ({_TABLE_KINDS},'S')
  UNION ALL SELECT 'function', p.proname::text, p.proowner
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = current_schema()
) o ORDER BY kind DESC, name
"""


def migrate(settings: Settings, grant: Sequence[str] = ()) -> dict[str, Any]:
    """`reg catalog migrate [--grant ROLE]...`: the schema brought to this reg's head by its
    owner, then each runtime role's grants re-applied (a new table has none)."""
    catalog = _owner_catalog(settings, "migrate")
    try:
        out = catalog.migrate()
        out["grants"] = [apply(catalog, role) for role in grant]
        return out
    finally:
        catalog.dispose()


def grant(settings: Settings, role: str, *, dry_run: bool = False) -> dict[str, Any]:
    """`reg catalog grants ROLE [--dry-run]`."""
    catalog = _owner_catalog(settings, "grants")
    try:
        return apply(catalog, role, dry_run=dry_run)
    finally:
        catalog.dispose()


def _owner_catalog(settings: Settings, command: str) -> Catalog:
    if settings.remote:
        raise UsageError(
            f"reg catalog {command} runs on the database itself, not through reg server",
            "unset REG_URL and set REG_CATALOG_URL to the owner role's URL",
        )
    return Catalog.of(settings.catalog, ensure_schema=False)


def apply(catalog: Catalog, role: str, *, dry_run: bool = False) -> dict[str, Any]:
    """Grant `role` least privilege on the catalog's schema (run as the schema's owner); with
    `dry_run`, only the checks and the SQL, nothing executed."""
    if catalog.is_sqlite:
        raise UsageError(
            "SQLite has no roles: grants apply to PostgreSQL catalogs only",
            "protect the catalog file instead: owned by the server's user, mode 600",
        )
    _check_name(role)
    revision = catalog.current_revision()
    if revision is None:
        raise RegistryError(
            f"the catalog {catalog.describe()} has no schema yet",
            "run `reg catalog migrate` as its owner first",
        )
    with catalog.session(write=not dry_run) as s:
        conn = s.connection()
        schema, relations, sequences = _inspect(conn, role)
        sql = _statements(schema, role, relations, sequences)
        if not dry_run:
            # The DB-API cursor with no parameters: the driver then leaves `%` in a quoted
            # name alone (SQLAlchemy's exec_driver_sql would turn `%s` into a placeholder).
            cursor = conn.connection.cursor()
            try:
                for statement in sql:
                    cursor.execute(statement)
            finally:
                cursor.close()
            _verify(conn, role, schema, relations)
    return {
        "catalog": catalog.describe(),
        "revision": revision,
        "schema": schema,
        "role": role,
        "dry_run": dry_run,
        "tables": {t: list(RULES[t]) for t in relations},
        "sequences": sequences,
        "sql": sql,
    }


def _check_name(role: str) -> None:
    if not role or "\x00" in role or len(role.encode()) > 63:
        raise UsageError(f"bad role name {role!r}", "a PostgreSQL role name: 1 to 63 bytes, no NUL")


def _inspect(conn: Connection, role: str) -> tuple[str, list[str], list[str]]:
    """The schema, its relations (each with a rule) and sequences; refuses a role that would
    make the grants meaningless, and a caller that cannot grant them."""
    found = conn.execute(
        text(
            "SELECT r.oid, r.rolsuper, r.rolcreaterole, current_user, current_schema()"
            " FROM (SELECT 1) one LEFT JOIN pg_roles r ON r.rolname = :role"
        ),
        {"role": role},
    ).one()
    oid, superuser, createrole, me, schema = found
    if schema is None:
        raise RegistryError(
            "no schema in the search_path of REG_CATALOG_URL exists",
            "point REG_CATALOG_URL at the catalog's database (and schema)",
        )
    if oid is None:
        raise NotFound(
            f"role {role} does not exist", f"create it first: CREATE ROLE {quote(role)} LOGIN"
        )
    if role == me:
        raise UsageError(
            f"{role} is the role running this command: granting to the owner proves nothing",
            "connect as the owner (REG_CATALOG_URL) and name the runtime role",
        )
    if superuser:
        raise UsageError(
            f"{role} is a superuser: it bypasses every grant and trigger",
            "run reg server as a plain LOGIN role (NOSUPERUSER)",
        )
    if createrole:
        raise UsageError(
            f"{role} has CREATEROLE: it could give itself the owner's privileges",
            f"ALTER ROLE {quote(role)} NOCREATEROLE",
        )
    owners = conn.execute(text(_OWNERS), {"role": oid}).all()
    for kind, name, theirs, _ in owners:
        if theirs:
            raise UsageError(
                f"{role} owns (or belongs to the owner of) {kind} {name}: "
                "an owner can drop, alter or disable anything there",
                "use a role that owns nothing in the catalog's database and is no member of "
                "its owner",
            )
    for kind, name, _, mine in owners:
        if kind in ("schema", "table") and not mine:
            raise PermissionDenied(
                f"{me} does not own {kind} {name}: only the catalog's owner can grant on it",
                "run `reg catalog grants` with the owner's REG_CATALOG_URL",
            )
    rows = conn.execute(
        text(
            "SELECT c.relname::text, c.relkind::text FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            f" WHERE n.nspname = current_schema() AND c.relkind IN ({_TABLE_KINDS},'S')"
            " ORDER BY c.relname"
        )
    ).all()
    relations = [name for name, kind in rows if kind != "S"]
    unknown = [name for name in relations if name not in RULES]
    if unknown:
        raise RegistryError(
            f"{', '.join(unknown)} in schema {schema} {'has' if len(unknown) == 1 else 'have'} "
            "no grant rule in this reg: granting nothing (an unknown table could hold anything)",
            "run the reg that migrated the schema, or give it a rule in registry/catalog/grants.py",
        )
    return str(schema), relations, [name for name, kind in rows if kind == "S"]


def quote(name: str) -> str:
    """A PostgreSQL quoted identifier: the name verbatim, `"` doubled. (SQLAlchemy's quoting
    also doubles `%` for its paramstyle, which would name another role here.)"""
    return '"' + name.replace('"', '""') + '"'


def _statements(schema: str, role: str, relations: list[str], sequences: list[str]) -> list[str]:
    s, r = quote(schema), quote(role)
    sql = [
        # Revoke first: a re-run removes whatever an earlier run or a person added.
        f"REVOKE ALL ON ALL TABLES IN SCHEMA {s} FROM {r}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {s} FROM {r}",
        f"REVOKE ALL ON SCHEMA {s} FROM {r}",
        f"REVOKE CREATE ON SCHEMA {s} FROM PUBLIC",  # PostgreSQL < 15 grants it to everyone
        f"GRANT USAGE ON SCHEMA {s} TO {r}",
    ]
    sql += [f"GRANT {', '.join(RULES[t])} ON TABLE {s}.{quote(t)} TO {r}" for t in relations]
    if sequences:  # serial ids: nextval (USAGE) and currval (SELECT), never setval (UPDATE)
        names = ", ".join(f"{s}.{quote(q)}" for q in sequences)
        sql.append(f"GRANT USAGE, SELECT ON SEQUENCE {names} TO {r}")
    return sql


def _verify(conn: Connection, role: str, schema: str, relations: list[str]) -> None:
    """Read the role's effective privileges back: a grant to PUBLIC or to a role it belongs to
    survives the REVOKEs above, and GRANT only warns when it grants nothing."""
    version = int(conn.exec_driver_sql("SHOW server_version_num").scalar() or 0)
    privileges = (*TABLE_PRIVILEGES, *(("MAINTAIN",) if version >= 170000 else ()))
    rows = conn.execute(
        text(
            "SELECT c.relname::text, p.priv,"
            " CASE WHEN p.priv = ANY(CAST(:columnar AS text[]))"
            "  THEN has_any_column_privilege(CAST(:role AS name), c.oid, p.priv)"
            "  ELSE has_table_privilege(CAST(:role AS name), c.oid, p.priv) END,"
            " has_table_privilege(CAST(:role AS name), c.oid, p.priv || ' WITH GRANT OPTION')"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,"
            " unnest(CAST(:privs AS text[])) AS p(priv)"
            f" WHERE n.nspname = current_schema() AND c.relkind IN ({_TABLE_KINDS})"
            " ORDER BY 1, 2"
        ),
        {"role": role, "privs": list(privileges), "columnar": list(_COLUMN_PRIVILEGES)},
    ).all()
    wrong = [
        f"{'has' if held else 'lacks'} {priv} on {table}"
        for table, priv, held, _ in rows
        if held != (priv in RULES[table])
    ]
    wrong += [f"may grant {priv} on {table}" for table, priv, _, grantable in rows if grantable]
    schema_row = conn.execute(
        text(
            "SELECT has_schema_privilege(CAST(:role AS name), current_schema(), 'USAGE'),"
            " has_schema_privilege(CAST(:role AS name), current_schema(), 'CREATE'),"
            " (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            "  WHERE n.nspname = current_schema() AND CASE WHEN c.relkind = 'S'"  # in order
            "  THEN has_sequence_privilege(CAST(:role AS name), c.oid, 'UPDATE') END)"
        ),
        {"role": role},
    ).one()
    usage, create, settable = schema_row
    wrong += [f"lacks USAGE on schema {schema}"] if not usage else []
    wrong += [f"has CREATE on schema {schema}"] if create else []
    wrong += [f"may setval {settable} sequence(s)"] if settable else []
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        raise RegistryError(
            f"after the grants {role} still {shown}: nothing was committed",
            "another grant reaches it (to PUBLIC or a role it belongs to): revoke that first",
        )
