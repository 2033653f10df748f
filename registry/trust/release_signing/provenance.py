"""A release's provenance statement and model card, written into the release before
it is signed, so `model.sig` covers them.

The statement is an in-toto Statement v1 with an SLSA Provenance v1 predicate: its subjects
are the release's weights and extras (path and sha256); its build definition names the
checkpoint (ref and manifest digest, world size) and the promotion's options; its run details
carry the validation the promotion relied on (device, device name, world size, each check and
whether it passed, the probe, who validated, attested or not), the reg version and the time.
`reg verify RELEASE --provenance` checks it against the catalog.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from registry.formats.documents import FileRecord

PROVENANCE_FILE = "provenance.intoto.json"
CARD_FILE = "README.md"  # the Hugging Face model card's name
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://reg.dev/promote/v1"
BUILDER = "reg promote"
MAX_PROVENANCE = 16 * 1024 * 1024  # read back from a folder or the store: bounded


def reg_version() -> str:
    try:
        return version("reg")
    except PackageNotFoundError:
        return "unknown"


def statement(
    *,
    release: str,
    files: Sequence[FileRecord],
    source: str,
    manifest_sha256: str,
    world_size: int,
    options: Mapping[str, Any],
    validation: Mapping[str, Any],
    created_at: str,
    created_by: str,
    signed_later: bool = False,
) -> dict[str, Any]:
    """The statement (deterministic for one release: a rerun of a killed promotion writes the
    same bytes). `signed_later`: made by `reg sign-release` for a release committed unsigned
    (from what the catalog recorded of it, its files re-hashed first)."""
    metadata: dict[str, Any] = {
        "invocationId": release,
        "startedOn": created_at,
        "promotedBy": created_by,
    }
    if signed_later:
        metadata["signedAfterPromotion"] = True
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f.path, "digest": {"sha256": f.sha256}} for f in files],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"release": release, "source": source, **options},
                "internalParameters": {"reg_version": reg_version()},
                "resolvedDependencies": [
                    {
                        "uri": f"reg:checkpoint/{source}",
                        "digest": {"sha256": manifest_sha256},
                        "annotations": {"world_size": world_size},
                    }
                ],
            },
            "runDetails": {
                "builder": {"id": BUILDER, "version": {"reg": reg_version()}},
                "metadata": metadata,
                "byproducts": [{"name": "validation", "annotations": dict(validation)}],
            },
        },
    }


def to_bytes(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def validation_record(row: Any) -> dict[str, Any]:
    """What the statement says of a validation row: enough to see what was proved where."""
    checks = [
        {"name": str(c.get("name")), "passed": bool(c.get("passed"))}
        for c in row.checks
        if isinstance(c, dict)
    ]
    probe = next((c for c in row.checks if isinstance(c, dict) and c.get("name") == "probe"), None)
    return {
        "id": row.id,
        "passed": bool(row.passed),
        "device": row.device,
        "device_name": row.device_name,
        "world_size": row.world_size,
        "torch_version": row.torch_version,
        "mode": row.mode,
        "checks": checks,
        "probe": None
        if probe is None
        else {"passed": bool(probe.get("passed")), "detail": str(probe.get("detail", ""))},
        "validated_by": row.created_by,
        "attested": bool(row.attested),
    }


def _plain(text: object) -> str:
    """Text from a recorded field, made inert in Markdown (a table cell, no HTML, no code)."""
    out = str(text)
    for char in "\\`*_[]<>|#":
        out = out.replace(char, "\\" + char)
    return " ".join(out.split())


def card(doc: Mapping[str, Any]) -> bytes:
    """A model card (README.md) made from the provenance statement; recorded text (device
    names, probe details, names) is escaped, so the signed card renders only what reg wrote."""
    build = doc["predicate"]["buildDefinition"]
    params = build["externalParameters"]
    dep = build["resolvedDependencies"][0]
    run = doc["predicate"]["runDetails"]
    v = run["byproducts"][0]["annotations"]
    checks = ", ".join(
        f"{_plain(c['name'])} {'ok' if c['passed'] else 'FAILED'}" for c in v.get("checks", [])
    )
    later = run["metadata"].get("signedAfterPromotion")
    version = _plain(run["builder"]["version"]["reg"])
    lines = [
        f"# {params['release']}",
        "",
        f"Promoted{'' if later else ' by `reg` ' + version} from "
        f"checkpoint `{params['source']}` (manifest sha256 `{dep['digest']['sha256']}`, world "
        f"size {dep['annotations']['world_size']}) by {_plain(run['metadata']['promotedBy'])} "
        f"at {run['metadata']['startedOn']}."
        + (
            f" Signed after promotion by `reg sign-release` ({version}),"
            " its stored bytes re-hashed against the registry first."
            if later
            else ""
        ),
        "",
        "## Validation",
        "",
    ]
    if not v:
        lines.append("- none recorded")
    else:
        lines += [
            f"- {'passed' if v['passed'] else 'FAILED'} on {_plain(v['device'])} "
            f"({_plain(v['device_name'])}), world size {v['world_size']}, torch "
            f"{_plain(v['torch_version'])}, by {_plain(v['validated_by'])}"
            f"{' (attested)' if v['attested'] else ''}",
            f"- checks: {checks or 'none recorded'}",
        ]
    if v.get("probe"):
        lines.append(
            f"- probe: {'ok' if v['probe']['passed'] else 'FAILED'} {v['probe']['detail']}"
        )
    lines += ["", "## Files", "", "| file | sha256 |", "|---|---|"]
    lines += [f"| {_plain(s['name'])} | `{s['digest']['sha256']}` |" for s in doc["subject"]]
    lines += [
        "",
        "## Verifying",
        "",
        f"`model.sig` covers every file of this folder (this card, `{PROVENANCE_FILE}` and "
        "`release.json` included). With the registry's public key pinned as `reg.pub`:",
        "",
        "```",
        "model_signing verify key . --signature model.sig --public_key reg.pub",
        "```",
        "",
    ]
    return "\n".join(lines).encode()
