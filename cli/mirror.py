"""`reg mlflow sync` and `reg ui`: the MLflow mirror."""

from __future__ import annotations

import signal
import sys

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json
from registry.errors import UsageError
from registry.text import redact_url

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
    skip: int | None = typer.Option(
        None, "--skip", help="First set aside the pending event with this id (audited)."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Drain pending catalog events into MLflow now (admin); idempotent."""

    def once() -> dict[str, object]:
        with open_registry() as reg:
            return reg.mlflow_sync(budget, skip).to_json()

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
        if out.get("skipped"):
            print(f"set aside event #{skip}")
        print(
            f"mirrored {out['applied']} event(s); {out['pending']} pending"
            + (f"; stopped at: {out['error']}" if out.get("error") else "")
        )
    if out.get("error"):
        from registry.errors import RegistryError

        raise RegistryError(
            f"MLflow sync incomplete: {out['error']}",
            "the events wait; run `reg mlflow sync` again when MLflow is up, or set the event "
            "aside with `reg mlflow sync --skip ID` if it can never apply",
        )


def ui(
    port: int = typer.Option(5000, "--port", help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    auth: bool | None = typer.Option(
        None,
        "--auth/--no-auth",
        help="MLflow's login with reg tokens (default: on when the policy has grants).",
    ),
    allowed_hosts: str | None = typer.Option(
        None,
        "--allowed-hosts",
        help="Host headers MLflow answers, comma-separated (default: localhost, private IPs).",
    ),
) -> None:
    """Run the MLflow UI and artifact server over the mirror (Ctrl-C or SIGTERM stops it)."""
    from registry.api.local import LocalRegistry
    from registry.integrations.mirror.ui import plan_ui, run_ui

    with open_registry() as reg:
        if not isinstance(reg, LocalRegistry):
            raise UsageError(
                "reg ui runs on the registry's own host (it reads the catalog and the store)",
                "run it where reg server runs, without REG_URL",
            )
        reg.authorize_read(project=None, model=None)
        plan = plan_ui(
            reg.settings,
            reg.catalog,
            reg.store,
            host=host,
            port=port,
            auth=auth,
            has_grants=bool(reg.policy.access.grants),
            allowed_hosts=allowed_hosts,
        )
        uri, home = reg.settings.mlflow_tracking_uri, reg.settings.home
    if plan.drained.get("error") or plan.drained.get("skipped"):
        from registry.text import inert

        why = plan.drained.get("error") or plan.drained.get("skipped")
        print(
            f"reg: warning: MLflow is not up to date ({inert(str(why))}); see `reg mlflow sync`",
            file=sys.stderr,
        )
    login = "log in with your reg principal and a reg token" if plan.auth else "no login"
    print(
        f"MLflow UI: {plan.url}  ({login}; tracking store {redact_url(uri)}; "
        f"release bytes from {plan.artifacts or 'nowhere: an in-memory store'}; Ctrl-C stops it)",
        flush=True,
    )
    code = run_ui(plan, home)
    if code not in (0, -signal.SIGTERM):
        raise typer.Exit(1)
