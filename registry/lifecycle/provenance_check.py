"""`reg verify RELEASE --provenance`: the release's signature and provenance agree
with the catalog.

    - the catalog records a signature, by a key it knows and has not revoked;
    - `model.sig` in the store is the recorded one, a valid signature by that key over exactly
      the release's files as the catalog records them (release.json included);
    - the provenance statement is the recorded one, its subjects are the release's weights and
      extras with their digests, and what it says of the source checkpoint (ref, manifest
      digest, world size) and of the validation (id, device, world size, passed, attested)
      is what the catalog says.

The bytes of every file are re-hashed by `reg verify` itself; this checks what they claim.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from registry.catalog.models import Checkpoint, Project, Run
from registry.core.layout import RELEASE_DOCUMENT, release_prefix
from registry.errors import IntegrityError, RegistryError
from registry.trust import signed_facts as facts
from registry.trust.release_signing import bundle
from registry.trust.release_signing.keys import REVOKED, find
from registry.trust.release_signing.provenance import CARD_FILE, MAX_PROVENANCE, PROVENANCE_FILE

if TYPE_CHECKING:
    from registry.formats.documents import FileRecord
    from registry.lifecycle.context import Context
    from registry.lifecycle.views import ReleaseView

GENERATED = (PROVENANCE_FILE, CARD_FILE, RELEASE_DOCUMENT, bundle.SIGNATURE_FILE)


def check(ctx: Context, view: ReleaseView, files: list[FileRecord]) -> dict[str, Any]:
    """{"ok", "key_id", "key_state", "problems": [{"path", "problem"}]} for `view`, whose
    stored files (release.json included) are `files`."""
    sig = view.signature
    if sig is None:
        return _report(None, None, [("model.sig", "the release is not signed")])
    problems: list[tuple[str, str]] = []
    with ctx.catalog.session() as s:
        key = find(s, sig.key_id, ctx.audit_key)
        forged = ctx.audit_key is not None and not facts.signed_ids(
            s,
            ctx.audit_key,
            facts.RELEASE_SIGNATURE,
            {sig.id or 0: facts.release_signature_content(sig)},
        )
        source = s.get(Checkpoint, view.row.source_checkpoint_id)
        run = s.get(Run, source.run_id) if source is not None else None
        owner = s.get(Project, run.project_id) if run is not None else None
        where = None
        if source is not None and run is not None and owner is not None:
            where = f"{owner.name}/{run.name}@step{source.step}"
    if forged:
        problems.append(("model.sig", "its signature record does not carry the server's MAC"))
    if key is None:
        problems.append(("model.sig", f"signed by key {sig.key_id[:16]}, which is not known"))
    elif key.state == REVOKED:
        problems.append(("model.sig", f"signed by key {sig.key_id[:16]}, revoked: {key.reason}"))
    by_path = {f.path: f for f in files}
    prefix = release_prefix(view.model.name, view.row.version)
    signature = _read(ctx, prefix, by_path.get(bundle.SIGNATURE_FILE), sig.sha256, problems)
    if signature is not None and key is not None:
        covered = {f.path: f.sha256 for f in files if f.path != bundle.SIGNATURE_FILE}
        try:
            bundle.check_folder(signature, key.public_pem, covered)
        except IntegrityError as exc:
            problems.append(("model.sig", str(exc)))
    statement = _read(ctx, prefix, by_path.get(PROVENANCE_FILE), sig.provenance_sha256, problems)
    if statement is not None:
        try:
            doc = json.loads(statement)
            problems += _disagreements(doc, view, files, source, where)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            problems.append((PROVENANCE_FILE, "not a provenance statement reg wrote"))
    return _report(sig.key_id, key.state if key else "unknown", problems)


def _read(
    ctx: Context,
    prefix: str,
    record: FileRecord | None,
    recorded: str,
    problems: list[tuple[str, str]],
) -> bytes | None:
    if record is None:
        problems.append(("?", f"a file of sha256 {recorded[:12]} is recorded but not listed"))
        return None
    if record.sha256 != recorded or record.size > MAX_PROVENANCE:
        problems.append((record.path, "is not the file the signature record names"))
        return None
    try:
        info = ctx.store.head(prefix + record.path, version=record.version)
        if info is None or info.size != record.size:  # read nothing larger than recorded
            problems.append((record.path, "is missing, or not the size recorded"))
            return None
        data = bytes(ctx.store.get_bytes(prefix + record.path, version=record.version))
    except RegistryError as exc:
        problems.append((record.path, str(exc)))
        return None
    if hashlib.sha256(data).hexdigest() != recorded:
        problems.append((record.path, "its sha256 is not the one recorded"))
        return None
    return data


def _disagreements(
    doc: dict[str, Any],
    view: ReleaseView,
    files: list[FileRecord],
    source: Checkpoint | None,
    where: str | None,
) -> list[tuple[str, str]]:
    out = []
    subjects = {s["name"]: s["digest"]["sha256"] for s in doc["subject"]}
    # README.md is reg's card unless an extra of that name is among the subjects
    generated = set(GENERATED) - ({CARD_FILE} if CARD_FILE in subjects else set())
    released = {f.path: f.sha256 for f in files if f.path not in generated}
    if subjects != released:
        out.append((PROVENANCE_FILE, "its subjects are not the release's files and digests"))
    build = doc["predicate"]["buildDefinition"]
    params, dep = build["externalParameters"], build["resolvedDependencies"][0]
    if params.get("release") != view.name:
        out.append((PROVENANCE_FILE, f"names release {params.get('release')}, not {view.name}"))
    if source is not None:
        if params.get("source") != where or dep["digest"]["sha256"] != source.manifest_sha256:
            out.append((PROVENANCE_FILE, f"names another source than {where} as recorded"))
        if dep["annotations"]["world_size"] != source.world_size:
            out.append((PROVENANCE_FILE, "names another world size than the source's"))
    v, said = view.validation, doc["predicate"]["runDetails"]["byproducts"][0]["annotations"]
    if v is not None:
        recorded = (v.id, v.device, v.device_name, v.world_size, bool(v.passed), bool(v.attested))
        claimed = (
            said["id"],
            said["device"],
            said["device_name"],
            said["world_size"],
            said["passed"],
            said["attested"],
        )
        if recorded != claimed:
            out.append((PROVENANCE_FILE, "says another validation than the catalog records"))
    return out


def _report(
    key_id: str | None, key_state: str | None, problems: list[tuple[str, str]]
) -> dict[str, Any]:
    return {
        "ok": not problems,
        "key_id": key_id,
        "key_state": key_state,
        "problems": [{"path": p, "problem": m} for p, m in problems],
    }
