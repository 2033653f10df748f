"""`reg show` for a person: one headline, aligned `label  value` lines, sections for what is
nested, tables for lists of records. Nothing unknown or empty is printed as `None`; sizes read
as sizes, flags as yes/no, digests in tables cut to their first 16 characters (the full ones,
and the raw shape, are behind `--json`). Fields this module does not know still print, under
their own names: a new result field is never hidden.
"""

from __future__ import annotations

from typing import Any

from registry.core.timeutil import human_bytes

_SIZES = {"bytes", "tensor_bytes", "size", "freed_bytes"}
_SECONDS = {"seconds", "upload_seconds", "restore_seconds", "save_seconds"}
_LABELS = {
    "world_size": "world size",
    "world_size_inferred": "world size inferred",
    "upload_seconds": "upload took",
    "tensor_count": "tensors",
    "tensor_bytes": "tensor bytes",
    "pushed_by": "pushed by",
    "created_at": "created",
    "created_by": "created by",
    "uri": "stored at",
    "sha256": "sha256",
    "manifest_sha256": "manifest sha256",
}
# Shown in the headline, not again below it.
_HEADLINE = {"ref", "release", "state", "status"}
# Maps whose keys are the user's or the layout's names (metrics, resume classes): printed as
# they are, never relabelled or read as sizes.
_NAMED_BY_USER = {"metrics", "resume_state"}
_DIGEST_CELL = 16


def render_details(doc: dict[str, Any]) -> str:
    """The text `reg show` prints for one checkpoint (`ref`) or release (`release`)."""
    lines = [_headline(doc)]
    scalars = {k: v for k, v in doc.items() if k not in _HEADLINE and not _is_nested(v)}
    lines += _aligned(scalars, "  ")
    for key, value in doc.items():
        if key in _HEADLINE or not _is_nested(value) or _empty(value):
            continue
        lines += ["", _label(key)]
        lines += _nested(value, "  ", raw=key in _NAMED_BY_USER)
    return "\n".join(lines) + "\n"


def _headline(doc: dict[str, Any]) -> str:
    if "release" in doc:
        what = f"release {doc['release']}"
        state = doc.get("status")
    else:
        what = f"checkpoint {doc.get('ref')}"
        state = doc.get("state")
    facts = [str(state)] if state else []
    if doc.get("pinned"):
        facts.append("pinned")
    if doc.get("resumable") is False:
        facts.append("not resumable")
    return f"{what} ({', '.join(facts)})" if facts else what


def _is_nested(value: Any) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(v, dict) for v in value)
    )


def _empty(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


def _label(key: str) -> str:
    return _LABELS.get(key, key.replace("_", " "))


def _aligned(fields: dict[str, Any], indent: str, raw: bool = False) -> list[str]:
    if raw:
        shown = [(k, _value("", v)) for k, v in fields.items() if not _empty(v)]
    else:
        shown = [(_label(k), _value(k, v)) for k, v in fields.items() if not _empty(v)]
    width = max((len(label) for label, _ in shown), default=0)
    return [f"{indent}{label.ljust(width)}  {value}" for label, value in shown]


def _nested(value: Any, indent: str, raw: bool = False) -> list[str]:
    if isinstance(value, dict):
        lines = _aligned({k: v for k, v in value.items() if not _is_nested(v)}, indent, raw)
        for key, inner in value.items():
            if _is_nested(inner) and not _empty(inner):
                lines += [f"{indent}{key if raw else _label(key)}"]
                lines += _nested(inner, indent + "  ", raw)
        return lines
    records = [v for v in value if isinstance(v, dict)]
    return _table(records, indent)


def _table(records: list[dict[str, Any]], indent: str) -> list[str]:
    """Records as columns: only the columns some record has a value in."""
    columns = [
        k
        for k in dict.fromkeys(k for r in records for k in r)
        if any(not _empty(r.get(k)) for r in records)
    ]
    cells = [[_label(c).upper() for c in columns]]
    cells += [[_cell(c, r.get(c)) for c in columns] for r in records]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return [
        (indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))).rstrip()
        for row in cells
    ]


def _cell(key: str, value: Any) -> str:
    if _empty(value):
        return ""
    if key == "sha256" and isinstance(value, str) and len(value) > _DIGEST_CELL:
        return value[:_DIGEST_CELL] + "..."
    return _value(key, value)


def _value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key == "version" and isinstance(value, int):
        return f"v{value}"
    if key in _SIZES and isinstance(value, int):
        return human_bytes(value)
    if key in _SECONDS and isinstance(value, int | float):
        return f"{value:.3g} s"
    if isinstance(value, list):
        return ", ".join(_value(key, v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={_value(k, v)}" for k, v in value.items() if not _empty(v))
    return str(value)
