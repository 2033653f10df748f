"""Fixtures of the server's tests alone (the shared ones are in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def moto_server():  # type: ignore[no-untyped-def]
    """One S3-compatible server (moto) for the session, on a free port on 127.0.0.1."""
    from tests.s3server import MotoServer
    from tests.sharing import timed

    with timed("moto S3 server (per worker)"):
        server = MotoServer().start()
    yield server
    server.stop()
