"""Bring the journal's decisions back into the catalog (`reg catalog rebuild`).

`read` takes every object under `journal/` that reads strictly and, where the registry has an
audit key, carries a valid signature; the rest is skipped, each with its reason. Events an
`aborted` event names were never committed and are left out.

Replaying writes catalog rows only: no journal events, no audit events per decision, no
outbox events for MLflow, no deletes (a replayed yank does not unpublish again). It is
idempotent: a row the event made is recognized by its time (the journal records the time the
row holds), so a second rebuild changes nothing. A target that is not in the catalog (a release
whose release.json is gone, a collected checkpoint) is skipped and reported.

    validations   first (releases restored next link to them, as release.json names them)
    policies      by version; a version the catalog holds with other text is reported
    aliases       in order; the history row of each move is recognized by its time
    yank/deprecate  per release, the strongest (a yank is final)
    pin/unpin     per checkpoint, the last one
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session, select

from registry.catalog import queries
from registry.catalog.models import (
    DELETED,
    DEPRECATED,
    RELEASE_PENDING,
    YANKED,
    Alias,
    AliasEvent,
    Checkpoint,
    Model,
    PolicyDocument,
    Release,
    Validation,
)
from registry.errors import InvalidDocument, PolicyError, RegistryError
from registry.journal.event import (
    ABORTED,
    ALIAS,
    DEPRECATE,
    MAX_BYTES,
    PIN,
    POLICY,
    UNPIN,
    VALIDATION,
    YANK,
    Event,
    parse,
    signature_problem,
)
from registry.layout import JOURNAL
from registry.storage.base import ObjectInfo

if TYPE_CHECKING:
    from registry.context import Context

SAME_TIME = 1e-6  # seconds: a float time read back from either catalog
CURRENT, REPLAYED = "current", "replayed"


class Skip(Exception):
    """This event cannot be replayed (the message says why); the others go on."""


@dataclass
class Replay:
    """What a rebuild did with the journal (its JSON is part of rebuild's)."""

    dry_run: bool
    events: list[Event] = field(default_factory=list)  # live, verified, in time order
    replayed: Counter[str] = field(default_factory=Counter)
    current: Counter[str] = field(default_factory=Counter)
    aborted: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    validations: dict[tuple[str, str, int, int], int] = field(default_factory=dict)

    def skip(self, key: str, reason: str) -> None:
        self.skipped.append({"event": key, "reason": reason})

    def to_json(self) -> dict[str, Any]:
        return {
            "events_replayed": dict(sorted(self.replayed.items())),
            "events_current": dict(sorted(self.current.items())),
            "events_aborted": self.aborted,
            "events_skipped": self.skipped,
        }

    def validation_for(self, project: str, run: str, step: int, old_id: int | None) -> int | None:
        """The row a validation the journal names by its original id is now."""
        return None if old_id is None else self.validations.get((project, run, step, old_id))


def read(ctx: Context, *, dry_run: bool) -> Replay:
    """Every event in the store that may be replayed (read `ctx.workers` at a time)."""
    out = Replay(dry_run)
    found: list[Event] = []
    objects = list(ctx.store.list(JOURNAL))
    with ThreadPoolExecutor(max_workers=max(1, ctx.workers)) as pool:
        loaded = list(pool.map(lambda obj: _load(ctx, obj), objects))
    for obj, result in zip(objects, loaded, strict=True):
        if isinstance(result, str):
            out.skip(obj.key, result)
        else:
            found.append(result)
    aborted = {e.target["event"] for e in found if e.kind == ABORTED}
    out.aborted = len(aborted & {e.id for e in found})
    # in the order they were decided (an event's time is the catalog row's; a backfilled
    # event is written late but carries its row's time), then as written
    out.events = sorted(
        (e for e in found if e.kind != ABORTED and e.id not in aborted), key=lambda e: (e.ts, e.id)
    )
    return out


def _load(ctx: Context, obj: ObjectInfo) -> Event | str:
    """The event, or why it is not taken."""
    if obj.size > MAX_BYTES:
        return f"{obj.size} bytes, over {MAX_BYTES}: not read"
    try:
        e = parse(_read_capped(ctx, obj.key), obj.key)
    except InvalidDocument as exc:
        return exc.message
    except RegistryError as exc:  # gone since it was listed, or the store failed
        return f"cannot be read: {exc.message}"
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # a reader's gap
        return f"cannot be parsed: {type(exc).__name__}: {str(exc)[:200]}"
    return signature_problem(e, ctx.audit_key) or e


def _read_capped(ctx: Context, key: str) -> bytes:
    """At most MAX_BYTES + 1 bytes (the object may have grown since it was listed)."""
    pieces, size = [], 0
    for piece in ctx.store.stream(key):
        pieces.append(piece)
        size += len(piece)
        if size > MAX_BYTES:
            break
    return b"".join(pieces)


# -- applying ----------------------------------------------------------------------------------


def apply_validations(ctx: Context, out: Replay) -> None:
    for e in out.events:
        if e.kind == VALIDATION:
            _one(ctx, out, e, [e], _validation)


def apply_decisions(ctx: Context, out: Replay) -> None:
    for e in out.events:
        if e.kind == POLICY:
            _one(ctx, out, e, [e], _policy)
    for e in out.events:
        if e.kind == ALIAS:
            _one(ctx, out, e, [e], _alias)
    for last, group in _grouped(out.events, (YANK, DEPRECATE), ("model", "version"), _strongest):
        _one(ctx, out, last, group, _status)
    for last, group in _grouped(out.events, (PIN, UNPIN), ("project", "run", "step"), _last):
        _one(ctx, out, last, group, _pin)


def _grouped(
    events: list[Event], kinds: tuple[str, ...], by: tuple[str, ...], pick: Any
) -> list[tuple[Event, list[Event]]]:
    groups: dict[tuple[Any, ...], list[Event]] = {}
    for e in events:
        if e.kind in kinds:
            groups.setdefault(tuple(e.target[k] for k in by), []).append(e)
    return [(pick(group), group) for group in groups.values()]


def _last(group: list[Event]) -> Event:
    return group[-1]


def _strongest(group: list[Event]) -> Event:
    yanks = [e for e in group if e.kind == YANK]
    return (yanks or group)[-1]


def _one(ctx: Context, out: Replay, e: Event, group: list[Event], apply: Any) -> None:
    """Apply `e` (standing for `group`) in its own transaction; count every event of the group."""
    try:
        with ctx.catalog.session(write=not out.dry_run) as s:
            result = apply(s, e, out)
    except Skip as exc:
        for each in group:
            out.skip(each.key, f"{each.describe()}: {exc}")
        return
    except (RegistryError, SQLAlchemyError) as exc:
        text = exc.message if isinstance(exc, RegistryError) else str(exc).splitlines()[0]
        for each in group:
            out.skip(each.key, f"{each.describe()}: the catalog refused it: {text}")
        return
    counter = out.replayed if result == REPLAYED else out.current
    for each in group:
        counter[each.kind] += 1


def _checkpoint(s: Session, t: dict[str, Any]) -> Checkpoint:
    run = queries.find_run(s, t["project"], t["run"])
    ckpt = None
    if run is not None:
        ckpt = s.exec(
            select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.step == t["step"])
        ).first()
    if ckpt is None:
        raise Skip("the checkpoint is not in the catalog (nor in the store)")
    return ckpt


def _release(s: Session, t: dict[str, Any]) -> tuple[Model, Release]:
    model = s.exec(select(Model).where(Model.name == t["model"])).first()
    release = None
    if model is not None:
        release = s.exec(
            select(Release).where(Release.model_id == model.id, Release.version == t["version"])
        ).first()
    if model is None or release is None or release.status == RELEASE_PENDING:
        raise Skip("the release is not in the catalog (its release.json is not in the store)")
    return model, release


def _validation(s: Session, e: Event, out: Replay) -> str:
    t, f = e.target, e.fact
    ckpt = _checkpoint(s, t)
    row = next(
        (
            v
            for v in s.exec(select(Validation).where(Validation.checkpoint_id == ckpt.id)).all()
            if abs(v.created_at - e.ts) < SAME_TIME and v.device == f["device"]
        ),
        None,
    )
    if row is None and out.dry_run:
        return REPLAYED
    result = CURRENT
    if row is None:
        row = Validation(
            checkpoint_id=ckpt.id or 0,
            passed=f["passed"],
            device=f["device"],
            device_name=f["device_name"],
            torch_version=f["torch_version"],
            world_size=f["world_size"],
            seconds=f["seconds"],
            phases=f["phases"],
            checks=f["checks"],
            created_at=e.ts,
            created_by=e.actor,
            # attested only where the server's signature proves the server recorded it
            attested=f["attested"] and e.mac is not None,
            model_path=f["model_path"],
            mode=f["mode"],
            driver=f["driver"],
        )
        s.add(row)
        s.flush()
        result = REPLAYED
    if not out.dry_run:
        out.validations[(t["project"], t["run"], t["step"], f["validation_id"])] = row.id or 0
    return result


def _policy(s: Session, e: Event, out: Replay) -> str:
    from policies.loader import parse_policy

    version, text, digest = e.target["version"], e.fact["text"], e.fact["sha256"]
    row = s.exec(select(PolicyDocument).where(PolicyDocument.version == version)).first()
    if row is not None:
        if row.sha256 != digest:
            raise Skip(f"the catalog's policy v{version} is another document ({row.sha256[:12]})")
        return CURRENT
    try:
        parse_policy(text, f"policy v{version}")
    except PolicyError as exc:  # a policy this reg cannot read would lock every client out
        raise Skip(f"the policy does not read: {exc.message}") from None
    if out.dry_run:
        return REPLAYED
    s.add(
        PolicyDocument(
            version=version, text=text, sha256=digest, applied_at=e.ts, applied_by=e.actor
        )
    )
    return REPLAYED


def _alias(s: Session, e: Event, out: Replay) -> str:
    model, release = _release(s, e.target)
    name = e.fact["alias"]
    history = s.exec(
        select(AliasEvent).where(
            AliasEvent.model_id == model.id,
            AliasEvent.name == name,
            AliasEvent.to_version == release.version,
        )
    ).all()
    if any(abs(h.ts - e.ts) < SAME_TIME for h in history):
        return CURRENT  # this move is in the catalog, and the pointer moved with it
    if out.dry_run:
        return REPLAYED
    row = s.exec(select(Alias).where(Alias.model_id == model.id, Alias.name == name)).first()
    if row is None:
        row = Alias(model_id=model.id or 0, name=name, release_id=0, updated_at=0, updated_by="")
    row.release_id, row.updated_at, row.updated_by = release.id or 0, e.ts, e.actor
    s.add(row)
    s.add(
        AliasEvent(
            model_id=model.id or 0,
            name=name,
            from_version=e.fact["from"],
            to_version=release.version,
            ts=e.ts,
            actor=e.actor,
        )
    )
    return REPLAYED


def _status(s: Session, e: Event, out: Replay) -> str:
    _, release = _release(s, e.target)
    status = YANKED if e.kind == YANK else DEPRECATED
    if release.status in (status, YANKED):
        return CURRENT  # a yank is final; a deprecation is there already
    if out.dry_run:
        return REPLAYED
    release.status, release.status_reason = status, e.fact["reason"]
    release.status_changed_at, release.status_changed_by = e.ts, e.actor
    s.add(release)
    return REPLAYED


def _pin(s: Session, e: Event, out: Replay) -> str:
    ckpt = _checkpoint(s, e.target)
    if ckpt.state == DELETED:
        raise Skip(f"the checkpoint was collected ({ckpt.delete_reason})")
    pinned = e.kind == PIN
    reason = e.fact.get("reason") if pinned else None
    by = e.actor if pinned else None
    if (ckpt.pinned, ckpt.pin_reason, ckpt.pinned_by) == (pinned, reason, by):
        return CURRENT
    if not pinned and not ckpt.pinned:
        return CURRENT
    if out.dry_run:
        return REPLAYED
    ckpt.pinned, ckpt.pin_reason, ckpt.pinned_by = pinned, reason, by
    s.add(ckpt)
    return REPLAYED
