"""Tokens behind `reg server` are the server's alone: a token row written into
the catalog around the server (the runtime role's credentials, or the owner's) opens nothing,
a token's record never changes, and a revoked token stays revoked."""

from __future__ import annotations

import hashlib

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from registry.catalog.engine import Catalog


def _status(server, token: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.get(
        server.url + "/v1/whoami", headers={"authorization": f"Bearer {token}"}, timeout=30
    )


def test_a_token_row_written_around_the_server_opens_nothing(reg_server) -> None:
    catalog = Catalog(reg_server.env["REG_CATALOG_URL"])
    secret = "s" * 43
    digest = hashlib.sha256(secret.encode()).hexdigest()
    with catalog.engine.begin() as conn:
        for token_id, mac in (("forged1", None), ("forged2", "0" * 64)):
            conn.execute(
                text(
                    "INSERT INTO api_token (id, principal, secret_sha256, created_at, created_by,"
                    " mac) VALUES (:id, 'admin', :digest, 1.0, 'mallory', :mac)"
                ),
                {"id": token_id, "digest": digest, "mac": mac},
            )
    for token_id in ("forged1", "forged2"):
        r = _status(reg_server, f"reg_{token_id}_{secret}")
        assert r.status_code == 401 and "not minted by this server" in r.json()["message"]
    # A real token still works, and its record cannot be bent to another principal.
    alice = reg_server.token("alice")
    assert _status(reg_server, alice).json()["principal"] == "alice"
    alice_id = alice.split("_")[1]
    for statement in (
        "UPDATE api_token SET principal = 'admin' WHERE id = :id",
        "UPDATE api_token SET expires_at = NULL, mac = NULL WHERE id = :id",
    ):
        with pytest.raises(DBAPIError, match="never changes"), catalog.engine.begin() as conn:
            conn.execute(text(statement), {"id": alice_id})
    # Revocation is one-way with the triggers in place: not undone by an update, nor by deleting
    # the row to insert it again unrevoked (with its valid MAC).
    reg_server.call("admin", "DELETE", f"/v1/tokens/{alice_id}")
    assert _status(reg_server, alice).status_code == 401
    for statement, said in (
        ("UPDATE api_token SET revoked_at = NULL WHERE id = :id", "stays revoked"),
        ("DELETE FROM api_token WHERE id = :id", "never deleted"),
    ):
        with pytest.raises(DBAPIError, match=said), catalog.engine.begin() as conn:
            conn.execute(text(statement), {"id": alice_id})
    catalog.dispose()
