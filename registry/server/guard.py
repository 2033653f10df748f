"""Connections that hold the server without asking anything (slowloris) are cut off.

uvicorn reads a request's headers with no deadline and accepts connections until the process
runs out of descriptors: a few hundred clients sending one header line every ten seconds kept
every slot, legitimate requests were reset and the audit sealer failed with "Too many open
files". This protocol (uvicorn's httptools one, `http=` in registry.server.run) adds:

- **a header deadline**: a connection must finish a request's headers within
  REG_SERVER_HEADER_TIMEOUT (default 15 s) of opening, or of the first byte of its next
  request; then it is closed. Idle keep-alive connections already close after uvicorn's 5 s,
  and a request body that stops arriving is abandoned by the app (REG_SERVER_IDLE_TIMEOUT).
- **a connection cap** below the descriptor limit: REG_SERVER_MAX_CONNECTIONS, default
  min(1000, RLIMIT_NOFILE - 128), so requests, the catalog's pool, the store's files and the
  sealer always have descriptors left. At the cap a new connection takes the place of the one
  that has waited longest for its headers (an attacker's slot, never a request being served);
  when every slot is serving a request it is answered 503 and closed.
"""

from __future__ import annotations

import json
import logging
import resource
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from registry.core.config import Settings

if TYPE_CHECKING:
    import asyncio

    from registry.core.config import ServerSettings

log = logging.getLogger("reg.server")
RESERVED_FDS = 128  # beside the connections: pool, store files, logs, the sealer, the drain
_BODY = json.dumps(
    {
        "exit_code": 1,
        "message": "the server is at its connection limit",
        "hint": "retry shortly",
        "type": "Busy",
    }
).encode()
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)
LOG_EVERY_S = 10.0  # closed connections are logged as a count, at most this often


def limits(server: ServerSettings) -> tuple[float, int]:
    """(header deadline, connection cap): the settings', the cap by default from the descriptor
    limit (checked when the settings are read: a bad value stops the start in one line)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fit = 1000 if soft == resource.RLIM_INFINITY else max(8, min(1000, soft - RESERVED_FDS))
    return server.header_timeout_s, server.max_connections or fit


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and a connection cap."""

    # Connections waiting for a request's headers, the longest waiting first (per process:
    # one event loop per uvicorn worker).
    _waiting: OrderedDict[GuardedProtocol, None] = OrderedDict()
    _limits: tuple[float, int] | None = None
    _cut_since: dict[str, int] = {}  # why -> connections closed since the last log line
    _logged_at = float("-inf")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if GuardedProtocol._limits is None:  # once per worker process, from its settings
            GuardedProtocol._limits = limits(Settings.from_env().server)
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False

    # -- the cap ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        assert GuardedProtocol._limits is not None
        if len(self.connections) >= GuardedProtocol._limits[1] and not self._evict_one():
            self._refused = True
            transport.write(_BUSY)
            transport.close()
            return
        super().connection_made(transport)
        self._wait_for_headers()

    @staticmethod
    def _evict_one() -> bool:
        """Close the connection that has waited longest for its headers: True if there was
        one (its slot is free now)."""
        if not GuardedProtocol._waiting:
            return False
        oldest, _ = GuardedProtocol._waiting.popitem(last=False)
        oldest._cut("evicted at the connection limit while it had sent no complete request")
        return True

    # -- the deadline -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # the first byte of a request: its headers are due
            self._wait_for_headers()

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Waiting for nothing until the next request's first byte (keep-alive times out
        # between requests), but the slot may be taken back at the cap.
        if not self.transport.is_closing():
            self._stop_waiting()
            GuardedProtocol._waiting[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._stop_waiting()
        super().connection_lost(exc)

    def _wait_for_headers(self) -> None:
        assert GuardedProtocol._limits is not None
        self._stop_waiting()
        GuardedProtocol._waiting[self] = None
        self._deadline = self.loop.call_later(
            GuardedProtocol._limits[0], self._cut, "sent no complete request headers in time"
        )

    def _stop_waiting(self) -> None:
        GuardedProtocol._waiting.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _cut(self, why: str) -> None:
        self._stop_waiting()
        if self.transport.is_closing():
            return
        self.transport.close()
        cut = GuardedProtocol._cut_since
        cut[why] = cut.get(why, 0) + 1
        now = self.loop.time()
        if now - GuardedProtocol._logged_at >= LOG_EVERY_S:  # an attack is a count, not a flood
            GuardedProtocol._logged_at = now
            last = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
            log.warning(json.dumps({"connections": "closed", **cut, "last": last}))
            cut.clear()
