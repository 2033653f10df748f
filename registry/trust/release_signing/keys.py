"""Release signing keys: ECDSA P-256, the key type OpenSSF model-signing's key mode
takes. A key's id is model-signing's public-key hint, the sha256 of its PEM public key.

The private half is a file `SIGNING_DIR/<key_id>.pem` (the directory 0700, the file 0600,
unencrypted) of the process that promotes: `reg server` behind a shared registry (it never
leaves that host; `reg keys` is run there by an operator), REG_HOME/signing embedded. The
public half and the key's life (created, retired, revoked) are rows of the append-only
`signing_key_event`; a key's state is its latest event. At most one key is active: it signs
new releases. A retired key signs nothing more and its releases still verify; a revoked key's
signatures are reported as untrusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from policies.access import Action
from registry.catalog.models import FactMac, SigningKeyEvent
from registry.core.timeutil import iso, now
from registry.errors import IntegrityError, NotFound, UsageError
from registry.trust.signed_facts import SIGNING_KEY, sign, signed_ids, signing_key_content

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

CREATED, RETIRED, REVOKED = "created", "retired", "revoked"
ACTIVE = "active"  # a created key not retired or revoked


@dataclass(frozen=True)
class SigningKey:
    key_id: str
    state: str  # active | retired | revoked
    public_pem: str
    created_at: float
    created_by: str
    changed_at: float | None = None
    changed_by: str | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "state": self.state,
            "created_at": iso(self.created_at),
            "created_by": self.created_by,
            "changed_at": iso(self.changed_at),
            "changed_by": self.changed_by,
            "reason": self.reason,
            "public_pem": self.public_pem,
        }


def key_id_of(public_pem: bytes) -> str:
    """model-signing's public-key hint: the sha256 of the PEM (SubjectPublicKeyInfo) bytes."""
    return hashlib.sha256(public_pem).hexdigest()


def all_keys(session: Session, audit_key: bytes | None = None) -> list[SigningKey]:
    """Every key, oldest first, each in the state its latest event gives it. With `audit_key`
    (behind the server) only events the server signed count: a key row written around it is
    no key (and a retirement or revocation written around it changes nothing)."""
    events = list(session.exec(select(SigningKeyEvent).order_by(col(SigningKeyEvent.id))).all())
    if audit_key is not None:
        good = signed_ids(
            session,
            audit_key,
            SIGNING_KEY,
            {e.id: signing_key_content(e) for e in events if e.id is not None},
        )
        events = [e for e in events if e.id in good]
    keys: dict[str, SigningKey] = {}
    for e in events:
        if e.event == CREATED and e.public_pem and e.key_id not in keys:
            if key_id_of(e.public_pem.encode()) != e.key_id:
                continue  # a row whose id is not its key's: never a key
            keys[e.key_id] = SigningKey(e.key_id, ACTIVE, e.public_pem, e.at, e.by)
        elif e.event in (RETIRED, REVOKED) and e.key_id in keys:
            was = keys[e.key_id]
            if was.state == REVOKED:
                continue  # revocation is final
            keys[e.key_id] = SigningKey(
                was.key_id, e.event, was.public_pem, was.created_at, was.created_by,
                e.at, e.by, e.reason,
            )  # fmt: skip
    return list(keys.values())


def find(session: Session, key_id: str, audit_key: bytes | None = None) -> SigningKey | None:
    return next((k for k in all_keys(session, audit_key) if k.key_id == key_id), None)


def active(session: Session, audit_key: bytes | None = None) -> SigningKey | None:
    """The key that signs new releases: the newest one still active."""
    live = [k for k in all_keys(session, audit_key) if k.state == ACTIVE]
    return live[-1] if live else None


def create(ctx: Context, *, retire_active: bool = False) -> SigningKey:
    """A new P-256 key: its private half written 0600 under the signing directory first, then
    its public half recorded. With an active key already: refused unless `retire_active`
    (`reg keys rotate`), which retires it in the same transaction."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ctx.authorize(Action.CATALOG, target="signing keys")
    directory = _directory(ctx)
    with ctx.catalog.session() as s:
        current = active(s, ctx.audit_key)
    if current is not None and not retire_active:
        raise UsageError(
            f"signing key {current.key_id[:16]} is active already",
            "reg keys rotate creates a new one and retires it",
        )
    private = ec.generate_private_key(ec.SECP256R1())
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    key_id = key_id_of(public_pem)
    private_pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path = directory / f"{key_id}.pem"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, private_pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    at = now()
    try:
        with ctx.catalog.session(write=True) as s:
            if retire_active and current is not None:
                _add(ctx, s, _event(ctx, current.key_id, RETIRED, at, reason="rotated"))
            _add(ctx, s, _event(ctx, key_id, CREATED, at, public_pem=public_pem.decode()))
            ctx.audit(s, "keys.create", key_id, retired=current.key_id if current else None)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()  # never recorded: nothing signs with it
        raise
    return SigningKey(key_id, ACTIVE, public_pem.decode(), at, ctx.actor)


def change(ctx: Context, key_id: str, event: str, reason: str | None = None) -> SigningKey:
    """Retire or revoke a key (by its id or a unique prefix of at least 8 characters)."""
    if event not in (RETIRED, REVOKED):
        raise UsageError(f"a signing key is retired or revoked, not {event!r}")
    ctx.authorize(Action.CATALOG, target="signing keys")
    with ctx.catalog.session(write=True) as s:
        key = _resolve(s, key_id, ctx.audit_key)
        if key.state == REVOKED or (key.state == RETIRED and event == RETIRED):
            raise UsageError(f"signing key {key.key_id[:16]} is {key.state} already")
        at = now()
        _add(ctx, s, _event(ctx, key.key_id, event, at, reason=reason))
        ctx.audit(
            s, f"keys.{'retire' if event == RETIRED else 'revoke'}", key.key_id, reason=reason
        )
    return SigningKey(
        key.key_id, event, key.public_pem, key.created_at, key.created_by, at, ctx.actor, reason
    )


def private_key_path(ctx: Context, key_id: str) -> Path:
    """The private key file of `key_id` on this host, checked: a regular file of this user,
    readable by no one else (`check_pair` checks that it holds that key)."""
    directory = _directory(ctx)
    path = directory / f"{key_id}.pem"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise IntegrityError(
            f"the private half of signing key {key_id[:16]} is not in {directory}",
            "promote on the host that holds it (reg server), or reg keys rotate",
        ) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise IntegrityError(
            f"{path} is not a private file of this user (mode {stat.S_IMODE(st.st_mode):o})",
            f"chmod 600 {path}",
        )
    return path


def check_pair(path: Path, key: SigningKey) -> None:
    """The private key file at `path` holds the key the catalog records (not a stray one)."""
    from cryptography.hazmat.primitives import serialization

    try:
        private = serialization.load_pem_private_key(path.read_bytes(), None)
        public = private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    except (OSError, ValueError, TypeError) as exc:
        raise IntegrityError(
            f"the private half of signing key {key.key_id[:16]} is not readable: "
            f"{type(exc).__name__}",
            "reg keys rotate makes a new one",
        ) from None
    if key_id_of(public) != key.key_id:
        raise IntegrityError(
            f"the private key file of signing key {key.key_id[:16]} holds another key",
            "restore that key's file, or reg keys rotate",
        )


def _resolve(session: Session, key_id: str, audit_key: bytes | None) -> SigningKey:
    if len(key_id) < 8:
        raise UsageError(f"key id {key_id!r} is too short", "give at least 8 characters")
    matches = [k for k in all_keys(session, audit_key) if k.key_id.startswith(key_id.lower())]
    if not matches:
        raise NotFound(f"no signing key {key_id}", "reg keys ls lists them")
    if len(matches) > 1:
        raise UsageError(f"key id {key_id} is ambiguous", "give more characters")
    return matches[0]


def _directory(ctx: Context) -> Path:
    if ctx.signing_dir is None:
        raise UsageError("this process keeps no signing keys", "run it where reg server runs")
    directory = ctx.signing_dir
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        raise IntegrityError(
            f"cannot use the signing key directory: {exc.strerror or exc}",
            "run this as the user reg server runs as",
        ) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise IntegrityError(
            f"{directory} is not a private directory of this user", f"chmod 700 {directory}"
        )
    return directory


def _add(ctx: Context, session: Session, event: SigningKeyEvent) -> None:
    """Add `event`, signed by the server's audit key where this process holds it. Where the
    catalog's key events are signed (a registry behind reg server) and this process cannot
    sign, refused: the server would ignore the event (a revocation that revokes nothing)."""
    if (
        ctx.audit_key is None
        and session.exec(select(FactMac.id).where(FactMac.kind == SIGNING_KEY).limit(1)).first()
    ):
        raise UsageError(
            "this registry's signing keys are signed by reg server's audit key, which this "
            "process cannot read: the server would ignore this change",
            "run reg keys as the server's user on its host (REG_AUDIT_KEY_FILE readable)",
        )
    session.add(event)
    if ctx.audit_key is not None:
        session.flush()  # its id, which the signature names
        sign(
            session,
            ctx.audit_key,
            SIGNING_KEY,
            event.id or 0,
            signing_key_content(event),
            signed_by=ctx.actor,
        )


def _event(
    ctx: Context,
    key_id: str,
    event: str,
    at: float,
    *,
    public_pem: str | None = None,
    reason: str | None = None,
) -> SigningKeyEvent:
    return SigningKeyEvent(
        key_id=key_id, event=event, public_pem=public_pem, reason=reason, at=at, by=ctx.actor
    )
