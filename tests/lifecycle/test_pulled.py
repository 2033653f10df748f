"""A pulled folder keeps its document (a checkpoint's MANIFEST.json, a release's release.json):
`reg verify --dir` checks it offline, and a pulled checkpoint folder can be pushed again as
another run's step (a fork, a migration), refused when its files no longer match."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tests.helpers import flip_byte


def _push_and_pull(cli: Any, ckpts: Any, dest: Path) -> dict[str, Any]:
    pushed = cli("push-ckpt", ckpts.ws2.step_dir(4), "--run", "r", "--step", "4")
    assert pushed.returncode == 0, pushed.stderr
    pulled = cli("pull", "r@step4", dest)
    assert pulled.returncode == 0, pulled.stderr
    assert "MANIFEST.json kept for reg verify --dir" in pulled.stdout
    return dict(json.loads(cli("show", "r@step4", "--json").stdout))


def test_verify_dir_checks_a_pulled_checkpoint_offline(deployment, cli, ckpts, tmp_path):
    dest = tmp_path / "pulled"
    shown = _push_and_pull(cli, ckpts, dest)
    manifest = (dest / "MANIFEST.json").read_bytes()
    assert hashlib.sha256(manifest).hexdigest() == shown["manifest_sha256"]
    assert {f["path"] for f in shown["files"]} == {
        p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()
    } - {"MANIFEST.json"}

    # Offline: no registry settings at all.
    offline = {"REG_URL": "", "REG_TOKEN": "", "REG_CATALOG_URL": "sqlite:////nonexistent/x.db"}
    ok = cli("verify", "--dir", dest, "--sha256", shown["manifest_sha256"], env=offline)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{dest}: ok, {len(shown['files'])} files")
    assert "default/r@step4" in ok.stdout or "r@step4" in ok.stdout
    report = json.loads(cli("verify", "--dir", dest, "--json", env=offline).stdout)
    assert report["ok"] and report["kind"] == "checkpoint" and report["ref"].endswith("r@step4")
    assert report["document_sha256"] == shown["manifest_sha256"]

    other = cli("verify", "--dir", dest, "--sha256", "0" * 64, env=offline)
    assert other.returncode == 1 and "MANIFEST.json: sha256" in other.stdout

    shard = next(p for p in sorted(dest.iterdir()) if p.suffix == ".distcp")
    flip_byte(shard)
    (dest / "notes.txt").write_text("mine")
    (dest / ".metadata").unlink()
    bad = cli("verify", "--dir", dest, env=offline)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert sorted(bad.stdout.splitlines()) == sorted(
        [
            f"{dest}: .metadata: missing",
            f"{dest}: {shard.name}: sha256 "
            f"{hashlib.sha256(shard.read_bytes()).hexdigest()[:12]}..., MANIFEST.json records "
            f"{next(f['sha256'] for f in shown['files'] if f['path'] == shard.name)[:12]}...",
            f"{dest}: notes.txt: not listed in MANIFEST.json",
        ]
    )
    assert bad.stderr.count("\n") == 1 and "3 problem(s)" in bad.stderr
    problems = json.loads(cli("verify", "--dir", dest, "--json", env=offline).stdout)["problems"]
    assert {p["path"] for p in problems} == {".metadata", shard.name, "notes.txt"}


def test_a_pulled_folder_pushes_again_as_another_run(deployment, cli, ckpts, tmp_path):
    dest = tmp_path / "pulled"
    shown = _push_and_pull(cli, ckpts, dest)
    fork = cli("push-ckpt", dest, "--run", "fork", "--step", "4", "--json")
    assert fork.returncode == 0, fork.stderr
    pushed = json.loads(fork.stdout)
    # the kept MANIFEST.json is not a file of it
    assert [{**f, "rank": None} for f in pushed["files"]] == [
        {**f, "rank": None} for f in shown["files"]
    ]
    assert cli("verify", "fork@step4").returncode == 0

    flip_byte(next(p for p in sorted(dest.iterdir()) if p.suffix == ".distcp"))
    refused = cli("push-ckpt", dest, "--run", "fork2", "--step", "4")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert (
        "was pulled from default/r@step4 but no longer matches its MANIFEST.json"
        in (refused.stderr)
        or "was pulled from r@step4 but no longer matches its MANIFEST.json" in refused.stderr
    )
    assert "nothing was committed" in refused.stderr
    assert json.loads(cli("ls", "fork2", "--json").stdout) == []

    (dest / "MANIFEST.json").write_text("{}")
    broken = cli("push-ckpt", dest, "--run", "fork3", "--step", "4")
    assert broken.returncode == 1 and "MANIFEST.json" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_verify_dir_checks_a_pulled_release(cli, ckpts, cpu_policy, tmp_path):
    assert cli("push-ckpt", ckpts.ws2.step_dir(4), "--run", "r", "--step", "4").returncode == 0
    promoted = cli("promote", "r@step4", "--model", "tiny", "--json")
    assert promoted.returncode == 0, promoted.stderr
    release = json.loads(promoted.stdout)
    assert cli("pull-release", "tiny:v1", tmp_path / "rel").returncode == 0
    ok = cli("verify", "--dir", tmp_path / "rel", "--sha256", release["sha256"], "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["kind"] == "release" and report["release"] == "tiny:v1" and report["ok"]
    flip_byte(tmp_path / "rel" / "model.safetensors")
    bad = cli("verify", "--dir", tmp_path / "rel")
    assert bad.returncode == 1 and "model.safetensors: sha256" in bad.stdout


def test_verify_usage_errors_are_one_line(cli, tmp_path):
    for args in (
        ("verify", "r@step4", "--dir", tmp_path),
        ("verify",),
        ("verify", "--dir", tmp_path),
        ("verify", "--dir", tmp_path, "--sha256", "nothex"),
    ):
        res = cli(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_a_kept_document_over_the_cap_is_refused_unread(cli, tmp_path):
    from registry.lifecycle.checkpoints.pulled import MAX_KEPT

    folder = tmp_path / "pulled"
    folder.mkdir()
    with open(folder / "MANIFEST.json", "wb") as f:  # sparse: nothing is written or read
        f.truncate(MAX_KEPT + 1)
    (folder / ".metadata").write_bytes(b"x")
    for args in (("verify", "--dir", folder), ("push-ckpt", folder, "--run", "f", "--step", "1")):
        res = cli(*args)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1 and f"over {MAX_KEPT}" in res.stderr, res.stderr


def test_the_server_never_reads_a_manifest_a_client_sends(cli, ckpts, reg_server, tmp_path):
    """A client that sends a pulled folder's MANIFEST.json (the CLI never does) is refused:
    in the server's received folder it is a reserved name, not a kept manifest to trust."""
    import struct

    import httpx

    pushed = cli(
        "push-ckpt", ckpts.ws2.step_dir(4), "--run", "r", "--step", "4", "--project", "team-a"
    )
    assert pushed.returncode == 0, pushed.stderr
    dest = tmp_path / "pulled"
    assert cli("pull", "team-a/r@step4", dest).returncode == 0
    assert (dest / "MANIFEST.json").is_file()
    paths = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    header = {
        "project": "team-a",
        "run": "fork",
        "step": 4,
        "files": [{"path": p, "size": (dest / p).stat().st_size} for p in paths],
    }
    data = json.dumps(header).encode()
    tail = b"".join(
        (dest / p).read_bytes() + hashlib.sha256((dest / p).read_bytes()).digest() for p in paths
    )
    r = httpx.post(
        f"{reg_server.url}/v1/checkpoints/push",
        content=b"REGPUSH1" + struct.pack(">Q", len(data)) + data + tail,
        headers={"authorization": f"Bearer {reg_server.token('alice')}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "MANIFEST.json, a name the registry reserves" in r.json()["message"]
    assert reg_server.call("admin", "GET", "/v1/checkpoints?run=fork") == []
