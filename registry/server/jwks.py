"""The keys of an OIDC provider (a JWKS), as `reg server` reads them: a file, reread when it
changes (mtime, size or inode), or an http(s) URL, fetched with a timeout and a size cap and
cached.

An unknown `kid` refetches a URL's JWKS at most once per REFRESH_FLOOR_S, so a flood of made-up
kids costs the provider one request a minute per server process; the cache is also renewed
after MAX_AGE_S so that a key the provider withdrew stops working, and a failed renewal keeps
the cached keys (an outage of the provider does not log everyone out). Only the public members
of RSA, EC and OKP keys are kept: an `oct` key (a shared secret) never becomes a verification key.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from registry.text import redact_url

log = logging.getLogger("reg.server.oidc")

# Members of a JWK that hold private or symmetric key material: never used to build a key.
_PRIVATE = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})
MAX_JWKS_BYTES = 256 << 10
FETCH_TIMEOUT_S = 5.0
REFRESH_FLOOR_S = 60.0  # an unknown kid refetches a URL's JWKS at most this often
RETRY_EMPTY_S = 5.0  # with no keys at all (the provider was down), retry this often
MAX_AGE_S = 600.0  # a URL's keys are renewed after this, so withdrawn keys stop working


class JwksUnavailable(Exception):
    """The JWKS cannot be read or is not a JWKS (the message names the source, never a secret)."""


@dataclass
class KeySet:
    """The usable public keys of one JWKS document, as read at `read_at` (monotonic)."""

    keys: tuple[dict[str, Any], ...]
    read_at: float
    _built: dict[tuple[int, str], Any] = field(default_factory=dict, repr=False)

    def matching(self, kid: str | None) -> list[tuple[int, dict[str, Any]]]:
        """The keys a JWT with header `kid` may be signed by: those with that kid; with no
        kid, the only key of a single-key JWKS."""
        if kid is None:
            return [(0, self.keys[0])] if len(self.keys) == 1 else []
        return [(i, k) for i, k in enumerate(self.keys) if k.get("kid") == kid]

    def built(self, index: int, alg: str) -> Any:
        """The PyJWK of key `index` bound to `alg` (built once per key set)."""
        from jwt import PyJWK

        cached = self._built.get((index, alg))
        if cached is None:
            cached = self._built[(index, alg)] = PyJWK(self.keys[index], algorithm=alg)
        return cached


def parse_jwks(data: bytes, source: str, read_at: float) -> KeySet:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise JwksUnavailable(f"{source} is not JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise JwksUnavailable(f"{source} is not a JWKS (a JSON object with a keys list)")
    keys = []
    for k in doc["keys"]:
        if not isinstance(k, dict) or k.get("kty") not in ("RSA", "EC", "OKP"):
            continue  # an `oct` key is a shared secret: no place in a public key set
        if k.get("use", "sig") != "sig" or not isinstance(k.get("kid", ""), str):
            continue
        keys.append({m: v for m, v in k.items() if m not in _PRIVATE})
    if not keys:
        raise JwksUnavailable(f"{source} holds no public signing key (RSA, EC or OKP)")
    return KeySet(tuple(keys), read_at)


class JwksSource(Protocol):
    def keys(self) -> KeySet:
        """The keys to check a JWT against now (JwksUnavailable when there are none)."""
        ...

    def refreshed(self) -> KeySet | None:
        """Newer keys for a kid `keys()` lacks, or None when none may be fetched now."""
        ...


class FileJwks:
    """A JWKS file, reread when it changes; a bad rewrite keeps the last good keys."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._keys: KeySet | None = None
        self._lock = threading.Lock()

    def keys(self) -> KeySet:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if self._keys is not None:
                return self._keys
            raise JwksUnavailable(f"JWKS file {self.path}: {exc.strerror}") from None
        seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        if seen != self._seen:
            with self._lock:
                if seen != self._seen:
                    self._reread(seen)
        if self._keys is None:
            raise JwksUnavailable(f"JWKS file {self.path} holds no usable key")
        return self._keys

    def _reread(self, seen: tuple[int, int, int]) -> None:
        self._seen = seen  # a bad file is not reread until it changes again
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_JWKS_BYTES + 1)
            if len(data) > MAX_JWKS_BYTES:
                raise JwksUnavailable(f"JWKS file {self.path} is over {MAX_JWKS_BYTES} bytes")
            self._keys = parse_jwks(data, f"JWKS file {self.path}", time.monotonic())
        except (OSError, JwksUnavailable) as exc:
            if self._keys is None:
                raise JwksUnavailable(str(exc)) from None
            log.warning("keeping the previous JWKS: %s", exc)

    def refreshed(self) -> KeySet | None:
        return None  # keys() already saw any change


def fetch_url(url: str, *, timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """The body of `url`: 200 only, no redirects, at most MAX_JWKS_BYTES, within `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    shown = redact_url(url)
    try:
        with (
            httpx.Client(timeout=timeout_s, follow_redirects=False) as client,
            client.stream("GET", url, headers={"accept": "application/json"}) as response,
        ):
            if response.status_code != 200:
                raise JwksUnavailable(f"JWKS {shown} answered HTTP {response.status_code}")
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_JWKS_BYTES:
                    raise JwksUnavailable(f"JWKS {shown} is over {MAX_JWKS_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise JwksUnavailable(f"JWKS {shown} took over {timeout_s:.0f}s")
            return bytes(data)
    except httpx.HTTPError as exc:
        raise JwksUnavailable(f"cannot fetch JWKS {shown} ({type(exc).__name__})") from None


class UrlJwks:
    """A provider's JWKS over HTTP(S): cached, renewed after MAX_AGE_S, refetched for an
    unknown kid at most once per REFRESH_FLOOR_S. One fetch at a time; requests whose kid is
    known never wait for it."""

    def __init__(
        self,
        url: str,
        *,
        fetch: Callable[[str], bytes] = fetch_url,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self._fetch = fetch
        self._clock = clock
        self._keys: KeySet | None = None
        self._last_attempt = -math.inf
        self._last_error = ""
        self._lock = threading.Lock()
        self.fetches = 0  # attempts, for tests and the log

    def keys(self) -> KeySet:
        current = self._keys
        if current is None:
            with self._lock:
                if self._keys is None:
                    if self._clock() - self._last_attempt < RETRY_EMPTY_S and self._last_error:
                        raise JwksUnavailable(self._last_error)
                    self._attempt()
                if self._keys is None:
                    raise JwksUnavailable(self._last_error)
                return self._keys
        if self._clock() - current.read_at > MAX_AGE_S and self._lock.acquire(blocking=False):
            try:  # renew; on failure keep serving the cached keys and retry after the floor
                if self._clock() - self._last_attempt >= REFRESH_FLOOR_S:
                    self._attempt()
            finally:
                self._lock.release()
        return self._keys or current

    def refreshed(self) -> KeySet | None:
        with self._lock:
            if self._clock() - self._last_attempt < REFRESH_FLOOR_S:
                return None
            return self._keys if self._attempt() else None

    def _attempt(self) -> bool:
        self._last_attempt = self._clock()
        self.fetches += 1
        try:
            data = self._fetch(self.url)
            self._keys = parse_jwks(data, f"JWKS {redact_url(self.url)}", self._clock())
            self._last_error = ""
            return True
        except JwksUnavailable as exc:
            self._last_error = str(exc)
            log.warning("%s", exc)
            return False
