"""Strict readers of JSON documents: every value checked for its shape, every failure an
`InvalidDocument` naming the document and the key (one line, no traceback)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from registry.core.refs import CheckpointRef, check_name, parse_checkpoint_ref
from registry.errors import InvalidDocument, RegistryError

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9._=-][A-Za-z0-9._=+-]*")


class StrictReader:
    """Reads one document (`where` names it in every error)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def error(self, key: str, problem: str) -> InvalidDocument:
        return InvalidDocument(
            f"{self.where}: {key} {problem}",
            "the stored document is damaged or was not written by reg",
        )

    def document(self, data: bytes, formats: tuple[str, ...]) -> dict[str, Any]:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidDocument(
                f"{self.where}: not JSON ({exc})", "the stored document is damaged"
            ) from None
        except RecursionError:
            raise InvalidDocument(
                f"{self.where}: nested too deeply to be a reg document",
                "the stored document is damaged or crafted",
            ) from None
        if not isinstance(doc, dict):
            raise self.error("document", "is not a JSON object")
        if doc.get("format") not in formats:
            raise self.error(
                "format", f"is {doc.get('format')!r}; this reg reads {', '.join(formats)}"
            )
        return doc

    def keys(self, doc: dict[str, Any], names: str, where: str = "") -> None:
        wanted = set(names.split())
        unknown, missing = sorted(set(doc) - wanted), sorted(wanted - set(doc))
        label = f"{where}." if where else ""
        if unknown:
            raise self.error(f"{label}{unknown[0]}", "is not a known key")
        if missing:
            raise self.error(f"{label}{missing[0]}", "is missing")

    def mapping(self, value: Any, key: str, names: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(key, "is not an object")
        self.keys(value, names, key)
        return value

    def integer(
        self, value: Any, key: str, *, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        """A whole number in [minimum, maximum), always below 2^63 (the catalog's BIGINT)."""
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"is {value!r}, not a whole number")
        if minimum is not None and value < minimum:
            raise self.error(key, f"is {value}, below {minimum}")
        if value >= (maximum if maximum is not None else 2**63):
            raise self.error(key, f"is {value}, too large")
        return value

    def number(self, value: Any, key: str) -> float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.error(key, f"is {value!r}, not a number")
        if not math.isfinite(value):
            raise self.error(key, f"is {value!r}, not a finite number")
        return float(value)

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, f"is {value!r}, not true or false")
        return value

    def text(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(key, f"is {value!r}, not a non-empty string")
        return self.unicode(value, key)

    def unicode(self, value: str, key: str) -> str:
        """JSON can carry lone surrogates, which no database or terminal takes."""
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise self.error(key, "is not valid UTF-8 text") from None
        return value

    def digest(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not _SHA256.fullmatch(value):
            raise self.error(key, f"is {value!r}, not a lowercase hex sha256")
        return value

    def name(self, value: Any, key: str) -> str:
        try:
            return check_name(self.text(value, key), key)
        except RegistryError as exc:
            raise self.error(key, f"is not a valid name ({exc.message})") from None

    def timestamp(self, value: Any, key: str) -> str:
        try:
            when = datetime.fromisoformat(self.text(value, key).replace("Z", "+00:00"))
        except ValueError:
            raise self.error(key, f"is {value!r}, not an ISO 8601 time") from None
        if when.tzinfo is None:
            raise self.error(key, f"is {value!r}, a time without its zone (write Z for UTC)")
        return str(value)

    def checkpoint_ref(self, value: Any, key: str) -> CheckpointRef:
        try:
            ref = parse_checkpoint_ref(self.text(value, key))
        except RegistryError as exc:
            raise self.error(key, f"is not a checkpoint ref ({exc.message})") from None
        if ref.step is None:
            raise self.error(key, f"is {value!r}, which names no step")
        return ref

    def optional(self, value: Any, read: Callable[[Any, str], Any], key: str) -> Any:
        return None if value is None else read(value, key)

    def string_list(self, value: Any, key: str) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "is not a list of strings")
        return [self.unicode(v, key) for v in value]

    def string_map(self, value: Any, key: str) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self.error(key, "is not an object of strings")
        return {self.unicode(k, key): self.unicode(v, key) for k, v in value.items()}

    def relative_path(self, value: Any, key: str) -> str:
        path = self.text(value, key)
        parts = path.split("/")
        if any(not _PATH_SEGMENT.fullmatch(p) or p.startswith("..") for p in parts):
            raise self.error(key, f"is {path!r}, not a safe relative path")
        return path
