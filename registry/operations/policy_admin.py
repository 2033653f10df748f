"""The effective policy lives in the catalog: apply (admin, versioned, audited), show, check."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from sqlalchemy import func
from sqlmodel import select

from policies.access import Action, check_grants, scoped_admin_grants
from policies.export import bucket_policy
from policies.loader import Policy, Webhook, load_policy_file, parse_policy
from policies.resume import resume_overrides
from registry.catalog.models import PolicyDocument
from registry.core.timeutil import now
from registry.errors import PolicyError, RegistryError, UnprovenFact, UsageError
from registry.journal.event import POLICY
from registry.journal.write import record as journal_record
from registry.lifecycle.checkpoints.resume_changes import emit_changes, undecided
from registry.lifecycle.retention import emit_expiry_changes
from registry.trust import signed_facts
from registry.trust.audit_chain.service import seal_now
from registry.trust.proven_policy import in_force
from registry.trust.signed_facts import model_owners
from registry.trust.webhook_signatures import read_secret

if TYPE_CHECKING:
    from registry.lifecycle.context import Context


IN_FORCE_WAIT_S = 10.0  # how long an apply waits for a concurrent sealer's anchor


def check(path: Path) -> Policy:
    return load_policy_file(path)


def apply(ctx: Context, path: Path) -> dict[str, Any]:
    """Store the policy in the catalog (admin): versioned and audited; every client uses it
    from now on (the caller makes a new Context to see it)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror}") from exc
    return apply_text(ctx, text, str(path))


def apply_text(ctx: Context, text: str, name: str) -> dict[str, Any]:
    """`apply` of a document already read (`name` says where it came from, for errors)."""
    ctx.authorize(Action.POLICY, target=f"policy {name}")
    parsed = parse_policy(text, name)  # refused before anything is stored
    _keeps_an_admin(ctx, parsed, name)
    digest = hashlib.sha256(text.encode()).hexdigest()
    with ctx.catalog.session(write=True) as s:
        version = (s.exec(select(func.max(PolicyDocument.version))).one() or 0) + 1
        applied = now()
        row = PolicyDocument(
            version=version, text=text, sha256=digest, applied_at=applied, applied_by=ctx.actor
        )
        s.add(row)
        s.flush()
        if ctx.audit_key is not None:  # the server (or its host): signed, proven in force
            signed_facts.sign(
                s,
                ctx.audit_key,
                signed_facts.POLICY,
                row.id or 0,
                signed_facts.policy_content(row),
                signed_by=ctx.actor,
            )
        ctx.audit(
            s,
            "policy-apply",
            f"policy v{version}",
            sha256=digest,
            version=version,
            grants=len(parsed.access.grants),
        )
        changed = emit_changes(ctx, s, ctx.policy.resume, parsed.resume)
        expiry_changed = emit_expiry_changes(ctx, s, ctx.policy.retention, parsed.retention)
        # last: the commit follows it (registry.journal.write); the grants are in the text
        journal_record(
            ctx, s, POLICY, {"version": version}, {"text": text, "sha256": digest}, ts=applied
        )
    if ctx.audit_key is not None:  # in force now, not after the sealer's next anchor
        _in_force_now(ctx, version)
    return {
        "version": version,
        "sha256": digest,
        "grants": len(parsed.access.grants),
        "resume_changed": changed,  # checkpoints whose resume verdict the new policy changes
        "expiry_changed": expiry_changed,  # checkpoints whose retention it changes
        # committed before the catalog kept key paths: not decided until `reg catalog migrate`
        # (or their first show, pull, validate or promote) records them
        "resume_undecided": len(undecided(ctx)),
        "warnings": resume_overrides(parsed.resume) + _webhook_warnings(parsed.webhooks),
    }


def _webhook_warnings(hooks: list[Webhook]) -> list[str]:
    """Subscribers whose secret file this process (the server, embedded the user) cannot use:
    applied all the same (the file may come later), their deliveries wait and say why."""
    out = []
    for hook in hooks:
        try:
            read_secret(hook.secret_file)
        except RegistryError as exc:
            out.append(f"webhook {hook.name}: {exc.message}; its deliveries wait until it is fixed")
    return out


def _in_force_now(ctx: Context, version: int) -> None:
    """The applied version is the proven one (`registry.trust.proven_policy`); else the apply is
    recorded but decides nothing, and the admin must hear it (a seal row written around the
    sealer can keep its event from being sealed)."""
    assert ctx.audit_key is not None
    # The server's sealer may seal the event between our seal and our anchor (it commits its
    # seal after we read the head): then the head we anchored is older than the event's seal,
    # and sealing and anchoring again settles it. Only that waits, and boundedly; an event
    # that will never be proven (unsigned, forged, a broken chain) is named at once.
    deadline = time.monotonic() + IN_FORCE_WAIT_S
    while True:
        seal_now(ctx.catalog, ctx.store, ctx.audit_key)
        found = in_force(ctx.catalog, ctx.store, ctx.audit_key)
        if found.version == version:
            return
        why = next(
            (line for line in found.ignored if line.startswith(f"policy v{version}:")),
            found.error.message if found.error else "its apply event is not sealed and anchored",
        )
        waiting = why.endswith(("not anchored yet", "not sealed yet"))
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    raise UnprovenFact(
        f"policy v{version} is recorded but not in force: {why}",
        "reg audit verify names what keeps the audit chain from sealing it",
    )


def _keeps_an_admin(ctx: Context, policy: Policy, path: str) -> None:
    """A policy with grants must leave someone, and the one applying it, able to administer:
    otherwise no one could ever apply the next policy."""
    grants = policy.access.grants
    if not grants and ctx.server:
        raise PolicyError(
            f"{path}: access.grants: none; refused: behind reg server that would make every "
            "token holder an admin",
            "keep the admin grants (reg policy show prints the policy in force)",
        )
    if not grants:
        return  # single-user mode: everyone is admin
    scoped = scoped_admin_grants(grants)
    if scoped:
        raise PolicyError(
            f"{path}: {scoped[0]}; refused",
            'an admin grant has projects = ["*"] and models = ["*"]; use releaser or trainer '
            "for one project or model",
        )
    if not any(g.role == "admin" for g in grants):
        raise PolicyError(
            f'{path}: access.grants: no grant has role = "admin"; refused',
            "keep at least one admin grant, or no one could apply the next policy",
        )
    if not check_grants(grants, ctx.principal.name, Action.POLICY).allowed:
        raise PolicyError(
            f"{path}: access.grants: {ctx.principal.name} (applying it) would no longer be "
            "an admin; refused",
            f"add {ctx.principal.name} to an admin grant, or have another admin apply it",
        )


def show(ctx: Context) -> dict[str, Any]:
    ctx.authorize_read()  # grants and ARNs are for the registry's users, not for anyone
    policy = ctx.policy
    return {
        "source": policy.source,
        "document": policy.text,
        "effective": policy.rules.model_dump(mode="json"),
    }


def export(ctx: Context, bucket: str | None = None) -> tuple[dict[str, Any], list[str]]:
    ctx.authorize(Action.POLICY, target="policy export")
    prefix = ""
    if bucket is None:
        url = urlparse(ctx.store.url)
        if url.scheme != "s3":
            raise UsageError(
                "the store is not on S3; say which bucket the policy is for",
                "reg policy export --bucket NAME[/PREFIX]",
            )
        bucket, prefix = url.netloc, url.path.strip("/")
    else:
        bucket, _, prefix = bucket.partition("/")

    with ctx.catalog.session() as s:
        owners = model_owners(s, ctx.audit_key if ctx.server else None)
    return bucket_policy(ctx.policy.access, bucket, prefix, owners)
