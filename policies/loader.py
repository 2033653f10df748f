"""Policy documents: TOML overlaid on the shipped default, validated into typed models.

A bad document is refused with the file, the line where the key is, the key and what was
expected. Durations are written "30s", "15m", "24h", "7d", "2w" or "never"; sizes "500GB",
"20TB", "1.5TiB" or "none".
"""

from __future__ import annotations

import copy
import fnmatch
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from policies import DEFAULT_POLICY_PATH
from policies.durations import NEVER, parse_duration
from policies.layouts import RESUME_CLASSES
from policies.workflow import WEBHOOK_EVENTS, check_url
from registry.errors import PolicyError

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGTP]?i?B|B)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1}
for _i, _p in enumerate("KMGTP", start=1):
    _SIZE_UNITS[f"{_p}B"] = 1000**_i
    _SIZE_UNITS[f"{_p}IB"] = 1024**_i


def parse_size(value: str | int | None) -> int | None:
    """Bytes; None for "none"."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"expected a size of at least 1 byte, or 'none', got {value!r}")
        return value
    text = str(value).strip()
    if text.lower() == "none":
        return None
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"expected a size like '500GB', '20TB' or 'none', got {value!r}")
    unit = (match.group(2) or "").upper()
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise ValueError(f"expected a size of at least 1 byte, or 'none', got {value!r}")
    return size


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KeepBest(_Model):
    metric: str
    mode: Literal["min", "max"] = "min"
    n: int = Field(default=1, ge=1, le=10**9)


class RetentionRules(_Model):
    keep_last: int = Field(default=3, ge=1, le=10**9)
    keep_every_steps: int = Field(default=0, ge=0, le=10**18)
    milestone_ttl: float = NEVER
    ttl: float = 7 * 86400
    keep_best: KeepBest | None = None
    max_bytes: int | None = None
    orphan_grace: float = 86400

    @field_validator("milestone_ttl", "ttl", "orphan_grace", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int | None:
        return parse_size(v)


class RetentionPolicy(RetentionRules):
    projects: dict[str, RetentionRules] = Field(default_factory=dict)

    def for_project(self, project: str) -> RetentionRules:
        return self.projects.get(project, self)


ValidationMode = Literal["streamed", "sharded", "whole", "resharded"]
VALIDATION_MODES: tuple[ValidationMode, ...] = ("streamed", "sharded", "whole", "resharded")


class PromotionPolicy(_Model):
    require_device: Literal["cuda", "any"] = "cuda"
    require_resumable: bool = True
    probe_rtol: float = Field(default=1e-3, ge=0, le=1e6, allow_inf_nan=False)
    # The validation modes a promotion accepts (registry/lifecycle/validation/modes.py).
    modes: list[ValidationMode] = Field(
        default_factory=lambda: list(VALIDATION_MODES), min_length=1
    )
    # Only validations whose probe ran count (one skipped for the memory budget does not).
    require_probe: bool = False
    # Sign every release: "auto" = behind `reg server` yes (a promotion without an
    # active signing key is refused), embedded where a key exists (`reg keys create`).
    require_signature: Literal["auto"] | bool = "auto"


class ResumePolicy(_Model):
    """Overrides of the checkpoint layouts (policies/layouts.py). Left out, each layout's own
    rules apply: `model_key` and `required` are None unless the document writes them."""

    model_key: str | None = None  # where the model is; "" = keys no other class claims
    required: list[str] | None = None  # replaces every layout's required classes
    classes: dict[str, list[str]] = Field(default_factory=dict)  # key paths added to a class

    @field_validator("required")
    @classmethod
    def _known(cls, v: list[str] | None) -> list[str] | None:
        unknown = [c for c in v or [] if c not in RESUME_CLASSES]
        if unknown:
            raise ValueError(
                f"unknown resume class {unknown[0]!r}; known: {', '.join(RESUME_CLASSES)}"
            )
        return v

    @field_validator("classes")
    @classmethod
    def _paths(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, paths in v.items():
            if name not in RESUME_CLASSES or name == "model":
                raise ValueError(
                    f"unknown resume class {name!r} (model is placed by model_key); known: "
                    f"{', '.join(RESUME_CLASSES[1:])}"
                )
            for path in paths:
                _key_path(path)
        return v

    @field_validator("model_key")
    @classmethod
    def _model_path(cls, v: str | None) -> str | None:
        return v if not v else _key_path(v)


def _key_path(path: str) -> str:
    if not path or len(path) > 1024 or any(not s for s in path.split(".")):
        raise ValueError(f"{path!r} is not a dotted key path such as 'app.model'")
    return path


class ReleasePolicy(_Model):
    object_lock: Literal["GOVERNANCE", "COMPLIANCE", "off"] = "GOVERNANCE"
    lock_days: int = Field(default=3650, ge=1, le=36500)  # S3 allows 100 years
    # Extras that are code (modeling_*.py, auto_map in a config): refused unless true; a
    # release made with some records them (registry/formats/extras.py has the rule).
    allow_code_extras: bool = False


PRINCIPAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


class Grant(_Model):
    principals: list[str]
    role: Literal["viewer", "trainer", "releaser", "admin", "validator"]
    projects: list[str] = Field(default_factory=lambda: ["*"])
    # None (the key left out): the models its projects own (a model belongs to the project it
    # was first released from); only an explicit list crosses projects.
    models: list[str] | None = None

    @field_validator("principals")
    @classmethod
    def _principals(cls, v: list[str]) -> list[str]:
        for p in v:
            if not PRINCIPAL.fullmatch(p):
                raise ValueError(
                    f"invalid principal {p!r}: letters, digits, . _ @ - only, no globs"
                )
        return v

    @field_validator("projects", "models")
    @classmethod
    def _globs(cls, v: list[str] | None) -> list[str] | None:
        for g in v or ():
            if not g or not re.fullmatch(r"[A-Za-z0-9._*?-]+", g):
                raise ValueError(f"invalid glob {g!r}: use names with * and ? only")
            fnmatch.translate(g)
        return v


_GLOB = re.compile(r"[A-Za-z0-9._*?-]{1,128}")
_WEBHOOK_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def _principal_or_role(value: str) -> str:
    """`alice` or `role:releaser` (a role includes the roles above it)."""
    role = value.removeprefix("role:")
    if role != value:
        if role not in ("viewer", "trainer", "releaser", "admin", "validator"):
            raise ValueError(f"unknown role in {value!r}: viewer, trainer, releaser, admin")
        return value
    if not PRINCIPAL.fullmatch(value):
        raise ValueError(f"invalid principal {value!r}: a name, or role:NAME")
    return value


class ProtectedAlias(_Model):
    """An alias that moves only when `approvals` distinct approvers, never its requester,
    approved that exact version (`registry.lifecycle.alias_requests`)."""

    alias: str  # a name or a glob
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    approvers: list[str] = Field(min_length=1)
    # None: whoever may move the model's aliases (the alias action) may ask
    requesters: list[str] | None = None
    approvals: int = Field(default=1, ge=1, le=20)
    expires: float = 7 * 86400

    @field_validator("alias")
    @classmethod
    def _alias_glob(cls, v: str) -> str:
        if not _GLOB.fullmatch(v):
            raise ValueError(f"invalid alias glob {v!r}: use names with * and ? only")
        return v

    @field_validator("models")
    @classmethod
    def _model_globs(cls, v: list[str]) -> list[str]:
        for g in v:
            if not _GLOB.fullmatch(g):
                raise ValueError(f"invalid glob {g!r}: use names with * and ? only")
        return v

    @field_validator("approvers", "requesters")
    @classmethod
    def _who(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [_principal_or_role(p) for p in v]

    @field_validator("expires", mode="before")
    @classmethod
    def _expiry(cls, v: Any) -> float:
        seconds = parse_duration(v)
        if not 1 <= seconds <= 366 * 86400:
            raise ValueError(f"expected a duration from 1s to 366d, got {v!r}")
        return seconds


class Webhook(_Model):
    """An HTTP subscriber (`registry.integrations.webhooks`): POSTs of the events it names,
    signed with HMAC-SHA256 under the secret in `secret_file` (read by the server alone)."""

    name: str
    url: str = Field(max_length=2048)
    events: list[str] = Field(min_length=1)
    secret_file: str
    allow_private: bool = False  # loopback and private addresses, and plain http

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _WEBHOOK_NAME.fullmatch(v):
            raise ValueError(f"invalid webhook name {v!r}: a-z, 0-9, _ and -, at most 64")
        return v

    @field_validator("events")
    @classmethod
    def _events(cls, v: list[str]) -> list[str]:
        for name in v:
            if name != "*" and name not in WEBHOOK_EVENTS:
                raise ValueError(f"unknown event {name!r}; known: {', '.join(WEBHOOK_EVENTS)}")
        return v

    @field_validator("secret_file")
    @classmethod
    def _secret_path(cls, v: str) -> str:
        if not v.startswith("/") or "\x00" in v:
            raise ValueError(f"secret_file {v!r} must be an absolute path on the server")
        return v

    @model_validator(mode="after")
    def _url(self) -> Webhook:
        check_url(self.url, allow_private=self.allow_private)
        return self


class AccessPolicy(_Model):
    grants: list[Grant] = Field(default_factory=list)
    aws: dict[str, str] = Field(default_factory=dict)


class Policy(_Model):
    retention: RetentionPolicy = Field(default_factory=RetentionPolicy)
    promotion: PromotionPolicy = Field(default_factory=PromotionPolicy)
    resume: ResumePolicy = Field(default_factory=ResumePolicy)
    release: ReleasePolicy = Field(default_factory=ReleasePolicy)
    access: AccessPolicy = Field(default_factory=AccessPolicy)
    # The release workflow (policies/workflow.py): aliases that move only once
    # approved, and the HTTP subscribers told what happened.
    protected_aliases: list[ProtectedAlias] = Field(default_factory=list, max_length=1000)
    webhooks: list[Webhook] = Field(default_factory=list, max_length=100)

    @field_validator("webhooks")
    @classmethod
    def _unique_names(cls, v: list[Webhook]) -> list[Webhook]:
        seen: set[str] = set()
        for hook in v:
            if hook.name in seen:
                raise ValueError(f"two webhooks are named {hook.name!r}: names are unique")
            seen.add(hook.name)
        return v


def _overlay(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _overlay(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _default_document() -> dict[str, Any]:
    return tomllib.loads(DEFAULT_POLICY_PATH.read_text())


def _line_of(text: str, key: str) -> int | None:
    pattern = re.compile(rf"^\s*\"?{re.escape(key)}\"?\s*=", re.MULTILINE)
    match = pattern.search(text)
    return text.count("\n", 0, match.start()) + 1 if match else None


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}", "fix the syntax") from exc
    # Per-project overrides overlay the project's effective retention rules, not the bare model.
    retention = document.get("retention", {})
    if isinstance(retention, dict) and isinstance(retention.get("projects"), dict):
        base = _overlay(_default_document()["retention"], retention)
        base.pop("projects", None)
        for name, override in retention["projects"].items():
            if isinstance(override, dict):
                retention["projects"][name] = _overlay(base, override)
    merged = _overlay(_default_document(), document)
    try:
        return Policy.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = ".".join(str(p) for p in err["loc"])
        last = next((str(p) for p in reversed(err["loc"]) if isinstance(p, str)), path)
        line = _line_of(text, last)
        where = f"{source}:{line}" if line else source
        message = err["msg"].removeprefix("Value error, ")
        raise PolicyError(f"{where}: {path}: {message}", "see policies/default.toml") from None


def load_policy_file(path: Path) -> Policy:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror}", "check REG_POLICY") from exc
    return parse_policy(text, str(path))


def default_policy() -> Policy:
    return parse_policy("", str(DEFAULT_POLICY_PATH))
