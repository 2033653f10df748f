"""Checkpoint commands: push-ckpt, ls, show, pull, verify (a ref or a pulled folder), pin."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import typer

from cli import advise
from cli.common import JSON_OPTION, LAYOUT_OPTION, open_registry, parse_metrics
from cli.details import render_details
from cli.render import emit_json, note, plural, progress_for, table
from registry.core.refs import check_name
from registry.core.timeutil import human_bytes, parse_rate
from registry.errors import IntegrityError, UsageError


def register(app: typer.Typer) -> None:
    app.command("push-ckpt")(push_ckpt)
    app.command("ls")(ls)
    app.command("show")(show)
    app.command("pull")(pull)
    app.command("verify")(verify)
    app.command("pin")(pin)
    app.command("unpin")(unpin)
    app.command("advise")(advise.advise)
    app.command("recovery")(advise.recovery)  # deprecated: goes in the next release
    runs = typer.Typer(help="A training run as a whole.", no_args_is_help=True)
    runs.command("finish")(finish)
    runs.command("restart")(advise.restart)
    app.add_typer(runs, name="run")


def push_ckpt(
    directory: Path = typer.Argument(
        ..., help="The checkpoint directory (DCP, or a trainer's save: docs/reference/layouts.md)."
    ),
    run: str = typer.Option(..., "--run", help="Run name."),
    step: int | None = typer.Option(
        None,
        "--step",
        help="Training step of the checkpoint (else the one its files record: the Trainer's "
        "trainer_state.json, Megatron's iter_N).",
    ),
    project: str = typer.Option("default", "--project", help="Project name."),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        help="World size it was saved at (else recorded: the Trainer's rng_state_R.pth; "
        "else inferred from the shard files).",
    ),
    metric: list[str] = typer.Option([], "--metric", help="NAME=VALUE recorded with it."),
    layout: str | None = LAYOUT_OPTION,
    claim: str | None = typer.Option(
        None,
        "--claim",
        help="Push this node's part of a step claimed by `reg claim-ckpt` (no commit).",
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Register a checkpoint directory as RUN@stepN (copied, hashed, committed)."""
    if claim is not None:  # one node's part: the step is the claim's, its files a subset
        if step is None:
            raise UsageError("--claim needs --step", "give the step `reg claim-ckpt` claimed")
        _push_part(directory, claim, run, step, project, json_output)
        return
    from registry.api.offline import recorded_step

    metrics = parse_metrics(metric)  # the command line first, then the directory
    check_name(project, "project name")
    check_name(run, "run name")
    step = recorded_step(directory, step, world_size)  # refused here at once, before the catalog
    notes: list[str] = []
    with open_registry() as reg:
        out = reg.push_checkpoint(
            directory,
            run=run,
            step=step,
            project=project,
            world_size=world_size,
            metrics=metrics,
            progress=progress_for(json_output),
            notes=notes,
            layout=layout,
        )
    for n in notes:
        note(n)
    for w in out.get("warnings", []):
        note(f"{out.ref}: {w}")
    if out.unclassified:
        hint = "; try " + " or ".join(out.suggestions) if out.suggestions else ""
        note(f"{out.ref}: keys in no resume class: {', '.join(out.unclassified)}{hint}")
    if json_output:
        emit_json(out)
        return

    if out.unchanged:
        print(f"{out.ref} already holds this content; nothing copied")
    else:
        speed = out.bytes / out.upload_seconds / 1e6 if out.upload_seconds else 0
        print(
            f"pushed {out.ref}: {plural(len(out.files), 'file')}, {human_bytes(out.bytes)} "
            f"in {out.upload_seconds:.1f}s ({speed:.0f} MB/s), world size "
            f"{out.world_size}, {out.get('layout')} layout, resumable: "
            f"{_yes(out.resumable, out.missing_state)}"
        )


def _push_part(
    directory: Path, claim: str, run: str, step: int, project: str, json_output: bool
) -> None:
    with open_registry() as reg:
        out = reg.push_checkpoint_part(
            directory,
            claim=claim,
            run=run,
            step=step,
            project=project,
            progress=progress_for(json_output),
        )
    if json_output:
        emit_json(out)
        return

    print(
        f"pushed {plural(len(out.files), 'file')} ({human_bytes(out.bytes)}) of {out.ref} "
        f"in {out.upload_seconds:.1f}s; commit with `reg commit-ckpt --claim` once every "
        "node has pushed"
    )


def ls(
    run: str | None = typer.Argument(None, help="Only this run."),
    project: str | None = typer.Option(None, "--project", help="Only this project."),
    all_states: bool = typer.Option(False, "--all", help="Include collected checkpoints."),
    json_output: bool = JSON_OPTION,
) -> None:
    """List committed checkpoints."""
    with open_registry() as reg:
        rows = reg.list_checkpoints(run, project, include_deleted=all_states)
    if json_output:
        emit_json(rows)
        return

    if not rows and run is not None:  # a model's name given here, most likely
        note(f"no checkpoints of run {run}; the releases of a model are `reg releases {run}`")
    table(
        ["REF", "WORLD", "SIZE", "FILES", "RESUMABLE", "PINNED", "STATE", "CREATED"],
        [
            [
                r.ref,
                r.world_size,
                human_bytes(r.bytes),
                len(r.files),
                _yes(r.resumable, r.missing_state),
                "yes" if r.pinned else "",
                r.state,
                r.created_at,
            ]
            for r in rows
        ],
    )


def show(
    ref: str = typer.Argument(..., help="RUN@stepN, RUN@latest, MODEL:vK or MODEL@ALIAS."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Show everything known about a checkpoint or a release."""
    with open_registry() as reg:
        out = reg.show(ref)
    if json_output:
        emit_json(out)
        return
    sys.stdout.write(render_details(out.to_json()))


def pull(
    ref: str = typer.Argument(..., help="RUN@stepN or RUN@latest."),
    dest: Path = typer.Argument(..., help="A new or empty directory."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Copy a checkpoint out of the registry, verifying every byte."""
    with open_registry() as reg:
        out = reg.pull(ref, dest, progress=progress_for(json_output))
    if json_output:
        emit_json(out)
    else:
        kept = f", {out.kept} kept for reg verify --dir" if out.kept else ""
        print(f"pulled {out.ref} into {out.dest} ({plural(len(out.files), 'file')} verified{kept})")


def verify(
    ref: str | None = typer.Argument(None, help="A checkpoint or release ref."),
    repair: bool = typer.Option(
        False,
        "--repair",
        help="Restore each damaged file from the version its record names (versioned S3 "
        "buckets; admin).",
    ),
    directory: Path | None = typer.Option(
        None,
        "--dir",
        help="Check a pulled folder offline against the MANIFEST.json or release.json it keeps.",
    ),
    sha256: str | None = typer.Option(
        None,
        "--sha256",
        help="With --dir: the digest the registry recorded for that document (reg show: "
        "manifest_sha256, or a release's sha256).",
    ),
    every_artifact: bool = typer.Option(
        False,
        "--all",
        help="Scrub: re-hash every committed checkpoint and release, the longest unverified "
        "first (admin).",
    ),
    rate: str | None = typer.Option(
        None, "--rate", help="With --all: at most this bandwidth (e.g. 200MB/s)."
    ),
    every: str | None = typer.Option(
        None, "--every", help="With --all: run forever, once per interval (e.g. 24h)."
    ),
    limit: int | None = typer.Option(
        None, "--limit", min=1, help="With --all: at most this many artifacts per pass."
    ),
    public_key: Path | None = typer.Option(
        None,
        "--public-key",
        help="With --dir: a release folder's model.sig must sign exactly it, by this pinned "
        "PEM key.",
    ),
    provenance: bool = typer.Option(
        False,
        "--provenance",
        help="A release: also check its signature (model.sig) and provenance statement "
        "against the catalog.",
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Re-hash the stored copy (or, with --dir, a pulled folder; with --all, everything);
    exit 1 naming each missing or corrupt file."""
    if every_artifact or rate is not None or every is not None or limit is not None:
        if not every_artifact or ref is not None or repair or directory or sha256:
            raise UsageError(
                "--rate, --every and --limit go with --all, and --all with no REF or --dir",
                "reg verify --all [--rate 200MB/s] [--every 24h] scrubs the whole registry",
            )
        _scrub(rate, every, limit, json_output)
        return
    if directory is not None or sha256 is not None or public_key is not None:
        if ref is not None or repair or provenance or directory is None:
            raise UsageError(
                "give either REF, or --dir DIR [--sha256 HEX] [--public-key FILE]",
                "reg verify REF checks the store; reg verify --dir DIR a pulled folder",
            )
        _verify_dir(directory, sha256, public_key, json_output)
        return
    if ref is None:
        # as typer words it for a required argument; --help shows --dir too
        raise UsageError("Missing argument 'ref'.", "`reg verify --help` shows the usage")
    with open_registry() as reg:
        out = reg.verify(
            ref, repair=repair, provenance=provenance, progress=progress_for(json_output)
        )
    if json_output:
        emit_json(out)
    else:
        for path in out.get("repaired", []):
            print(f"{out.ref or out.release}: {path}: restored from its version")
        for p in out.problems:
            print(f"{out.ref or out.release}: {p['path']}: {p['problem']}")
        if out.ok:
            signed = out.signature
            by = (
                f", signed by key {signed['key_id'][:16]} ({signed['key_state']})" if signed else ""
            )
            print(f"{out.ref or out.release}: ok, {plural(out.files, 'file')} verified{by}")
    if not out.ok:
        signed = out.signature or {}
        if signed and len(signed["problems"]) == len(out.problems):  # the bytes are intact
            _damaged(
                f"{out.release}: its signature or provenance does not hold "
                f"({len(out.problems)} problem(s))",
                "do not serve it; reg show names the key, reg keys ls its state",
                json_output,
            )
        _damaged(
            f"{len(out.problems)} damaged file(s) in {out.ref or out.release}",
            "the stored copy is damaged; restore it from another copy",
            json_output,
        )


def _scrub(rate: str | None, every: str | None, limit: int | None, json_output: bool) -> None:
    bps = parse_rate(rate) if rate is not None else None
    if every is not None:
        from cli.schedule import repeat

        def cycle() -> dict[str, object]:
            with open_registry() as reg:
                return reg.scrub(rate=bps, limit=limit).to_json()

        repeat(every, cycle)
        return
    with open_registry() as reg:
        out = reg.scrub(rate=bps, limit=limit, progress=progress_for(json_output))
    if json_output:
        emit_json(out)
    else:
        from registry.core.timeutil import human_bytes
        from registry.text import inert

        for d in out.damaged:
            for p in d["problems"]:
                print(f"{inert(d['target'])}: {inert(p['path'])}: {inert(p['problem'])}")
        print(
            f"scrubbed {out.artifacts} artifact(s), {human_bytes(out.bytes)} in "
            f"{out.seconds:.1f}s ({human_bytes(out.bytes_per_second)}/s)"
        )
    if not out.ok:
        _damaged(
            f"{len(out.damaged)} damaged artifact(s)",
            "`reg verify REF --repair` or `reg fsck --repair` restores recorded versions",
            json_output,
        )


def _damaged(message: str, hint: str, json_output: bool) -> None:
    """Exit 1 with one line on stderr; with --json the report printed is the one document."""
    if json_output:
        note(f"error: {message} ({hint})")
        raise typer.Exit(1)
    raise IntegrityError(message, hint)


def _verify_dir(
    directory: Path, sha256: str | None, public_key: Path | None, json_output: bool
) -> None:
    """Offline: no catalog and no store are opened."""
    from registry.api.offline import read_public_key, verify_folder

    if sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise UsageError(f"--sha256 {sha256[:80]!r} is not a sha256", "64 lowercase hex digits")
    pem = read_public_key(public_key) if public_key is not None else None
    report = verify_folder(directory, expect_sha256=sha256, public_key=pem)
    out = report.to_json()
    name = out.get("ref") or out.get("release")
    if json_output:
        emit_json(out)
    else:
        for p in out["problems"]:
            print(f"{out['dir']}: {p['path']}: {p['problem']}")
        if report.ok:
            from registry.core.timeutil import human_bytes

            pinned = " and its digest" if sha256 else ""
            pinned += ", signed by the pinned key" if pem else ""
            print(
                f"{out['dir']}: ok, {out['files']} files ({human_bytes(out['bytes'])}) match "
                f"the {out['document']}{pinned} of {name} (sha256 {out['document_sha256']})"
            )
            later = ", ".join(out.get("signed_later", []))
            if later and not pem:
                note(
                    f"{later}: added after promotion, and only as model.sig lists them; without "
                    "--public-key nothing here says who signed that list"
                )
    if not report.ok:
        _damaged(
            f"{len(out['problems'])} problem(s) in {out['dir']} (pulled from {name})",
            "pull it again from the registry",
            json_output,
        )


def pin(
    ref: str = typer.Argument(..., help="RUN@stepN."),
    reason: str | None = typer.Option(None, "--reason", help="Why it must be kept."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Protect a checkpoint from retention."""
    with open_registry() as reg:
        out = reg.pin(ref, reason)
    emit_json(out) if json_output else print(f"pinned {out.ref}")


def finish(
    run: str = typer.Argument(..., help="RUN or PROJECT/RUN."),
    status: str = typer.Option(
        "finished", "--status", help="How the job ended: finished, failed or killed."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Say a run's training job ended: its MLflow run stops showing RUNNING."""
    with open_registry() as reg:
        out = reg.finish_run(run, status=status)
    emit_json(out) if json_output else print(f"{out.project}/{out.run}: {out.status}")


def unpin(
    ref: str = typer.Argument(..., help="RUN@stepN."), json_output: bool = JSON_OPTION
) -> None:
    """Remove a pin; retention applies again."""
    with open_registry() as reg:
        out = reg.unpin(ref)
    emit_json(out) if json_output else print(f"unpinned {out.ref}")


def _yes(flag: bool, missing: list[str]) -> str:
    return "yes" if flag else f"no (missing {', '.join(missing)})"
