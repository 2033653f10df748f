"""What only the catalog's owner runs, where the catalog is and never through `reg server`: the
schema migrated and a runtime role's least-privilege grants (`reg catalog migrate|grants`), and
the rows written before signed facts and the journal signed and journaled (`reg catalog
sign|backfill-journal`). Each opens the embedded registry under the owner's settings.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from policies.resume import resume_overrides
from registry.api.local import LocalRegistry
from registry.catalog import grants
from registry.core.config import Settings
from registry.errors import UsageError
from registry.journal.backfill import backfill
from registry.lifecycle.checkpoints.resume_changes import record_all
from registry.operations.fact_signing import sign_catalog as sign


def migrate_catalog(settings: Settings, grant: Sequence[str] = ()) -> dict[str, Any]:
    """The schema brought to this reg's head by its owner, each role in `grant` given its grants
    again, then the key paths recorded of checkpoints committed before the catalog kept them
    (from each one's .metadata in the store); `warnings`: what the policy in force overrides."""
    out = grants.migrate(settings, grant)
    with LocalRegistry(settings) as reg:
        out["key_paths"] = record_all(reg.context)
        out["warnings"] = resume_overrides(reg.context.policy.resume)
    return out


def grant_runtime_role(settings: Settings, role: str, *, dry_run: bool = False) -> dict[str, Any]:
    """`role` given least privilege on the catalog (PostgreSQL): read and append history, update
    only what the server updates, no DDL. `dry_run`: the SQL, nothing changed."""
    return grants.grant(settings, role, dry_run=dry_run)


def sign_catalog(settings: Settings, *, dry_run: bool = False) -> dict[str, Any]:
    """Sign the policy documents, attested validations and model owners written before signed
    facts, each checked against the audit log first (with the server's audit key)."""
    with _on_the_catalogs_host(settings, "sign", "and REG_AUDIT_KEY_FILE") as reg:
        return sign(reg.context, dry_run=dry_run)


def backfill_journal(settings: Settings, *, dry_run: bool = False) -> dict[str, Any]:
    """Journal what the catalog decided before it had a journal, each with its row's time and
    author, so `reg catalog rebuild` can replay it. Idempotent."""
    with _on_the_catalogs_host(settings, "backfill-journal") as reg:
        return backfill(reg.context, dry_run=dry_run)


@contextmanager
def _on_the_catalogs_host(
    settings: Settings, command: str, also: str = ""
) -> Iterator[LocalRegistry]:
    """The embedded registry: the work needs the catalog and the store themselves."""
    if settings.remote:
        raise UsageError(
            f"reg catalog {command} runs on the server's host, not through the server",
            f"unset REG_URL; run it with the server's settings {also}".rstrip(),
        )
    with LocalRegistry(settings) as reg:
        yield reg
