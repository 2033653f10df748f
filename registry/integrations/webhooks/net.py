"""One POST to a subscriber, where the server may send it (`policies.workflow`).

The URL is checked, then the host resolved, and every address it resolves to must be allowed
(a name that also resolves to a metadata address is refused whole); the connection goes to a
checked address, never to whatever a second lookup returns (DNS rebinding). TLS verifies the
certificate against the URL's host name. Redirects are never followed (a 3xx is a failure),
proxies from the environment are not used, and the whole exchange has a deadline: a receiver
that drips its reply is cut off. The reply's body is read at most 64 KiB and then dropped:
only its status is kept.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from policies.workflow import address_problem, check_url

CONNECT_S = 3.0
DEADLINE_S = 10.0
_READ_AT_MOST = 64 * 1024


class SendError(Exception):
    """Why a POST failed, in one line (never the reply's body)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message, self.status = message, status


@dataclass(frozen=True)
class Reply:
    status: int
    seconds: float


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    allow_private: bool,
    deadline_s: float = DEADLINE_S,
) -> Reply:
    """POST `body` to `url`; the reply's status if 2xx, else SendError."""
    started = time.monotonic()
    try:
        check_url(url, allow_private=allow_private)
    except ValueError as exc:
        raise SendError(str(exc)) from None
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = _resolve(host, port, allow_private)
    sock = _connect(address, port, host, https=parts.scheme == "https", deadline_s=deadline_s)
    cutoff = threading.Timer(max(0.1, deadline_s - (time.monotonic() - started)), _cut, [sock])
    cutoff.daemon = True
    cutoff.start()
    conn = http.client.HTTPConnection(host, port, timeout=deadline_s)
    conn.sock = sock  # already connected (and wrapped) to the checked address
    try:
        path = parts.path or "/"
        conn.request("POST", path + (f"?{parts.query}" if parts.query else ""), body, headers)
        reply = conn.getresponse()
        reply.read(_READ_AT_MOST)
        status = reply.status
    except (OSError, http.client.HTTPException) as exc:
        late = time.monotonic() - started >= deadline_s
        why = f"no reply within {deadline_s:g} s" if late else _describe(exc)
        raise SendError(why) from None
    finally:
        cutoff.cancel()
        conn.close()
    if 300 <= status < 400:
        raise SendError(f"HTTP {status}: redirects are not followed", status)
    if not 200 <= status < 300:
        raise SendError(f"HTTP {status}", status)
    return Reply(status, time.monotonic() - started)


def _resolve(host: str, port: int, allow_private: bool) -> str:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise SendError(f"cannot resolve {host}: {_describe(exc)}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for text in addresses:
        problem = address_problem(
            ipaddress.ip_address(text.split("%", 1)[0]), allow_private=allow_private
        )
        if problem:
            raise SendError(f"{host} resolves to {problem}")
    if not addresses:
        raise SendError(f"{host} resolves to no address")
    return addresses[0]


def _connect(
    address: str, port: int, host: str, *, https: bool, deadline_s: float
) -> socket.socket:
    started = time.monotonic()
    try:
        sock = socket.create_connection((address, port), timeout=min(CONNECT_S, deadline_s))
    except OSError as exc:
        raise SendError(f"cannot connect to {host}:{port}: {_describe(exc)}") from None
    # connected: what is left of the deadline bounds the handshake and the exchange
    sock.settimeout(max(0.1, deadline_s - (time.monotonic() - started)))
    if not https:
        return sock
    try:
        return ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    except (OSError, ssl.SSLError) as exc:
        sock.close()
        raise SendError(f"TLS with {host} failed: {_describe(exc)}") from None


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed: nothing to cut
        sock.shutdown(socket.SHUT_RDWR)


def _describe(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(text).splitlines()[0][:200]
