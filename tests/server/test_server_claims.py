"""Saves from the training loop and node-by-node pushes through `reg server`: every file
streams through the server into its store and is hashed there; the commit takes no file list
from a client; the claim token alone grants nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry import Registry
from registry.core.config import Settings
from tests.helpers import Ckpts, split_as_nodes, torchrun


def _as(server: Any, who: str) -> dict[str, str]:
    return dict(server.client_env(who))


def _direct(server: Any) -> Registry:
    return Registry(Settings.from_env(server.env), user="admin")  # an operator acting as admin


def test_a_training_job_saves_and_restores_through_the_server(
    reg_server: Any, tmp_path: Path
) -> None:
    alice = _as(reg_server, "alice")
    args = ["--project", "team-a", "--run-name", "srv", "--every", "1"]
    first = tmp_path / "first.json"
    torchrun(
        "examples.train_with_manager",
        2,
        [*args, "--steps", "2", "--async"],
        env_extra={**alice, "PYTHONWARNINGS": "ignore"},
    )
    torchrun(
        "examples.train_with_manager",
        2,
        [*args, "--steps", "1", "--report", str(first)],
        env_extra={**alice, "PYTHONWARNINGS": "ignore"},
    )
    assert json.loads(first.read_text())["resumed"] == 2
    with _direct(reg_server) as reg:
        listed = reg.list_checkpoints("srv", "team-a")
        assert [c["step"] for c in listed] == [1, 2, 3]
        shown = reg.show("team-a/srv@step2")
        assert shown["pushed_by"] == "alice" and shown["world_size"] == 2
        assert shown["digests_reported_by"] is None  # the server hashed every byte itself
        assert shown["save_costs"]["async"] is True
        assert [r["rank"] for r in shown["save_costs"]["ranks"]] == [0, 1]
        assert shown["restores"] and shown["restores"][0]["world_size"] == 2
        assert reg.verify("team-a/srv@step3")["ok"]
        store = Path(reg.settings.store_url.removeprefix("file://"))
    leftovers = list(store.glob("ckpt/team-a/srv/step-*/.reg-claim-*"))
    assert leftovers == []


def test_node_parts_through_the_server_and_what_a_token_does_not_grant(
    reg_server: Any, cli: Any, ckpts: Ckpts, tmp_path: Path
) -> None:
    a, b = split_as_nodes(ckpts, tmp_path)
    alice, bob = _as(reg_server, "alice"), _as(reg_server, "bob")
    res = cli("claim-ckpt", "--project", "team-b", "--run", "n", "--step", "2", env=alice)
    assert res.returncode == 4, res.stderr  # alice trains in team-a only
    res = cli("claim-ckpt", "--project", "team-a", "--run", "n", "--step", "2", env=alice)
    assert res.returncode == 0, res.stderr
    token = res.stdout.strip()
    part = ["--claim", token, "--project", "team-a", "--run", "n", "--step", "2"]
    # Bob holds the token but may not push in team-a: the token alone grants nothing.
    res = cli("push-ckpt", a, *part, env=bob)
    assert res.returncode == 4 and "Traceback" not in res.stderr, res.stderr
    res = cli("push-ckpt", a, *part, "--json", env=alice)
    assert res.returncode == 0, res.stderr
    assert sorted(f["path"] for f in json.loads(res.stdout)["files"]) == [
        ".metadata",
        "__0_0.distcp",
    ]
    res = cli("commit-ckpt", "--claim", token, env=alice)
    assert res.returncode == 1 and "of rank(s) 1 that .metadata names" in res.stderr
    # A file already written under the claim is not rewritten through the server.
    res = cli("push-ckpt", a, *part, env=alice)
    assert res.returncode == 5 and "already written under this claim" in res.stderr
    # Paths are the server's to check: a traversal or a reserved name is refused.
    url = f"{reg_server.url}/v1/claims/{token}/files/"
    auth = {"authorization": f"Bearer {reg_server.token('alice')}"}
    for bad in ("..%2F..%2Fx", "sub/../../x", ".reg-claim-forged.json", "MANIFEST.json"):
        got = httpx.put(url + bad, content=b"{}", headers=auth)
        # 400 from the server's check; 404 where the URL resolved outside the route.
        assert got.status_code in (400, 404), (bad, got.status_code, got.text)
    res = cli("push-ckpt", b, *part, env=alice)
    assert res.returncode == 0, res.stderr
    res = cli("commit-ckpt", "--claim", token, "--world-size", "2", "--json", env=alice)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ref"] == "team-a/n@step2" and out["world_size"] == 2
    # Nothing the refused requests sent became part of the checkpoint.
    assert sorted(f["path"] for f in out["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    with _direct(reg_server) as reg:
        assert reg.verify("team-a/n@step2")["ok"]
    pulled = tmp_path / "pulled"
    assert cli("pull", "team-a/n@step2", pulled, env=alice).returncode == 0
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        assert (pulled / name).read_bytes() == (ckpts.ws2.step_dir(2) / name).read_bytes()


def _claim(server: Any, who: str, step: int) -> str:
    got = server.call(
        who, "POST", "/v1/claims", json={"project": "team-a", "run": "h", "step": step}
    )
    return str(got["claim"])


def test_bad_uploads_and_commits_are_refused_by_the_server(reg_server: Any) -> None:
    token = _claim(reg_server, "alice", 1)
    url = f"{reg_server.url}/v1/claims/{token}"
    auth = {"authorization": f"Bearer {reg_server.token('alice')}"}
    # A reserved name as a directory, and a file where a directory was written.
    assert httpx.put(f"{url}/files/MANIFEST.json/y", content=b"x", headers=auth).status_code == 400
    assert httpx.put(f"{url}/files/a", content=b"x", headers=auth).status_code == 200
    collide = httpx.put(f"{url}/files/a/b", content=b"x", headers=auth)
    assert collide.status_code == 409 and "collides" in collide.json()["message"]
    # Costs the server would have to render later: too deep, or not finite.
    deep: Any = 1.0
    for _ in range(300):
        deep = {"x": deep}
    for costs in ({"deep": deep}, {"persist_seconds": float("nan")}, {"k" * 100: 1}):
        body = json.dumps({"save_costs": costs})
        got = httpx.post(f"{url}/commit", content=body, headers=auth)
        assert got.status_code == 400, (got.status_code, got.text)
    huge = '{"project": "team-a", "run": "h", "step": ' + "9" * 5000 + "}"
    got = httpx.post(f"{reg_server.url}/v1/claims", content=huge, headers=auth)
    assert got.status_code == 400, got.text


def test_a_restore_record_cannot_rewrite_who_restored(
    reg_server: Any, cli: Any, ckpts: Ckpts
) -> None:
    alice = _as(reg_server, "alice")
    res = cli(
        "push-ckpt",
        ckpts.ws2.step_dir(2),
        "--project",
        "team-a",
        "--run",
        "h",
        "--step",
        "2",
        env=alice,
    )
    assert res.returncode == 0, res.stderr
    body = {"ref": "team-a/h@step2", "restore": {"world_size": 2, "phases": {"by": 1.0, "at": 2.0}}}
    reg_server.call("alice", "POST", "/v1/checkpoints/pulled", json=body)
    with _direct(reg_server) as reg:
        restore = reg.show("team-a/h@step2")["restores"][0]
    assert restore["by"] == "alice" and restore["phases"] == {"by": 1.0, "at": 2.0}


def test_a_writer_whose_claim_changed_leaves_nothing_in_the_new_attempts_way(
    reg_server: Any,
) -> None:
    """The bytes of a PUT that finishes after its claim was given up and the step claimed
    again are deleted; the new attempt writes that file."""
    import threading

    old = _claim(reg_server, "alice", 3)
    auth = {"authorization": f"Bearer {reg_server.token('alice')}"}
    go = threading.Event()

    def slow() -> Any:
        yield b"first half "
        go.wait(60)
        yield b"second half"

    answers: list[Any] = []
    put = threading.Thread(
        target=lambda: answers.append(
            httpx.put(
                f"{reg_server.url}/v1/claims/{old}/files/__0_0.distcp",
                content=slow(),
                headers=auth,
                timeout=60,
            )
        )
    )
    put.start()
    import time

    time.sleep(1.0)  # the PUT is in the store's hands
    reg_server.call("alice", "POST", "/v1/claims/renew", json={"claim": old, "seconds": 0})
    new = _claim(reg_server, "alice", 3)
    go.set()
    put.join(60)
    assert answers and answers[0].status_code in (404, 409), answers
    fresh = httpx.put(
        f"{reg_server.url}/v1/claims/{new}/files/__0_0.distcp", content=b"mine", headers=auth
    )
    assert fresh.status_code == 200, fresh.text
    assert fresh.json()["size"] == 4


def _left_in(step: Path) -> list[str]:
    """What a step's prefix holds beside the claim's own record."""
    return sorted(
        p.relative_to(step).as_posix()
        for p in step.rglob("*")
        if not p.name.startswith(".reg-claim")
    )


def test_a_path_segment_too_long_for_a_file_name_is_a_400(reg_server: Any) -> None:
    """Checked before the filesystem is touched, with push's rules: at most 255 bytes a
    segment, 1,024 characters, 32 segments; the usual error body, nothing left on disk."""
    token = _claim(reg_server, "alice", 5)
    url = f"{reg_server.url}/v1/claims/{token}/files/"
    auth = {"authorization": f"Bearer {reg_server.token('alice')}"}
    with _direct(reg_server) as reg:
        store = Path(reg.settings.store_url.removeprefix("file://"))
    step = store / "ckpt" / "team-a" / "h" / "step-5"
    for bad, why in (
        ("x" * 300, "a segment of 300 bytes, over 255"),
        ("sub/" + "y" * 256, "a segment of 256 bytes, over 255"),
        ("/".join(["d"] * 33), "33 segments, over 32"),
        ("/".join(["e" * 200] * 6), "paths at most 1024 characters"),  # dcp_scan's check
    ):
        got = httpx.put(url + bad, content=b"bytes", headers=auth)
        assert got.status_code == 400, (bad[:40], got.status_code, got.text)
        body = got.json()
        assert body["exit_code"] == 2 and body["type"] and body["hint"], body
        assert why in f"{body['message']} ({body['hint']})", body
        assert "team-a/h@step5" in body["message"], body
        assert _left_in(step) == [], bad[:40]
    assert not [p for p in (store / ".tmp").rglob("*") if p.is_file()]
    ok = httpx.put(url + "sub/" + "z" * 255, content=b"bytes", headers=auth)
    assert ok.status_code == 200, ok.text
    assert _left_in(step) == ["sub", "sub/" + "z" * 255]


@pytest.mark.process  # reg server
def test_a_name_the_store_cannot_hold_is_a_400_not_a_500(catalog_url: str, tmp_path: Path) -> None:
    """A store root deep enough that a path within the rules passes PATH_MAX: the
    filesystem's ENAMETOOLONG is the client's error (400), not the server's (500)."""
    from tests.serverproc import RegServer, server_env, team_policy

    root = tmp_path / "store"
    while len(str(root)) < 3300:
        root = root / ("s" * 200)
    root.mkdir(parents=True)
    home = tmp_path / "server-home"
    server = RegServer(server_env(home, catalog_url, root.as_uri()), home)
    server.init().start()
    try:
        server.apply_policy(team_policy())
        token = _claim(server, "alice", 6)
        path = "/".join(["n" * 200] * 4)
        got = httpx.put(
            f"{server.url}/v1/claims/{token}/files/{path}",
            content=b"bytes",
            headers={"authorization": f"Bearer {server.token('alice')}"},
        )
        assert got.status_code == 400, got.text
        body = got.json()
        assert body["exit_code"] == 2 and "too long a name for the store" in body["message"]
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()
