"""The audit key: 32 random bytes that only `reg server` (and an operator on its host) can read.

Whoever holds it can sign audit events and seals; the database owner does not, so rows written
or rewritten by hand fail verification. Replicas share one key file (`REG_AUDIT_KEY_FILE`).
The file holds the raw bytes, or the same as 64 hex digits (a secret manager's text form).
Rotation is not supported: a chain sealed with one key verifies only with it, and the key id
in every seal and anchor turns a wrong key into one clear line instead of "everything forged".
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from registry.errors import UsageError

KEY_BYTES = 32


class AuditKeyMissing(UsageError):
    """Exit 2: this process has no audit key where it needs one (a setup, not a failure)."""


def key_id(key: bytes) -> str:
    """A short public name of the key (an HMAC under it, not a hash of it)."""
    return hmac.new(key, b"reg.audit.key-id/1", hashlib.sha256).hexdigest()[:16]


def create(path: Path) -> bool:
    """Write a new key to `path` (mode 0600, never over an existing file): True if created."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, 0o600)
        data = secrets.token_bytes(KEY_BYTES)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    os.close(fd)
    return True


def read(path: Path) -> bytes:
    """The key in `path`; AuditKeyMissing if there is none, UsageError if it is not a key."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise AuditKeyMissing(
            f"no audit key at {path}",
            "run `reg server init` on the server's host (it creates one), or set "
            "REG_AUDIT_KEY_FILE to the key file the other replicas use",
        ) from None
    except OSError as exc:
        raise AuditKeyMissing(
            f"cannot read the audit key {path}: {exc.strerror}",
            "run as the server's user, or fix the file's permissions",
        ) from None
    _private(path)
    return parse(data, path)


def _private(path: Path) -> None:
    """Refuse a key others may read (as ssh does a private key): whoever reads it can sign
    events and seals, and the chain proves nothing against them."""
    if os.name != "posix":
        return
    mode = path.stat().st_mode  # the target of a link (a mounted secret)
    if mode & 0o077:
        raise UsageError(
            f"the audit key {path} is open to group or others (mode {mode & 0o777:04o})",
            f"chmod 600 {path} (a mounted secret: defaultMode 0400 or 0600)",
        )


def parse(data: bytes, path: Path) -> bytes:
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    if len(text) == 2 * KEY_BYTES:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(text.decode("ascii"))
    raise UsageError(
        f"{path} is not an audit key ({len(data)} bytes)",
        f"it holds {KEY_BYTES} random bytes, or {2 * KEY_BYTES} hex digits",
    )


def optional(path: Path) -> bytes | None:
    """The key where this process may read it (the server's host), else None: an embedded
    client without it records events unsigned, and the sealer will not take them."""
    try:
        return read(path)
    except AuditKeyMissing:
        return None


_SERVER_KEYS: dict[Path, bytes] = {}


def for_server(path: Path) -> bytes:
    """The key `reg server` runs with, read once per process (it refuses to start without)."""
    key = _SERVER_KEYS.get(path)
    if key is None:
        key = _SERVER_KEYS[path] = read(path)
    return key
