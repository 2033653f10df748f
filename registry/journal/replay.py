"""Bring the journal's decisions back into the catalog (`reg catalog rebuild`).

`read` takes every object under `journal/` that reads strictly, passes the checks the live
commands make (names, aliases, reasons, the actor, a time that is plausible and the event's own)
and, where the registry has an audit key, carries a valid signature; the rest is skipped, each
with its reason. Events an `aborted` event names were never committed and are left out. A
journal that holds signed events is not replayed at all without its key (UsageError, exit 2:
the rebuild is run again with REG_AUDIT_KEY_FILE pointing at the key's backup).

Replay restores only what was lost. The catalog is the truth for every row it still holds: a
decision is applied only onto what this rebuild re-created (a pin or validation onto a
checkpoint whose row it added, a yank or deprecation onto a release it added, an alias move
where the model row is new or every release the model's alias events name was added, a policy
when the catalog holds no policy document at all). Every other event is `current`. Of several
events for one target only the one applied counts as replayed; the others are `superseded`.

Replaying writes catalog rows only: no journal events, no audit events per decision, no
outbox events for MLflow, no deletes (a replayed yank does not unpublish again). It is
idempotent: a second rebuild re-creates nothing, so it applies nothing. A target that is not
in the catalog (a release whose release.json is gone, a collected checkpoint) is skipped and
reported.

    validations   first (releases restored next link to them, as release.json names them)
    policies      by version, only into a catalog without any
    aliases       in order, per model; the history row of each move is recognized by its time
    yank/deprecate  per release, the strongest (a yank is final)
    pin/unpin     per checkpoint, the last one
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session, select

from policies.loader import parse_policy
from policies.workflow import protection_for
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
from registry.core.config import checked_user
from registry.core.layout import JOURNAL
from registry.core.refs import check_alias, check_reason
from registry.errors import InvalidDocument, PolicyError, RegistryError, UsageError
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
from registry.storage.base import ObjectInfo
from registry.trust import audit, signed_facts
from registry.trust.audit_chain.keys import key_id

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

SAME_TIME = 1e-6  # seconds: a float time read back from either catalog
CURRENT, REPLAYED = "current", "replayed"
EARLIEST = 946_684_800.0  # 2000-01-01T00:00:00Z: no reg decision is older


class Skip(Exception):
    """This event cannot be replayed (the message says why); the others go on."""


@dataclass
class Replay:
    """What a rebuild did with the journal (its JSON is part of rebuild's)."""

    dry_run: bool
    events: list[Event] = field(default_factory=list)  # live, verified, in time order
    replayed: Counter[str] = field(default_factory=Counter)
    current: Counter[str] = field(default_factory=Counter)
    superseded: Counter[str] = field(default_factory=Counter)
    unsigned: int = 0  # replayed events without a signature (no audit key: trusted as stored)
    aborted: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    validations: dict[tuple[str, str, int, int], int] = field(default_factory=dict)
    # what this rebuild re-created (rebuild.py fills these in): replay applies onto these only
    checkpoints: set[tuple[str, str, int]] = field(default_factory=set)
    releases: set[tuple[str, int]] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    # With the audit key, what replay writes that the server decides from is signed
    # (`registry.trust.signed_facts`), by whoever runs the rebuild.
    audit_key: bytes | None = field(default=None, repr=False)
    actor: str = ""

    def skip(self, key: str, reason: str) -> None:
        self.skipped.append({"event": key, "reason": reason})

    def to_json(self) -> dict[str, Any]:
        return {
            "events_replayed": dict(sorted(self.replayed.items())),
            "events_current": dict(sorted(self.current.items())),
            "events_superseded": dict(sorted(self.superseded.items())),
            "events_unsigned": self.unsigned,
            "events_aborted": self.aborted,
            "events_skipped": self.skipped,
        }

    def validation_for(self, project: str, run: str, step: int, old_id: int | None) -> int | None:
        """The row a validation the journal names by its original id is now."""
        return None if old_id is None else self.validations.get((project, run, step, old_id))


def read(ctx: Context, *, dry_run: bool) -> Replay:
    """Every event in the store that may be replayed (read `ctx.workers` at a time). A journal
    with signed events and no key to check them is refused whole (UsageError), before anything
    is changed: replaying it unchecked would take whatever a store writer added."""
    out = Replay(dry_run, audit_key=ctx.audit_key, actor=ctx.actor)
    found: list[Event] = []
    objects = list(ctx.store.list(JOURNAL))
    with ThreadPoolExecutor(max_workers=max(1, ctx.workers)) as pool:
        loaded = list(pool.map(lambda obj: _load(ctx, obj), objects))
    for obj, result in zip(objects, loaded, strict=True):
        if isinstance(result, str):
            out.skip(obj.key, result)
        else:
            found.append(result)
    _refuse_without_key(ctx, found)
    trusted: list[Event] = []
    for e in found:
        problem = signature_problem(e, ctx.audit_key) or _implausible(e)
        if problem:
            out.skip(e.key, problem)
        else:
            trusted.append(e)
    aborted = {e.target["event"] for e in trusted if e.kind == ABORTED}
    out.aborted = len(aborted & {e.id for e in trusted})
    # in the order they were decided (an event's time is the catalog row's; a backfilled
    # event is written late but carries its row's time), then as written
    out.events = sorted(
        (e for e in trusted if e.kind != ABORTED and e.id not in aborted),
        key=lambda e: (e.ts, e.id),
    )
    return out


def _refuse_without_key(ctx: Context, events: list[Event]) -> None:
    signed = sorted({e.key_id for e in events if e.key_id is not None})
    if not signed:
        return
    hint = (
        "put the key's backup where REG_AUDIT_KEY_FILE names (default REG_HOME/audit.key) and "
        "run the rebuild again; without it a forged event cannot be told from a genuine one"
    )
    if ctx.audit_key is None:
        raise UsageError(
            f"the journal is signed (key id {', '.join(signed)}) and this registry has no "
            "audit key: nothing replayed",
            hint,
        )
    if not any(e.mac is not None and signature_problem(e, ctx.audit_key) is None for e in events):
        raise UsageError(
            f"no event in the journal is signed with this registry's audit key (key id "
            f"{key_id(ctx.audit_key)}; the journal's: {', '.join(signed)}): nothing replayed",
            hint,
        )


def _implausible(e: Event) -> str | None:
    """What the live command would have refused in this event (None: nothing)."""
    if not EARLIEST <= e.ts <= time.time() + 86_400:
        return f"its time {e.ts!r} is before 2000 or more than a day ahead"
    if abs(e.ts - int(e.id.partition("-")[0]) / 1e9) > 1.0:
        return f"its time {e.ts!r} is not the time its id names"
    try:
        # as an identity is checked where it is taken (REG_USER, a login, a token's principal)
        checked_user(e.actor, "its actor")
        if e.kind == ALIAS:
            check_alias(e.fact["alias"])
        if e.kind in (PIN, YANK, DEPRECATE):
            reason = check_reason(e.fact["reason"], f"{e.kind} reason")
            if e.kind == YANK and not (reason and reason.strip()):
                return "a yank without a reason"
    except UsageError as exc:
        return exc.message
    return None


def _load(ctx: Context, obj: ObjectInfo) -> Event | str:
    """The event, or why it is not taken (its signature is checked by `read`)."""
    if obj.size > MAX_BYTES:
        return f"{obj.size} bytes, over {MAX_BYTES}: not read"
    try:
        return parse(_read_capped(ctx, obj.key), obj.key)
    except InvalidDocument as exc:
        return exc.message
    except RegistryError as exc:  # gone since it was listed, or the store failed
        return f"cannot be read: {exc.message}"
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # a reader's gap
        return f"cannot be parsed: {type(exc).__name__}: {str(exc)[:200]}"


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
    with ctx.catalog.session() as s:  # a catalog with a policy keeps its own
        has_policy = s.exec(select(PolicyDocument.id).limit(1)).first() is not None
    for e in out.events:
        if e.kind == POLICY:
            if has_policy:
                out.current[POLICY] += 1
            else:
                _one(ctx, out, e, [e], _policy)
    yanked: dict[tuple[str, int], float] = {}
    for e in out.events:
        if e.kind == YANK:
            yanked.setdefault((e.target["model"], e.target["version"]), e.ts)
    policies = [e for e in out.events if e.kind == POLICY]  # in time order, as events are
    for model, moves in _grouped(out.events, (ALIAS,), ("model",), _last):
        del model
        lost = moves[0].target["model"] in out.models or all(
            (m.target["model"], m.target["version"]) in out.releases for m in moves
        )
        for e in moves:
            if not lost:
                out.current[ALIAS] += 1
                continue
            since = yanked.get((e.target["model"], e.target["version"]))
            if since is not None and since <= e.ts:
                out.skip(e.key, f"{e.describe()}: the release was yanked before it")
                continue
            unapproved = _unapproved(ctx, e, policies)
            if unapproved:
                out.skip(e.key, f"{e.describe()}: {unapproved}")
                continue
            _one(ctx, out, e, [e], _alias)
    for last, group in _grouped(out.events, (YANK, DEPRECATE), ("model", "version"), _strongest):
        if (last.target["model"], last.target["version"]) in out.releases:
            _one(ctx, out, last, group, _status)
        else:
            out.current.update(e.kind for e in group)
    for last, group in _grouped(out.events, (PIN, UNPIN), ("project", "run", "step"), _last):
        if tuple(last.target[k] for k in ("project", "run", "step")) in out.checkpoints:
            _one(ctx, out, last, group, _pin)
        else:
            out.current.update(e.kind for e in group)


def _unapproved(ctx: Context, e: Event, policies: list[Event]) -> str | None:
    """Why a move of a protected alias may not be replayed. A signed event (its MAC checked by
    `read`) was written by the command, through the protection: it stands. An unsigned one
    must record as many distinct approvers, none its requester, as the rule in force at its
    time asked: the journal's last policy before it, else (none journaled: a policy file) the
    one in force now. So an event a store writer added moves nothing the command would not
    have, and a move made before its alias was protected is not undone."""
    if e.mac is not None:
        return None
    model, alias = e.target["model"], e.fact["alias"]
    earlier = [p for p in policies if p.ts <= e.ts]
    try:
        if earlier:
            then = earlier[-1]
            rules = parse_policy(then.fact["text"], f"journal policy v{then.target['version']}")
        else:
            rules = ctx.policy.rules
    except PolicyError as exc:
        return f"the policy in force then cannot be read ({exc.message})"
    rule = protection_for(rules.protected_aliases, model, alias)
    if rule is None:
        return None
    requester = e.fact.get("requested_by")
    approvers = {n for n in e.fact.get("approved_by") or () if n != requester}
    if len(approvers) < rule.approvals:
        return (
            f"{model}@{alias} is protected (approvals = {rule.approvals}) and the journal "
            f"records {len(approvers)} approval(s) of this move"
        )
    return None


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
    return (yanks or group)[0 if yanks else -1]  # the first yank: it is final


def _one(ctx: Context, out: Replay, e: Event, group: list[Event], apply: Any) -> None:
    """Apply `e` (standing for `group`) in its own transaction; the others are superseded."""
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
    if result == REPLAYED:
        out.replayed[e.kind] += 1
        out.unsigned += e.mac is None
    else:
        out.current[e.kind] += 1
    out.superseded.update(each.kind for each in group if each is not e)


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
    lost = (t["project"], t["run"], t["step"]) in out.checkpoints
    if row is None and out.dry_run:
        return REPLAYED if lost else CURRENT
    result = CURRENT
    if row is None and lost:  # a checkpoint the catalog kept keeps its own validations
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
        if out.audit_key is not None and row.attested:
            content = signed_facts.validation_content(
                row, signed_facts.subject_of(s, row.checkpoint_id)
            )
            signed_facts.sign(
                s,
                out.audit_key,
                signed_facts.VALIDATION,
                row.id or 0,
                content,
                signed_by=out.actor,
            )
        result = REPLAYED
    if row is not None and not out.dry_run:
        out.validations[(t["project"], t["run"], t["step"], f["validation_id"])] = row.id or 0
    return result


def _policy(s: Session, e: Event, out: Replay) -> str:
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
    row = PolicyDocument(
        version=version, text=text, sha256=digest, applied_at=e.ts, applied_by=e.actor
    )
    s.add(row)
    if out.audit_key is not None and e.mac is not None:
        # A policy the server signed in the journal is in force behind it again once signed
        # and named by an apply event the chain seals (registry.trust.proven_policy).
        s.flush()
        content = signed_facts.policy_content(row)
        signed_facts.sign(
            s, out.audit_key, signed_facts.POLICY, row.id or 0, content, signed_by=out.actor
        )
        audit.record(
            s,
            out.actor,
            "policy-apply",
            f"policy v{version}",
            audit_key=out.audit_key,
            sha256=digest,
            version=version,
            replayed=True,
            applied_by=e.actor,
        )
    return REPLAYED


def _alias(s: Session, e: Event, out: Replay) -> str:
    model, release = _release(s, e.target)
    if release.status == YANKED:
        raise Skip("the release is yanked: an alias cannot point at it")
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
            request_id=e.fact.get("request"),
            requested_by=e.fact.get("requested_by"),
            approved_by=",".join(e.fact["approved_by"]) if e.fact.get("approved_by") else None,
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
