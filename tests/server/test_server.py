"""`reg server` over real HTTP (uvicorn on 127.0.0.1), on SQLite and PostgreSQL catalogs.

Every attack of the issue is a test here that now does no harm: exit 4, nothing written, the
denial audited under the token's principal. Checkpoints are the session's real torchrun ones.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import httpx
import pytest

from tests.serverproc import team_policy
from tests.zygote import run_reg

# What a validator's passing report holds at least (Attempt.from_json refuses less).
PASSED_CHECKS = [
    {"name": name, "passed": True, "detail": "ok"}
    for name in ("integrity", "restore", "shapes", "finite")
]


def _as(server, who: str, **extra: str) -> dict[str, str]:
    return {**server.client_env(who), **extra}


def _push(cli, ckpts, step: int, *, run: str = "r", project: str = "team-a", env=None):
    """`reg push-ckpt` of the session's ws=2 checkpoint at `step`."""
    return cli(
        "push-ckpt",
        ckpts.ws2.step_dir(step),
        "--run",
        run,
        "--step",
        str(step),
        "--project",
        project,
        env=env,
    )


def _audit(server) -> list[dict]:
    return server.call("admin", "GET", "/v1/audit")


def _one_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def test_identity_comes_from_the_token_not_reg_user(cli, ckpts, reg_server):
    """A viewer sets REG_USER=alice and pushes: refused as vera, audited as vera."""
    env = _as(reg_server, "vera", REG_USER="alice")
    res = _push(cli, ckpts, 2, run="r", project="team-a", env=env)
    assert res.returncode == 4, res.stderr
    assert "vera may not push" in _one_line(res)
    denied = [e for e in _audit(reg_server) if e["outcome"] == "denied"]
    assert denied[-1]["actor"] == "vera" and denied[-1]["action"] == "push"
    assert denied[-1]["details"]["token"] == reg_server.token("vera").split("_")[1]
    assert not [e for e in _audit(reg_server) if e["actor"] == "alice"]
    assert reg_server.call("admin", "GET", "/v1/checkpoints") == []
    who = cli("whoami", "--json", env=env)
    assert json.loads(who.stdout)["principal"] == "vera"


@pytest.mark.parametrize(
    "token",
    ["", "garbage", "reg_deadbeef0000_nosuchsecret", "Bearer x" * 100],
)
def test_requests_without_a_valid_token_exit_4(cli, reg_server, token):
    res = cli("ls", env={"REG_URL": reg_server.url, "REG_TOKEN": token})
    assert res.returncode == 4, res.stderr
    _one_line(res)


def test_revoked_and_expired_tokens_stop_working(cli, reg_server):
    made = reg_server.call("admin", "POST", "/v1/tokens", json={"principal": "vera"})
    env = {"REG_URL": reg_server.url, "REG_TOKEN": made["token"]}
    assert cli("ls", env=env).returncode == 0
    res = cli("token", "revoke", made["id"], "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["principal"] == "vera"
    res = cli("ls", env=env)
    assert (res.returncode == 4 and "not valid" not in res.stderr) or "revoked" in res.stderr
    short = reg_server.call(
        "admin", "POST", "/v1/tokens", json={"principal": "vera", "expires_s": 0.5}
    )
    import time

    time.sleep(2.0)  # expiry is rounded up to the whole second
    res = cli("ls", env={"REG_URL": reg_server.url, "REG_TOKEN": short["token"]})
    assert res.returncode == 4 and "expired" in res.stderr
    listed = json.loads(cli("token", "ls", "--json").stdout)
    states = {t["id"]: t["state"] for t in listed}
    assert states[made["id"]] == "revoked" and states[short["id"]] == "expired"
    assert all("token" not in t and "secret" not in json.dumps(t) for t in listed)
    actions = [e["action"] for e in _audit(reg_server)]
    assert "token-create" in actions and "token-revoke" in actions


def test_the_catalog_keeps_only_token_hashes(reg_server, catalog_url):
    token = reg_server.token("vera")
    secret = token.split("_", 2)[2]
    from registry.catalog.engine import Catalog

    catalog = Catalog(catalog_url)
    with catalog.dbapi() as (conn, _):
        cur = conn.cursor()
        cur.execute("SELECT id, principal, secret_sha256 FROM api_token")
        rows = cur.fetchall()
    catalog.dispose()
    assert rows and all(secret not in json.dumps(list(map(str, r))) for r in rows)


def test_only_admins_mint_tokens(cli, reg_server):
    res = cli("token", "create", "mallory", env=_as(reg_server, "alice"))
    assert res.returncode == 4 and "alice may not token" in _one_line(res)


def test_a_trainers_validation_is_refused_and_never_recorded(cli, ckpts, reg_server):
    """A trainer runs `reg validate` through the server: exit 4 before any work; nothing a
    client sends can add a validation row except a validator's report."""
    env = _as(reg_server, "alice")
    pushed = _push(cli, ckpts, 2, run="r", project="team-a", env=env)
    assert pushed.returncode == 0, pushed.stderr
    res = cli("validate", "team-a/r@step2", "--device", "cpu", env=env)
    assert res.returncode == 4 and "alice may not attest" in _one_line(res)
    forged = {
        "ref": "team-a/r@step2",
        "attempt": {
            "passed": True,
            "device": "cuda",
            "device_name": "NVIDIA H100 80GB HBM3",
            "torch_version": "2.13.0",
            "world_size": 1,
            "seconds": 1.0,
            "phases": {},
            "checks": PASSED_CHECKS,
        },
    }
    r = httpx.post(
        f"{reg_server.url}/v1/validations",
        json=forged,
        headers={"authorization": f"Bearer {reg_server.token('alice')}"},
    )
    assert r.status_code == 403 and r.json()["exit_code"] == 4
    shown = reg_server.call("admin", "GET", "/v1/show", params={"ref": "team-a/r@step2"})
    assert shown["state"] == "committed"
    assert not [e for e in _audit(reg_server) if e["action"] == "validate"]
    from registry import Registry

    # The Python API in remote mode has no catalog to write to.
    with Registry() as remote, pytest.raises(Exception, match="belongs to reg server"):
        remote.catalog  # noqa: B018


def test_the_gpu_gate_takes_only_a_validators_attestation(cli, ckpts, reg_server, catalog_url):
    """A validation row written straight into the catalog (as any embedded client could) does
    not open the gate; a validator's report does."""
    cuda_policy = team_policy().replace('require_device = "any"', 'require_device = "cuda"')
    assert 'require_device = "cuda"' in cuda_policy
    reg_server.apply_policy(cuda_policy)
    env = _as(reg_server, "alice")
    assert _push(cli, ckpts, 2, run="r", project="team-a", env=env).returncode == 0
    _insert_validation(catalog_url, device="cuda", device_name="NVIDIA H100 80GB HBM3")
    res = cli("promote", "team-a/r@step2", "--model", "tiny-a", env=_as(reg_server, "rel"))
    assert res.returncode == 1 and "require_device" in _one_line(res)
    assert reg_server.call("admin", "GET", "/v1/releases") == []
    attempt = {
        "passed": True,
        "device": "cuda",
        "device_name": "NVIDIA H200",
        "torch_version": "2.13",
        "world_size": 1,
        "seconds": 0.5,
        "phases": {"restore_seconds": 0.5},
        "checks": PASSED_CHECKS,
    }
    recorded = reg_server.call(
        "val", "POST", "/v1/validations", json={"ref": "team-a/r@step2", "attempt": attempt}
    )
    assert recorded["attested"] is True
    res = cli(
        "promote", "team-a/r@step2", "--model", "tiny-a", "--json", env=_as(reg_server, "rel")
    )
    assert res.returncode == 0, res.stderr
    release = json.loads(res.stdout)
    assert release["validation"]["id"] == recorded["validation_id"]
    assert release["created_by"] == "rel"


def _insert_validation(catalog_url: str, **values: str) -> None:
    from registry.catalog.engine import Catalog
    from registry.catalog.models import Checkpoint, Validation

    catalog = Catalog(catalog_url)
    with catalog.session(write=True) as s:
        ckpt = s.exec(__import__("sqlmodel").select(Checkpoint)).first()
        s.add(
            Validation(
                checkpoint_id=ckpt.id,
                passed=True,
                torch_version="2.13",
                world_size=1,
                seconds=1.0,
                created_at=0.0,
                created_by="alice",
                **values,
            )
        )
    catalog.dispose()


def test_a_forged_report_is_checked_field_by_field(reg_server):
    bad = {
        "passed": True,
        "device": "tpu",
        "device_name": "x",
        "torch_version": "2",
        "world_size": 1,
        "seconds": 1,
        "phases": {},
        "checks": [],
    }
    r = httpx.post(
        f"{reg_server.url}/v1/validations",
        json={"ref": "r@step1", "attempt": bad},
        headers={"authorization": f"Bearer {reg_server.token('val')}"},
    )
    assert r.status_code == 400 and r.json()["exit_code"] == 2


def test_scoped_admin_grants_are_refused_and_count_for_nothing(
    cli, reg_server, catalog_url, tmp_path
):
    scoped = team_policy(
        '\n[[access.grants]]\nprincipals = ["carol"]\nrole = "admin"\nprojects = ["team-a"]\n'
    )
    policy = tmp_path / "scoped.toml"
    policy.write_text(scoped)
    res = cli("policy", "apply", policy)
    assert res.returncode == 2 and "registry-wide" in _one_line(res)
    # One applied by an older reg (signed by the server, without today's checks): in force,
    # and its scoped admin grant is treated as no grant.
    _apply_as_an_older_reg(reg_server, catalog_url, scoped, version=99)
    res = cli("policy", "check")
    assert res.returncode == 0 and "carol" in res.stderr and "grants nothing" in res.stderr
    escalate = tmp_path / "escalate.toml"
    escalate.write_text(
        team_policy('\n[[access.grants]]\nprincipals = ["carol"]\nrole = "admin"\n')
    )
    res = cli("policy", "apply", escalate, env=_as(reg_server, "carol"))
    assert res.returncode == 4 and "carol may not policy" in _one_line(res)
    res = cli("gc", "--dry-run", env=_as(reg_server, "carol"))
    assert res.returncode == 4


def test_a_viewer_cannot_apply_a_policy_or_lock_admins_out(cli, reg_server, tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text('[[access.grants]]\nprincipals = ["vera"]\nrole = "admin"\n')
    res = cli("policy", "apply", mine, env=_as(reg_server, "vera"))
    assert res.returncode == 4
    shown = json.loads(cli("policy", "show", "--json").stdout)
    assert '"vera"' in shown["document"] and 'role = "viewer"' in shown["document"]
    lockout = tmp_path / "lockout.toml"
    lockout.write_text('[[access.grants]]\nprincipals = ["someone-else"]\nrole = "admin"\n')
    res = cli("policy", "apply", lockout)  # the admin demoting itself
    assert res.returncode == 2 and "would no longer be an admin" in _one_line(res)


def test_server_init_names_an_admin_of_the_policy_in_force(reg_server):

    out = run_reg("server", "init", "--admin", "vera", env=reg_server.env)
    assert out.returncode == 2 and "vera is not an admin" in out.stderr


def test_a_private_catalog_cannot_drive_gc_of_the_shared_store(cli, ckpts, reg_server, tmp_path):
    """A trainer points REG_CATALOG_URL at an empty private SQLite file and REG_STORE_URL at
    the shared store, then runs rebuild and GC: with REG_URL they are not used at all."""
    alice = _as(reg_server, "alice")
    assert _push(cli, ckpts, 2, run="r", project="team-a", env=alice).returncode == 0
    bob = _as(reg_server, "bob")
    assert _push(cli, ckpts, 4, run="other", project="team-b", env=bob).returncode == 0
    private = tmp_path / "private.db"
    attack = {
        **alice,
        "REG_CATALOG_URL": f"sqlite:///{private}",
        "REG_STORE_URL": (reg_server.home / "store").as_uri(),
        "REG_USER": "admin",
    }
    for args in (["catalog", "rebuild"], ["gc"], ["storage", "init"]):
        res = cli(*args, env=attack)
        assert res.returncode == 4, (args, res.stderr)
    assert not private.exists()
    listed = reg_server.call("admin", "GET", "/v1/checkpoints")
    assert {c["ref"] for c in listed} == {"team-a/r@step2", "team-b/other@step4"}
    for ref in ("team-a/r@step2", "team-b/other@step4"):
        assert reg_server.call("admin", "POST", "/v1/verify", json={"ref": ref})["ok"]
    denied = {(e["actor"], e["action"]) for e in _audit(reg_server) if e["outcome"] == "denied"}
    assert {("alice", "catalog"), ("alice", "gc"), ("alice", "storage")} <= denied


def test_listing_shows_only_what_the_caller_may_read(cli, ckpts, reg_server):
    assert (
        _push(cli, ckpts, 2, run="r", project="team-a", env=_as(reg_server, "alice")).returncode
        == 0
    )
    assert json.loads(cli("ls", "--json", env=_as(reg_server, "bob")).stdout) == []
    res = cli("pull", "team-a/r@step2", "/tmp/never", env=_as(reg_server, "bob"))
    assert res.returncode == 4


# -- the data path -------------------------------------------------------------------------------


def _raw_push(server, who: str, header: dict, tail: bytes) -> httpx.Response:
    data = json.dumps(header).encode()
    body = b"REGPUSH1" + struct.pack(">Q", len(data)) + data + tail
    return httpx.post(
        f"{server.url}/v1/checkpoints/push",
        content=body,
        headers={"authorization": f"Bearer {server.token(who)}"},
        timeout=60,
    )


@pytest.mark.parametrize(
    "path", ["../escape", "/abs", "a/../../b", "a//b", ".", "x\x00y", "a" * 2000]
)
def test_push_paths_cannot_leave_the_upload_directory(reg_server, path):
    header = {"project": "team-a", "run": "r", "step": 1, "files": [{"path": path, "size": 1}]}
    r = _raw_push(reg_server, "alice", header, b"x" + b"\0" * 32)
    assert r.status_code == 400 and r.json()["exit_code"] == 2
    assert not (reg_server.home / "escape").exists()
    assert not any((reg_server.home / "uploads").glob("push-*"))


def test_a_push_is_capped_at_its_declared_sizes(reg_server):
    header = {"project": "team-a", "run": "r", "step": 1, "files": [{"path": "a", "size": 4}]}
    r = _raw_push(reg_server, "alice", header, b"abcd" + b"\0" * 32 + b"more bytes")
    assert r.status_code == 400 and "more bytes than its header declared" in r.json()["message"]
    r = _raw_push(reg_server, "alice", header, b"ab")
    assert r.status_code == 422 and "ended inside a" in r.json()["message"]
    assert not any((reg_server.home / "uploads").glob("push-*"))
    assert reg_server.call("admin", "GET", "/v1/checkpoints") == []


def test_bytes_damaged_in_transit_are_refused_naming_the_file(reg_server):
    header = {"project": "team-a", "run": "r", "step": 1, "files": [{"path": "a", "size": 4}]}
    r = _raw_push(reg_server, "alice", header, b"abcd" + b"\1" * 32)
    assert r.status_code == 422 and r.json()["message"].startswith("a arrived with sha256")


def test_a_push_needs_the_grant_before_a_byte_is_stored(reg_server):
    header = {"project": "team-a", "run": "r", "step": 1, "files": [{"path": "a", "size": 4}]}
    r = _raw_push(reg_server, "vera", header, b"abcd" + b"\0" * 32)
    assert r.status_code == 403 and r.json()["exit_code"] == 4
    assert not any((reg_server.home / "uploads").glob("push-*"))


def test_json_bodies_are_bounded(reg_server):
    r = httpx.post(
        f"{reg_server.url}/v1/pin",
        content=b"{" + b" " * (2 << 20) + b"}",
        headers={
            "authorization": f"Bearer {reg_server.token('admin')}",
            "content-type": "application/json",
        },
    )
    assert r.status_code == 400 and "over" in r.json()["message"]


def test_a_refused_mirror_sync_names_no_address_of_the_servers(reg_server):
    r = httpx.post(
        f"{reg_server.url}/v1/mlflow/sync",
        json={"budget_s": 5},
        headers={"authorization": f"Bearer {reg_server.token('vera')}"},
        timeout=60,
    )
    assert r.status_code == 403 and "the MLflow mirror" in r.json()["message"], r.text
    assert "://" not in r.json()["message"]


@pytest.mark.parametrize(
    ("verb", "path", "given", "message"),
    [
        ("GET", "/v1/advise", {"run": "r", "gpus": "eight"}, "gpus must be a whole number"),
        ("GET", "/v1/checkpoints", {"include_deleted": "perhaps"}, "include_deleted must be true"),
        ("POST", "/v1/pin", {"ref": "r@step1", "pinned": "yes"}, "pinned must be true or false"),
        ("POST", "/v1/gc", {"dryrun": True}, "dryrun: no such field"),
        ("POST", "/v1/mlflow/sync", {"skip": 2**70}, "skip is out of range"),
        ("POST", "/v1/status", {"ref": "m:v1", "status": "gone"}, "status must be deprecated"),
        ("POST", "/v1/fsck", {"sample": -1}, "--sample must be a number of files, 0 or more"),
        ("POST", "/v1/scrub", {"limit": 0}, "--limit must be a number of artifacts"),
        ("POST", "/v1/mlflow/sync", {"budget_s": 0}, "the budget must be"),
        ("POST", "/v1/alias", {"model": "m", "alias": "prod"}, "version is required"),
    ],
)
def test_a_derived_route_refuses_a_bad_argument_in_one_line(reg_server, verb, path, given, message):
    """Each argument is checked by its contract type before any work: 400, exit 2, the field
    named (not FastAPI's 422 of before, which the client could not turn into a line)."""
    headers = {"authorization": f"Bearer {reg_server.token('admin')}"}
    if verb == "GET":
        r = httpx.get(reg_server.url + path, params=given, headers=headers, timeout=60)
    else:
        r = httpx.post(reg_server.url + path, json=given, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["exit_code"] == 2 and message in r.json()["message"], r.json()
    assert "Traceback" not in reg_server.log_text()


def test_a_server_side_dcp_check_refuses_what_the_client_did_not(reg_server, ckpts):
    """The server inventories .metadata itself: a client that skips its own scan and sends a
    directory without .metadata is refused with exit 2."""
    shard = (ckpts.ws2.step_dir(2) / "__0_0.distcp").read_bytes()
    import hashlib

    header = {
        "project": "team-a",
        "run": "r",
        "step": 1,
        "files": [{"path": "__0_0.distcp", "size": len(shard)}],
    }
    r = _raw_push(reg_server, "alice", header, shard + hashlib.sha256(shard).digest())
    assert r.status_code == 400 and "no .metadata" in r.json()["message"]


# -- the whole CLI through the server ----------------------------------------------------------


def test_every_lifecycle_command_works_remotely_with_json(cli, ckpts, reg_server, tmp_path):
    """The same commands, JSON and exit codes as embedded (tests/cli/test_cli.py)."""
    alice, rel = _as(reg_server, "alice"), _as(reg_server, "rel")
    res = cli(
        "push-ckpt",
        ckpts.ws2.step_dir(4),
        "--run",
        "run42",
        "--step",
        "4",
        "--project",
        "team-a",
        "--world-size",
        "2",
        "--metric",
        "val_loss=1.5",
        "--json",
        env=alice,
    )
    assert res.returncode == 0, res.stderr
    pushed = json.loads(res.stdout)
    assert pushed["ref"] == "team-a/run42@step4" and pushed["world_size"] == 2
    assert json.loads(cli("ls", "--json", env=alice).stdout)[0]["ref"] == "team-a/run42@step4"
    shown = json.loads(cli("show", "team-a/run42@latest", "--json", env=alice).stdout)
    assert shown["metrics"] == {"val_loss": 1.5} and shown["pushed_by"] == "alice"
    res = cli("pull", "team-a/run42@step4", tmp_path / "out", env=alice)
    assert res.returncode == 0 and (tmp_path / "out" / ".metadata").exists()
    for f in pushed["files"]:
        assert (tmp_path / "out" / f["path"]).stat().st_size == f["size"]
    assert cli("verify", "team-a/run42@step4", env=alice).returncode == 0
    assert cli("pin", "team-a/run42@step4", "--reason", "keep", env=alice).returncode == 0
    assert json.loads(cli("show", "team-a/run42@step4", "--json").stdout)["pinned"]
    assert cli("unpin", "team-a/run42@step4", env=alice).returncode == 0
    res = cli(
        "validate", "team-a/run42@step4", "--device", "cpu", "--json", env=_as(reg_server, "val")
    )
    assert res.returncode == 0, res.stderr
    validated = json.loads(res.stdout)
    assert validated["passed"] and validated["attested"]
    extra = tmp_path / "config.json"
    extra.write_text('{"hidden": 8}')
    res = cli(
        "promote",
        "team-a/run42@step4",
        "--model",
        "tiny-lm",
        "--alias",
        "prod",
        "--extra",
        extra,
        "--json",
        env=rel,
    )
    assert res.returncode == 0, res.stderr
    release = json.loads(res.stdout)
    assert (
        release["release"] == "tiny-lm:v1"
        and release["validation"]["id"] == validated["validation_id"]
    )
    assert json.loads(cli("releases", "--json", env=alice).stdout)[0]["aliases"] == ["prod"]
    res = cli("pull-release", "tiny-lm@prod", tmp_path / "rel", env=alice)
    assert res.returncode == 0 and (tmp_path / "rel" / "config.json").read_text() == '{"hidden": 8}'
    assert cli("alias", "set", "tiny-lm", "canary", "v1", env=rel).returncode == 0
    assert cli("deprecate", "tiny-lm:v1", env=rel).returncode == 0
    res = cli("yank", "tiny-lm:v1", "--reason", "bad data", env=rel)
    assert res.returncode == 4  # yank is admin
    assert cli("yank", "tiny-lm:v1", "--reason", "bad data").returncode == 0
    res = cli("pull-release", "tiny-lm:v1", tmp_path / "gone", env=alice)
    assert res.returncode == 5 and "yanked" in _one_line(res)
    gc = json.loads(cli("gc", "--dry-run", "--json").stdout)
    assert {d["ref"] for d in gc["decisions"]} == {"team-a/run42@step4"}
    audit = json.loads(cli("audit", "--json").stdout)
    assert {"push", "pin", "validate", "promote", "alias", "yank"} <= {e["action"] for e in audit}


@pytest.mark.parametrize(
    ("args", "code", "pattern"),
    [
        (["show", "run42@stepX"], 2, "malformed ref"),
        (["show", "nope@step1"], 3, "run nope not found"),
        (["pull", "nope@latest", "/tmp/none-such"], 3, "not found"),
        (["push-ckpt", ".", "--run", "r", "--step", "1"], 2, "no .metadata"),
        (["gc"], 4, "may not gc"),
    ],
)
def test_remote_errors_keep_their_exit_codes(cli, reg_server, args, code, pattern):
    res = cli(*args, env=_as(reg_server, "vera"))
    assert res.returncode == code, res.stderr
    assert pattern in _one_line(res)
    res = cli(*args, "--json", env=_as(reg_server, "vera")) if args[0] != "pull" else None
    if res is not None:
        doc = json.loads(res.stdout)
        assert doc["error"]["exit_code"] == code


def test_an_unreachable_server_is_one_line(cli):
    from tests.serverproc import free_port

    res = cli("ls", env={"REG_URL": f"http://127.0.0.1:{free_port()}", "REG_TOKEN": "reg_a_b"})
    assert res.returncode == 1 and "cannot talk to" in _one_line(res)


def test_login_stores_the_token_for_that_url_only(cli, reg_server, clean_env):
    token = reg_server.token("vera")
    env = {"REG_TOKEN": ""}
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "cli", "login", reg_server.url, "--token-stdin", "--json"],
        input=token + "\n",
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr
    saved = clean_env / "login.json"
    assert saved.stat().st_mode & 0o777 == 0o600
    assert json.loads(out.stdout)["principal"] == "vera"
    res = cli("whoami", env={"REG_TOKEN": ""})
    assert res.returncode == 0 and res.stdout.strip() == "vera"
    res = cli("whoami", env={"REG_TOKEN": "", "REG_URL": "http://127.0.0.1:1"})
    assert res.returncode == 4  # the saved token is for the other URL


# -- operations ----------------------------------------------------------------------------------


def test_health_readiness_metrics_and_request_ids(cli, reg_server):
    assert httpx.get(f"{reg_server.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{reg_server.url}/readyz").json()["status"] == "ready"
    r = httpx.get(
        f"{reg_server.url}/v1/checkpoints",
        headers={"authorization": f"Bearer {reg_server.token('vera')}", "x-request-id": "abc-123"},
    )
    assert r.headers["x-request-id"] == "abc-123"
    metrics = httpx.get(f"{reg_server.url}/metrics").text
    assert 'reg_requests_total{method="GET",route="/v1/checkpoints",status="200"}' in metrics
    assert "reg_request_seconds_bucket" in metrics
    logged = [
        json.loads(line) for line in reg_server.log_text().splitlines() if line.startswith("{")
    ]
    mine = [e for e in logged if e.get("request_id") == "abc-123"]
    assert mine and mine[0]["principal"] == "vera" and mine[0]["status"] == 200
    assert httpx.get(f"{reg_server.url}/openapi.json").json()["info"]["title"] == "reg server"


def _big_push_started(server, big_ckpt, files: str = "push-*/*"):
    """`reg push-ckpt` of the ~200 MB checkpoint as alice, in the background, returned once
    the server has begun writing it (a file under its uploads)."""
    import subprocess
    import sys
    import time

    push = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "push-ckpt",
            str(big_ckpt.step_dir(1)),
            "--run",
            "big",
            "--step",
            "1",
            "--project",
            "team-a",
        ],
        env={**os.environ, **_as(server, "alice")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    uploads = server.home / "uploads"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(uploads.glob(files)):
        time.sleep(0.01)
    assert any(uploads.glob(files)), "the push never started"
    return push


def test_sigterm_lets_an_inflight_push_finish(cli, big_ckpt, reg_server):
    push = _big_push_started(reg_server, big_ckpt, "push-*")
    # uvicorn finishes in-flight requests, then exits by the signal it got (-15).
    assert reg_server.stop() in (0, -15)
    _out, err = push.communicate(timeout=120)
    assert push.returncode == 0, err
    reg_server.start()
    listed = reg_server.call("admin", "GET", "/v1/checkpoints")
    assert [c["ref"] for c in listed] == ["team-a/big@step1"]
    assert reg_server.call("admin", "POST", "/v1/verify", json={"ref": "team-a/big@step1"})["ok"]


# -- what a hostile review found (each fixed; each a test) ---------------------------------------


def test_a_policy_without_grants_never_makes_token_holders_admins(
    cli, reg_server, catalog_url, tmp_path
):
    bare = tmp_path / "bare.toml"
    bare.write_text("[retention]\nkeep_last = 5\n")
    reg_server.token("vera")  # minted while the team policy holds
    res = cli("policy", "apply", bare)
    assert res.returncode == 2 and "every token holder an admin" in _one_line(res)
    # A row written into the catalog around the server is no policy at all: ignored.
    from registry.catalog.engine import Catalog
    from registry.catalog.models import PolicyDocument

    catalog = Catalog(catalog_url)
    with catalog.session(write=True) as s:
        s.add(
            PolicyDocument(
                version=50,
                text=bare.read_text(),
                sha256="0" * 64,
                applied_at=0.0,
                applied_by="old-reg",
            )
        )
    catalog.dispose()
    assert cli("gc", "--dry-run", env=_as(reg_server, "admin")).returncode == 0
    assert cli("token", "create", "admin", env=_as(reg_server, "vera")).returncode == 4
    # Applied for real (signed with the server's key, its apply event sealed and anchored),
    # as an older reg could: in force, and still no grant, no access, for anyone.
    _apply_as_an_older_reg(reg_server, catalog_url, bare.read_text(), version=51)
    for who, args in (
        ("vera", ["token", "create", "admin"]),
        ("admin", ["gc", "--dry-run"]),
        ("vera", ["audit"]),
    ):
        res = cli(*args, env=_as(reg_server, who))
        assert res.returncode == 4, (who, args, res.stderr)


def _apply_as_an_older_reg(server, catalog_url: str, text: str, *, version: int) -> None:
    """A policy row, its signature and its signed apply event, written with the server's key
    and sealed and anchored at once: what an apply through the server leaves, without the
    checks of today's apply."""
    import hashlib

    from registry.catalog.engine import Catalog
    from registry.catalog.models import PolicyDocument
    from registry.core.config import Settings
    from registry.storage import open_store
    from registry.trust import audit, signed_facts
    from registry.trust.audit_chain import keys
    from registry.trust.audit_chain.service import seal_now

    key = keys.read(server.home / "audit.key")
    catalog = Catalog(catalog_url)
    digest = hashlib.sha256(text.encode()).hexdigest()
    with catalog.session(write=True) as s:
        row = PolicyDocument(
            version=version, text=text, sha256=digest, applied_at=1.0, applied_by="old-reg"
        )
        s.add(row)
        s.flush()
        content = signed_facts.policy_content(row)
        signed_facts.sign(s, key, signed_facts.POLICY, row.id, content, signed_by="old-reg")
        audit.record(
            s,
            "old-reg",
            "policy-apply",
            f"policy v{version}",
            audit_key=key,
            sha256=digest,
            version=version,
        )
    seal_now(catalog, open_store(Settings.from_env(server.env).store_url), key)
    catalog.dispose()


def test_nothing_is_read_or_parsed_for_a_caller_without_a_token(reg_server):
    deep = b"[" * 200_000
    for headers in ({}, {"authorization": f"Bearer {reg_server.token('vera')}"}):
        r = httpx.post(f"{reg_server.url}/v1/gc", content=deep, headers=headers)
        assert r.status_code in (400, 401), r.text
        assert r.json()["exit_code"] in (2, 4)
    r = httpx.post(
        f"{reg_server.url}/v1/promote",
        content=b"x" * (8 << 20),
        headers={"authorization": f"Bearer {reg_server.token('vera')}"},
    )
    assert r.status_code == 403 and "vera may not promote" in r.json()["message"]


def test_a_stalled_body_is_abandoned(ckpts, tmp_path, catalog_url):
    import socket

    from tests.serverproc import RegServer, server_env

    env = {**server_env(tmp_path / "h", catalog_url), "REG_SERVER_IDLE_TIMEOUT": "1"}
    server = RegServer(env, tmp_path / "h").init().start()
    try:
        server.apply_policy(team_policy())
        header = json.dumps(
            {"project": "team-a", "run": "r", "step": 1, "files": [{"path": "a", "size": 100}]}
        ).encode()
        body = b"REGPUSH1" + struct.pack(">Q", len(header)) + header + b"x" * 10
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/checkpoints/push HTTP/1.1\r\nhost: x\r\n"
                + f"authorization: Bearer {server.token('alice')}\r\n".encode()
                + f"content-length: {len(body) + 1000}\r\n\r\n".encode()
                + body
            )
            answer = ""
            while "sent nothing" not in answer and (piece := sock.recv(65536)):
                answer += piece.decode(errors="replace")
        assert " 422 " in answer.splitlines()[0] and "sent nothing for 1s" in answer
        assert not any((server.home / "uploads").glob("push-*"))
    finally:
        server.stop()


def test_deep_paths_and_huge_declarations_are_refused_before_a_byte_is_written(reg_server):
    deep = "/".join(["d"] * 33) + "/f"
    header = {"project": "team-a", "run": "r", "step": 1, "files": [{"path": deep, "size": 1}]}
    r = _raw_push(reg_server, "alice", header, b"")
    assert r.status_code == 400 and "plain relative file path" in r.json()["message"]
    header["files"] = [{"path": "huge", "size": 1 << 49}]
    r = _raw_push(reg_server, "alice", header, b"")
    assert r.status_code == 422 and "free for uploads" in r.json()["message"]
    assert not list((reg_server.home / "uploads").glob("push-*"))


def test_what_a_killed_server_left_in_uploads_is_swept_at_start(cli, big_ckpt, reg_server):
    import signal

    push = _big_push_started(reg_server, big_ckpt)
    uploads = reg_server.home / "uploads"
    reg_server.stop(signal.SIGKILL)
    _, err = push.communicate(timeout=60)
    assert push.returncode == 1 and "cannot talk to" in err
    assert [p for p in uploads.glob("push-*") if p.is_dir()], "nothing was left to sweep"
    reg_server.start()
    assert not list(uploads.glob("push-*"))
    assert reg_server.call("admin", "GET", "/v1/checkpoints") == []
    res = cli(
        "push-ckpt",
        big_ckpt.step_dir(1),
        "--run",
        "big",
        "--step",
        "1",
        "--project",
        "team-a",
        env=_as(reg_server, "alice"),
    )
    assert res.returncode == 0, res.stderr  # the rerun takes over the dead push's claim


@pytest.mark.parametrize(
    "attempt",
    [
        {"seconds": 10**400},
        {"phases": {"x": 10**400}},
        {"checks": [{"name": "restore", "passed": True, "detail": [[["deep"]]]}]},
        {"checks": [{"name": "restore", "passed": True, "detail": "ok"}]},  # checks left out
        {"mode": "sharded"},  # at world size 1
        {"mode": "streamed", "world_size": 2},
        {"mode": "whole"},  # only rows from before modes read whole
    ],
)
def test_a_validators_report_with_impossible_values_is_refused(reg_server, attempt):
    doc = {
        "passed": True,
        "device": "cuda",
        "device_name": "x",
        "torch_version": "2",
        "world_size": 1,
        "seconds": 1,
        "phases": {},
        "checks": PASSED_CHECKS,
        **attempt,
    }
    r = httpx.post(
        f"{reg_server.url}/v1/validations",
        json={"ref": "r@step1", "attempt": doc},
        headers={"authorization": f"Bearer {reg_server.token('val')}"},
    )
    assert r.status_code == 400 and r.json()["exit_code"] == 2, r.text


def test_numbers_out_of_range_are_usage_errors_not_server_errors(reg_server):
    for path, body in (("/v1/alias", {"model": "m", "alias": "a", "version": 10**19}),):
        r = httpx.post(
            reg_server.url + path,
            json=body,
            headers={"authorization": f"Bearer {reg_server.token('admin')}"},
        )
        assert r.status_code == 400, r.text
    r = httpx.get(
        f"{reg_server.url}/v1/recovery",
        params={"run": "r", "mtbf_s": -1},
        headers={"authorization": f"Bearer {reg_server.token('admin')}"},
    )
    assert r.status_code == 400 and r.json()["exit_code"] == 2
    header = {
        "project": "team-a",
        "run": "r",
        "step": 1,
        "metrics": {"x": 10**400},
        "files": [{"path": "a", "size": 0}],
    }
    import hashlib

    r = _raw_push(reg_server, "alice", header, hashlib.sha256(b"").digest())
    assert r.status_code == 400 and r.json()["exit_code"] == 2, r.text
    assert "/uploads/" not in r.text


def test_a_model_the_caller_cannot_read_looks_like_no_model(cli, reg_server):
    res = cli("releases", "secret-model", env=_as(reg_server, "rel"))
    assert res.returncode == 3 and "model secret-model not found" in _one_line(res)


@pytest.mark.parametrize("name", ["\u0430dmin", "reg-server", "a b", "x" * 200])
def test_tokens_only_for_names_a_grant_can_hold(cli, reg_server, name):
    res = cli("token", "create", name)
    assert res.returncode == 2, res.stderr


def test_a_lying_server_cannot_fill_the_destination(tmp_path, monkeypatch):
    """A server (or a proxy) that sends more than the file it listed: cut off at the listed
    size, nothing left behind."""
    import hashlib
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Liar(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/v1/files"):
                body = json.dumps(
                    {
                        "ref": "m:v1",
                        "view": {},
                        "files": [
                            {
                                "path": "model.safetensors",
                                "size": 10,
                                "sha256": hashlib.sha256(b"0123456789").hexdigest(),
                            }
                        ],
                    }
                ).encode()
            else:
                body = b"x" * (50 << 20)
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("REG_URL", f"http://127.0.0.1:{httpd.server_port}")
        monkeypatch.setenv("REG_TOKEN", "reg_x_y")
        from registry import IntegrityError, Registry

        with Registry() as reg, pytest.raises(IntegrityError, match="more than the 10 bytes"):
            reg.pull_release("m:v1", tmp_path / "dest")
        assert list(tmp_path.iterdir()) == []
    finally:
        httpd.shutdown()


def test_the_gc_schedule_runs_in_the_server_with_one_leader(cli, ckpts, tmp_path, catalog_url):
    """`reg server --gc-every 1s`: retention runs without anyone asking, as the server's own
    principal; a second replica in the same interval does not run it again."""
    import time

    from tests.serverproc import RegServer, server_env

    server = RegServer(server_env(tmp_path / "h", catalog_url), tmp_path / "h").init()
    server.start("--gc-every", "1s")
    try:
        server.apply_policy(team_policy('\n[retention]\nkeep_last = 1\nttl = "0s"\n'))
        env = {"REG_URL": server.url, "REG_TOKEN": server.token("alice")}
        for step in (2, 4):
            res = _push(cli, ckpts, step, run="r", project="team-a", env=env)
            assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            listed = server.call("admin", "GET", "/v1/checkpoints", params={"project": "team-a"})
            if [c["ref"] for c in listed] == ["team-a/r@step4"]:
                break
            time.sleep(0.5)
        assert [c["ref"] for c in listed] == ["team-a/r@step4"]
        gc_events = [e for e in server.call("admin", "GET", "/v1/audit") if e["action"] == "gc"]
        assert gc_events and {e["actor"] for e in gc_events} == {"reg-server"}
        # the log line follows the deletions' commit (and the log's flush): polled, not raced
        while '"gc": "scheduled"' not in server.log_text() and time.monotonic() < deadline + 10:
            time.sleep(0.2)
        assert '"gc": "scheduled"' in server.log_text()
    finally:
        server.stop()


def test_retention_keeps_what_a_validator_is_validating(cli, ckpts, reg_server):
    """Between a validator's begin and its report the checkpoint is held (GC keeps it); the
    report gives the hold back."""
    reg_server.apply_policy(team_policy('\n[retention]\nkeep_last = 1\nttl = "0s"\n'))
    alice = _as(reg_server, "alice")
    for step in (2, 4):
        assert _push(cli, ckpts, step, run="r", project="team-a", env=alice).returncode == 0
    begun = reg_server.call("val", "POST", "/v1/validations/begin", json={"ref": "team-a/r@step2"})
    plan = reg_server.call("admin", "POST", "/v1/gc", json={"dry_run": True})
    kept = {d["ref"]: d for d in plan["decisions"]}["team-a/r@step2"]
    assert kept["action"] == "keep", kept
    attempt = {
        "passed": True,
        "device": "cpu",
        "device_name": "x",
        "torch_version": "2",
        "world_size": 1,
        "seconds": 1,
        "phases": {},
        "checks": PASSED_CHECKS,
    }
    reg_server.call(
        "val",
        "POST",
        "/v1/validations",
        json={"ref": "team-a/r@step2", "attempt": attempt, "hold": begun["hold"]},
    )
    plan = reg_server.call("admin", "POST", "/v1/gc", json={"dry_run": True})
    assert {d["ref"]: d for d in plan["decisions"]}["team-a/r@step2"]["action"] == "delete"


def test_a_deeply_nested_push_header_is_a_usage_error(reg_server):
    data = b"[" * 100_000
    body = b"REGPUSH1" + struct.pack(">Q", len(data)) + data
    r = httpx.post(
        f"{reg_server.url}/v1/checkpoints/push",
        content=body,
        headers={"authorization": f"Bearer {reg_server.token('alice')}"},
    )
    assert r.status_code == 400 and "nested too deeply" in r.json()["message"]


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_the_server_runs_the_mlflow_drain(cli, ckpts, tmp_path, catalog_url):
    """A push through the server is mirrored into MLflow by the server's drain: the client has
    neither MLflow's credentials nor the catalog."""
    import time

    from mlflow import MlflowClient

    from tests.serverproc import RegServer, server_env

    tracking = f"sqlite:///{tmp_path / 'server-mlflow.db'}"
    env = {
        **server_env(tmp_path / "h", catalog_url),
        "REG_MLFLOW": "on",
        "MLFLOW_TRACKING_URI": tracking,
    }
    # The tracking store is made (MLflow migrates a new SQLite file on first use) before the
    # server's drain and this test's polling can both be first to use it and migrate it at once.
    MlflowClient(tracking_uri=tracking).search_experiments()
    server = RegServer(env, tmp_path / "h").init().start()
    try:
        server.apply_policy(team_policy())
        res = cli(
            "push-ckpt",
            ckpts.ws2.step_dir(2),
            "--run",
            "r",
            "--step",
            "2",
            "--project",
            "team-a",
            env={"REG_URL": server.url, "REG_TOKEN": server.token("alice")},
        )
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 120
        while True:
            exp = MlflowClient(tracking_uri=tracking).get_experiment_by_name("team-a")
            models = (
                MlflowClient(tracking_uri=tracking).search_logged_models([exp.experiment_id])
                if exp
                else []
            )
            if models:
                break
            assert time.monotonic() < deadline, (server.home / "mlflow-drain.log").read_text()
            time.sleep(1)
        assert [m.name for m in models] == ["r-step2"]
    finally:
        server.stop()


def test_layouts_through_the_server(cli, layouts, reg_server):
    """--layout travels with a streamed push, a validator's validation (run on the client, with
    the layout the server recorded unless forced) and a promotion run in the server."""
    src = layouts["stateful"].step_dir(2)
    args = ("--run", "s", "--step", "2", "--project", "team-a", "--json")
    pushed = cli("push-ckpt", src, *args, "--layout", "dcp", env=_as(reg_server, "alice"))
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["suggestions"] == ["--layout stateful"]
    shown = json.loads(cli("show", "team-a/s@step2", "--json", env=_as(reg_server, "vera")).stdout)
    assert shown["layout"] == "dcp" and shown["missing_state"] == ["model", "train_state"]
    val = cli("validate", "team-a/s@step2", "--device", "cpu", "--json", env=_as(reg_server, "val"))
    assert val.returncode == 0, val.stderr
    assert json.loads(val.stdout)["layout"] == "dcp"  # the recorded one
    promote = ("promote", "team-a/s@step2", "--model", "tiny-a", "--json")
    refused = cli(*promote, env=_as(reg_server, "rel"))
    assert (
        refused.returncode == 1 and "not resumable (missing model, train_state)" in refused.stderr
    )
    res = cli(*promote, "--layout", "stateful", env=_as(reg_server, "rel"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tensor_count"] == len(layouts["stateful"].full_weights(2))
    bad = cli("push-ckpt", src, *args[:-1], "--layout", "x", env=_as(reg_server, "alice"))
    assert bad.returncode == 2 and "unknown layout 'x'" in _one_line(bad)


def test_several_dcp_roots_and_strip_prefix_through_the_server(cli, reg_server, tmp_path):
    """A streamed push of accelerate's layout, a validator's validation with --strip-prefix
    (run on the client) and a promotion with it in the server."""
    from tests.formats.test_dcp_roots import accelerate_like

    src = accelerate_like(tmp_path / "src")
    args = ("--run", "acc", "--step", "3", "--project", "team-a", "--json")
    pushed = cli("push-ckpt", src, *args, env=_as(reg_server, "alice"))
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["layout"] == "accelerate"
    val = cli("validate", "team-a/acc@step3", "--device", "cpu", "--json",
              env=_as(reg_server, "val"))  # fmt: skip
    assert val.returncode == 0, val.stderr
    promote = ("promote", "team-a/acc@step3", "--model", "tiny-a", "--json")
    bad = cli(*promote, "--strip-prefix", "w", env=_as(reg_server, "rel"))
    assert bad.returncode == 2 and "does not start with" in _one_line(bad)
    res = cli(*promote, env=_as(reg_server, "rel"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tensor_count"] == 2
