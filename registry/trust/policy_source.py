"""The policy in force (DESIGN §6): the document an admin applied to the catalog; until one is
applied, `REG_POLICY`, else `REG_HOME/policy.toml`, else the shipped `policies/default.toml`.

Once a policy is applied, local files are ignored with a warning, so a client cannot grant
itself rights by pointing `REG_POLICY` elsewhere. The document is read when a Context is made
(one query); it is validated only when a rule is first asked for, and single-user mode (no
grants) is decided from the TOML alone, so `reg ls` pays for neither pydantic nor validation.
"""

from __future__ import annotations

import tomllib
import warnings
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from policies import DEFAULT_POLICY_PATH
from policies.loader import parse_policy
from registry.errors import PolicyError, UnprovenFact

if TYPE_CHECKING:
    from collections.abc import Callable

    from policies.loader import (
        AccessPolicy,
        Policy,
        PromotionPolicy,
        ReleasePolicy,
        ResumePolicy,
        RetentionPolicy,
    )
    from registry.catalog.engine import Catalog
    from registry.core.config import Settings
    from registry.storage.base import BaseStore


class EffectivePolicy:
    def __init__(self, text: str, source: str, since: float | None = None) -> None:
        self.text = text
        self.source = source  # where it came from, for people: a path or "catalog policy vN"
        # When it took effect: applied to the catalog, or the file's last change (a webhook
        # subscriber it adds gets the events from then on); None: the shipped default.
        self.since = since

    @classmethod
    def for_server(
        cls,
        catalog: Catalog,
        store: BaseStore,
        key: bytes,
        *,
        policy_path: Path | None,
        home: Path,
    ) -> EffectivePolicy:
        """The policy in force behind `reg server`: the newest one proven applied by an admin
        (signed, sealed and anchored: `registry.trust.proven_policy`), never merely the newest row.
        UnprovenFact when the catalog's policy cannot be proven: the server then decides
        nothing. Until any policy is applied, the local file, as `load`."""
        from registry.trust.proven_policy import in_force

        found = in_force(catalog, store, key)
        if found.error is not None:
            raise found.error
        if found.version is None:
            return cls._local(policy_path, home)
        return cls(found.text, found.source, found.applied_at)

    @classmethod
    def in_force(
        cls,
        catalog: Catalog,
        settings: Settings,
        key: bytes | None,
        store: Callable[[], BaseStore],
    ) -> EffectivePolicy:
        """The policy an embedded process decides under: proven (`on_host`) where it holds the
        audit key, else as `load` finds it. `store` is opened only to prove one."""
        path, home = settings.policy_path, settings.home
        if key is None:
            return cls.load(catalog, policy_path=path, home=home)
        return cls.on_host(catalog, store(), key, policy_path=path, home=home)

    @classmethod
    def on_host(
        cls,
        catalog: Catalog,
        store: BaseStore,
        key: bytes,
        *,
        policy_path: Path | None,
        home: Path,
    ) -> EffectivePolicy:
        """An embedded process that holds the audit key (the server's host) decides as the
        server does, under the proven policy: it signs what it decides, and the server will
        trust that. When the catalog's policy cannot be proven, under this host's own file
        (`REG_POLICY`, else the shipped default), with a warning: never under a row anyone
        could have written, and the operator can still restore it (`reg policy apply`,
        `reg catalog sign`)."""
        try:
            return cls.for_server(catalog, store, key, policy_path=policy_path, home=home)
        except UnprovenFact as exc:
            warnings.warn(
                f"{exc.message}; this host decides under its own policy file instead",
                stacklevel=3,
            )
            local = cls._local(policy_path, home)
            source = f"{local.source} (the catalog's policy is unproven)"
            return cls(local.text, source, local.since)

    @classmethod
    def load(cls, catalog: Catalog, *, policy_path: Path | None, home: Path) -> EffectivePolicy:
        local = policy_path or home / "policy.toml"
        with catalog.dbapi() as (conn, _):
            cursor = conn.cursor()
            cursor.execute(
                "SELECT version, text, applied_by, applied_at FROM policy_document "
                "ORDER BY version DESC LIMIT 1"
            )
            applied = cursor.fetchone()
            cursor.close()
        if applied is not None:
            if policy_path is not None or local.exists():
                warnings.warn(
                    f"ignoring {local}: the catalog has policy v{applied[0]} applied, "
                    "which every client uses",
                    stacklevel=3,
                )
            source = f"catalog policy v{applied[0]} (applied by {applied[2]})"
            return cls(applied[1], source, applied[3])
        return cls._local(policy_path, home)

    @classmethod
    def _local(cls, policy_path: Path | None, home: Path) -> EffectivePolicy:
        local = policy_path or home / "policy.toml"
        path = policy_path or (local if local.exists() else DEFAULT_POLICY_PATH)
        try:
            text = Path(path).read_text()
            since = None if path == DEFAULT_POLICY_PATH else Path(path).stat().st_mtime
            return cls(text, str(path), since)
        except OSError as exc:
            raise PolicyError(
                f"cannot read policy {path}: {exc.strerror}", "check REG_POLICY"
            ) from exc

    @cached_property
    def rules(self) -> Policy:
        """The whole document, validated (a bad one is a PolicyError naming file:line)."""
        return parse_policy(self.text, self.source)

    @cached_property
    def has_grants(self) -> bool:
        """Whether the document grants anything. Anything but a clear "no" counts as yes, so a
        malformed document is validated (and refused) rather than read as single-user mode."""
        try:
            access = tomllib.loads(self.text).get("access", {})
        except tomllib.TOMLDecodeError:
            return True
        return not isinstance(access, dict) or access.get("grants") not in (None, [])

    @cached_property
    def has_webhooks(self) -> bool:
        """Whether the document names webhook subscribers (from the TOML alone)."""
        try:
            return bool(tomllib.loads(self.text).get("webhooks"))
        except tomllib.TOMLDecodeError:
            return False

    @property
    def retention(self) -> RetentionPolicy:
        return self.rules.retention

    @property
    def promotion(self) -> PromotionPolicy:
        return self.rules.promotion

    @property
    def resume(self) -> ResumePolicy:
        return self.rules.resume

    @property
    def release(self) -> ReleasePolicy:
        return self.rules.release

    @property
    def access(self) -> AccessPolicy:
        return self.rules.access
