"""Admin commands: gc, audit."""

from __future__ import annotations

import json
import sys

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json, table
from registry.text import inert

storage_app = typer.Typer(help="Object store administration.", no_args_is_help=True)
catalog_app = typer.Typer(help="Catalog administration.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("gc")(gc)
    app.command("audit")(audit)
    app.add_typer(storage_app, name="storage")
    storage_app.command("init")(storage_init)
    app.add_typer(catalog_app, name="catalog")
    catalog_app.command("rebuild")(catalog_rebuild)


def catalog_rebuild(
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be added."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Rebuild missing catalog rows from the store's MANIFEST.json and release.json (admin)."""
    with open_registry() as reg:
        out = reg.rebuild_catalog(dry_run=dry_run)
    if json_output:
        emit_json(out)
        return
    verb = "would add" if dry_run else "added"
    print(
        f"{verb} {len(out['checkpoints_added'])} checkpoint(s), "
        f"{len(out['releases_added'])} release(s)"
    )
    for ref in out["checkpoints_added"] + out["releases_added"]:
        print(f"  {ref}")
    for skipped in out["skipped"]:
        print(f"  skipped {inert(skipped)}", file=sys.stderr)
    print(f"not recoverable from the store: {out['not_recoverable']}")


def storage_init(json_output: bool = JSON_OPTION) -> None:
    """Check the store (bucket, versioning, Object Lock) and set its lifecycle rules (admin)."""
    with open_registry() as reg:
        out = reg.storage_init()
    if json_output:
        emit_json(out)
        return
    for key, value in out.items():
        print(f"{key}: {', '.join(value) if isinstance(value, list) else value}")


def gc(
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; delete nothing."),
    every: str | None = typer.Option(
        None, "--every", help="Run forever, once per interval (e.g. 1h)."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Apply the retention policy: delete what no rule keeps, sweep orphans, explain each."""
    if every is not None:
        from cli.schedule import repeat

        repeat(every, _gc_cycle)
        return
    with open_registry() as reg:
        out = reg.gc(dry_run=dry_run)
    if json_output:
        emit_json(out)
        return
    from registry.timeutil import human_bytes

    table(
        ["REF", "ACTION", "REASON", "SIZE"],
        [[d["ref"], d["action"], d["reason"], human_bytes(d["bytes"])] for d in out["decisions"]],
    )
    for err in out["errors"]:
        print(f"error: {inert(str(err))}", file=sys.stderr)
    verb = "would free" if dry_run else "freed"
    print(
        f"{verb} {human_bytes(out['freed_bytes'])}"
        + (f"; swept {len(out['orphans'])} orphan(s)" if out["orphans"] else "")
    )


def _gc_cycle() -> dict[str, object]:
    with open_registry() as reg:
        result = reg.gc()
    return {
        "freed_bytes": result["freed_bytes"],
        "deleted": sum(d["action"] == "delete" for d in result["decisions"]),
        "kept": sum(d["action"] == "keep" for d in result["decisions"]),
        "errors": result["errors"],
    }


def audit(
    since: str | None = typer.Option(None, "--since", help="A duration back (24h) or ISO date."),
    actor: str | None = typer.Option(None, "--actor", help="Only this principal."),
    action: str | None = typer.Option(None, "--action", help="Only this action."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Show the audit log (admin): who did what, when, with what outcome."""
    with open_registry() as reg:
        events = reg.audit_log(since=_since(since), actor=actor, action=action)
    if json_output:
        emit_json(events)
        return
    table(
        ["TS", "ACTOR", "ACTION", "TARGET", "OUTCOME", "DETAILS"],
        [
            [
                e["ts"],
                e["actor"],
                e["action"],
                e["target"],
                e["outcome"],
                json.dumps(e["details"], sort_keys=True) if e["details"] else "",
            ]
            for e in events
        ],
    )


def _since(text: str | None) -> float | None:
    if text is None:
        return None
    import time
    from datetime import datetime

    from policies.loader import parse_duration
    from registry.errors import UsageError

    try:
        return time.time() - parse_duration(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise UsageError(f"bad --since {text!r}", "write a duration (24h) or an ISO date") from None
