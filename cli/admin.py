"""Admin commands: gc, fsck, audit, storage init, and catalog administration (rebuild, migrate,
grants, sign, backfill-journal)."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json, note, progress_for, table
from policies.durations import parse_duration
from registry.core.config import Settings
from registry.core.timeutil import human_bytes, positive_duration
from registry.errors import IntegrityError, UsageError
from registry.text import inert

storage_app = typer.Typer(help="Object store administration.", no_args_is_help=True)
catalog_app = typer.Typer(help="Catalog administration.", no_args_is_help=True)
audit_app = typer.Typer(invoke_without_command=True)


def register(app: typer.Typer) -> None:
    app.command("gc")(gc)
    app.command("fsck")(fsck)
    app.add_typer(audit_app, name="audit")
    audit_app.callback()(audit)
    audit_app.command("verify")(audit_verify)
    audit_app.command("seal")(audit_seal)
    app.add_typer(storage_app, name="storage")
    storage_app.command("init")(storage_init)
    app.add_typer(catalog_app, name="catalog")
    catalog_app.command("rebuild")(catalog_rebuild)
    catalog_app.command("migrate")(catalog_migrate)
    catalog_app.command("grants")(catalog_grants)
    catalog_app.command("sign")(catalog_sign)
    catalog_app.command("backfill-journal")(catalog_backfill_journal)


def catalog_migrate(
    grant: list[str] = typer.Option(
        [], "--grant", help="Re-apply a runtime role's grants afterwards (repeatable)."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Migrate the catalog's schema as its owner (REG_CATALOG_URL); print the revision before
    and after. Then record the key paths of checkpoints committed before the catalog kept them,
    from each one's .metadata in the store (REG_STORE_URL)."""
    from registry.api.host import migrate_catalog

    # the catalog's owner migrates it, never through a server
    out = migrate_catalog(Settings.from_env(), grant)
    if json_output:
        emit_json(out)
        return
    for warning in out["warnings"]:
        note(f"warning: the policy in force: {warning}")
    if out["before"] == out["after"]:
        print(f"{out['catalog']}: schema at revision {out['after']}, nothing to migrate")
    else:
        print(f"{out['catalog']}: migrated from revision {out['before']} to {out['after']}")
    for done in out["grants"]:
        print(f"granted {done['role']} least privilege on {len(done['tables'])} table(s)")
    keys = out["key_paths"]
    if keys["recorded"]:
        print(f"recorded the key paths of {keys['recorded']} older checkpoint(s)")
    for failed in keys["failed"]:
        note(f"{failed['ref']}: key paths not recorded: {failed['error']}")


def catalog_grants(
    role: str = typer.Argument(..., help="The runtime role reg server connects as."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the SQL; change nothing."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Give ROLE least privilege on the catalog (PostgreSQL; run as the owner): read and append
    history, update only what the server updates, no DDL."""
    from registry.api.host import grant_runtime_role

    out = grant_runtime_role(Settings.from_env(), role, dry_run=dry_run)
    if json_output:
        emit_json(out)
        return
    if dry_run:
        for statement in out["sql"]:
            print(f"{statement};")
        return
    table(["TABLE", "PRIVILEGES"], [[t, ", ".join(p)] for t, p in out["tables"].items()])
    print(
        f"granted {out['role']} least privilege on schema {out['schema']} "
        f"(revision {out['revision']}): {len(out['tables'])} table(s), "
        f"{len(out['sequences'])} sequence(s)"
    )


def catalog_sign(
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be signed."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Sign the policy documents, attested validations and model owners written before signed
    facts, each checked against the audit log first (admin; on the server's host, with its
    audit key). Example: `reg catalog sign --dry-run`, then `reg catalog sign`."""
    from registry.api.host import sign_catalog

    out = sign_catalog(Settings.from_env(), dry_run=dry_run)
    if json_output:
        emit_json(out)
        return
    verb = "would sign" if dry_run else "signed"
    for kind, targets in out["signed"].items():
        print(
            f"{verb} {len(targets)} {kind} row(s)" + (f": {', '.join(targets)}" if targets else "")
        )
    if out["policy_event"]:
        print(f"recorded policy-sign for {out['policy_event']}: it is in force behind the server")
    for r in out["refused"]:
        note(f"not signed: {r['target']}: {r['reason']}")


def catalog_backfill_journal(
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be written."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Journal what the catalog decided before it had a journal (admin; once, after upgrading
    a registry from before the journal): policies, validations, aliases, yanks, deprecations
    and pins, each with its row's time and author, so `reg catalog rebuild` can replay them.
    Idempotent. Runs where the catalog is: embedded, or on the server's host."""
    from registry.api.host import backfill_journal

    out = backfill_journal(Settings.from_env(), dry_run=dry_run)
    if json_output:
        emit_json(out)
        return
    written = out["events_written"]
    kinds = ", ".join(f"{kind} {n}" for kind, n in written.items())
    print(
        f"{'would write' if dry_run else 'wrote'} {sum(written.values())} journal event(s)"
        + (f": {kinds}" if kinds else "")
        + f"; {out['already_journaled']} decision(s) already journaled"
    )


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
        f"{verb} {len(out.checkpoints_added)} checkpoint(s), {len(out.releases_added)} release(s)"
    )
    for ref in out.checkpoints_added + out.releases_added:
        print(f"  {ref}")
    replayed = out.get("events_replayed") or {}
    if replayed or out.get("events_current") or out.get("events_aborted"):
        kinds = ", ".join(f"{kind} {n}" for kind, n in replayed.items())
        print(
            f"{'would replay' if dry_run else 'replayed'} {sum(replayed.values())} decision(s)"
            + (f": {kinds}" if kinds else "")
            + f"; {sum((out.get('events_current') or {}).values())} already in the catalog"
            + f"; {sum((out.get('events_superseded') or {}).values())} superseded"
            + f"; {out.get('events_aborted', 0)} aborted"
        )
        if out.get("events_unsigned"):
            print(
                f"{out.events_unsigned} replayed decision(s) unsigned: trusted as any writer "
                "of the store's journal/ wrote them (no audit key)"
            )
    for skipped in out.skipped:
        print(f"  skipped {inert(skipped)}", file=sys.stderr)
    print(f"not recoverable from the store: {out.not_recoverable}")


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

    table(
        ["REF", "ACTION", "REASON", "SIZE"],
        [[d["ref"], d["action"], d["reason"], human_bytes(d["bytes"])] for d in out.decisions],
    )
    for err in out.errors:
        print(f"error: {inert(str(err))}", file=sys.stderr)
    verb = "would free" if dry_run else "freed"
    print(
        f"{verb} {human_bytes(out.freed_bytes)}"
        + (f"; swept {len(out.orphans)} orphan(s)" if out.orphans else "")
    )


def _gc_cycle() -> dict[str, object]:
    with open_registry() as reg:
        result = reg.gc()
    return {
        "freed_bytes": result.freed_bytes,
        "deleted": sum(d["action"] == "delete" for d in result.decisions),
        "kept": sum(d["action"] == "keep" for d in result.decisions),
        "errors": result.errors,
    }


def fsck(
    project: str | None = typer.Option(None, "--project", help="Only this project."),
    repair: bool = typer.Option(
        False, "--repair", help="Do what is safe: sweep, finish deletions, restore versions."
    ),
    full: bool = typer.Option(False, "--full", help="Hash every file, not a sample."),
    sample: int = typer.Option(
        32, "--sample", min=0, help="Data files hashed without --full (documents always are)."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Check the whole registry, catalog against store: missing, damaged, unlisted objects,
    dead claims, unfinished deletions. Exit 1 when anything but leftovers is found."""
    with open_registry() as reg:
        out = reg.fsck(
            project, repair=repair, full=full, sample=sample, progress=progress_for(json_output)
        )
    if json_output:
        emit_json(out)
    else:
        c = out.checked
        print(
            f"checked {c['checkpoints']} checkpoint(s), {c['releases']} release(s), "
            f"{c['objects']} object(s) ({human_bytes(c['bytes'])}); hashed {c['hashed_files']} "
            f"file(s) ({human_bytes(c['hashed_bytes'])})"
        )
        shown = out.left if repair else out.problems
        if shown:
            table(
                ["KIND", "TARGET", "OBJECT", "DETAIL", "LEFTOVER"],
                [
                    [
                        p["kind"],
                        inert(p["target"]),
                        inert(p["key"] or ""),
                        inert(p["detail"]),
                        p["sweepable"],
                    ]
                    for p in shown
                ],
            )
        for line in out.get("repaired", []):
            print(f"repaired: {inert(line)}")
        if out.clean:
            found = out.left if repair else out.problems
            print("clean" + (": only leftovers of interrupted work" if found else ""))
    if not out.clean:
        _fsck_failed(out.to_json(), repair, json_output)


def _fsck_failed(out: dict[str, Any], repair: bool, json_output: bool) -> None:
    """Exit 1 with one line on stderr (with --json, the report is the one document)."""
    found = [p for p in (out["left"] if repair else out["problems"]) if not p["sweepable"]]
    damaged = sum(
        p["kind"] in ("missing-object", "size-mismatch", "sha256-mismatch") for p in found
    )
    if damaged:
        message = f"{damaged} stored file(s) missing or different"
        hint = "`reg fsck --repair` restores recorded versions where the bucket keeps them"
    else:
        message = f"{len(found)} finding(s) need a person"
        hint = "each row above says what to do"
    if json_output:
        note(f"error: {message} ({hint})")
        raise typer.Exit(1)
    raise IntegrityError(message, hint)


def audit(
    ctx: typer.Context,
    since: str | None = typer.Option(None, "--since", help="A duration back (24h) or ISO date."),
    actor: str | None = typer.Option(None, "--actor", help="Only this principal."),
    action: str | None = typer.Option(None, "--action", help="Only this action."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Show the audit log (admin): who did what, when, with what outcome."""
    if ctx.invoked_subcommand is not None:
        return
    with open_registry() as reg:
        events = reg.audit_log(since=_since(since), actor=actor, action=action)
    if json_output:
        emit_json(events)
        return
    table(
        ["TS", "ACTOR", "ACTION", "TARGET", "OUTCOME", "DETAILS"],
        [
            [
                e.ts,
                e.actor,
                e.action,
                e.target,
                e.outcome,
                json.dumps(e.details, sort_keys=True) if e.details else "",
            ]
            for e in events
        ],
    )


def audit_verify(
    max_unsealed_age: str | None = typer.Option(
        None,
        "--max-unsealed-age",
        help="Fail when a signed event waited unsealed longer (default: max(15m, 10 x "
        "REG_AUDIT_SEAL_EVERY) of the server).",
    ),
    max_anchor_age: str | None = typer.Option(
        None,
        "--max-anchor-age",
        help="Fail when a signed event waited unanchored longer while the newest anchor is "
        "older too (default: max(15m, 3 x REG_AUDIT_ANCHOR_EVERY)).",
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Check every audit event, seal and anchor against the server's key (admin); exit 1
    naming each edit, reordering, deletion, forged event, truncated tail or stalled sealer."""

    def seconds(text: str | None, flag: str) -> float | None:
        return None if text is None else positive_duration(text, flag, "15m")

    unsealed = seconds(max_unsealed_age, "--max-unsealed-age")
    anchor = seconds(max_anchor_age, "--max-anchor-age")
    with open_registry() as reg:
        out = reg.audit_verify(max_unsealed_age_s=unsealed, max_anchor_age_s=anchor)
    if json_output:
        emit_json(out)
    else:
        for p in out.problems:
            print(f"{p['kind']}: {inert(p['message'])}")
        if out.ok:
            oldest = f" (oldest {out.oldest_unsealed})" if out.oldest_unsealed else ""
            print(
                f"audit log ok: {out.events} events, {out.sealed} sealed in "
                f"{out.seals} seals, {out.unsealed} not sealed yet{oldest}; "
                f"{out.anchors} anchor(s) in the store"
            )
    if not out.ok:
        from registry.errors import IntegrityError

        failed = IntegrityError(
            f"the audit log fails verification: {len(out.problems)} problem(s)",
            "each is named in the output; the catalog was changed outside reg",
        )
        if not json_output:
            raise failed
        print(f"reg: error: {failed}", file=sys.stderr)  # stdout keeps its one document
        raise typer.Exit(failed.exit_code)


def audit_seal(json_output: bool = JSON_OPTION) -> None:
    """Seal the audit events not sealed yet and anchor the chain head in the store (admin)."""
    with open_registry() as reg:
        out = reg.audit_seal()
    if json_output:
        emit_json(out)
        return
    for r in out.refused:
        print(f"not sealed: event {r['event']}: {r['reason']}", file=sys.stderr)
    head, anchor = out.head, out.anchor
    print(f"sealed {out.sealed} event(s) in {len(out.seals)} seal(s)")
    if head is not None and anchor is not None:
        where = "already anchored" if anchor["existing"] else f"anchored at {anchor['key']}"
        lock = f" ({anchor['locked']})" if anchor.get("locked") else ""
        print(f"chain head: seal {head['seq']}, {head['events']} events; {where}{lock}")


def _since(text: str | None) -> float | None:
    if text is None:
        return None

    try:
        return time.time() - parse_duration(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise UsageError(f"bad --since {text!r}", "write a duration (24h) or an ISO date") from None
