"""Facts the catalog cannot forge: whoever can write the catalog without the server's
audit key (the runtime role of README's deployment, the owner) can deny service, never decide.

On real parts: PostgreSQL with the owner and the least-privilege runtime role, `reg server` over
HTTP, a real checkpoint. Each forgery is written with the role that could write it, then the
server's answer, its log, `reg audit verify` and `reg fsck` are checked.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from tests.catalog.test_catalog_roles import _connect, roles  # noqa: F401 (the fixture)
from tests.serverproc import RegServer, server_env, team_policy

H100 = "NVIDIA H100 80GB HBM3"


def _one_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: "), res.stderr
    return lines[0]


def _push(cli, ckpts, env, step: int = 2, run: str = "r", project: str = "team-a"):
    res = cli(
        "push-ckpt", ckpts.ws2.step_dir(step), "--run", run, "--step", str(step),
        "--project", project, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr


@pytest.fixture
def runtime_server(roles, tmp_path):  # noqa: F811 (the fixture imported above)
    """reg server on PostgreSQL as the runtime role, the team policy applied through it; the
    test gets (server, db)."""
    db = roles.database()
    home = tmp_path / "server-home"
    server = RegServer(server_env(home, roles.url(roles.runtime, db)), home).init().start()
    server.apply_policy(team_policy())
    yield server, db
    server.stop()


def _as_runtime(roles, db: str, sql: str, *params: object) -> None:  # noqa: F811
    with _connect(roles.runtime, db) as conn:
        conn.execute(sql, params or None)
        conn.commit()


# -- the policy in force ---------------------------------------------------------------------


@pytest.mark.postgres
def test_a_policy_row_inserted_as_the_runtime_role_grants_nothing(
    cli,
    roles,  # noqa: F811
    runtime_server,
):
    server, db = runtime_server
    admin, vera = server.client_env("admin"), server.client_env("vera")
    shown = json.loads(cli("policy", "show", "--json", env=admin).stdout)
    assert "signed, sealed in audit seal" in shown["source"], shown["source"]
    in_force = shown["source"]
    # The attack: a newer version granting the viewer admin, with a made-up signature and a
    # made-up apply event beside it.
    text = team_policy('\n[[access.grants]]\nprincipals = ["vera"]\nrole = "admin"\n')
    digest = hashlib.sha256(text.encode()).hexdigest()
    _as_runtime(
        roles, db,
        "INSERT INTO policy_document (version, text, sha256, applied_at, applied_by)"
        " VALUES (99, %s, %s, %s, 'admin')",
        text, digest, time.time(),
    )  # fmt: skip
    _as_runtime(
        roles, db,
        "INSERT INTO fact_mac (kind, row_id, mac, signed_at, signed_by) SELECT 'policy', id,"
        " repeat('a', 64), 0, 'admin' FROM policy_document WHERE version = 99",
    )  # fmt: skip
    _as_runtime(
        roles, db,
        "INSERT INTO audit_event (ts, actor, action, target, outcome, details, mac)"
        " VALUES (%s, 'admin', 'policy-apply', 'policy v99', 'allowed', %s::json, repeat('b', 64))",
        time.time(), json.dumps({"sha256": digest, "version": 99}),
    )  # fmt: skip
    res = cli("token", "create", "vera", env=vera)
    assert res.returncode == 4 and "vera may not token" in _one_line(res)
    assert cli("gc", "--dry-run", env=vera).returncode == 4
    shown = json.loads(cli("policy", "show", "--json", env=admin).stdout)
    assert shown["source"] == in_force and "vera" not in json.dumps(
        [g for g in shown["effective"]["access"]["grants"] if g["role"] == "admin"]
    )
    assert "policy v99" in server.log_text()  # the ignored row, named once
    res = cli("audit", "verify", "--json", env=admin)
    assert res.returncode == 1
    kinds = {(p["kind"], p.get("target")) for p in json.loads(res.stdout)["problems"]}
    assert ("policy-forged", "policy v99") in kinds, kinds
    res = cli("fsck", "--json", env=admin)
    assert res.returncode == 1, res.stderr
    report = json.loads(res.stdout)
    assert "problems" in report, (res.stdout[:2000], res.stderr)
    found = {(p["kind"], p["target"]) for p in report["problems"]}
    assert ("policy-forged", "policy v99") in found, found


@pytest.mark.postgres
def test_deleting_the_newest_policy_row_fails_closed_instead_of_rolling_back(
    cli,
    roles,  # noqa: F811
    runtime_server,
    tmp_path,
):
    server, db = runtime_server
    admin, vera = server.client_env("admin"), server.client_env("vera")  # minted before
    newer = tmp_path / "newer.toml"
    newer.write_text(team_policy("\n[retention]\nkeep_last = 7\n"))
    assert cli("policy", "apply", newer, env=admin).returncode == 0
    version = json.loads(cli("policy", "show", "--json", env=admin).stdout)["source"]
    assert version.startswith("catalog policy v3 ")
    # The runtime role cannot delete a policy row; the owner can, with the triggers off.
    with _connect(roles.owner, db) as conn:
        conn.execute("ALTER TABLE policy_document DISABLE TRIGGER USER")
        conn.execute("DELETE FROM policy_document WHERE version = 3")
        conn.execute("ALTER TABLE policy_document ENABLE TRIGGER USER")
        conn.commit()
    for env, args in ((admin, ["gc", "--dry-run"]), (vera, ["ls"])):
        res = cli(*args, env=env)
        line = _one_line(res)
        assert res.returncode == 1 and "policy v3" in line and "missing" in line, line
    # On the host, with the key: verify names it; re-applying the policy restores service.
    host = {**server.env, "REG_USER": "admin"}
    res = cli("audit", "verify", "--json", env=host)
    assert res.returncode == 1
    assert "policy-unproven" in {p["kind"] for p in json.loads(res.stdout)["problems"]}
    res = cli("policy", "apply", newer, env=host)
    assert res.returncode == 0, res.stderr
    assert cli("gc", "--dry-run", env=admin).returncode == 0


# -- the GPU gate ------------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_validation_row_inserted_as_the_runtime_role_opens_no_gate(
    cli,
    ckpts,
    roles,  # noqa: F811
    runtime_server,
    tmp_path,
):
    server, db = runtime_server
    admin, alice, rel, val = (server.client_env(w) for w in ("admin", "alice", "rel", "val"))
    gpu = tmp_path / "gpu.toml"
    gpu.write_text(team_policy().replace('require_device = "any"', 'require_device = "cuda"'))
    assert cli("policy", "apply", gpu, env=admin).returncode == 0
    _push(cli, ckpts, alice, step=2)
    _push(cli, ckpts, alice, step=4)
    # A real, signed CPU validation of step 2 (it passes, but not the cuda gate).
    res = cli("validate", "team-a/r@step2", "--device", "cpu", "--json", env=val)
    assert res.returncode == 0, res.stderr
    real = json.loads(res.stdout)["validation_id"]
    checks = json.dumps(
        [{"name": n, "passed": True, "detail": "ok"} for n in ("integrity", "restore", "shapes",
                                                               "finite")]
    )  # fmt: skip
    for step in (2, 4):  # a forged H100 validation of each step
        _as_runtime(
            roles, db,
            "INSERT INTO validation (checkpoint_id, passed, device, device_name, torch_version,"
            " world_size, seconds, phases, checks, created_at, created_by, attested, mode)"
            " SELECT c.id, true, 'cuda', %s, '2.13.0', 1, 1.0, '{}', %s::json, %s, 'val', true,"
            " 'streamed' FROM checkpoint c WHERE c.step = %s",
            H100, checks, time.time(), step,
        )  # fmt: skip
    # The real validation's signature copied onto the forged row of step 4 (moved): no good.
    _as_runtime(
        roles, db,
        "INSERT INTO fact_mac (kind, row_id, mac, signed_at, signed_by)"
        " SELECT 'validation', v.id, f.mac, 0, 'val'"
        " FROM validation v JOIN checkpoint c ON c.id = v.checkpoint_id, fact_mac f"
        " WHERE v.device_name = %s AND c.step = 4 AND f.kind = 'validation' AND f.row_id = %s",
        H100, real,
    )  # fmt: skip
    for step in (2, 4):
        res = cli("promote", f"team-a/r@step{step}", "--model", "tiny-a", env=rel)
        line = _one_line(res)
        assert res.returncode == 1 and "cuda" in line, line
    assert json.loads(cli("releases", "--json", env=admin).stdout) == []
    log = server.log_text()
    assert "unsigned or its signature does not verify" in log
    res = cli("audit", "verify", "--json", env=admin)
    kinds = [p["kind"] for p in json.loads(res.stdout)["problems"]]
    assert res.returncode == 1 and kinds.count("validation-unsigned") == 1, kinds
    assert kinds.count("validation-forged") == 1, kinds
    res = cli("fsck", "--json", env=admin)
    assert res.returncode == 1 and "validation-forged" in res.stdout


# -- owners of models --------------------------------------------------------------------------

OWNERS = """
[[access.grants]]
principals = ["rel-a"]
role = "releaser"
projects = ["team-a"]

[[access.grants]]
principals = ["rel-b"]
role = "releaser"
projects = ["team-b"]

[[access.grants]]
principals = ["rel-x"]
role = "releaser"
projects = ["team-b"]
models = ["shared-*"]
"""


def test_a_model_belongs_to_the_project_it_was_first_released_from(
    cli, ckpts, reg_server, catalog_url, tmp_path
):
    server = reg_server
    server.apply_policy(team_policy(OWNERS))
    alice, bob = server.client_env("alice"), server.client_env("bob")
    a, b, x = (server.client_env(w) for w in ("rel-a", "rel-b", "rel-x"))
    _push(cli, ckpts, alice, step=2, project="team-a")
    _push(cli, ckpts, bob, step=2, project="team-b")
    _push(cli, ckpts, bob, step=4, project="team-b")
    for model in ("tiny-a", "shared-a"):
        res = cli("promote", "team-a/r@step2", "--model", model, "--alias", "prod", env=a)
        assert res.returncode == 0, res.stderr
    # team-b's releaser, with no models key: not into team-a's model, nor its aliases or status.
    for args in (
        ["promote", "team-b/r@step2", "--model", "tiny-a"],
        ["alias", "set", "tiny-a", "prod", "v1"],
        ["deprecate", "tiny-a:v1"],
    ):
        res = cli(*args, env=b)
        assert res.returncode == 4, (args, res.stderr)
        assert "owned by project team-a" in _one_line(res), res.stderr
    assert cli("releases", "tiny-a", env=b).returncode == 3  # not even its name
    # ... into a model of its own, yes; an explicit models entry crosses projects.
    assert cli("promote", "team-b/r@step2", "--model", "tiny-b", env=b).returncode == 0
    res = cli("promote", "team-b/r@step4", "--model", "shared-a", "--json", env=x)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["release"] == "shared-a:v2"
    assert cli("promote", "team-b/r@step4", "--model", "tiny-a", env=x).returncode == 4
    # A model row written around the server, claiming team-b: its owner is not signed, so it
    # is unknown, and only a grant on every project (or naming it) covers it.
    from registry.catalog.engine import Catalog
    from registry.catalog.models import Model

    catalog = Catalog(catalog_url)
    with catalog.session(write=True) as s:
        s.add(Model(name="trap", created_at=time.time(), project="team-b"))
    catalog.dispose()
    res = cli("promote", "team-b/r@step4", "--model", "trap", env=b)
    assert res.returncode == 4, res.stderr
    assert "model trap" in server.log_text()
    res = cli("audit", "verify", "--json")
    found = {(p["kind"], p.get("target")) for p in json.loads(res.stdout)["problems"]}
    assert ("model-unsigned", "model trap (owner team-b)") in found, found


# -- the upgrade of a registry from before signed facts -----------------------------------------


def test_catalog_sign_checks_and_signs_a_registry_from_before_signed_facts(
    cli, ckpts, catalog_url, tmp_path
):
    """Rows written without the key (as every reg before this one wrote them): behind the
    server the policy cannot be proven, so nothing is decided, until `reg catalog sign` on the
    host checks them against the audit log and signs them, once, audited."""
    home = tmp_path / "server-home"
    env = server_env(home, catalog_url)
    host = {**env, "REG_USER": "admin"}
    policy = tmp_path / "team.toml"
    policy.write_text(team_policy())
    # Before the key: an embedded registry with a policy, a validation and a release.
    assert cli("policy", "apply", policy, env={**host, "REG_POLICY": str(policy)}).returncode == 0
    _push(cli, ckpts, host, step=2)
    assert cli("validate", "team-a/r@step2", "--device", "cpu", env=host).returncode == 0
    assert cli("promote", "team-a/r@step2", "--model", "tiny-a", env=host).returncode == 0
    server = RegServer(env, home).init()  # the audit key; the policy has grants: kept
    # A forged policy row beside them: the sign refuses it (no apply event names it).
    # And one with an apply event inserted beside it: by hand, so neither signed nor sealed.
    from registry.catalog.engine import Catalog
    from registry.catalog.models import PolicyDocument
    from registry.trust import audit

    catalog = Catalog(catalog_url)
    forged = team_policy('\n[[access.grants]]\nprincipals = ["mallory"]\nrole = "admin"\n')
    with catalog.session(write=True) as s:
        for version, text in ((2, "[retention]\n"), (3, forged)):
            digest = hashlib.sha256(text.encode()).hexdigest()
            s.add(
                PolicyDocument(
                    version=version, text=text, sha256=digest, applied_at=time.time(),
                    applied_by="admin",
                )
            )  # fmt: skip
        audit.record(s, "admin", "policy-apply", "policy v3", sha256=digest, version=3)
    catalog.dispose()
    server.start()
    try:
        res = cli("ls", env=server.client_env("admin"))
        line = _one_line(res)
        assert res.returncode == 1 and "cannot be established" in line, line
        res = cli("catalog", "sign", "--dry-run", "--json", env=host)
        assert res.returncode == 0, res.stderr
        dry = json.loads(res.stdout)
        assert dry["signed"]["policy"] == ["policy v1"] and dry["signed"]["model"] == [
            "model tiny-a"
        ]
        assert [r["target"] for r in dry["refused"]] == ["policy v2", "policy v3"]
        res = cli("catalog", "sign", "--json", env=host)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["signed"] == dry["signed"]
        # v1's apply event (unsigned, from before the key) proves it where the server's
        # sealer already took it into the genesis seal and anchored it; otherwise a signed
        # policy-sign event names v1 and is sealed and anchored at once.
        assert out["policy_event"] in (None, "policy v1")
        # In force again (v1, not the forged v2), and the upgrade is in the audit log.
        admin = server.client_env("admin")
        assert cli("ls", env=admin).returncode == 0
        source = json.loads(cli("policy", "show", "--json", env=admin).stdout)["source"]
        assert source.startswith("catalog policy v1 "), source
        actions = [e["action"] for e in json.loads(cli("audit", "--json", env=admin).stdout)]
        assert "catalog-sign" in actions
        assert ("policy-sign" in actions) == (out["policy_event"] is not None)
        again = json.loads(cli("catalog", "sign", "--json", env=host).stdout)
        assert all(not v for v in again["signed"].values()) and again["policy_event"] is None
        # Through the server it is refused: only the host holds the key.
        res = cli("catalog", "sign", env=admin)
        assert res.returncode == 2 and "server's host" in _one_line(res)
    finally:
        server.stop()


# -- deletions ---------------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_deletion_mark_written_as_the_runtime_role_deletes_nothing(
    cli,
    ckpts,
    roles,  # noqa: F811
    runtime_server,
):
    """GC finishes deletions an interrupted run left `deleting`: behind the server only the
    marks its own GC signed, or a forged mark would delete any unpinned checkpoint (the
    database refuses marking a pinned one)."""
    server, db = runtime_server
    admin, alice = server.client_env("admin"), server.client_env("alice")
    for step in (2, 4):
        _push(cli, ckpts, alice, step=step)
    _as_runtime(
        roles, db,
        "UPDATE checkpoint SET state = 'deleting', deleted_by = 'admin', deleted_at = %s,"
        " delete_reason = 'expired' WHERE step = 2",
        time.time(),
    )  # fmt: skip
    res = cli("gc", "--json", env=admin)
    out = json.loads(res.stdout)
    assert any("deletion mark is unsigned or forged" in e for e in out["errors"]), out
    with _connect(roles.owner, db) as conn:
        state = conn.execute("SELECT state FROM checkpoint WHERE step = 2").fetchone()[0]
    assert state == "deleting"  # left as it is, bytes and all
    assert cli("verify", "team-a/r@step4", env=admin).returncode == 0
    stored = list((server.home / "store" / "ckpt" / "team-a" / "r" / "step-2").iterdir())
    assert any(p.name == "MANIFEST.json" for p in stored), stored
    res = cli("fsck", "--json", env=admin)
    found = {(p["kind"], p["target"]) for p in json.loads(res.stdout)["problems"]}
    assert res.returncode == 1 and ("deletion-unsigned", "deletion of team-a/r@step2") in found


@pytest.mark.postgres
def test_key_paths_rewritten_in_the_catalog_do_not_decide_the_resume_gate(
    cli,
    ckpts,
    roles,  # noqa: F811
    runtime_server,
):
    """Resumability is decided from the key paths; behind the server a promotion proves the
    recorded ones against the stored .metadata (its digest checked) before the gate."""
    server, db = runtime_server
    alice, rel = server.client_env("alice"), server.client_env("rel")
    _push(cli, ckpts, alice, step=2)
    with _connect(roles.owner, db) as conn:
        keys, sidecars = conn.execute("SELECT keys, sidecars FROM key_set").fetchone()
        keys = sorted([*keys, "lr_scheduler.last_epoch"])
        body = json.dumps({"keys": keys, "sidecars": sidecars}, separators=(",", ":"))
        conn.execute("ALTER TABLE key_set DISABLE TRIGGER USER")
        conn.execute(
            "UPDATE key_set SET keys = %s::json, sha256 = %s",
            (json.dumps(keys), hashlib.sha256(body.encode()).hexdigest()),
        )
        conn.execute("ALTER TABLE key_set ENABLE TRIGGER USER")
        conn.commit()
    res = cli("promote", "team-a/r@step2", "--model", "tiny-a", env=rel)
    line = _one_line(res)
    assert res.returncode == 1 and "not those of its stored .metadata" in line, line


@pytest.mark.postgres
def test_a_pin_or_resume_point_cleared_as_the_runtime_role_still_protects(
    cli,
    ckpts,
    roles,  # noqa: F811
    runtime_server,
    tmp_path,
):
    """Pins, resume points and a release's yank are rows the server updates, so the runtime
    role can clear or set them; behind the server GC keeps what the signed audit log says is
    pinned, resumed from or the source of a release not really yanked. A copy of an old signed
    unpin under a new id (the owner, with the uid index dropped) is not newer than the pin."""
    server, db = runtime_server
    admin, alice, rel = (server.client_env(w) for w in ("admin", "alice", "rel"))
    for run in ("r", "s", "t"):
        for step in (2, 4):
            _push(cli, ckpts, alice, step=step, run=run)
    for verb in ("pin", "unpin", "pin"):
        extra = ["--reason", "keep"] if verb == "pin" else []
        assert cli(verb, "team-a/r@step2", *extra, env=alice).returncode == 0
    assert cli("pull", "team-a/s@step2", tmp_path / "resume", env=alice).returncode == 0
    assert cli("promote", "team-a/t@step2", "--model", "tiny-t", env=rel).returncode == 0
    _as_runtime(roles, db, "UPDATE checkpoint SET pinned = false, pin_reason = NULL")
    _as_runtime(roles, db, "UPDATE run SET resumed_from_step = NULL")
    _as_runtime(roles, db, "UPDATE release SET status = 'yanked'")
    with _connect(roles.owner, db) as conn:
        conn.execute("DROP INDEX ix_audit_event_uid")
        conn.execute(
            "INSERT INTO audit_event (ts, actor, action, target, outcome, details, uid, mac)"
            " SELECT ts, actor, action, target, outcome, details, uid, mac FROM audit_event"
            " WHERE action = 'unpin'"
        )
        conn.commit()
    ttl = tmp_path / "ttl.toml"
    ttl.write_text(team_policy('\n[retention]\nkeep_last = 1\nttl = "0s"\n'))
    assert cli("policy", "apply", ttl, env=admin).returncode == 0
    plan = json.loads(cli("gc", "--dry-run", "--json", env=admin).stdout)
    doomed = {d["ref"] for d in plan["decisions"] if d["action"] == "delete"}
    # what the rows alone would say, but for the release's source, kept as not really yanked
    assert doomed == {"team-a/r@step2", "team-a/s@step2"}
    kept = {d["ref"]: d["reason"] for d in plan["decisions"] if d["action"] == "keep"}
    assert "tiny-t:v1" in kept["team-a/t@step2"], kept
    out = json.loads(cli("gc", "--json", env=admin).stdout)
    errors = " ".join(out["errors"])
    assert "team-a/r@step2: kept: pinned in the signed audit log" in errors, out
    assert "team-a/s@step2: kept: its run resumed from it" in errors, out
    listed = {c["ref"] for c in json.loads(cli("ls", "--json", env=alice).stdout)}
    assert listed == {f"team-a/{run}@step{step}" for run in "rst" for step in (2, 4)}
    assert out["freed_bytes"] == 0


@pytest.mark.postgres
def test_the_runtime_role_can_neither_rename_a_run_nor_write_a_seal_out_of_the_chain(
    cli,
    ckpts,
    roles,  # noqa: F811
    runtime_server,
):
    """A store prefix is built from names: a renamed run with a decoy in its place would point
    GC at another run's objects. A seal row below the chain (seq 0) would be taken as covering
    the events it names. The database refuses both."""
    import psycopg

    server, db = runtime_server
    _push(cli, ckpts, server.client_env("alice"), step=2)
    with pytest.raises(psycopg.errors.RaiseException, match="keeps its name"):
        _as_runtime(roles, db, "UPDATE run SET name = 'decoy'")
    with pytest.raises(psycopg.errors.RaiseException, match="next link"):
        _as_runtime(
            roles, db,
            "INSERT INTO audit_seal (seq, key_id, prev_mac, mac, event_ids, tags, count, total,"
            " low, high, sealed_at) VALUES (0, 'x', repeat('0', 64), repeat('0', 64), '1', '', 1,"
            " 1, 1, 1, 0)",
        )  # fmt: skip


@pytest.mark.postgres
def test_a_seal_row_written_as_the_next_link_stops_sealing_and_an_apply_says_so(
    cli,
    roles,  # noqa: F811
    runtime_server,
    tmp_path,
):
    """The next link is the one seal row the database accepts from anyone: one that does not
    verify is never extended (the events it names would never be sealed), and a policy
    applied meanwhile is recorded but reported not in force, never silently ignored; its
    apply event lies under a seal that does not verify, so the server then decides nothing
    (denied service, loudly) rather than keep the older policy."""
    server, db = runtime_server
    admin = server.client_env("admin")
    _as_runtime(
        roles, db,
        "INSERT INTO audit_seal (seq, key_id, prev_mac, mac, event_ids, tags, count, total, low,"
        " high, sealed_at) SELECT s.seq + 1, s.key_id, s.mac, repeat('f', 64),"
        " (SELECT max(id) + 1 FROM audit_event) || '-' || (SELECT max(id) + 1000 FROM"
        " audit_event), '', 1000, s.total + 1000, (SELECT max(id) + 1 FROM audit_event),"
        " (SELECT max(id) + 1000 FROM audit_event), 0 FROM audit_seal s"
        " ORDER BY s.seq DESC LIMIT 1",
    )  # fmt: skip
    newer = tmp_path / "newer.toml"
    newer.write_text(team_policy("\n[retention]\nkeep_last = 9\n"))
    res = cli("policy", "apply", newer, env=admin)
    line = _one_line(res)
    assert res.returncode == 1 and "recorded but not in force" in line, line
    assert "does not verify" in line, line
    res = cli("ls", env=admin)
    line = _one_line(res)
    assert res.returncode == 1 and "cannot be established" in line and "does not verify" in line
    res = cli("audit", "verify", "--json", env={**server.env, "REG_USER": "admin"})
    assert res.returncode == 1 and json.loads(res.stdout)["problems"]


@pytest.mark.postgres
def test_the_host_with_the_key_decides_under_the_proven_policy_too(
    cli,
    ckpts,
    roles,  # noqa: F811
    runtime_server,
):
    """An operator's embedded command on the server's host signs what it decides, so it must
    not decide under a row anyone could have written (a forged ttl = "0s")."""
    server, db = runtime_server
    alice = server.client_env("alice")
    for step in (2, 4):
        _push(cli, ckpts, alice, step=step)
    text = team_policy('\n[retention]\nkeep_last = 1\nttl = "0s"\n')
    _as_runtime(
        roles, db,
        "INSERT INTO policy_document (version, text, sha256, applied_at, applied_by)"
        " VALUES (99, %s, %s, %s, 'admin')",
        text, hashlib.sha256(text.encode()).hexdigest(), time.time(),
    )  # fmt: skip
    host = {**server.env, "REG_USER": "admin"}
    res = cli("gc", "--json", env=host)
    assert res.returncode == 0, res.stderr
    assert not [d for d in json.loads(res.stdout)["decisions"] if d["action"] == "delete"]
    assert len(json.loads(cli("ls", "--json", env=alice).stdout)) == 2
