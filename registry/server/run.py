"""Run `reg server` under uvicorn: logging as JSON lines, SIGTERM lets in-flight requests end
(`--graceful-timeout`), the background work (MLflow drain, GC schedule) starts with the app."""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from registry.core.config import Settings
from registry.core.timeutil import positive_duration
from registry.errors import UsageError
from registry.server.background import Background
from registry.server.oidc_config import config_from
from registry.trust.audit_chain import keys
from registry.trust.audit_chain.schedule import intervals

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI

    from registry.core.config import Settings


class JsonLines(logging.Formatter):
    """Every log line one JSON object: the request lines already are; uvicorn's and others'
    messages are wrapped with their time, level and logger."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if message.startswith("{"):
            return message
        out = {"ts": record.created, "level": record.levelname, "logger": record.name}
        out["message"] = message
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out)


def build_app() -> FastAPI:
    """The app for this host's settings, with its background work tied to its lifespan."""
    from registry.server.app import create_app

    settings = Settings.from_env()
    audit_ready(settings)
    app = create_app(settings)

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        app.state.reg.catalog.current_revision()  # migrate (or fail) before the first request
        background = Background(app.state.reg, settings.server.gc_every_s)
        background.start()
        try:
            yield
        finally:
            background.close()
            app.state.reg.catalog.dispose()

    app.router.lifespan_context = lifespan
    return app


def audit_ready(settings: Settings) -> None:
    """No audit key (or a bad sealing interval): no server. Every replica signs with the one
    key file (`reg server init` creates it)."""
    keys.for_server(settings.audit_key_path)
    intervals()


def factory() -> FastAPI:
    """For `uvicorn --factory registry.server.run:factory` and `--workers N`."""

    return build_app()


def serve(
    *,
    host: str,
    port: int,
    gc_every: str | None,
    workers: int,
    ssl_certfile: str | None,
    ssl_keyfile: str | None,
    graceful_s: int,
) -> None:
    import uvicorn

    settings = Settings.from_env()
    if settings.remote:
        raise UsageError("reg server serves this host's catalog: unset REG_URL")
    config_from(settings)  # a partial or unsafe OIDC setting stops the start here, in one line
    audit_ready(settings)
    if gc_every is not None:
        # The setting the flag stands for, in the environment every worker reads its settings
        # from (uvicorn starts them from an import string: no arguments reach them).
        positive_duration(gc_every, "--gc-every")  # a bad one stops the start, naming the flag
        os.environ["REG_SERVER_GC_EVERY"] = gc_every
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("alembic").setLevel(logging.WARNING)  # migrations say what they did
    uvicorn.run(
        "registry.server.run:factory",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        timeout_graceful_shutdown=graceful_s,
        log_config=None,
        access_log=False,
        server_header=False,
        # A header deadline and a connection cap below the descriptor limit (slowloris).
        http="registry.server.guard:GuardedProtocol",
    )
