"""`reg server` under concurrency: a bounded load run (bench/server_load.py at full size), and
two replicas serving one PostgreSQL catalog and one store."""

from __future__ import annotations

import threading

import httpx
import pytest

from bench.server_load import load
from tests.serverproc import RegServer, server_env, team_policy


@pytest.mark.exclusive
def test_bounded_load_run_loses_nothing(reg_server, ckpts):
    """16 clients for a few seconds: no error beyond expected conflicts, no lost update."""
    tokens = [reg_server.token("admin")] * 16
    out = load(reg_server.url, tokens, ckpts.ws2.step_dir(2), seconds=4)
    assert out["errors"] == [], out["errors"][:3]
    assert out["lost_updates"] == []
    assert out["latency_ms"]["push"]["n"] >= 16 and out["ok"] > 50
    shared = reg_server.call(
        "admin", "GET", "/v1/checkpoints", params={"run": "shared", "project": "load"}
    )
    for ckpt in shared:  # the contended steps: each committed once, and whole
        assert reg_server.call("admin", "POST", "/v1/verify", json={"ref": ckpt["ref"]})["ok"]


@pytest.mark.postgres
@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)  # replicas share PostgreSQL
def test_two_replicas_on_one_catalog_hold_the_invariants(catalog_url, tmp_path, ckpts):
    store = (tmp_path / "shared-store").as_uri()
    a = RegServer(server_env(tmp_path / "a", catalog_url, store), tmp_path / "a").init().start()
    b = RegServer(server_env(tmp_path / "b", catalog_url, store), tmp_path / "b")
    b.env["REG_AUDIT_KEY_FILE"] = str(tmp_path / "a" / "audit.key")  # replicas share the key
    b.env["REG_SIGNING_DIR"] = str(tmp_path / "a" / "signing")  # and the signing keys
    b.tokens = a.tokens  # one catalog: a token minted through a works on b
    b.admin_token = a.admin_token
    b.start()
    try:
        a.apply_policy(team_policy())
        out = _both(a, b, ckpts)
        assert out["errors"] == [], out["errors"][:3]
        assert out["lost_updates"] == []
        listed = a.call("admin", "GET", "/v1/checkpoints")
        assert listed == b.call("admin", "GET", "/v1/checkpoints")
        # Concurrent promotions of one checkpoint through both replicas: one release.
        ref = listed[0]["ref"]
        results = _concurrently(
            [lambda s=s: _post(s, "/v1/promote", {"ref": ref, "model": "tiny-x"}) for s in (a, b)]
        )
        assert all(r.status_code in (200, 409) for r in results), [r.text for r in results]
        releases = a.call("admin", "GET", "/v1/releases")
        assert [r["release"] for r in releases] == ["tiny-x:v1"]
        # GC on both at once: one runs, the other is told another GC runs (409) or runs after.
        results = _concurrently([lambda s=s: _post(s, "/v1/gc", {}) for s in (a, b)])
        assert all(r.status_code in (200, 409) for r in results), [r.text for r in results]
        for c in a.call("admin", "GET", "/v1/checkpoints"):
            assert a.call("admin", "POST", "/v1/verify", json={"ref": c["ref"]})["ok"], c["ref"]
        assert a.call("admin", "POST", "/v1/verify", json={"ref": "tiny-x:v1"})["ok"]
    finally:
        a.stop()
        b.stop()


def _both(a: RegServer, b: RegServer, ckpts) -> dict:
    results: list[dict] = []

    def run(server: RegServer, name: str) -> None:
        # Each replica's clients push runs of their own; all of them contend for `shared`.
        results.append(
            load(server.url, [server.admin_token] * 4, ckpts.ws2.step_dir(2), 3, name=name)
        )

    threads = [threading.Thread(target=run, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "errors": [e for r in results for e in r["errors"]],
        "lost_updates": [u for r in results for u in r["lost_updates"]],
    }


def _post(server: RegServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        server.url + path,
        json=body,
        timeout=300,
        headers={"authorization": f"Bearer {server.admin_token}"},
    )


def _concurrently(calls: list) -> list[httpx.Response]:
    out: list = [None] * len(calls)

    def one(i: int) -> None:
        out[i] = calls[i]()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
