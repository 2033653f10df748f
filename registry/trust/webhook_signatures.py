"""A subscriber's secret and the signature every delivery carries.

    X-Reg-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>

as GitHub and Stripe sign theirs: the timestamp is signed with the body, so a receiver rejects
a replay by its age and a repeat by the body's `id`. The secret is a file on the server (the
policy names only its path): a regular file, readable by the server's user alone (no group or
other bits), owned by it, of 16 bytes to 4 KiB; surrounding whitespace is not part of it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

from registry.errors import UsageError

HEADER = "X-Reg-Signature"
MIN_BYTES, MAX_BYTES = 16, 4096


def read_secret(path: str) -> bytes:
    """The secret in `path`, or UsageError saying what is wrong with the file."""
    try:
        # O_NONBLOCK: a FIFO planted there fails the regular-file check, never blocks us
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(
            f"secret file {path}: {exc.strerror}",
            "create it for the server's user alone: umask 077; head -c 32 /dev/urandom | "
            f"base64 > {path}",
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"secret file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise UsageError(
                f"secret file {path} is readable by others (mode {stat.S_IMODE(info.st_mode):o})",
                f"chmod 600 {path}",
            )
        if info.st_uid != os.getuid():
            raise UsageError(
                f"secret file {path} belongs to uid {info.st_uid}, not this server's user",
                "chown it to the user reg runs as",
            )
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    secret = data.strip()
    if len(data) > MAX_BYTES or len(secret) < MIN_BYTES:
        raise UsageError(
            f"secret file {path} holds {len(secret)} bytes; a secret is {MIN_BYTES} to {MAX_BYTES}",
            f"head -c 32 /dev/urandom | base64 > {path}",
        )
    return secret


def signature(secret: bytes, timestamp: int, body: str) -> str:
    """The header's value for `body` sent at `timestamp`."""
    mac = hmac.new(secret, f"{timestamp}.{body}".encode(), hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: bytes, header: str, body: str, *, now: float, tolerance_s: float = 300) -> bool:
    """A receiver's check (and the tests'): the signature matches and is recent."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = signature(secret, timestamp, body).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))
