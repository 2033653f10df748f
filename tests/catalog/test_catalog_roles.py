"""The database trusts only the server: an owner role migrates (`reg catalog migrate`), the role
`reg server` runs as gets least privilege (`reg catalog grants ROLE`), and the database itself
refuses that role every rewrite of history and every DDL.

PostgreSQL tests create their own LOGIN roles (random suffixes; trust auth lets them log in)
and databases owned by the owner role, and drop them all at the end, failed or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from registry.catalog.engine import HEAD_REVISION
from tests.helpers import PG_URL, pg_available
from tests.zygote import run_reg

ROOT = Path(__file__).resolve().parents[2]
ADMIN_URL = PG_URL.replace("+psycopg", "")
INJECTION = 'x"; DROP TABLE audit_event; -- %s :x'


def _admin(sql: str, *params: object) -> None:
    import psycopg

    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql, params or None)


def _connect(role: str, db: str):  # type: ignore[no-untyped-def]
    import psycopg

    return psycopg.connect(host="127.0.0.1", port=5432, user=role, dbname=db)


@dataclass
class Roles:
    """The test's roles; `database()` makes a database owned by `owner`, dropped at the end."""

    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    databases: list[str] = field(default_factory=list)

    @property
    def owner(self) -> str:
        return f"reg_own_{self.suffix}"

    @property
    def runtime(self) -> str:
        return f"reg_rt_{self.suffix}"

    @property
    def member(self) -> str:  # belongs to the owner role
        return f"reg_member_{self.suffix}"

    @property
    def creator(self) -> str:  # CREATEROLE
        return f"reg_creator_{self.suffix}"

    @property
    def weird(self) -> str:  # exists, and its name is an injection attempt
        return f"{INJECTION}{self.suffix}"

    def url(self, role: str, db: str) -> str:
        return f"postgresql+psycopg://{role}@127.0.0.1:5432/{db}"

    def database(self, *, migrate: bool = True, grant: bool = True) -> str:
        db = f"reg_t_{uuid.uuid4().hex[:12]}"
        self.databases.append(db)
        _admin(f'CREATE DATABASE {db} OWNER "{self.owner}"')
        if migrate:
            out = reg_cli("catalog", "migrate", url=self.url(self.owner, db))
            assert out.returncode == 0, out.stderr
        if grant:
            out = reg_cli("catalog", "grants", self.runtime, url=self.url(self.owner, db))
            assert out.returncode == 0, out.stderr
        return db

    def create(self) -> None:
        from psycopg import sql

        for name, options in (
            (self.owner, "LOGIN"),
            (self.runtime, "LOGIN"),
            (self.member, "LOGIN"),
            (self.creator, "LOGIN CREATEROLE"),
            (self.weird, "LOGIN"),
        ):
            _admin(sql.SQL("CREATE ROLE {} " + options).format(sql.Identifier(name)).as_string())
        _admin(f'GRANT "{self.owner}" TO "{self.member}"')

    def drop(self) -> None:
        from psycopg import sql

        for db in self.databases:
            _admin(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        for name in (self.member, self.creator, self.weird, self.runtime, self.owner):
            _admin(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)).as_string())


def reg_cli(*args: str, url: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REG_", "AWS_", "MLFLOW_"))}
    env.update(REG_CATALOG_URL=url, REG_HOME=str(home or ROOT / ".no-such-reg-home"))
    return run_reg(*args, env=env, timeout=120)


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: "), res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def roles(request: pytest.FixtureRequest) -> Iterator[Roles]:
    if not pg_available():
        pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 (.ci/run starts it)")
    made = Roles()
    request.addfinalizer(made.drop)  # before anything exists: a half-made setup goes too
    made.create()
    yield made


# -- the whole server workflow as the runtime role -----------------------------------------------


@pytest.mark.postgres
def test_the_server_runs_its_whole_workflow_as_the_runtime_role(cli, ckpts, roles, tmp_path):
    """Pushes, reads, pins, validation, promotion, aliases, tokens, policy, GC, the audit log
    and its seals, all through `reg server` connected as the runtime role: the grants are
    sufficient and nothing does DDL at run time."""
    from tests.serverproc import RegServer, server_env, team_policy

    db = roles.database()
    home = tmp_path / "server-home"
    server = RegServer(server_env(home, roles.url(roles.runtime, db)), home).init().start()
    try:
        server.apply_policy(team_policy())
        admin, alice, rel, val = (
            server.client_env(who) for who in ("admin", "alice", "rel", "val")
        )
        for step in (2, 4):
            res = cli(
                "push-ckpt",
                ckpts.ws2.step_dir(step),
                "--run",
                "r",
                "--step",
                str(step),
                "--project",
                "team-a",
                env=alice,
            )
            assert res.returncode == 0, res.stderr
        listed = json.loads(cli("ls", "--json", env=alice).stdout)
        assert {c["ref"] for c in listed} == {"team-a/r@step2", "team-a/r@step4"}
        shown = json.loads(cli("show", "team-a/r@step4", "--json", env=alice).stdout)
        assert shown["pushed_by"] == "alice"
        assert cli("pin", "team-a/r@step2", "--reason", "look", env=alice).returncode == 0
        assert cli("unpin", "team-a/r@step2", env=alice).returncode == 0
        res = cli("validate", "team-a/r@step4", "--device", "cpu", "--json", env=val)
        assert res.returncode == 0 and json.loads(res.stdout)["passed"], res.stderr
        res = cli("promote", "team-a/r@step4", "--model", "tiny-a", "--alias", "prod", env=rel)
        assert res.returncode == 0, res.stderr
        assert cli("alias", "set", "tiny-a", "canary", "v1", env=rel).returncode == 0
        assert cli("deprecate", "tiny-a:v1", env=rel).returncode == 0
        res = cli("pull-release", "tiny-a@prod", tmp_path / "rel", env=alice)
        assert res.returncode == 0, res.stderr
        made = json.loads(cli("token", "create", "vera", "--json", env=admin).stdout)
        assert cli("token", "revoke", made["id"], env=admin).returncode == 0
        policy = tmp_path / "retention.toml"
        policy.write_text(team_policy('\n[retention]\nkeep_last = 1\nttl = "0s"\n'))
        res = cli("policy", "apply", policy, env=admin)
        assert res.returncode == 0, res.stderr
        plan = json.loads(cli("gc", "--dry-run", "--json", env=admin).stdout)
        assert {d["ref"]: d["action"] for d in plan["decisions"]}["team-a/r@step2"] == "delete"
        res = cli("gc", "--json", env=admin)
        assert res.returncode == 0, res.stderr
        done = json.loads(res.stdout)
        assert not done["errors"] and done["freed_bytes"] > 0
        listed = json.loads(cli("ls", "--json", env=alice).stdout)
        assert [c["ref"] for c in listed] == ["team-a/r@step4"]
        assert cli("catalog", "rebuild", "--dry-run", env=admin).returncode == 0
        audit = json.loads(cli("audit", "--json", env=admin).stdout)
        assert {
            "push",
            "pin",
            "validate",
            "promote",
            "alias",
            "token-create",
            "token-revoke",
            "policy-apply",
            "gc",
        } <= {e["action"] for e in audit}
        sealed = server.call("admin", "POST", "/v1/audit/seal")  # the HMAC chain's seals
        assert sealed["head"] and not sealed["refused"], sealed
        with _connect(roles.owner, db) as conn:
            assert conn.execute("SELECT count(*) FROM audit_seal").fetchone()[0] >= 1
        checked = server.call("admin", "POST", "/v1/audit/verify")
        assert checked["ok"], checked["problems"]
        log = server.log_text().lower()
        assert "permission denied" not in log and "sealing failed" not in log
    finally:
        server.stop()


# -- what the database refuses the runtime role ---------------------------------------------------


@pytest.fixture(scope="module")
def granted(roles: Roles) -> tuple[str, int]:
    """A migrated, granted database with one active release (put there by the owner)."""
    from registry.catalog.engine import Catalog
    from registry.catalog.models import ACTIVE, COMMITTED, Checkpoint, Model, Project, Release, Run

    db = roles.database()
    catalog = Catalog(roles.url(roles.owner, db))
    try:
        with catalog.session(write=True) as s:
            project = Project(name="p", created_at=0)
            model = Model(name="m", created_at=0)
            s.add_all([project, model])
            s.flush()
            run = Run(project_id=project.id or 0, name="r", created_at=0)
            s.add(run)
            s.flush()
            ckpt = Checkpoint(
                run_id=run.id or 0, step=1, state=COMMITTED, created_at=0, pushed_by="x"
            )
            s.add(ckpt)
            s.flush()
            release = Release(
                model_id=model.id or 0,
                version=1,
                status=ACTIVE,
                sha256="a" * 64,
                source_checkpoint_id=ckpt.id or 0,
                source_ref="p/r@step1",
                options_key="k",
                created_at=0,
                created_by="x",
            )
            s.add(release)
            s.flush()
            release_id = release.id or 0
    finally:
        catalog.dispose()
    return db, release_id


DENIED, GUARDED = "42501", "P0001"  # insufficient_privilege; a trigger's RAISE EXCEPTION
ATTACKS = [
    pytest.param(["TRUNCATE audit_event"], DENIED, id="truncate-audit"),
    pytest.param(["UPDATE audit_event SET actor = 'mallory'"], DENIED, id="update-audit"),
    pytest.param(["DELETE FROM audit_event"], DENIED, id="delete-audit"),
    pytest.param(["UPDATE audit_seal SET mac = 'x'"], DENIED, id="update-audit-seal"),
    pytest.param(["DELETE FROM audit_seal"], DENIED, id="delete-audit-seal"),
    pytest.param(["UPDATE policy_document SET text = ''"], DENIED, id="update-policy"),
    pytest.param(["DELETE FROM policy_document"], DENIED, id="delete-policy"),
    pytest.param(["UPDATE alias_event SET to_version = 1"], DENIED, id="update-alias-history"),
    pytest.param(["DELETE FROM alias_event"], DENIED, id="delete-alias-history"),
    pytest.param(["TRUNCATE release CASCADE"], DENIED, id="truncate-release"),
    pytest.param(["ALTER TABLE audit_event DISABLE TRIGGER ALL"], DENIED, id="disable-triggers"),
    pytest.param(
        ["DROP TRIGGER audit_event_append_only ON audit_event"], DENIED, id="drop-trigger"
    ),
    pytest.param(
        [
            "CREATE OR REPLACE FUNCTION reg_append_only() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN RETURN NEW; END $$"
        ],
        DENIED,
        id="replace-trigger-function",
    ),
    pytest.param(["CREATE TABLE stash (x int)"], DENIED, id="create-table"),
    pytest.param(["CREATE SCHEMA stash"], DENIED, id="create-schema"),
    pytest.param(["ALTER TABLE audit_event ADD COLUMN x int"], DENIED, id="add-column"),
    pytest.param(["DROP TABLE audit_event"], DENIED, id="drop-table"),
    pytest.param(["ALTER TABLE audit_event OWNER TO CURRENT_USER"], DENIED, id="take-ownership"),
    pytest.param(["SELECT setval('audit_event_id_seq', 1)"], DENIED, id="rewind-sequence"),
    pytest.param(
        ["GRANT UPDATE, DELETE ON audit_event TO CURRENT_USER", "DELETE FROM audit_event"],
        DENIED,
        id="grant-itself",  # GRANT without the grant option only warns: the DELETE proves it
    ),
    pytest.param(["GRANT {owner} TO CURRENT_USER"], DENIED, id="join-the-owner-role"),
    pytest.param(["SET ROLE {owner}"], DENIED, id="become-the-owner"),
    pytest.param(
        ["UPDATE release SET status = 'pending' WHERE id = {release}"],
        GUARDED,
        id="active-release-back-to-pending",
    ),
    pytest.param(
        ["UPDATE release SET sha256 = repeat('0', 64) WHERE id = {release}"],
        GUARDED,
        id="forge-release-digest",
    ),
    pytest.param(["DELETE FROM release WHERE id = {release}"], GUARDED, id="delete-release"),
]


@pytest.mark.postgres
@pytest.mark.parametrize(("statements", "sqlstate"), ATTACKS)
def test_the_database_refuses_the_runtime_role(roles, granted, statements, sqlstate):
    import psycopg

    db, release_id = granted
    with _connect(roles.runtime, db) as conn:
        *before, last = [s.format(owner=f'"{roles.owner}"', release=release_id) for s in statements]
        try:
            for statement in before:
                conn.execute(statement)
            with pytest.raises(psycopg.Error) as refused:
                conn.execute(last)
            assert refused.value.sqlstate == sqlstate, refused.value
        finally:
            conn.rollback()
    with _connect(roles.owner, db) as conn:  # and nothing of it happened
        assert (
            conn.execute("SELECT status FROM release WHERE id = %s", (release_id,)).fetchone()[0]
            == "active"
        )
        assert conn.execute("SELECT to_regclass('audit_event') IS NOT NULL").fetchone()[0]


@pytest.mark.postgres
def test_the_runtime_role_keeps_what_it_needs(roles, granted):
    """The control for the attacks: the same connection reads and appends history."""
    db, _ = granted
    with _connect(roles.runtime, db) as conn:
        conn.execute(
            "INSERT INTO audit_event (ts, actor, action, target, outcome, details)"
            " VALUES (0, 'rt', 'probe', 't', 'allowed', '{}')"
        )
        assert conn.execute("SELECT count(*) FROM audit_event").fetchone()[0] >= 1
        conn.rollback()


# -- the grants themselves ------------------------------------------------------------------------


@pytest.mark.postgres
def test_every_table_of_the_schema_has_a_rule(roles, granted):
    from registry.catalog.grants import RULES
    from registry.catalog.models import SQLModel

    db, _ = granted
    with _connect(roles.owner, db) as conn:
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = current_schema() AND c.relkind IN ('r','p','v','m','f')"
            )
        }
    assert tables == set(RULES), "a table without a rule, or a rule without a table"
    assert set(SQLModel.metadata.tables) <= set(RULES)
    for rule in RULES.values():
        assert not {"TRUNCATE", "TRIGGER", "REFERENCES"} & set(rule)
    for history in ("audit_event", "audit_seal", "alias_event", "policy_document"):
        assert RULES[history] == ("SELECT", "INSERT")


@pytest.mark.postgres
def test_grants_refuse_roles_that_would_make_them_meaningless(roles, granted):
    db, _ = granted
    owner_url = roles.url(roles.owner, db)
    cases = [
        (owner_url, "reg_nobody_" + roles.suffix, 3, "does not exist"),
        (owner_url, INJECTION, 3, "does not exist"),
        (owner_url, "postgres", 2, "is a superuser"),
        (owner_url, roles.owner, 2, "is the role running this command"),
        (roles.url("postgres", db), roles.owner, 2, "owns (or belongs to the owner of)"),
        (owner_url, roles.member, 2, "owns (or belongs to the owner of)"),
        (owner_url, roles.creator, 2, "has CREATEROLE"),
        (roles.url(roles.runtime, db), roles.member, 2, "owns (or belongs to the owner of)"),
        (roles.url(roles.runtime, db), roles.weird, 4, "does not own"),
    ]
    for url, role, code, pattern in cases:
        res = reg_cli("catalog", "grants", role, url=url)
        assert res.returncode == code, (role, res.stderr)
        assert pattern in _one_line(res), res.stderr
    with _connect(roles.owner, db) as conn:
        assert conn.execute("SELECT to_regclass('audit_event') IS NOT NULL").fetchone()[0]


@pytest.mark.postgres
def test_a_role_name_is_quoted_not_injected_and_dry_run_changes_nothing(roles, granted):
    db, _ = granted
    url = roles.url(roles.owner, db)

    def holds(priv: str) -> bool:
        with _connect(roles.owner, db) as conn:
            row = conn.execute(
                "SELECT has_table_privilege(%s, 'audit_event', %s)", (roles.weird, priv)
            ).fetchone()
            return bool(row[0])

    assert not holds("INSERT")
    res = reg_cli("catalog", "grants", roles.weird, "--dry-run", url=url)
    assert res.returncode == 0, res.stderr
    quoted = '"' + roles.weird.replace('"', '""') + '"'
    assert f'GRANT SELECT, INSERT ON TABLE "public"."audit_event" TO {quoted};' in res.stdout
    assert not holds("INSERT")  # dry run: nothing granted
    res = reg_cli("catalog", "grants", roles.weird, "--json", url=url)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tables"]["audit_event"] == ["SELECT", "INSERT"]
    assert holds("INSERT") and not holds("UPDATE") and not holds("TRUNCATE")
    with _connect(roles.owner, db) as conn:
        assert conn.execute("SELECT to_regclass('audit_event') IS NOT NULL").fetchone()[0]


@pytest.mark.postgres
def test_grants_are_idempotent_and_remove_excess(roles):
    db = roles.database()
    url = roles.url(roles.owner, db)
    with _connect(roles.owner, db) as conn:
        conn.execute(f'GRANT ALL ON audit_event TO "{roles.runtime}"')
        conn.execute(f'GRANT CREATE ON SCHEMA public TO "{roles.runtime}"')
        conn.commit()
    for _ in range(2):
        res = reg_cli("catalog", "grants", roles.runtime, url=url)
        assert res.returncode == 0, res.stderr
    with _connect(roles.owner, db) as conn:
        got = conn.execute(
            "SELECT has_table_privilege(%(r)s, 'audit_event', 'UPDATE'),"
            " has_table_privilege(%(r)s, 'audit_event', 'TRUNCATE'),"
            " has_schema_privilege(%(r)s, 'public', 'CREATE'),"
            " has_table_privilege(%(r)s, 'audit_event', 'INSERT')",
            {"r": roles.runtime},
        ).fetchone()
    assert got == (False, False, False, True)


@pytest.mark.postgres
def test_grants_fail_closed(roles):
    """A table no rule names, and a privilege that reaches the role through PUBLIC: refused,
    and nothing committed."""
    db = roles.database(grant=False)
    url = roles.url(roles.owner, db)
    with _connect(roles.owner, db) as conn:
        conn.execute("CREATE TABLE stray (x int)")
        conn.commit()
    res = reg_cli("catalog", "grants", roles.runtime, url=url)
    assert res.returncode == 1 and "stray in schema public has no grant rule" in _one_line(res)
    with _connect(roles.owner, db) as conn:
        conn.execute("DROP TABLE stray")
        conn.execute("GRANT UPDATE ON audit_event TO PUBLIC")
        conn.commit()
    res = reg_cli("catalog", "grants", roles.runtime, url=url)
    assert res.returncode == 1, res.stderr
    assert "still has UPDATE on audit_event" in _one_line(res)
    with _connect(roles.owner, db) as conn:  # rolled back: the runtime got nothing
        row = conn.execute(
            "SELECT has_table_privilege(%s, 'project', 'INSERT')", (roles.runtime,)
        ).fetchone()
        assert row[0] is False


# -- a runtime role never migrates ----------------------------------------------------------------


@pytest.mark.postgres
def test_a_runtime_role_on_a_schema_behind_gets_one_line_and_runs_no_ddl(roles, tmp_path):
    from registry.catalog.engine import Catalog

    db = roles.database(migrate=False, grant=False)
    runtime = roles.url(roles.runtime, db)
    res = reg_cli("ls", url=runtime, home=tmp_path)
    assert res.returncode == 1
    assert "has no schema yet" in _one_line(res) and "reg catalog migrate" in res.stderr
    owner = Catalog(roles.url(roles.owner, db), ensure_schema=False)
    assert owner.migrate("0004")["after"] == "0004"  # an older reg's schema
    owner.dispose()
    res = reg_cli("ls", url=runtime, home=tmp_path)
    assert res.returncode == 1
    assert "may not read the catalog" in _one_line(res) and "reg catalog grants" in res.stderr
    assert (
        reg_cli("catalog", "grants", roles.runtime, url=roles.url(roles.owner, db)).returncode == 0
    )
    for args in (["ls"], ["catalog", "migrate"]):
        res = reg_cli(*args, url=runtime, home=tmp_path)
        assert res.returncode == 1
        line = _one_line(res)
        assert f"is at schema revision 0004; this reg needs {HEAD_REVISION}" in line
        assert f"reg catalog migrate`, then `reg catalog grants {roles.runtime}`" in line
    with _connect(roles.owner, db) as conn:  # untouched: still 0004, no 0005 trigger
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone()[0] == "0004"
        assert not conn.execute(
            "SELECT 1 FROM pg_trigger WHERE tgname = 'policy_document_append_only'"
        ).fetchone()
    res = reg_cli(
        "catalog", "migrate", "--grant", roles.runtime, "--json", url=roles.url(roles.owner, db)
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["before"], out["after"]) == ("0004", HEAD_REVISION)
    assert out["grants"][0]["role"] == roles.runtime
    assert reg_cli("ls", url=runtime, home=tmp_path).returncode == 0


# -- SQLite ---------------------------------------------------------------------------------------


def test_catalog_migrate_on_sqlite_and_no_grants_there(cli, tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    res = cli("catalog", "migrate", "--json", env={"REG_CATALOG_URL": url})
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["before"], out["after"], out["grants"]) == (None, HEAD_REVISION, [])
    res = cli("catalog", "migrate", env={"REG_CATALOG_URL": url})
    assert res.returncode == 0 and f"at revision {HEAD_REVISION}, nothing to migrate" in res.stdout
    res = cli("catalog", "grants", "someone", env={"REG_CATALOG_URL": url})
    assert res.returncode == 2 and "SQLite has no roles" in _one_line(res)
    res = cli("catalog", "migrate", env={"REG_URL": "http://127.0.0.1:9"})
    assert res.returncode == 2 and "not through reg server" in _one_line(res)
    import sqlite3

    with sqlite3.connect(tmp_path / "c.db") as conn:  # what a newer reg would leave
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    for args in (["catalog", "migrate"], ["ls"]):
        res = cli(*args, env={"REG_CATALOG_URL": url})
        assert res.returncode == 1 and "at revision 9999, newer than this reg" in _one_line(res)
