"""Checkpoints written by several nodes under one claim: claim-ckpt, commit-ckpt (and
`push-ckpt --claim`, in checkpoints.py)."""

from __future__ import annotations

import typer

from cli.common import JSON_OPTION, LAYOUT_OPTION, open_registry, parse_metrics
from cli.render import emit_json, plural
from registry.core.timeutil import human_bytes, positive_duration


def register(app: typer.Typer) -> None:
    app.command("claim-ckpt")(claim_ckpt)
    app.command("commit-ckpt")(commit_ckpt)


def claim_ckpt(
    run: str = typer.Option(..., "--run", help="Run name."),
    step: int = typer.Option(..., "--step", help="Training step of the checkpoint."),
    project: str = typer.Option("default", "--project", help="Project name."),
    lease: str = typer.Option(
        "1h", "--lease", help="How long the claim lives without a push renewing it."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Claim RUN@stepN for writers on several nodes; prints the claim token they share."""
    lease_s = positive_duration(lease, "--lease", "1h")
    with open_registry() as reg:
        out = reg.claim_checkpoint(run, step, project=project, lease_s=lease_s)
    if json_output:
        emit_json(out)
        return
    print(out.claim)


def commit_ckpt(
    claim: str = typer.Option(..., "--claim", help="The token `reg claim-ckpt` printed."),
    world_size: int | None = typer.Option(
        None, "--world-size", help="World size it was saved at (else inferred)."
    ),
    metric: list[str] = typer.Option([], "--metric", help="NAME=VALUE recorded with it."),
    layout: str | None = LAYOUT_OPTION,
    json_output: bool = JSON_OPTION,
) -> None:
    """Commit a claimed step once every file its .metadata names was pushed (else exit 1,
    naming the missing ranks' files)."""
    with open_registry() as reg:
        out = reg.commit_claimed(
            claim, world_size=world_size, metrics=parse_metrics(metric), layout=layout
        )
    if json_output:
        emit_json(out)
        return

    print(
        f"committed {out.ref}: {plural(len(out.files), 'file')}, {human_bytes(out.bytes)}, "
        f"world size {out.world_size}, resumable: {out.resumable}"
    )
