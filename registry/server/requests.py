"""Reading a request in `reg server`: the token first, then a bounded JSON body, read with an
idle limit and parsed off the event loop; typed fields out of it."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from registry.errors import RegistryError, UsageError
from registry.server.auth import context_for

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

MAX_JSON_BYTES = 1 << 20  # JSON request bodies; a push streams, a promotion's extras get more
MAX_PROMOTE_BYTES = 64 << 20


def idle_s(request: Request) -> float:
    """How long a request body may stop arriving before it is abandoned (the server's
    settings: REG_SERVER_IDLE_TIMEOUT)."""
    return float(request.app.state.reg.settings.server.idle_timeout_s)


async def authed_body(
    request: Request, limit: int = MAX_JSON_BYTES
) -> tuple[Context, dict[str, Any]]:
    """The request's Context (its token checked first: an anonymous caller gets nothing
    read), then its JSON body."""
    ctx = await run_in_threadpool(context_for, request)
    return ctx, await json_body(request, limit)


async def json_body(request: Request, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The request's JSON object, refused past `limit` bytes before it is all read, or when
    the client stops sending for idle_s(); parsed off the event loop."""
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > limit):
        raise UsageError(f"request body over {limit} bytes", "send less")
    data = bytearray()
    async for chunk in idle_limited(request):
        data += chunk
        if len(data) > limit:
            raise UsageError(f"request body over {limit} bytes", "send less")
    return await run_in_threadpool(_parse_json, bytes(data))


def _parse_json(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise UsageError("request body is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise UsageError(f"request body is not usable JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise UsageError("request body is not a JSON object")
    return doc


async def idle_limited(request: Request) -> AsyncIterator[bytes]:
    """The request's body, cut off (exit 1) when no byte arrives for idle_s(): a client that
    stops sending holds no connection, memory or upload for long."""
    limit = idle_s(request)
    iterator = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(iterator.__anext__(), limit)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RegistryError(
                f"the client sent nothing for {limit:.0f}s; request abandoned", "send again"
            ) from None
        yield chunk


def text(doc: dict[str, Any], key: str, default: str | None = None) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str):
        raise UsageError(f"{key} must be a string")
    return value


def opt_text(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise UsageError(f"{key} must be a string")
    return value


def flag(doc: dict[str, Any], key: str, default: bool = False) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise UsageError(f"{key} must be true or false")
    return value


def number(doc: dict[str, Any], key: str, default: float) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UsageError(f"{key} must be a number")
    return float(value)
