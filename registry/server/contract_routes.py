"""The endpoints derived from the contract: one per `@http` method of
`registry.api.contract.Registry`.

Each reads the token first (an anonymous caller gets nothing read), then the method's
arguments from the query string or a bounded JSON body, checked by their annotations
(`registry.api.wire`), and runs the embedded implementation (`LocalRegistry.serving`) under the
request's Context in a worker thread: access checks and audit happen there, as embedded.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from itertools import groupby
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from registry.api.contract import Registry
from registry.api.local import LocalRegistry
from registry.api.wire import Route, routes
from registry.errors import UsageError
from registry.server.auth import context_for
from registry.server.requests import json_body

router = APIRouter()


def _endpoint(shared: Sequence[Route]) -> Callable[[Request], Awaitable[Any]]:
    """The endpoint of one path, for the one method of it or the few told apart by a fixed
    field (`/pin`: pinned true or false)."""

    async def endpoint(request: Request) -> Any:
        ctx = await run_in_threadpool(context_for, request)
        from_query = shared[0].query
        doc: dict[str, Any] = dict(request.query_params) if from_query else await json_body(request)
        doc |= request.path_params
        route = _pick(shared, doc)
        arguments = route.arguments(doc, from_query=from_query)
        registry = LocalRegistry.serving(request.app.state.reg.settings, ctx)
        method = getattr(registry, route.method)
        return route.answer(await run_in_threadpool(lambda: method(**arguments)))

    return endpoint


def _pick(shared: Sequence[Route], doc: dict[str, Any]) -> Route:
    if len(shared) == 1:
        return shared[0]
    for route in shared:
        if route.matches(doc):
            return route
    told = next(iter(shared[0].fixed))
    fallback = [r for r in shared if r.default]
    if fallback and not any(k in doc for r in shared for k in r.fixed):
        return fallback[0]  # the field left out: the path's default method (`/pin` pins)
    values = " or ".join(_shown(r.fixed.get(told)) for r in shared)
    raise UsageError(f"{told} must be {values}")


def _shown(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _register() -> None:
    def key(route: Route) -> tuple[str, str]:
        return route.path, route.verb

    for (path, verb), group in groupby(sorted(routes(Registry), key=key), key=key):
        shared = list(group)
        router.add_api_route(
            path,
            _endpoint(shared),
            methods=[verb],
            name=" / ".join(r.method for r in shared),
            # Answers go through pydantic as the hand-written routes' do (an infinite float
            # of the policy is null, not an error).
            response_model=Any,
        )


_register()
