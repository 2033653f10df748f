"""`reg mlflow sync` and `reg ui`: the MLflow mirror."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json

mlflow_app = typer.Typer(
    help="The MLflow mirror of runs, checkpoints and releases.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(mlflow_app, name="mlflow")
    mlflow_app.command("sync")(sync)
    app.command("ui")(ui)


def sync(
    budget: float = typer.Option(300.0, "--budget", help="Give up after this many seconds."),
    every: str | None = typer.Option(None, "--every", help="Run forever, once per interval."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Drain pending catalog events into MLflow now (admin); idempotent."""

    def once() -> dict[str, object]:
        with open_registry() as reg:
            return reg.mlflow_sync(budget)

    if every is not None:
        from cli.schedule import repeat

        def cycle() -> dict[str, object]:
            out = once()
            if out.get("error"):
                from registry.errors import RegistryError

                raise RegistryError(f"MLflow sync incomplete: {out['error']}")
            return out

        repeat(every, cycle)
        return
    out = once()
    if json_output:
        emit_json(out)
    else:
        print(
            f"mirrored {out['applied']} event(s); {out['pending']} pending"
            + (f"; stopped at: {out['error']}" if out.get("error") else "")
        )
    if out.get("error"):
        from registry.errors import RegistryError

        raise RegistryError(
            f"MLflow sync incomplete: {out['error']}",
            "the events wait; run `reg mlflow sync` again when MLflow is up",
        )


def ui(port: int = typer.Option(5000, "--port", help="Port on 127.0.0.1.")) -> None:
    """Start the MLflow UI on the mirror's tracking store (Ctrl-C stops it and its workers)."""
    from registry.text import redact_url

    with open_registry() as reg:
        reg.authorize_read(project=None, model=None)
        uri = reg.settings.mlflow_tracking_uri
        home = reg.settings.home
    artifacts = (home / "mlflow-artifacts").as_uri()
    # The tracking URI may hold a password: it goes to the server by environment, never argv
    # (which every user of the machine can read in /proc).
    environment = dict(os.environ, MLFLOW_BACKEND_STORE_URI=uri)
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--default-artifact-root",
        artifacts,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # Its own process group: MLflow's server leaves worker processes behind otherwise.
    server = subprocess.Popen(cmd, cwd=home, env=environment, start_new_session=True)
    print(
        f"MLflow UI: http://127.0.0.1:{port}  (tracking store {redact_url(uri)}; Ctrl-C stops it)",
        flush=True,
    )
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
