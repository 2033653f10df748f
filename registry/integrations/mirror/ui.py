"""`reg ui`: the MLflow server over the mirror's tracking store.

- It serves the release bytes (`--serve-artifacts` from the store's `mlflow-artifacts/`,
  `storage.mlflow_artifacts`), so `mlflow.artifacts.download_artifacts("models:/NAME@prod")`
  returns the weights, on a local or an S3 store, with the server's credentials, never the
  client's.
- It always runs MLflow's auth app with reg's login function (`mirror.login`): every
  write through MLflow is refused. On a registry with grants, default permission none, people
  log in with their reg principal and a reg token, and see what reg's grants let them read
  (`mirror.access`). A registry without grants (one person, embedded) has no one to
  tell apart: no login, on 127.0.0.1 only.
- Before the server starts, a drain brings MLflow up to date (events, permissions, what is
  served).
- SIGTERM (systemd, docker, Kubernetes), SIGHUP (a closed terminal) and Ctrl-C stop the
  server's whole process group: MLflow leaves uvicorn and huey workers behind when only its own
  pid is killed. The server is also told to die with `reg ui` (PR_SET_PDEATHSIG), should that
  be killed outright.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import UsageError
from registry.integrations.mirror.access import ADMIN_USER, AccessSync, auth_db_uri
from registry.integrations.mirror.drain import drain
from registry.storage.mlflow_artifacts import destination

if TYPE_CHECKING:
    from collections.abc import Callable

    from registry.catalog.engine import Catalog
    from registry.core.config import Settings
    from registry.storage.base import BaseStore


@dataclass(frozen=True)
class UiPlan:
    command: list[str]
    environment: dict[str, str]
    auth: bool
    artifacts: str | None
    url: str
    drained: dict[str, Any]  # the drain before the start: applied, pending, error


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def plan_ui(
    settings: Settings,
    catalog: Catalog,
    store: BaseStore,
    *,
    host: str,
    port: int,
    auth: bool | None,
    has_grants: bool,
    allowed_hosts: str | None = None,
) -> UiPlan:
    """The MLflow server command and environment; `auth` None: a login when the policy has
    grants."""
    use_auth = has_grants if auth is None else auth
    if use_auth and not settings.audit_key_path.exists():
        raise UsageError(
            "the MLflow login takes reg tokens, and this registry has none (no audit key)",
            "run `reg server init` first, or `reg ui --no-auth` on 127.0.0.1",
        )
    if not use_auth and host not in _LOOPBACK:
        raise UsageError(
            f"without a login, {host} would show every project to anyone who reaches it",
            "keep the UI on 127.0.0.1, or give the registry grants and a login (reg server init)",
        )
    drained = drain(catalog, settings, 60, wait=True, holder="reg ui")  # pending events first
    # The tracking URI may hold a password: it goes to the server by environment, never argv
    # (which every user of the machine can read in /proc).
    env = dict(os.environ, MLFLOW_BACKEND_STORE_URI=settings.mlflow_tracking_uri)
    env.update(_auth_environment(settings))
    env.pop("REG_UI_OPEN", None)
    sync = AccessSync(settings, catalog)
    try:
        if use_auth:
            sync.sync()  # in step before the first login
        else:
            sync.open_user()
            env["REG_UI_OPEN"] = "1"
    finally:
        sync.auth.engine.dispose()
    command = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth"]
    artifacts = destination(store)
    if artifacts is not None:
        command += ["--serve-artifacts", "--artifacts-destination", artifacts]
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if artifacts.startswith("s3://") and endpoint:
            env["MLFLOW_S3_ENDPOINT_URL"] = endpoint
    else:
        command += ["--default-artifact-root", (settings.home / "mlflow-artifacts").as_uri()]
    if allowed_hosts:
        command += ["--allowed-hosts", allowed_hosts]
    command += ["--host", host, "--port", str(port), "--workers", "1"]
    return UiPlan(command, env, use_auth, artifacts, f"http://{host}:{port}", drained)


def _auth_environment(settings: Settings) -> dict[str, str]:
    """The auth app's config (written 0600 under REG_HOME) and the Flask session secret."""
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
        "authorization_function = registry.integrations.mirror.login:authenticate\n"
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
    """Run the server until it exits, Ctrl-C, SIGTERM or SIGHUP; then stop its whole group."""
    server = subprocess.Popen(
        plan.command,
        cwd=cwd,
        env=plan.environment,
        start_new_session=True,
        preexec_fn=_die_with(os.getpid()),
    )

    def stop(signum: int, _: Any) -> None:
        raise KeyboardInterrupt

    # Ctrl-C too, explicitly: a `reg ui` started in the background by a shell without job
    # control inherits SIGINT ignored, and would otherwise outlive the interrupt meant for it.
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, stop) for sig in stops}
    try:
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_group(server)


def _die_with(parent: int) -> Callable[[], None] | None:
    """What the server's process runs before exec: ask the kernel to SIGTERM it when `reg ui`
    dies (Linux's PR_SET_PDEATHSIG), and exit if that already happened. `prctl` is looked up
    here, in the parent: the child of a threaded process may only call what is resolved."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: SIGTERM, SIGHUP and Ctrl-C still stop the group

    def in_child() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return in_child


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
