"""`reg keys create|rotate|ls|public|retire|revoke`: release signing keys, and `reg
sign-release` for a release made before them."""

from __future__ import annotations

from typing import Any

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json, note, progress_for, table
from registry.errors import NotFound, UsageError

keys_app = typer.Typer(
    help="Release signing keys: the server's (or embedded user's) ECDSA P-256 keys.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")
    keys_app.command("create")(create)
    keys_app.command("rotate")(rotate)
    keys_app.command("ls")(ls)
    keys_app.command("public")(public)
    keys_app.command("retire")(retire)
    keys_app.command("revoke")(revoke)
    app.command("sign-release")(sign_release)


def _on_this_host(reg: Any, command: str) -> Any:
    """Key changes run where the private keys are: on the server's host, on its catalog."""
    if reg.settings.remote:
        raise UsageError(
            f"reg keys {command} runs on the host of reg server, against its catalog (the "
            "private key never leaves it)",
            "run it there without REG_URL",
        )
    return reg


def create(json_output: bool = JSON_OPTION) -> None:
    """Create the signing key (admin); its private half stays in REG_HOME/signing (0600)."""
    with open_registry() as reg:
        out = _on_this_host(reg, "create").create_signing_key()
    emit_json(out) if json_output else print(out.key_id)


def rotate(json_output: bool = JSON_OPTION) -> None:
    """Create a new signing key and retire the active one (its releases still verify)."""
    with open_registry() as reg:
        out = _on_this_host(reg, "rotate").create_signing_key(rotate=True)
    emit_json(out) if json_output else print(out.key_id)


def ls(json_output: bool = JSON_OPTION) -> None:
    """List the signing keys: id, state, created, changed."""
    with open_registry() as reg:
        rows = reg.signing_keys()
    if json_output:
        emit_json(rows)
        return
    if not rows:
        note("no signing keys (reg keys create)")
    table(
        ["KEY ID", "STATE", "CREATED", "BY", "CHANGED", "REASON"],
        [
            [r.key_id, r.state, r.created_at, r.created_by, r.changed_at or "-", r.reason or "-"]
            for r in rows
        ],
    )


def public(
    key_id: str | None = typer.Argument(None, help="A key id or prefix (default: the active)."),
) -> None:
    """Print a key's PEM public key: what consumers pin to verify releases."""
    with open_registry() as reg:
        rows = reg.signing_keys()
    if key_id is None:
        chosen = [r for r in rows if r.state == "active"][-1:]
        if not chosen:
            raise NotFound("no active signing key", "reg keys create")
    else:
        chosen = [r for r in rows if r.key_id.startswith(key_id.lower())]
        if len(chosen) != 1:
            raise (NotFound if not chosen else UsageError)(
                f"{'no' if not chosen else 'more than one'} signing key {key_id}",
                "reg keys ls lists them",
            )
    print(chosen[0].public_pem, end="")


def retire(
    key_id: str = typer.Argument(..., help="The key id (or a prefix of 8+ characters)."),
    reason: str | None = typer.Option(None, "--reason", help="Why (audited)."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Retire a key: it signs nothing more; the releases it signed still verify."""
    with open_registry() as reg:
        out = _on_this_host(reg, "retire").change_signing_key(key_id, "retired", reason)
    emit_json(out) if json_output else print(f"retired {out.key_id}")


def revoke(
    key_id: str = typer.Argument(..., help="The key id (or a prefix of 8+ characters)."),
    reason: str = typer.Option(..., "--reason", help="Why (audited)."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Revoke a key: the releases it signed are reported as untrusted by reg verify."""
    with open_registry() as reg:
        out = _on_this_host(reg, "revoke").change_signing_key(key_id, "revoked", reason)
    emit_json(out) if json_output else print(f"revoked {out.key_id}")


def sign_release(
    ref: str = typer.Argument(..., help="MODEL:vK or MODEL@ALIAS, a release made unsigned."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Sign a release made before signing (admin): its stored bytes are re-hashed first, then
    its provenance, model card and model.sig are added (nothing stored is rewritten)."""
    with open_registry() as reg:
        out = reg.sign_release(ref, progress=progress_for(json_output))
    key = (out.signature or {}).get("key_id", "")
    emit_json(out) if json_output else print(
        f"signed {out.release} with key {key[:16]} ({out.rehashed} bytes re-hashed first; "
        f"added {', '.join(out.added)})"
    )
