"""MLflow's auth app logs people in with their reg identity: HTTP basic auth, user = principal,
password = a reg token of that principal (`reg token create`). Configured as the app's
`authorization_function` by `reg ui`; runs inside the MLflow server, on the registry's host,
with the registry's settings (its catalog and audit key verify the token, as `reg server` does).
OIDC JWTs are not accepted here (a browser's basic-auth prompt cannot carry one): such
principals get a reg token for the UI.

A verified token is remembered for LOGIN_CACHE_S (the MLflow UI sends it with every request):
a revoked token stops working within that time. Each verification also brings the principal's
MLflow permissions in step with reg's grants (`registry.integrations.mirror.access`).

The mirror is read-only for everyone: every write through MLflow (tags, deletes, new
experiments, models or versions, artifact uploads) is refused here, before MLflow sees it.
reg trusts what the mirror wrote (which experiment serves a model's bytes, which number is which
version): letting anyone else write there, admins included, would let them change what a stock
client downloads. Changes are made with reg.

`REG_UI_OPEN=1` (set by `reg ui` on a registry without grants, for its MLflow server only):
no login; everyone is the one local user, who has READ on everything (not an MLflow admin, so
MLflow's own checks stand behind this one), still read-only.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from typing import Any

from registry.catalog.engine import Catalog
from registry.core.config import Settings
from registry.integrations.mirror.access import ADMIN_USER, LOCAL_USER, sync_access
from registry.trust.audit_chain import keys

LOGIN_CACHE_S = 30.0

_lock = threading.Lock()
_sync_lock = threading.Lock()  # one permission sync at a time (parallel first requests)
_verified: dict[str, float] = {}  # sha256(user, token) -> valid until (monotonic)
_state: dict[str, Any] = {}

# POST requests that only read (MLflow searches by POST), matched on the whole path: a route
# whose last segment is a parameter (an artifact path: `.../mpu/create/<path>`) never passes for
# a search by ending in one. Any other POST, PUT, PATCH or DELETE changes something.
_READ_POSTS = re.compile(
    r"/(?:ajax-)?api/[23]\.0/mlflow/(?:[a-z-]+/)?(?:search|search-datasets|get-latest-versions)"
    r"|/(?:ajax-)?api/2\.0/mlflow/artifacts/presigned-download-url"
    r"|/graphql"
)


def authenticate() -> Any:
    """The app's authorization function: a werkzeug Authorization, or a 401/403 response."""
    from flask import Response, request
    from werkzeug.datastructures import Authorization

    if writes(request.method, request.path):
        return Response("Read-only: reg is the source of truth; change it with reg.\n", 403)
    if os.environ.get("REG_UI_OPEN") == "1":
        return Authorization("basic", {"username": LOCAL_USER, "password": ""})
    auth = request.authorization
    if auth is None or auth.type != "basic" or not auth.username or not auth.password:
        return _challenge(Response)
    if auth.username in (ADMIN_USER, LOCAL_USER) or not verified(auth.username, auth.password):
        return _challenge(Response)
    return auth


def writes(method: str, path: str) -> bool:
    if method in ("GET", "HEAD", "OPTIONS"):
        return False
    return not (method == "POST" and _READ_POSTS.fullmatch(path))


def verified(user: str, token: str) -> bool:
    """Whether `token` is a live reg token of principal `user`."""
    key = hashlib.sha256(f"{user}\0{token}".encode()).hexdigest()
    with _lock:
        until = _verified.get(key)
        if until is not None and until > time.monotonic():
            return True
    try:
        settings, catalog, audit_key = _registry()
        from registry.trust.tokens import verify

        if verify(catalog, token, audit_key).principal != user:
            return False

        with _sync_lock:
            sync_access(settings, catalog, only=user)
    except Exception:  # a bad token (RegistryError), or the catalog unreachable: no login
        return False
    with _lock:
        _verified[key] = time.monotonic() + LOGIN_CACHE_S
    return True


def _registry() -> tuple[Any, Any, bytes]:
    """The registry's settings, catalog and audit key, made once (all or nothing: a catalog
    that is down now is tried again on the next login)."""
    with _lock:
        if not _state:
            settings = Settings.from_env()
            catalog = Catalog.of(settings.catalog)
            key = keys.for_server(settings.audit_key_path)
            _state.update(settings=settings, catalog=catalog, key=key)
        return _state["settings"], _state["catalog"], _state["key"]


def _challenge(response: Any) -> Any:
    return response(
        "Log in with your reg principal and a reg token as the password.\n",
        401,
        {"WWW-Authenticate": 'Basic realm="reg"'},
    )
