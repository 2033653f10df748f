"""MLflow's auth app logs people in with their reg identity: HTTP basic auth, user = principal,
password = a reg token of that principal (`reg token create`). Configured as the app's
`authorization_function` by `reg ui`; runs inside the MLflow server, on the registry's host,
with the registry's settings (its catalog and audit key verify the token, as `reg server` does).

A verified token is remembered for LOGIN_CACHE_S (the MLflow UI sends it with every request):
a revoked token stops working within that time. Each verification also brings the principal's
MLflow permissions in step with reg's grants (`registry.mirror_access`).

MLflow lets any logged-in user create experiments and registered models (and own them). Here
only reg's admins change anything through MLflow: everyone else's writes are refused before
MLflow sees them, so nobody can, say, create `releases/<model>` before the mirror does and own
the place a future release's bytes are served from.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from typing import Any

LOGIN_CACHE_S = 30.0

_lock = threading.Lock()
_verified: dict[str, tuple[bool, float]] = {}  # sha256(user, token) -> (admin, until)
_state: dict[str, Any] = {}


def authenticate() -> Any:
    """The app's authorization function: a werkzeug Authorization, or a 401 asking for one."""
    from flask import Response, request

    from registry.mirror_access import ADMIN_USER

    auth = request.authorization
    if auth is None or auth.type != "basic" or not auth.username or not auth.password:
        return _challenge(Response)
    admin = None if auth.username == ADMIN_USER else is_admin(auth.username, auth.password)
    if admin is None:
        return _challenge(Response)
    if not admin and writes(request.method, request.path):
        return Response(
            "Read-only: reg is the source of truth; change things with reg itself.\n", 403
        )
    return auth


# POST requests that only read (MLflow searches by POST); any other POST, PUT, PATCH or DELETE
# changes something, which only reg's admins may do through MLflow.
_READ_POSTS = re.compile(r".*/(search|search-datasets|get-latest-versions|presigned-download-url)$")


def writes(method: str, path: str) -> bool:
    if method in ("GET", "HEAD", "OPTIONS"):
        return False
    path = path.rstrip("/")
    return not (method == "POST" and (_READ_POSTS.fullmatch(path) or path.endswith("/graphql")))


def is_admin(user: str, token: str) -> bool | None:
    """None unless `token` is a live reg token of principal `user`; else whether reg makes
    them an admin."""
    key = hashlib.sha256(f"{user}\0{token}".encode()).hexdigest()
    with _lock:
        hit = _verified.get(key)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
    from registry.errors import RegistryError

    try:
        settings, catalog, audit_key = _registry()
        from registry.tokens import verify

        principal = verify(catalog, token, audit_key).principal
    except RegistryError:
        return None
    if principal != user:
        return None
    from registry.mirror_access import is_reg_admin, sync_access

    sync_access(settings, catalog, only=principal)
    admin = is_reg_admin(settings, catalog, principal)
    with _lock:
        _verified[key] = (admin, time.monotonic() + LOGIN_CACHE_S)
    return admin


def _registry() -> tuple[Any, Any, bytes]:
    with _lock:
        if not _state:
            from registry.audit_chain import keys
            from registry.catalog.engine import Catalog
            from registry.config import Settings

            settings = Settings.from_env()
            _state["settings"] = settings
            _state["catalog"] = Catalog(
                settings.catalog_url, busy_timeout_s=settings.busy_timeout_s
            )
            _state["key"] = keys.for_server(settings.audit_key_path)
        return _state["settings"], _state["catalog"], _state["key"]


def _challenge(response: Any) -> Any:
    return response(
        "Log in with your reg principal and a reg token as the password.\n",
        401,
        {"WWW-Authenticate": 'Basic realm="reg"'},
    )
