"""`reg server` on S3: the bytes of pushes and pulls go between the client and S3 (SeaweedFS, a
real S3 server, over HTTP) through presigned URLs; the server holds the only credentials.

The URLs' signed headers and lifetimes are asserted, and the enforcement reg relies on is shown
on the real server: a tampered, re-dated or expired URL writes nothing, a signed checksum, length
or `If-None-Match` cannot be swapped or dropped. On a store that checks none of it (moto), what
lands is recorded as the client's word and caught by `reg verify`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from botocore.exceptions import ClientError

from registry.lifecycle.checkpoints.presigned import URL_TTL_S
from registry.lifecycle.checkpoints.upload_plan import LEASE_S
from tests.serverproc import RegServer, server_env, team_policy


@pytest.fixture
def reg_on_s3(s3_server, catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """`reg server` with a store on the real S3 server (a fresh bucket on SeaweedFS, which checks
    signatures, signed headers, lengths and checksums); the test's own environment is a
    client's: REG_URL and a token, and no AWS credentials at all."""
    yield from _reg_server_on(
        s3_server, s3_server.credentials(), catalog_url, tmp_path, monkeypatch
    )


@pytest.fixture
def reg_on_moto(moto_server, catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The same on moto, which checks no presigned signature nor signed checksum: for the two
    tests that need a store that lets other bytes than declared land."""
    yield from _reg_server_on(
        moto_server, moto_server.credentials(), catalog_url, tmp_path, monkeypatch
    )


def _reg_server_on(
    s3: Any, aws: dict[str, str], catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RegServer]:
    import uuid

    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=s3.url, config=Config(signature_version="s3v4"), **_boto(aws)
    )
    bucket = f"reg-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    env = server_env(tmp_path / "server-home", catalog_url, f"s3://{bucket}/reg")
    env.update(aws)
    server = RegServer(env, tmp_path / "server-home")
    server.init().start()
    server.apply_policy(team_policy())
    for key in (*aws, "REG_CATALOG_URL", "REG_STORE_URL"):
        monkeypatch.delenv(key, raising=False)
    for key, value in server.client_env("admin").items():
        monkeypatch.setenv(key, value)
    server.bucket = bucket  # type: ignore[attr-defined]
    server.s3 = client  # type: ignore[attr-defined]
    server.aws = aws  # type: ignore[attr-defined]
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


def test_push_and_pull_go_straight_to_s3(reg_on_s3, ckpts, cli, tmp_path: Path) -> None:
    alice = _as(reg_on_s3, "alice")
    src = ckpts.ws2.step_dir(2)
    out = _push(cli, reg_on_s3, src, 2, "--json")
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
    assert _through_server(reg_on_s3) == 0
    assert not any(k.startswith("AWS_") for k in alice)
    # The plan object is gone; the files and MANIFEST.json are where the layout says.
    keys = {
        o["Key"]
        for o in reg_on_s3.s3.list_objects_v2(
            Bucket=reg_on_s3.bucket, Prefix="reg/ckpt/team-a/r/step-2/"
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
    res = cli("validate", "team-a/r@step2", "--device", "cpu", "--json", env=_as(reg_on_s3, "val"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["passed"] is True
    assert _through_server(reg_on_s3) == 0
    # The same push again is a no-op; other content at the same step is a conflict.
    again = _push(cli, reg_on_s3, src, 2, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["unchanged"] is True
    other = _push(cli, reg_on_s3, ckpts.ws2.step_dir(4), 2)
    assert other.returncode != 0 and "already committed with different content" in other.stderr


def test_urls_sign_exactly_the_claimed_keys(reg_on_s3, ckpts) -> None:
    src = ckpts.ws2.step_dir(2)
    begun = _begin(reg_on_s3, "alice", src, 7)
    assert begun.status_code == 200, begun.text
    doc = begun.json()
    assert doc["items"] == len(_files(src)) == len(doc["urls"])  # fewer than BEGIN_URLS
    for item in doc["urls"]:
        url = urlparse(item["url"])
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        assert url.path == f"/{reg_on_s3.bucket}/reg/ckpt/team-a/r/step-7/{item['path']}"
        assert q["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"  # SigV4, not SigV2
        # Dead before the claim they were signed under can run out (see URL_TTL_S).
        assert q["X-Amz-Expires"] == str(URL_TTL_S) and URL_TTL_S < LEASE_S
        signed = q["X-Amz-SignedHeaders"].split(";")
        assert {"host", "content-length", "if-none-match", "x-amz-checksum-sha256"} <= set(signed)
        assert item["headers"]["if-none-match"] == "*"
        access_key = reg_on_s3.aws["AWS_ACCESS_KEY_ID"]
        assert q["X-Amz-Credential"].startswith(access_key + "/")
    aborted = _finish(reg_on_s3, doc, "abort")
    assert aborted.status_code == 200, aborted.text


def test_multipart_parts_carry_their_checksums(reg_on_s3, big_ckpt, cli, tmp_path: Path) -> None:
    """A ~100 MB shard goes up in parts: each part URL signs the part's sha256 and size, the
    server completes the upload itself (If-None-Match), and the pull is bit-exact."""
    src = big_ckpt.step_dir(big_ckpt.steps[-1])
    begun = _begin(reg_on_s3, "alice", src, 3).json()
    parts = [u for u in begun["urls"] if u["part"]]
    assert parts, "the big checkpoint has files over the single-PUT size"
    for item in parts:
        q = {k: v[0] for k, v in parse_qs(urlparse(item["url"]).query).items()}
        assert q["partNumber"] == str(item["part"]) and q["uploadId"]
        assert {"content-length", "x-amz-checksum-sha256"} <= set(
            q["X-Amz-SignedHeaders"].split(";")
        )
    _finish(reg_on_s3, begun, "abort")
    alice = _as(reg_on_s3, "alice")
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
def test_begin_refuses_bad_file_lists(reg_on_s3, ckpts, files_edit, said: str) -> None:
    body = {
        "project": "team-a",
        "run": "r",
        "step": 5,
        "files": files_edit(_declared(ckpts.ws2.step_dir(2))),
    }
    r = _post(reg_on_s3, "alice", "/v1/checkpoints/push/begin", body)
    assert r.status_code in (400, 422), r.text
    assert said in r.json()["message"]
    # Nothing claimed: the step is free for a real push.
    assert _begin(reg_on_s3, "alice", ckpts.ws2.step_dir(2), 5).status_code == 200


def test_uploads_are_the_pushers_alone(reg_on_s3, ckpts) -> None:
    doc = _begin(reg_on_s3, "alice", ckpts.ws2.step_dir(2), 8).json()
    ident = {"ref": doc["ref"], "upload": doc["upload"]}
    # bob may not push to team-a at all; the admin may, but this upload is alice's.
    for who, code in (("bob", 403), ("admin", 403), ("vera", 403)):
        for path in ("urls", "assemble", "complete", "abort"):
            body = {**ident, "start": 0, "count": 1, "path": "__0_0.distcp"}
            r = _post(reg_on_s3, who, f"/v1/checkpoints/push/{path}", body)
            assert r.status_code == code, (who, path, r.text)
    assert _begin(reg_on_s3, "bob", ckpts.ws2.step_dir(2), 9).status_code == 403
    # A guessed id or another step's finds nothing.
    for bad in (
        {**ident, "upload": "0" * 32},
        {**ident, "ref": "team-a/r@step9"},
        {**ident, "upload": "../x"},
    ):
        r = _post(reg_on_s3, "alice", "/v1/checkpoints/push/urls", {**bad, "start": 0, "count": 1})
        assert r.status_code in (400, 404), r.text
    # The client's heartbeat (no URLs) renews alice's claim, and only hers.
    beat = {**ident, "start": 0, "count": 0}
    r = _post(reg_on_s3, "alice", "/v1/checkpoints/push/urls", beat)
    assert r.status_code == 200 and r.json()["urls"] == [], r.text
    assert _post(reg_on_s3, "admin", "/v1/checkpoints/push/urls", beat).status_code == 403
    r = _post(reg_on_s3, "alice", "/v1/checkpoints/push/urls", {**beat, "upload": "0" * 32})
    assert r.status_code == 404
    # Only a multipart file of the plan is assembled.
    for path in (".metadata", "../x", "nope"):
        body = {**ident, "path": path}
        r = _post(reg_on_s3, "alice", "/v1/checkpoints/push/assemble", body)
        assert r.status_code == 400 and "not a multipart file" in r.json()["message"], r.text
    # URLs only for the plan's items.
    r = _post(
        reg_on_s3,
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


def test_complete_refuses_what_was_not_uploaded(reg_on_s3, ckpts) -> None:
    src = ckpts.ws2.step_dir(2)
    doc = _begin(reg_on_s3, "alice", src, 11).json()
    ident = {"ref": doc["ref"], "upload": doc["upload"]}
    # Nothing uploaded yet: refused, and the claim is let go at once.
    r = _post(reg_on_s3, "alice", "/v1/checkpoints/push/complete", ident)
    assert r.status_code == 422 and "was not uploaded" in r.json()["message"]
    doc = _begin(reg_on_s3, "alice", src, 11).json()  # taken over at once
    assert _finish(reg_on_s3, doc, "abort").status_code == 200


def test_complete_checks_what_a_lax_store_holds(reg_on_moto, ckpts, cli) -> None:
    """On moto, because it lets a PUT land other bytes than its signed checksum (a real server
    refuses them: test_s3_refuses_other_bytes_than_the_signed_checksum): the server's own check
    at complete still refuses the push."""
    src = ckpts.ws2.step_dir(2)
    doc = _begin(reg_on_moto, "alice", src, 11).json()
    items = {u["path"]: u for u in doc["urls"]}
    for path, item in items.items():
        data = (src / path).read_bytes()
        if path == ".metadata":
            data = data[:-1] + bytes([data[-1] ^ 1])  # same size, other bytes
        assert _upload(item, data).status_code == 200
    r = _finish(reg_on_moto, doc, "complete")
    assert (
        r.status_code == 422 and ".metadata holds other bytes than declared" in r.json()["message"]
    )
    listed = cli("ls", "team-a/r", "--json", env=_as(reg_on_moto, "alice")).stdout
    assert "team-a/r@step11" not in listed


def test_a_short_upload_is_refused(reg_on_s3, ckpts) -> None:
    """S3 checks the signed length: a PUT of half the bytes writes nothing, and the server's
    complete finds the files missing."""
    src = ckpts.ws2.step_dir(2)
    doc = _begin(reg_on_s3, "alice", src, 12).json()
    for item in doc["urls"]:
        data = (src / item["path"]).read_bytes()
        if item["path"] != ".metadata":
            short = _upload_as_declared(item, data[: len(data) // 2], len(data))
            assert short.status_code >= 400, short.text
            assert not _exists(reg_on_s3, doc, item["path"])
        else:
            assert _upload(item, data).status_code == 200
    r = _finish(reg_on_s3, doc, "complete")
    assert r.status_code == 422 and "was not uploaded" in r.json()["message"], r.text


def test_s3_refuses_other_bytes_than_the_signed_checksum(reg_on_s3, ckpts, cli) -> None:
    """A client that uploads other bytes than it declared: S3 recomputes the signed sha256 and
    refuses the PUT (400 BadDigest), nothing lands, and the push cannot complete."""
    src = ckpts.ws2.step_dir(2)
    doc = _begin(reg_on_s3, "alice", src, 13).json()
    victim = next(u for u in doc["urls"] if u["path"].endswith(".distcp"))
    data = (src / victim["path"]).read_bytes()
    lie = _upload(victim, data[:-1] + bytes([data[-1] ^ 1]))
    assert lie.status_code == 400 and "BadDigest" in lie.text, lie.text
    assert not _exists(reg_on_s3, doc, victim["path"])
    for item in doc["urls"]:
        if item is not victim:
            assert _upload(item, (src / item["path"]).read_bytes()).status_code == 200
    r = _finish(reg_on_s3, doc, "complete")
    assert r.status_code == 422 and "was not uploaded" in r.json()["message"], r.text
    listed = cli("ls", "team-a/r", "--json", env=_as(reg_on_s3, "alice")).stdout
    assert "team-a/r@step13" not in listed


def test_a_lying_client_on_a_lax_store_is_recorded_as_such_and_verify_catches_it(
    reg_on_moto, ckpts, cli
) -> None:
    """On moto, because it stores bytes that do not match the signed checksum (SeaweedFS and AWS
    refuse the PUT, above): a store that does not check must not make reg lie. The digest stays
    the client's word, and the server's re-hash names the file."""
    src = ckpts.ws2.step_dir(2)
    doc = _begin(reg_on_moto, "alice", src, 13).json()
    victim = next(u["path"] for u in doc["urls"] if u["path"].endswith(".distcp"))
    for item in doc["urls"]:
        data = (src / item["path"]).read_bytes()
        if item["path"] == victim:  # the last byte: the chunk headers still look right
            data = data[:-1] + bytes([data[-1] ^ 1])
        _upload(item, data)
    r = _finish(reg_on_moto, doc, "complete")
    assert r.status_code == 200, r.text
    alice = _as(reg_on_moto, "alice")
    shown = json.loads(cli("show", "team-a/r@step13", "--json", env=alice).stdout)
    assert shown["digests_reported_by"] == "alice"
    res = cli("verify", "team-a/r@step13", env=alice)
    assert res.returncode == 1 and victim in (res.stdout + res.stderr)


def _exists(server: RegServer, doc: dict[str, Any], path: str) -> bool:
    key = f"reg/ckpt/{doc['ref'].replace('@step', '/step-')}/{path}"
    try:
        server.s3.head_object(Bucket=server.bucket, Key=key)  # type: ignore[attr-defined]
    except ClientError as exc:
        if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def _upload_as_declared(item: dict[str, Any], data: bytes, declared: int) -> httpx.Response:
    """A PUT whose Content-Length says `declared` bytes and whose body stops after `data` (the
    connection is then closed): what a client cut short, or a lying one, sends."""
    import http.client

    url = urlparse(str(item["url"]))
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.putrequest("PUT", f"{url.path}?{url.query}", skip_accept_encoding=True)
    for k, v in {**item["headers"], "content-length": str(declared)}.items():
        conn.putheader(k, v)
    conn.endheaders()
    conn.send(data)
    try:
        conn.sock.shutdown(1)  # SHUT_WR: no more bytes are coming
        resp = conn.getresponse()
        body = resp.read()
        status = resp.status
    except (OSError, http.client.HTTPException):
        status, body = 499, b"the server closed the connection"
    finally:
        conn.close()
    return httpx.Response(status, content=body)


TAMPERINGS = ("signature", "expiry", "date", "checksum", "no-if-none-match", "length")


def _tampered(item: dict[str, Any], data: bytes, tamper: str) -> tuple[str, dict[str, str], bytes]:
    url, headers = str(item["url"]), dict(item["headers"])
    q = {k: v[0] for k, v in parse_qs(urlparse(url).query).items()}
    if tamper == "signature":
        sig = q["X-Amz-Signature"]
        url = url.replace(sig, sig[:-1] + ("0" if sig[-1] != "0" else "1"))
    elif tamper == "expiry":
        url = url.replace(f"X-Amz-Expires={q['X-Amz-Expires']}", "X-Amz-Expires=604800")
    elif tamper == "date":
        url = url.replace(f"X-Amz-Date={q['X-Amz-Date']}", "X-Amz-Date=20991231T000000Z")
    elif tamper == "checksum":  # other bytes, and their own checksum in place of the signed one
        data = data[:-1] + bytes([data[-1] ^ 1])
        headers["x-amz-checksum-sha256"] = base64.b64encode(hashlib.sha256(data).digest()).decode()
    elif tamper == "no-if-none-match":
        headers.pop("if-none-match")
    elif tamper == "length":
        data = data + b"\0"
    return url, headers, data


def test_s3_writes_nothing_through_a_url_that_was_tampered_with(reg_on_s3, ckpts) -> None:
    """What the URL's signature binds, the real server enforces: an edited signature, a longer
    lifetime or another date, a swapped checksum (with bytes that match it), a dropped
    `If-None-Match` or another length: each refused (403 or 400), and the key stays empty."""
    src = ckpts.ws2.step_dir(2)
    doc = _begin(reg_on_s3, "alice", src, 16).json()
    item = next(u for u in doc["urls"] if u["path"] == ".metadata")
    data = (src / item["path"]).read_bytes()
    for tamper in TAMPERINGS:
        url, headers, body = _tampered(item, data, tamper)
        r = httpx.put(url, content=body, headers=headers, timeout=60)
        assert r.status_code in (400, 403), (tamper, r.status_code, r.text)
        assert not _exists(reg_on_s3, doc, item["path"]), tamper
    # The untouched URL still works: only the tampering was refused.
    assert _upload(item, data).status_code == 200
    assert _finish(reg_on_s3, doc, "abort").status_code == 200


def test_an_expired_url_writes_nothing(s3_env) -> None:
    """Upload URLs live URL_TTL_S, less than the claim they were signed under (LEASE_S), so a URL
    cannot land bytes after its claim ran out: that holds because S3 refuses an expired URL.
    Shown with a URL of the same kind, signed by the server's presigner for one second."""
    from registry.storage import open_store
    from registry.storage.s3_presign import Presigner

    store = open_store(s3_env)
    data = b"late bytes"
    signed = Presigner(store, ttl_s=1).put_url(  # type: ignore[arg-type]
        "ckpt/team-a/r/step-17/late", len(data), hashlib.sha256(data).hexdigest()
    )
    time.sleep(2.5)
    r = httpx.put(signed.url, content=data, headers=signed.headers, timeout=60)
    assert r.status_code == 403, r.text
    assert "expired" in r.text.lower(), r.text
    assert store.head("ckpt/team-a/r/step-17/late") is None


def test_a_used_url_cannot_overwrite(reg_on_s3, ckpts) -> None:
    src = ckpts.ws2.step_dir(2)
    doc = _begin(reg_on_s3, "alice", src, 14).json()
    for item in doc["urls"]:
        assert _upload(item, (src / item["path"]).read_bytes()).status_code == 200
    r = _finish(reg_on_s3, doc, "complete")
    assert r.status_code == 200, r.text
    item = doc["urls"][0]
    size = (src / item["path"]).stat().st_size
    assert _upload(item, os.urandom(size)).status_code == 412  # If-None-Match: *
    key = f"reg/ckpt/team-a/r/step-14/{item['path']}"
    body = reg_on_s3.s3.get_object(Bucket=reg_on_s3.bucket, Key=key)["Body"].read()
    assert body == (src / item["path"]).read_bytes()


def test_a_killed_client_frees_the_step(reg_on_s3, ckpts, cli) -> None:
    """A client that begins and vanishes (no abort) holds the step until its lease runs out;
    GC later sweeps what it uploaded. Here: the same pusher's next push is told who holds it."""
    src = ckpts.ws2.step_dir(2)
    doc = _begin(reg_on_s3, "alice", src, 15).json()
    _upload(doc["urls"][0], (src / doc["urls"][0]["path"]).read_bytes())
    res = _push(cli, reg_on_s3, src, 15)
    assert res.returncode != 0 and "is being pushed by alice" in res.stderr
    _finish(reg_on_s3, doc, "abort")
    # Abandoned, but its URLs live on: nobody else takes the step over before they are dead
    # (they could write into that attempt's keys); alice, whose URLs they are, at once.
    assert _begin(reg_on_s3, "admin", src, 15).status_code == 409
    res = _push(cli, reg_on_s3, src, 15)
    assert res.returncode == 0, res.stderr


def test_a_forced_layout_travels_in_the_upload_plan(reg_on_s3, layouts, cli) -> None:
    res = _push(cli, reg_on_s3, layouts["lightning"].step_dir(2), 5, "--layout", "torchtitan")
    assert res.returncode == 0, res.stderr
    shown = cli("show", "team-a/r@step5", "--json", env=_as(reg_on_s3, "alice"))
    out = json.loads(shown.stdout)
    # forced: Lightning's state_dict keys are taken for model keys at the top level, and the
    # sidecar counts for nothing
    assert out["layout"] == "torchtitan" and out["suggestions"] == ["--layout lightning"]
    assert "meta.pt" not in json.dumps(out["resume_state"])


def test_several_dcp_roots_push_through_presigned_urls(reg_on_s3, cli, tmp_path) -> None:
    """accelerate's layout (DCP roots one level down and its sidecars) uploads straight to S3:
    the server reads each root's .metadata and the sidecars from what S3 holds."""
    from tests.formats.test_dcp_roots import accelerate_like

    src = accelerate_like(tmp_path / "src")
    res = _push(cli, reg_on_s3, src, 6, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["layout"] == "accelerate" and out["resumable"] is True, out
    assert out["resume_state"]["train_state"] == ["custom_checkpoint_0.pkl"]
    (src / "optimizer_0" / ".metadata").unlink()
    refused = _push(cli, reg_on_s3, src, 7)
    assert refused.returncode == 2 and "optimizer_0/ holds DCP shards" in refused.stderr
