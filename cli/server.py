"""`reg server`, `reg server init`, `reg token create|ls|revoke`, `reg login`, `reg whoami`."""

from __future__ import annotations

import getpass
import json
import os
import sys

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json, note, table
from registry.core.config import LOGIN_FILE, Settings
from registry.core.timeutil import positive_duration
from registry.errors import UsageError

server_app = typer.Typer(
    help="Run reg server: the one trusted process of a shared registry "
    "(docs/concepts/design.md §9).",
    invoke_without_command=True,
)
token_app = typer.Typer(help="Tokens of reg server (admin).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(server_app, name="server")
    server_app.command("init")(init)
    app.add_typer(token_app, name="token")
    token_app.command("create")(token_create)
    token_app.command("ls")(token_ls)
    token_app.command("revoke")(token_revoke)
    app.command("login")(login)
    app.command("whoami")(whoami)


@server_app.callback()
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8470, "--port", help="Port (0: any free port, printed)."),
    gc_every: str | None = typer.Option(
        None, "--gc-every", help="Run GC on this schedule, e.g. 1h (one replica leads)."
    ),
    workers: int = typer.Option(1, "--workers", help="uvicorn worker processes."),
    ssl_certfile: str | None = typer.Option(None, "--ssl-certfile", help="TLS certificate."),
    ssl_keyfile: str | None = typer.Option(None, "--ssl-keyfile", help="TLS private key."),
    graceful_s: int = typer.Option(
        30, "--graceful-timeout", help="Seconds in-flight requests get after SIGTERM."
    ),
) -> None:
    """Serve the registry over HTTP with the catalog and store of this host's settings."""
    if ctx.invoked_subcommand is not None:
        return
    from registry.server.run import serve as run_server

    run_server(
        host=host,
        port=port,
        gc_every=gc_every,
        workers=workers,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        graceful_s=graceful_s,
    )


def init(
    admin: str = typer.Option(..., "--admin", help="The first admin's principal name."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Bootstrap the first admin and print its token once (run on the server's host)."""
    from registry.server.bootstrap import init_admin

    settings = Settings.from_env()
    if settings.remote:
        raise UsageError(
            "reg server init runs where the catalog is, not through REG_URL", "unset REG_URL"
        )
    out = init_admin(settings, admin, operator=f"{settings.user} (server init)")
    if json_output:
        emit_json({"token": out["token"], "principal": out["principal"]})
        return
    if out["policy"]:
        note(f"applied policy v{out['policy']['version']}: {admin} is admin")
    if out["signing_key"]["created"]:
        note(f"release signing key {out['signing_key']['key_id']} created (reg keys public)")
    note(f"token for {admin} (shown once; store it now):")
    print(out["token"])


def token_create(
    principal: str = typer.Argument(..., help="Who the token stands for."),
    expires: str | None = typer.Option(None, "--expires", help="Lifetime, e.g. 90d."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Mint a token for PRINCIPAL (admin); it is printed once, only its hash is kept."""
    expires_s = None if expires is None else positive_duration(expires, "--expires", "90d")
    with open_registry() as reg:
        out = reg.create_token(principal, expires_s=expires_s)
    if json_output:
        emit_json(out)
        return
    note(f"token {out.id} for {out.principal} (shown once; store it now):")
    print(out.token)


def token_ls(json_output: bool = JSON_OPTION) -> None:
    """List tokens: id, principal, state, expiry, last use (never the secrets)."""
    with open_registry() as reg:
        rows = reg.list_tokens()
    if json_output:
        emit_json(rows)
        return
    table(
        ["ID", "PRINCIPAL", "STATE", "CREATED", "EXPIRES", "LAST USED"],
        [
            [
                r.id,
                r.principal,
                r.state,
                r.created_at,
                r.expires_at or "never",
                r.last_used_at or "-",
            ]
            for r in rows
        ],
    )


def token_revoke(
    token_id: str = typer.Argument(..., help="The token's id (reg token ls)."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Revoke a token at once (admin)."""
    with open_registry() as reg:
        out = reg.revoke_token(token_id)
    emit_json(out) if json_output else print(f"revoked token {out.id} of {out.principal}")


def login(
    url: str = typer.Argument(..., help="The reg server URL, e.g. https://reg.example.com."),
    token_stdin: bool = typer.Option(False, "--token-stdin", help="Read the token from stdin."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Check a token against URL and keep it under REG_HOME (mode 0600) for the commands that
    run with REG_URL=URL (export it; REG_TOKEN is then not needed)."""
    from registry.api.remote.client import Client

    token = sys.stdin.readline().strip() if token_stdin else getpass.getpass("token: ").strip()
    settings = Settings.from_env()
    client = Client(url, token, allow_http=settings.allow_http)
    try:
        who = client.call("GET", "/whoami")
    finally:
        client.close()
    settings.home.mkdir(parents=True, exist_ok=True)
    path = settings.home / LOGIN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url.rstrip("/"), "token": token}, f)
    out = {"url": url.rstrip("/"), "principal": who["principal"], "saved": str(path)}
    if json_output:
        emit_json(out)
        return
    print(f"logged in to {out['url']} as {out['principal']} (token saved in {path})")
    if os.environ.get("REG_URL", "").rstrip("/") != out["url"]:
        note(f"set REG_URL={out['url']} (or url = in config.toml) to use it")


def whoami(json_output: bool = JSON_OPTION) -> None:
    """Who the registry takes you for: the token's principal (remote) or REG_USER/OS login."""
    from registry.api.local import LocalRegistry

    with open_registry() as reg:
        if not isinstance(reg, LocalRegistry):
            out = reg.whoami()  # type: ignore[attr-defined]  # RemoteRegistry's own method
        else:
            out = {
                "principal": reg.user,
                "authenticated_by": reg.context.principal.authenticated_by,
            }
    if json_output:
        emit_json(out)
        return
    print(out["principal"])
    if out.get("authenticated_by") == "oidc":  # stdout stays the bare name, for scripts
        note(f"authenticated by OIDC ({out.get('token')})")
