"""`reg policy show|check|apply|export`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json, note
from registry.errors import UsageError

policy_app = typer.Typer(
    help="Show, check, apply and export the registry policy.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(policy_app, name="policy")
    policy_app.command("show")(show)
    policy_app.command("check")(check)
    policy_app.command("apply")(apply)
    policy_app.command("export")(export)


def show(json_output: bool = JSON_OPTION) -> None:
    """Print the effective policy and where it comes from."""
    with open_registry() as reg:
        out = reg.policy_show()
    if json_output:
        emit_json(out)
        return
    print(f"# effective policy: {out.source}")
    print(out.document.rstrip() or "# (the shipped default)")


def check(
    path: Path | None = typer.Argument(None, help="A policy TOML file (default: the applied one)."),
) -> None:
    """Validate a policy file, or the policy in force (exit 2 with file:line on the first
    error); warns about grants that count for nothing (scoped admin grants)."""
    from policies.access import scoped_admin_grants
    from policies.loader import load_policy_file, parse_policy
    from policies.resume import resume_overrides

    if path is None:
        with open_registry() as reg:
            shown = reg.policy_show()
        name = shown.source
        policy = parse_policy(shown.document, name)
    else:
        name = str(path)
        policy = load_policy_file(path)
    for problem in scoped_admin_grants(policy.access.grants) + resume_overrides(policy.resume):
        note(f"warning: {name}: {problem}")
    print(f"{name}: ok ({len(policy.access.grants)} grant(s))")


def apply(
    path: Path = typer.Argument(..., help="A policy TOML file."), json_output: bool = JSON_OPTION
) -> None:
    """Store the policy in the catalog (admin): every host and client uses it from now on."""
    with open_registry() as reg:
        out = reg.apply_policy(path)
    if json_output:
        emit_json(out)
        return
    for warning in out.get("warnings", []):
        note(f"warning: {path}: {warning}")
    print(f"applied policy v{out.version} ({out.grants} grant(s), sha256 {out.sha256[:16]})")
    if out.get("resume_changed"):
        print(f"  the resume verdict of {out.resume_changed} checkpoint(s) changed")
    if out.get("resume_undecided"):
        print(
            f"  {out.resume_undecided} older checkpoint(s) keep their push-time verdict until "
            "`reg catalog migrate` records their key paths"
        )


def export(
    fmt: str = typer.Option("s3", "--format", help="Only s3 (a bucket policy) for now."),
    bucket: str | None = typer.Option(
        None, "--bucket", help="BUCKET[/PREFIX]; default: from REG_STORE_URL."
    ),
) -> None:
    """Render the grants as an S3 bucket policy (JSON on stdout)."""
    if fmt != "s3":
        raise UsageError(f"unknown --format {fmt!r}", "use s3")
    with open_registry() as reg:
        document, missing = reg.export_policy(bucket)
    if missing:
        note(f"warning: left out principals with no [access.aws] ARN: {', '.join(missing)}")
    sys.stdout.write(json.dumps(document, indent=2) + "\n")
