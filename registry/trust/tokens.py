"""Bearer tokens of `reg server` (DESIGN §9): minted by an admin, stored only as hashes,
checked in constant time.

A token reads `reg_<id>_<secret>`: the id is public (listings and audit events name it), the
secret is 32 random bytes shown once. The catalog keeps sha256(secret): a stolen catalog
yields no usable token, and a 256-bit secret needs no slow hash.

Each row also carries an HMAC under the server's audit key over everything it says (id,
principal, secret digest, creation, expiry): whoever can write the catalog without the key
(the runtime role's credentials, the owner's) cannot mint a token the server accepts.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlmodel import col, select

from registry.catalog.models import ApiToken
from registry.core.timeutil import iso, now
from registry.errors import NotFound, Unauthenticated, UsageError

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog

PREFIX = "reg_"
TOUCH_EVERY_S = 60.0  # last_used_at is written at most this often per token
MAX_TOKEN = 128


@dataclass(frozen=True, slots=True)
class Verified:
    token_id: str
    principal: str


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def token_mac(key: bytes, row: ApiToken) -> str:
    fields = [row.id, row.principal, row.secret_sha256, repr(row.created_at), row.created_by]
    fields.append("" if row.expires_at is None else repr(row.expires_at))
    message = "reg.token/1\n" + "\n".join(fields)
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def mint(
    catalog: Catalog,
    principal: str,
    *,
    created_by: str,
    expires_s: float | None,
    key: bytes | None,
) -> str:
    """A new token for `principal`, signed with `key` (the server's audit key); returns it in
    full (the only time it exists in clear)."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    # Whole seconds (expiry rounded up): the MAC covers the times as text, and a whole number of
    # seconds reads back the same from any database (PostgreSQL with extra_float_digits = 0
    # rounds fractions).
    at = now()
    row = ApiToken(
        id=token_id,
        principal=principal,
        secret_sha256=_digest(secret),
        created_at=float(math.floor(at)),
        created_by=created_by,
        expires_at=None if expires_s is None else float(math.ceil(at + expires_s)),
    )
    if key is not None:
        row.mac = token_mac(key, row)
    with catalog.session(write=True) as s:
        s.add(row)
    return f"{PREFIX}{token_id}_{secret}"


def split(token: str) -> tuple[str, str]:
    """(id, secret) of a well-formed token; Unauthenticated otherwise (never echoing it)."""
    if len(token) > MAX_TOKEN or not token.startswith(PREFIX):
        raise _refused("the token is malformed")
    token_id, sep, secret = token[len(PREFIX) :].partition("_")
    if not sep or not token_id or not secret:
        raise _refused("the token is malformed")
    return token_id, secret


def verify(catalog: Catalog, token: str, key: bytes) -> Verified:
    """The principal a presented token stands for, or Unauthenticated. An unknown id and a
    wrong secret read the same; only the holder of the right secret learns that it was
    revoked or has expired, or that its row was not signed with `key` (minted around the
    server, or before tokens were signed)."""
    token_id, secret = split(token)
    with catalog.session() as s:
        row = s.get(ApiToken, token_id)
    # Compare even when the id is unknown, so timing does not tell ids apart.
    expected = row.secret_sha256 if row is not None else _digest("")
    if not hmac.compare_digest(_digest(secret), expected) or row is None:
        raise _refused("the token is not valid")
    at = now()
    if row.revoked_at is not None:
        raise _refused("the token was revoked")
    if row.expires_at is not None and row.expires_at <= at:
        raise _refused("the token has expired")
    if row.mac is None or not hmac.compare_digest(row.mac, token_mac(key, row)):
        raise Unauthenticated(
            "the token was not minted by this server (its record is unsigned or altered)",
            "an admin mints a new one (reg token create; on the server host: "
            "reg server init --admin NAME)",
        )
    if row.last_used_at is None or at - row.last_used_at > TOUCH_EVERY_S:
        with catalog.session(write=True) as s:
            s.exec(update(ApiToken).where(col(ApiToken.id) == token_id).values(last_used_at=at))
    return Verified(row.id, row.principal)


def _refused(why: str) -> Unauthenticated:
    return Unauthenticated(why, "log in again with a valid token (reg login, or REG_TOKEN)")


def listing(catalog: Catalog) -> list[dict[str, Any]]:
    with catalog.session() as s:
        rows = s.exec(select(ApiToken).order_by(col(ApiToken.created_at))).all()
    at = now()
    return [
        {
            "id": r.id,
            "principal": r.principal,
            "created_at": iso(r.created_at),
            "created_by": r.created_by,
            "expires_at": iso(r.expires_at),
            "last_used_at": iso(r.last_used_at),
            "revoked_at": iso(r.revoked_at),
            "revoked_by": r.revoked_by,
            "state": "revoked"
            if r.revoked_at is not None
            else "expired"
            if r.expires_at is not None and r.expires_at <= at
            else "active",
        }
        for r in rows
    ]


def revoke(catalog: Catalog, token_id: str, *, revoked_by: str) -> dict[str, Any]:
    if len(token_id) > 32 or not token_id.isalnum():
        raise UsageError(f"{token_id[:40]!r} is not a token id", "reg token ls shows the ids")
    with catalog.session(write=True) as s:
        row = s.get(ApiToken, token_id)
        if row is None:
            raise NotFound(f"no token {token_id}", "reg token ls shows the ids")
        if row.revoked_at is None:
            row.revoked_at, row.revoked_by = now(), revoked_by
            s.add(row)
        return {"id": row.id, "principal": row.principal, "revoked_at": iso(row.revoked_at)}
