"""`reg server` on S3: the bytes of pushes and pulls go between the client and S3 (moto over
HTTP) through presigned URLs; the server holds the only credentials.

moto does not check presigned signatures or signed checksums, so the URLs' signed headers and
lifetimes are asserted here, and what moto lets through (other bytes than declared) is shown to
be recorded as the client's word and caught by `reg verify`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from registry.lifecycle.checkpoints.presigned import URL_TTL_S
from registry.lifecycle.checkpoints.upload_plan import LEASE_S
from tests.serverproc import RegServer, server_env, team_policy

AWS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3_server(moto_server, catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """`reg server` with an S3 store (a fresh bucket on the test's moto); the test's own
    environment is a client's: REG_URL and a token, and no AWS credentials at all."""
    import uuid

    import boto3

    bucket = f"reg-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_server.url, **_boto(AWS)).create_bucket(Bucket=bucket)
    env = server_env(tmp_path / "server-home", catalog_url, f"s3://{bucket}/reg")
    env.update(AWS, AWS_ENDPOINT_URL=moto_server.url)
    server = RegServer(env, tmp_path / "server-home")
    server.init().start()
    server.apply_policy(team_policy())
    for key in (*AWS, "AWS_ENDPOINT_URL", "REG_CATALOG_URL", "REG_STORE_URL"):
        monkeypatch.delenv(key, raising=False)
    for key, value in server.client_env("admin").items():
        monkeypatch.setenv(key, value)
    server.bucket = bucket  # type: ignore[attr-defined]
    server.s3 = boto3.client("s3", endpoint_url=moto_server.url, **_boto(AWS))  # type: ignore[attr-defined]
    yield server
    server.stop()


def _boto(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def _as(server: RegServer, who: str) -> dict[str, str]:
    return server.client_env(who)


def _through_server(server: RegServer) -> float:
    """Checkpoint bytes that went through the server, in or out (its /metrics counters)."""
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(("reg_bytes_received_total ", "reg_bytes_sent_total ")):
            total += float(line.split()[1])
    return total


def _files(path: Path) -> dict[str, str]:
    """The checkpoint's files (not the MANIFEST.json a pull keeps beside them)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and str(p.relative_to(path)) != "MANIFEST.json"
    }


def _declared(ckpt: Path) -> list[dict[str, object]]:
    from registry.lifecycle.checkpoints.upload_plan import part_sizes

    out = []
    for rel, digest in _files(ckpt).items():
        data = (ckpt / rel).read_bytes()
        sizes = part_sizes(len(data))
        parts = None
        if sizes:
            parts, at = [], 0
            for size in sizes:
                parts.append(hashlib.sha256(data[at : at + size]).hexdigest())
                at += size
        out.append({"path": rel, "size": len(data), "sha256": digest, "parts": parts})
    return out


def _begin(server: RegServer, who: str, ckpt: Path, step: int, **extra: object) -> httpx.Response:
    body = {"project": "team-a", "run": "r", "step": step, "files": _declared(ckpt), **extra}
    return httpx.post(
        server.url + "/v1/checkpoints/push/begin",
        json=body,
        headers={"authorization": f"Bearer {server.token(who)}"},
        timeout=60,
    )


def _post(server: RegServer, who: str, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(
        server.url + path,
        json=body,
        headers={"authorization": f"Bearer {server.token(who)}"},
        timeout=60,
    )


def test_push_and_pull_go_straight_to_s3(s3_server, ckpts, cli, tmp_path: Path) -> None:
    alice = _as(s3_server, "alice")
    src = ckpts.ws2.step_dir(2)
    out = _push(cli, s3_server, src, 2, "--json")
    assert out.returncode == 0, out.stderr
    pushed = json.loads(out.stdout)
    assert pushed["ref"] == "team-a/r@step2"
    shown = json.loads(cli("show", "team-a/r@step2", "--json", env=alice).stdout)
    local = _files(src)
    assert {f["path"]: f["sha256"] for f in shown["files"]} == local
    assert shown["digests_reported_by"] == "alice"  # the client's word until re-hashed
    res = cli("pull", "team-a/r@step2", tmp_path / "back", "--json", env=alice)
    assert res.returncode == 0, res.stderr
    assert _files(tmp_path / "back") == local
    # Not one checkpoint byte went through the server, either way: the client had no AWS
    # credentials, and the server received and sent nothing.
    assert _through_server(s3_server) == 0
    assert not any(k.startswith("AWS_") for k in alice)
    # The plan object is gone; the files and MANIFEST.json are where the layout says.
    keys = {
        o["Key"]
        for o in s3_server.s3.list_objects_v2(
            Bucket=s3_server.bucket, Prefix="reg/ckpt/team-a/r/step-2/"
        )["Contents"]
    }
    assert "reg/ckpt/team-a/r/step-2/MANIFEST.json" in keys
    assert not any(k.endswith(".reg-upload.json") for k in keys)
    # The server re-hashes on verify: the digests become its own.
    res = cli("verify", "team-a/r@step2", "--json", env=alice)
    assert res.returncode == 0, res.stderr
    shown = json.loads(cli("show", "team-a/r@step2", "--json", env=alice).stdout)
    assert shown["digests_reported_by"] is None
    # A validator reads it straight from S3 too (presigned ranged GETs).
    res = cli("validate", "team-a/r@step2", "--device", "cpu", "--json", env=_as(s3_server, "val"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["passed"] is True
    assert _through_server(s3_server) == 0
    # The same push again is a no-op; other content at the same step is a conflict.
    again = _push(cli, s3_server, src, 2, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["unchanged"] is True
    other = _push(cli, s3_server, ckpts.ws2.step_dir(4), 2)
    assert other.returncode != 0 and "already committed with different content" in other.stderr


def test_urls_sign_exactly_the_claimed_keys(s3_server, ckpts) -> None:
    src = ckpts.ws2.step_dir(2)
    begun = _begin(s3_server, "alice", src, 7)
    assert begun.status_code == 200, begun.text
    doc = begun.json()
    assert doc["items"] == len(_files(src)) == len(doc["urls"])  # fewer than BEGIN_URLS
    for item in doc["urls"]:
        url = urlparse(item["url"])
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        assert url.path == f"/{s3_server.bucket}/reg/ckpt/team-a/r/step-7/{item['path']}"
        assert q["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"  # SigV4, not SigV2
        # Dead before the claim they were signed under can run out (see URL_TTL_S).
        assert q["X-Amz-Expires"] == str(URL_TTL_S) and URL_TTL_S < LEASE_S
        signed = q["X-Amz-SignedHeaders"].split(";")
        assert {"host", "content-length", "if-none-match", "x-amz-checksum-sha256"} <= set(signed)
        assert item["headers"]["if-none-match"] == "*"
        assert "X-Amz-Credential" in q and "test/" in q["X-Amz-Credential"]
    aborted = _finish(s3_server, doc, "abort")
    assert aborted.status_code == 200, aborted.text


def test_multipart_parts_carry_their_checksums(s3_server, big_ckpt, cli, tmp_path: Path) -> None:
    """A ~100 MB shard goes up in parts: each part URL signs the part's sha256 and size, the
    server completes the upload itself (If-None-Match), and the pull is bit-exact."""
    src = big_ckpt.step_dir(big_ckpt.steps[-1])
    begun = _begin(s3_server, "alice", src, 3).json()
    parts = [u for u in begun["urls"] if u["part"]]
    assert parts, "the big checkpoint has files over the single-PUT size"
    for item in parts:
        q = {k: v[0] for k, v in parse_qs(urlparse(item["url"]).query).items()}
        assert q["partNumber"] == str(item["part"]) and q["uploadId"]
        assert {"content-length", "x-amz-checksum-sha256"} <= set(
            q["X-Amz-SignedHeaders"].split(";")
        )
    _finish(s3_server, begun, "abort")
    alice = _as(s3_server, "alice")
    res = cli("push-ckpt", src, "--run", "big", "--step", "1", "--project", "team-a", env=alice)
    assert res.returncode == 0, res.stderr
    res = cli("pull", "team-a/big@step1", tmp_path / "back", env=alice)
    assert res.returncode == 0, res.stderr
    assert _files(tmp_path / "back") == _files(src)


@pytest.mark.parametrize(
    ("files_edit", "said"),
    [
        (
            lambda fs: [{**f, "path": "../escape"} if f["path"] == ".metadata" else f for f in fs],
            "unsafe file path",
        ),
        (lambda fs: [f for f in fs if f["path"] != ".metadata"], "no .metadata"),
        (
            lambda fs: [
                *fs,
                {"path": "MANIFEST.json", "size": 2, "sha256": "0" * 64, "parts": None},
            ],
            "reserves",
        ),
        (
            lambda fs: [
                *fs,
                {"path": ".reg-upload.json", "size": 2, "sha256": "0" * 64, "parts": None},
            ],
            "reserves",
        ),
        (
            lambda fs: [*fs, {"path": "a//b", "size": 2, "sha256": "0" * 64, "parts": None}],
            "unsafe file path",
        ),
        (lambda fs: [{**f, "sha256": "XYZ"} for f in fs], "64 lowercase hex"),
        (lambda fs: [{**f, "parts": ["0" * 64]} for f in fs], "one PUT"),
        (
            lambda fs: [
                *fs,
                {"path": "huge", "size": 200 << 20, "sha256": "0" * 64, "parts": None},
            ],
            "parts",
        ),
        (lambda fs: fs + fs[:1], "repeats"),
    ],
    ids=[
        "dotdot",
        "no-metadata",
        "manifest",
        "plan-name",
        "empty-segment",
        "bad-digest",
        "parts-on-small",
        "no-parts-on-big",
        "duplicate",
    ],
)
def test_begin_refuses_bad_file_lists(s3_server, ckpts, files_edit, said: str) -> None:
    body = {
        "project": "team-a",
        "run": "r",
        "step": 5,
        "files": files_edit(_declared(ckpts.ws2.step_dir(2))),
    }
    r = _post(s3_server, "alice", "/v1/checkpoints/push/begin", body)
    assert r.status_code in (400, 422), r.text
    assert said in r.json()["message"]
    # Nothing claimed: the step is free for a real push.
    assert _begin(s3_server, "alice", ckpts.ws2.step_dir(2), 5).status_code == 200


def test_uploads_are_the_pushers_alone(s3_server, ckpts) -> None:
    doc = _begin(s3_server, "alice", ckpts.ws2.step_dir(2), 8).json()
    ident = {"ref": doc["ref"], "upload": doc["upload"]}
    # bob may not push to team-a at all; the admin may, but this upload is alice's.
    for who, code in (("bob", 403), ("admin", 403), ("vera", 403)):
        for path in ("urls", "assemble", "complete", "abort"):
            body = {**ident, "start": 0, "count": 1, "path": "__0_0.distcp"}
            r = _post(s3_server, who, f"/v1/checkpoints/push/{path}", body)
            assert r.status_code == code, (who, path, r.text)
    assert _begin(s3_server, "bob", ckpts.ws2.step_dir(2), 9).status_code == 403
    # A guessed id or another step's finds nothing.
    for bad in (
        {**ident, "upload": "0" * 32},
        {**ident, "ref": "team-a/r@step9"},
        {**ident, "upload": "../x"},
    ):
        r = _post(s3_server, "alice", "/v1/checkpoints/push/urls", {**bad, "start": 0, "count": 1})
        assert r.status_code in (400, 404), r.text
    # The client's heartbeat (no URLs) renews alice's claim, and only hers.
    beat = {**ident, "start": 0, "count": 0}
    r = _post(s3_server, "alice", "/v1/checkpoints/push/urls", beat)
    assert r.status_code == 200 and r.json()["urls"] == [], r.text
    assert _post(s3_server, "admin", "/v1/checkpoints/push/urls", beat).status_code == 403
    r = _post(s3_server, "alice", "/v1/checkpoints/push/urls", {**beat, "upload": "0" * 32})
    assert r.status_code == 404
    # Only a multipart file of the plan is assembled.
    for path in (".metadata", "../x", "nope"):
        body = {**ident, "path": path}
        r = _post(s3_server, "alice", "/v1/checkpoints/push/assemble", body)
        assert r.status_code == 400 and "not a multipart file" in r.json()["message"], r.text
    # URLs only for the plan's items.
    r = _post(
        s3_server,
        "alice",
        "/v1/checkpoints/push/urls",
        {**ident, "start": doc["items"] + 1, "count": 5},
    )
    assert r.status_code == 400


def _finish(server: RegServer, doc: dict[str, object], what: str = "complete") -> httpx.Response:
    """`push/complete` (or `abort`) of the upload `begin` answered with, as alice."""
    ident = {"ref": doc["ref"], "upload": doc["upload"]}
    return _post(server, "alice", f"/v1/checkpoints/push/{what}", ident)


def _push(cli, server: RegServer, src: Path, step: int, *extra: str):  # type: ignore[no-untyped-def]
    """`reg push-ckpt` of `src` as alice into team-a/r@step."""
    args = ("--run", "r", "--step", str(step), "--project", "team-a", *extra)
    return cli("push-ckpt", src, *args, env=_as(server, "alice"))


def _upload(item: dict[str, object], data: bytes) -> httpx.Response:
    headers = {**item["headers"], "content-length": str(len(data))}  # type: ignore[dict-item]
    return httpx.put(str(item["url"]), content=data, headers=headers, timeout=60)


def test_complete_checks_what_s3_holds(s3_server, ckpts, cli) -> None:
    src = ckpts.ws2.step_dir(2)
    doc = _begin(s3_server, "alice", src, 11).json()
    ident = {"ref": doc["ref"], "upload": doc["upload"]}
    # Nothing uploaded yet: refused, and the claim is let go at once.
    r = _post(s3_server, "alice", "/v1/checkpoints/push/complete", ident)
    assert r.status_code == 422 and "was not uploaded" in r.json()["message"]
    doc = _begin(s3_server, "alice", src, 11).json()  # taken over at once
    items = {u["path"]: u for u in doc["urls"]}
    for path, item in items.items():
        data = (src / path).read_bytes()
        if path == ".metadata":
            data = data[:-1] + bytes([data[-1] ^ 1])  # same size, other bytes
        assert _upload(item, data).status_code == 200
    r = _finish(s3_server, doc, "complete")
    assert (
        r.status_code == 422 and ".metadata holds other bytes than declared" in r.json()["message"]
    )
    assert (
        "team-a/r@step11" not in cli("ls", "team-a/r", "--json", env=_as(s3_server, "alice")).stdout
    )


def test_a_short_upload_is_refused(s3_server, ckpts) -> None:
    src = ckpts.ws2.step_dir(2)
    doc = _begin(s3_server, "alice", src, 12).json()
    for item in doc["urls"]:
        data = (src / item["path"]).read_bytes()
        if item["path"] != ".metadata":
            data = data[: len(data) // 2]  # moto takes it (real S3 checks the signed length)
        _upload(item, data)
    r = _finish(s3_server, doc, "complete")
    assert (
        r.status_code == 422 and "holds other bytes than the push declared" in r.json()["message"]
    )


def test_a_lying_client_is_recorded_as_such_and_verify_catches_it(s3_server, ckpts, cli) -> None:
    """moto stores bytes that do not match the signed checksum (real S3 refuses the PUT): the
    digest stays the client's word, and the server's re-hash names the file."""
    src = ckpts.ws2.step_dir(2)
    doc = _begin(s3_server, "alice", src, 13).json()
    victim = next(u["path"] for u in doc["urls"] if u["path"].endswith(".distcp"))
    for item in doc["urls"]:
        data = (src / item["path"]).read_bytes()
        if item["path"] == victim:  # the last byte: the chunk headers still look right
            data = data[:-1] + bytes([data[-1] ^ 1])
        _upload(item, data)
    r = _finish(s3_server, doc, "complete")
    assert r.status_code == 200, r.text
    alice = _as(s3_server, "alice")
    shown = json.loads(cli("show", "team-a/r@step13", "--json", env=alice).stdout)
    assert shown["digests_reported_by"] == "alice"
    res = cli("verify", "team-a/r@step13", env=alice)
    assert res.returncode == 1 and victim in (res.stdout + res.stderr)


def test_a_used_url_cannot_overwrite(s3_server, ckpts) -> None:
    src = ckpts.ws2.step_dir(2)
    doc = _begin(s3_server, "alice", src, 14).json()
    for item in doc["urls"]:
        assert _upload(item, (src / item["path"]).read_bytes()).status_code == 200
    r = _finish(s3_server, doc, "complete")
    assert r.status_code == 200, r.text
    item = doc["urls"][0]
    size = (src / item["path"]).stat().st_size
    assert _upload(item, os.urandom(size)).status_code == 412  # If-None-Match: *
    key = f"reg/ckpt/team-a/r/step-14/{item['path']}"
    body = s3_server.s3.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    assert body == (src / item["path"]).read_bytes()


def test_a_killed_client_frees_the_step(s3_server, ckpts, cli) -> None:
    """A client that begins and vanishes (no abort) holds the step until its lease runs out;
    GC later sweeps what it uploaded. Here: the same pusher's next push is told who holds it."""
    src = ckpts.ws2.step_dir(2)
    doc = _begin(s3_server, "alice", src, 15).json()
    _upload(doc["urls"][0], (src / doc["urls"][0]["path"]).read_bytes())
    res = _push(cli, s3_server, src, 15)
    assert res.returncode != 0 and "is being pushed by alice" in res.stderr
    _finish(s3_server, doc, "abort")
    # Abandoned, but its URLs live on: nobody else takes the step over before they are dead
    # (they could write into that attempt's keys); alice, whose URLs they are, at once.
    assert _begin(s3_server, "admin", src, 15).status_code == 409
    res = _push(cli, s3_server, src, 15)
    assert res.returncode == 0, res.stderr


def test_a_forced_layout_travels_in_the_upload_plan(s3_server, layouts, cli) -> None:
    res = _push(cli, s3_server, layouts["lightning"].step_dir(2), 5, "--layout", "torchtitan")
    assert res.returncode == 0, res.stderr
    shown = cli("show", "team-a/r@step5", "--json", env=_as(s3_server, "alice"))
    out = json.loads(shown.stdout)
    # forced: Lightning's state_dict keys are taken for model keys at the top level, and the
    # sidecar counts for nothing
    assert out["layout"] == "torchtitan" and out["suggestions"] == ["--layout lightning"]
    assert "meta.pt" not in json.dumps(out["resume_state"])


def test_several_dcp_roots_push_through_presigned_urls(s3_server, cli, tmp_path) -> None:
    """accelerate's layout (DCP roots one level down and its sidecars) uploads straight to S3:
    the server reads each root's .metadata and the sidecars from what S3 holds."""
    from tests.test_dcp_roots import accelerate_like

    src = accelerate_like(tmp_path / "src")
    res = _push(cli, s3_server, src, 6, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["layout"] == "accelerate" and out["resumable"] is True, out
    assert out["resume_state"]["train_state"] == ["custom_checkpoint_0.pkl"]
    (src / "optimizer_0" / ".metadata").unlink()
    refused = _push(cli, s3_server, src, 7)
    assert refused.returncode == 2 and "optimizer_0/ holds DCP shards" in refused.stderr
