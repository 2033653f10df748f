"""The stages of a promotion after its gates, each recorded on the release row (`stage`):

reserve   the version is allocated atomically (unique per model) on a pending row with a
          claim; a killed promotion's rerun takes over the same row and version
(proved   before reserving: every shard holding model chunks is read once and proved against
          the manifest's sha256, its model chunks kept in a local spool; proven.py)
build     safetensors (+ index) streamed from those proved bytes, then the extras, all
          put-if-absent and immutable (`consolidated`)
commit    release.json written last; the row becomes active in one transaction with its
          files, the alias move, the audit record and the MLflow event (`committed`)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, text
from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import col, select

from policies.access import Action
from policies.layouts import count_under
from registry.catalog import claims
from registry.catalog.claims import Claim
from registry.catalog.mlflow_names import refuse_colliding_model
from registry.catalog.models import (
    ACTIVE,
    RELEASE_PENDING,
    Model,
    Release,
    ReleaseFile,
    Validation,
)
from registry.core import faults
from registry.core.layout import RELEASE_DOCUMENT, checkpoint_prefix, release_prefix
from registry.core.timeutil import iso, now
from registry.errors import Conflict, GateNotMet, IntegrityError
from registry.formats.dcp import Inventory, inventory
from registry.formats.dcp_roots import merged_metadata
from registry.formats.documents import (
    FileRecord,
    ReleaseDocument,
    SourceRecord,
    ValidationRecord,
)
from registry.formats.hf_folder import CONFIG, GENERATION_CONFIG, generation_config
from registry.journal import outbox as events
from registry.lifecycle.alias_workflow import change_alias
from registry.lifecycle.checkpoints.resume_facts import key_paths
from registry.lifecycle.promotion import signed
from registry.lifecycle.promotion.consolidate import Consolidated, consolidate
from registry.lifecycle.promotion.converters import ADAPTER_FILE, Piece, convert, piece_key
from registry.lifecycle.promotion.hf import hf_record
from registry.lifecycle.promotion.proven import ProvenCheckpoint
from registry.lifecycle.promotion.records import Reservation
from registry.lifecycle.transfer import OnMismatch, put_reconciled
from registry.lifecycle.views import ReleaseView
from registry.trust.signed_facts import MODEL, model_content, sign

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.lifecycle.context import Context
    from registry.lifecycle.promotion.plan import PromotionPlan


# -- reserve ------------------------------------------------------------------------------------


class AlreadyReleased(Exception):
    """A concurrent promotion of the same checkpoint with the same options committed first."""


def reserve(ctx: Context, plan: PromotionPlan, validation: Validation) -> Reservation:
    """A pending release row for this promotion: new (the next version) or taken over.
    Raises AlreadyReleased when the same promotion committed meanwhile (decided in the write
    transaction, so two racing promotions make one release)."""
    for _ in range(10):
        with ctx.catalog.session(write=True) as s:
            model = s.exec(select(Model).where(Model.name == plan.model)).first()
            if model is None:
                if not ctx.catalog.is_sqlite:  # new models take turns: one MLflow name each
                    s.connection().execute(text("SELECT pg_advisory_xact_lock(7312, 0)"))
                refuse_colliding_model(s, plan.model)
                try:
                    with s.begin_nested():
                        _create_model(ctx, s, plan)
                except DBIntegrityError:
                    pass  # a concurrent promotion created it
                continue
            if not _may_publish_into(ctx, s, plan, model):
                break  # authorized as a new model, and another project's promotion made it
            if not ctx.catalog.is_sqlite:
                # Promotions of one model take turns from here to commit, so a twin's pending
                # row is seen before a version is allocated (READ COMMITTED would let two both
                # see none). SQLite's write transactions already take turns (BEGIN IMMEDIATE).
                lock = text("SELECT pg_advisory_xact_lock(7312, :model)")
                s.connection().execute(lock, {"model": model.id})
            same = s.exec(
                select(Release).where(
                    Release.model_id == model.id,
                    Release.source_checkpoint_id == plan.checkpoint.id,
                    Release.options_key == plan.options_key,
                    col(Release.status).in_([RELEASE_PENDING, ACTIVE]),
                )
            ).all()
            if any(r.status == ACTIVE for r in same):
                raise AlreadyReleased
            pending = same[0] if same else None
            if pending is not None:
                taken = _take_over(ctx, s, plan, pending, validation)
                if taken is not None:
                    return taken
                continue
            created = _allocate(ctx, s, plan, model, validation)
            if created is not None:
                return created
    else:
        raise Conflict(
            f"could not allocate a version of {plan.model}: too many concurrent promotions",
            "retry",
        )
    # Outside the write transaction: the denial is audited in a transaction of its own.
    ctx.authorize(
        Action.PROMOTE, project=plan.source.project, model=plan.model, target=str(plan.source)
    )
    raise Conflict(f"{plan.model} was created by another promotion meanwhile", "retry")


def _create_model(ctx: Context, session: Any, plan: PromotionPlan) -> None:
    """The model, owned by the project it is first released from; signed where the key is."""
    row = Model(name=plan.model, created_at=now(), project=plan.source.project)
    session.add(row)
    session.flush()
    if ctx.audit_key is not None:
        sign(session, ctx.audit_key, MODEL, row.id or 0, model_content(row), signed_by=ctx.actor)


def _may_publish_into(ctx: Context, session: Any, plan: PromotionPlan, model: Model) -> bool:
    """The promotion was authorized before the model existed (as its owner-to-be); a model that
    another project's promotion created meanwhile is judged by its real owner."""
    if ctx.principal.single_user:
        return True
    owner = ctx.trusted_owner(session, model)
    if owner == plan.source.project:
        return True
    return ctx.principal.authorize(
        Action.PROMOTE, project=plan.source.project, model=plan.model, model_owner=owner
    ).allowed


def _take_over(
    ctx: Context, session: Any, plan: PromotionPlan, pending: Release, validation: Validation
) -> Reservation | None:
    if claims.is_live(pending):
        raise Conflict(
            f"{plan.source} is being promoted to {plan.model}:v{pending.version} by "
            f"{pending.created_by} on {pending.claim_host} (pid {pending.claim_pid})",
            "wait for it; a dead promotion's claim expires within "
            f"{claims.LEASE_SECONDS:.0f}s and a rerun continues it",
        )
    claim = claims.take_over(session, pending)
    if claim is None:
        return None
    # The rerun continues with the attempt's validation, so the files it already wrote (whose
    # metadata names it) stay valid.
    attempt = session.get(Validation, pending.validation_id) if pending.validation_id else None
    return Reservation(claim, pending.version, attempt or validation)


def _allocate(
    ctx: Context, session: Any, plan: PromotionPlan, model: Model, validation: Validation
) -> Reservation | None:
    top = session.exec(select(func.max(Release.version)).where(Release.model_id == model.id)).one()
    token = claims.new_token()
    row = Release(
        model_id=model.id or 0,
        version=(top or 0) + 1,
        status=RELEASE_PENDING,
        source_checkpoint_id=plan.checkpoint.id or 0,
        source_ref=str(plan.source),
        validation_id=validation.id,
        options_key=plan.options_key,
        options=plan.options,
        dtype=plan.dtype,
        created_at=now(),
        created_by=ctx.actor,
        stage="reserved",
        **claims.claim_columns(token),
    )
    try:
        with session.begin_nested():
            session.add(row)
    except DBIntegrityError:
        return None  # another promotion took that version: allocate again
    session.flush()
    return Reservation(Claim(Release, row.id or 0, token), row.version, validation)


def _stage(ctx: Context, reservation: Reservation, stage: str) -> None:
    with ctx.catalog.session(write=True) as s:
        claims.guarded_update(s, reservation.claim, stage=stage)


# -- build --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """The proved model bytes of the checkpoint being promoted."""

    proven: ProvenCheckpoint
    inventory: Inventory
    names: dict[str, Piece]  # release tensor name -> checkpoint FQN (or one layer of one)


@contextmanager
def proved(ctx: Context, plan: PromotionPlan, progress: Progress | None) -> Iterator[Source]:
    """Prove `.metadata` and every shard holding model chunks against the catalog's digests
    (before a version is reserved: a tampered checkpoint consumes nothing)."""
    src = checkpoint_prefix(plan.source.project, plan.source.run, plan.checkpoint.step)
    with ProvenCheckpoint(
        ctx.store, src, plan.files, label=str(plan.source), workers=ctx.workers
    ) as proven:
        inv = inventory(merged_metadata(proven.metadata, light=True))
        names = model_names(plan, inv)
        proven.prove(
            (c for p in names.values() for c in inv.tensors[piece_key(p)].chunks), progress
        )
        yield Source(proven, inv, names)


def model_names(plan: PromotionPlan, inv: Inventory) -> dict[str, Piece]:
    """Release name -> checkpoint FQN, from the proven `.metadata`: its key paths must be the
    ones the catalog recorded (which decided the gates), and the model set must hold model
    tensors and no optimizer state."""
    resume, where = plan.resume, f"{plan.source} ({plan.resume.layout} layout)"
    if key_paths(inv) != plan.facts.keys:
        raise IntegrityError(
            f"{plan.source}: the key paths in its .metadata differ from the catalog's record",
            "the catalog row was changed: run `reg verify` and `reg audit verify`",
        )
    if resume.optimizer_in_model:
        raise GateNotMet(
            f"refusing to promote {where}: the model set holds optimizer state "
            f"({len(resume.optimizer_in_model)} keys, e.g. "
            f"{', '.join(resume.optimizer_in_model[:3])})",
            "set [resume] model_key to the model's own key path, or force the right --layout",
        )
    tensors = sorted(inv.tensors)
    unplaced = {p: count_under(tensors, p) for p in resume.unclassified}
    unplaced = {p: n for p, n in unplaced.items() if n}
    if unplaced and not plan.allow_unclassified:
        count = sum(unplaced.values())
        raise GateNotMet(
            f"refusing to promote {where}: {count} tensors are in no resume class, under "
            f"{', '.join(sorted(unplaced)[:5])}{' ...' if len(unplaced) > 5 else ''}",
            "place them (reg show suggests a --layout or [resume] setting), or leave them out "
            "of the release with --allow-unclassified",
        )
    names = resume.model_names(inv.tensors, plan.strip_prefix)
    if not names:
        shown = f"under {resume.model_path!r}" if resume.model_path else "at the top level"
        raise GateNotMet(
            f"refusing to promote {where}: no model tensors {shown}",
            "force the right --layout, or set [resume] model_key to where the model is "
            f"(reg show {plan.source} suggests one)",
        )
    config = json.loads(plan.hf_config.data) if plan.hf_config else None
    return convert(plan.convert, names, inv.tensors, config)


def build(
    ctx: Context,
    plan: PromotionPlan,
    reservation: Reservation,
    source: Source,
    progress: Progress | None,
) -> Consolidated:
    """Consolidate the model's tensors into safetensors and store the extras."""
    name = f"{plan.model}:v{reservation.version}"
    dest = release_prefix(plan.model, reservation.version)
    validation = reservation.validation
    tie_groups: list[list[str]] = next(
        (c["detail"] for c in validation.checks if c["name"] == "tied_weights"), []
    )
    built = consolidate(
        source.proven,
        source.inventory,
        source.names,
        ctx.store,
        dest,
        cast=plan.dtype,
        max_shard_bytes=plan.max_shard_bytes,
        metadata={
            "format": "pt",
            "reg.release": name,
            "reg.source": str(plan.source),
            "reg.validation_id": str(validation.id),
            "reg.manifest_sha256": plan.checkpoint.manifest_sha256 or "",
        },
        tie_groups=tie_groups,
        progress=progress,
        file_name=ADAPTER_FILE if plan.convert == "peft" else None,
    )
    _stage(ctx, reservation, "consolidated")
    rewritten = plan.hf_config if plan.hf_config and plan.hf_config.changes else None
    for extra in plan.extras:
        if rewritten is not None and extra.name == CONFIG:  # the release's own config.json
            stored = put_reconciled(
                ctx.store,
                dest + extra.name,
                data=rewritten.data,
                immutable=True,
                on_mismatch=OnMismatch.CONFLICT,
            )
            built.files.append(
                FileRecord(extra.name, stored.size, stored.sha256, version=stored.version)
            )
            continue
        stored = put_reconciled(
            ctx.store,
            dest + extra.name,
            **({"data": extra.data} if extra.data is not None else {"path": extra.path}),
            immutable=True,
            on_mismatch=OnMismatch.CONFLICT,
        )
        if stored.sha256 != extra.sha256:
            raise Conflict(f"{extra.label} changed while being promoted", "promote again")
        built.files.append(
            FileRecord(extra.name, stored.size, stored.sha256, version=stored.version)
        )
    built.files.extend(_generation_config(ctx, plan, dest))
    built.files.sort(key=lambda f: f.path)
    faults.point("promote-consolidated")
    return built


def _generation_config(ctx: Context, plan: PromotionPlan, dest: str) -> list[FileRecord]:
    """generation_config.json made from the release's config.json (`hf_folder
    .generation_config`) where the model generates and no extra of that name was given."""
    if plan.hf_config is None or any(e.name == GENERATION_CONFIG for e in plan.extras):
        return []  # no config.json (plan_config reads and checks a given one)
    made = generation_config(plan.hf_config.data)
    if made is None:
        return []
    stored = put_reconciled(
        ctx.store,
        dest + GENERATION_CONFIG,
        data=made,
        immutable=True,
        on_mismatch=OnMismatch.CONFLICT,
    )
    return [FileRecord(GENERATION_CONFIG, stored.size, stored.sha256, version=stored.version)]


# -- commit -------------------------------------------------------------------------------------


def commit(
    ctx: Context,
    plan: PromotionPlan,
    reservation: Reservation,
    built: Consolidated,
    signer: signed.Signer | None = None,
) -> dict[str, Any]:
    """Write release.json last (after the provenance and card where it is signed, then the
    signature over all of it), then make the release visible in one transaction."""
    with ctx.catalog.session() as s:
        row = s.get(Release, reservation.release_id)
        assert row is not None
        created = (row.created_at, row.created_by)
    if signer is not None:
        built.files.extend(signed.add_provenance(ctx, plan, reservation, built.files, created))
        built.files.sort(key=lambda f: f.path)
    document = _document(plan, reservation, built, created)
    data = document.to_bytes()
    stored = put_reconciled(
        ctx.store,
        release_prefix(plan.model, reservation.version) + RELEASE_DOCUMENT,
        data=data,
        immutable=True,
        on_mismatch=OnMismatch.CONFLICT,
    )
    faults.point("promote-documented")
    digest = hashlib.sha256(data).hexdigest()
    files = list(built.files)
    signed_by_key = None
    if signer is not None:
        signature, signed_by_key = signed.sign(ctx, plan, reservation, built.files, digest, signer)
        files.append(signature)
        faults.point("promote-signed")
    uri = ctx.store.describe(release_prefix(plan.model, reservation.version))
    validation = reservation.validation
    with ctx.catalog.session(write=True) as s:
        done = claims.guarded_update(
            s,
            reservation.claim,
            status=ACTIVE,
            sha256=digest,
            document_version=stored.version,
            bytes=sum(f.size for f in files) + len(data),
            tensor_count=built.tensor_count,
            tied=[[a, k] for a, k in sorted(built.tied.items())],
            stage="committed",
            claim_token=None,
            lease_until=None,
        )
        if not done:
            raise Conflict(
                f"lost the claim on {document.release} while promoting",
                "another process took the promotion over; check reg releases",
            )
        s.add_all(ReleaseFile.of(reservation.release_id, f) for f in files)
        if signed_by_key is not None:
            signed.record(ctx, s, reservation.release_id, files, signed_by_key)
        model = s.exec(select(Model).where(Model.name == plan.model)).one()
        release = s.get(Release, reservation.release_id)
        assert release is not None
        _emit_created(ctx, s, plan, reservation, document, digest, uri)
        moved = change_alias(ctx, s, model, plan.alias, release) if plan.alias else {}
        ctx.audit(
            s,
            "promote",
            document.release,
            source=str(plan.source),
            validation_id=validation.id,
            sha256=digest,
            layout=plan.resume.layout,
            model_path=plan.resume.model_path,
            strip_prefix=plan.strip_prefix or None,
            convert=plan.convert,
            base=plan.base.to_json() if plan.base else None,
            forced_layout=plan.layout,
            allow_unclassified=plan.allow_unclassified or None,
        )
        s.flush()
        out = ReleaseView.load(s, model, release).to_json(uri)
        out["alias_request"] = moved.get("request")  # a protected alias: asked, not moved
        return out


def _emit_created(
    ctx: Context,
    session: Any,
    plan: PromotionPlan,
    reservation: Reservation,
    document: ReleaseDocument,
    digest: str,
    uri: str,
) -> None:
    validation = reservation.validation
    ctx.events.emit(
        session,
        events.RELEASE_CREATED,
        model=plan.model,
        version=reservation.version,
        release=document.release,
        sha256=digest,
        uri=uri,
        source=str(plan.source),
        project=plan.source.project,
        run=plan.source.run,
        step=plan.source.step,
        validation_id=validation.id,
        validation_device=validation.device,
        validation_passed=validation.passed,
        files=len(document.files),
    )


def _document(
    plan: PromotionPlan,
    reservation: Reservation,
    built: Consolidated,
    created: tuple[float, str],
) -> ReleaseDocument:
    created_at, created_by = created
    v = reservation.validation
    return ReleaseDocument(
        model=plan.model,
        version=reservation.version,
        files=tuple(built.files),
        source=SourceRecord(
            plan.source, plan.checkpoint.manifest_sha256, plan.checkpoint.world_size
        ),
        validation=ValidationRecord(
            v.id, v.passed, v.device, v.device_name, v.torch_version, v.seconds
        ),
        dtype=plan.dtype,
        tied=built.tied,
        created_at=iso(created_at) or "",
        created_by=created_by,
        hf_config=hf_record(plan.hf_config),
        code_extras=plan.code_extras,
    )
