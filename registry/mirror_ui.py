"""`reg ui`: the MLflow server over the mirror's tracking store.

- It serves the release bytes (`--serve-artifacts` from the store's `mlflow-artifacts/`,
  `registry.mirror_artifacts`), so `mlflow.artifacts.download_artifacts("models:/NAME@prod")`
  returns the weights, on a local or an S3 store, with the server's credentials, never the
  client's.
- On a registry with grants it runs MLflow's auth app: default permission none, people log in
  with their reg principal and a reg token (`registry.mirror_login`), and see what reg's grants
  let them read (`registry.mirror_access`). A registry without grants (one person, embedded) has
  no one to tell apart: the UI runs without a login, on 127.0.0.1 unless told otherwise.
- SIGTERM (systemd, docker, Kubernetes) and Ctrl-C stop the server's whole process group: MLflow
  leaves uvicorn and huey workers behind when only its own pid is killed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import UsageError

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.config import Settings
    from registry.storage.base import BaseStore


@dataclass(frozen=True)
class UiPlan:
    command: list[str]
    environment: dict[str, str]
    auth: bool
    artifacts: str | None
    url: str


def plan_ui(
    settings: Settings,
    catalog: Catalog,
    store: BaseStore,
    *,
    host: str,
    port: int,
    auth: bool | None,
    has_grants: bool,
) -> UiPlan:
    """The MLflow server command and environment; `auth` None: on when the policy has grants."""
    from registry.mirror_artifacts import destination

    use_auth = has_grants if auth is None else auth
    if use_auth and not settings.audit_key_path.exists():
        raise UsageError(
            "the MLflow login takes reg tokens, and this registry has none (no audit key)",
            "run `reg server init` first, or `reg ui --no-auth` on 127.0.0.1",
        )
    if not use_auth and has_grants and host not in ("127.0.0.1", "localhost", "::1"):
        raise UsageError(
            f"--no-auth on {host} would show every project to anyone who reaches it",
            "keep the login (the default), or bind to 127.0.0.1",
        )
    # The tracking URI may hold a password: it goes to the server by environment, never argv
    # (which every user of the machine can read in /proc).
    env = dict(os.environ, MLFLOW_BACKEND_STORE_URI=settings.mlflow_tracking_uri)
    command = [sys.executable, "-m", "mlflow", "server"]
    artifacts = destination(store)
    if artifacts is not None:
        command += ["--serve-artifacts", "--artifacts-destination", artifacts]
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if artifacts.startswith("s3://") and endpoint:
            env["MLFLOW_S3_ENDPOINT_URL"] = endpoint
    else:
        command += ["--default-artifact-root", (settings.home / "mlflow-artifacts").as_uri()]
    if use_auth:
        from registry.mirror_access import sync_access

        env.update(_auth_environment(settings))
        command += ["--app-name", "basic-auth"]
        sync_access(settings, catalog)  # the auth store exists, in step, before the first login
    command += ["--host", host, "--port", str(port), "--workers", "1"]
    return UiPlan(command, env, use_auth, artifacts, f"http://{host}:{port}")


def _auth_environment(settings: Settings) -> dict[str, str]:
    """The auth app's config (written 0600 under REG_HOME) and the Flask session secret."""
    from registry.mirror_access import ADMIN_USER, auth_db_uri

    home = settings.home
    home.mkdir(parents=True, exist_ok=True)
    config = home / "mlflow-auth.ini"
    secret = _secret(home / "mlflow-flask-secret")
    text = (
        "[mlflow]\n"
        "default_permission = NO_PERMISSIONS\n"
        f"database_uri = {auth_db_uri(settings)}\n"
        f"admin_username = {ADMIN_USER}\n"
        # The bootstrap admin's password: never given out, and refused by the login anyway.
        f"admin_password = {_secret(home / 'mlflow-admin-password')}\n"
        "authorization_function = registry.mirror_login:authenticate\n"
    )
    _write_private(config, text)
    return {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_FLASK_SERVER_SECRET_KEY": secret}


def _secret(path: Path) -> str:
    if path.exists():
        return path.read_text().strip()
    value = secrets.token_urlsafe(32)
    _write_private(path, value + "\n")
    return value


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)


def run_ui(plan: UiPlan, cwd: Path) -> int:
    """Run the server until it exits, Ctrl-C or SIGTERM; then stop its whole process group."""
    server = subprocess.Popen(plan.command, cwd=cwd, env=plan.environment, start_new_session=True)

    def stop(signum: int, _: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop_group(server)


def _stop_group(server: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    with contextlib.suppress(ProcessLookupError):  # workers that outlived their parent
        os.killpg(server.pid, signal.SIGKILL)
