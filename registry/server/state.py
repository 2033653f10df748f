"""What every request of one `reg server` process reads: its settings, catalog and store, the
OIDC verifier, the upload slots, and the policy in force as proven."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry.trust.audit_chain import keys
from registry.trust.policy_source import EffectivePolicy

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.core.config import Settings
    from registry.server.oidc import OidcVerifier
    from registry.storage.base import BaseStore


@dataclass
class ServerState:
    settings: Settings
    catalog: Catalog
    store: BaseStore
    oidc: OidcVerifier | None = None  # bearer JWTs accepted beside reg tokens (REG_OIDC_*)
    uploads: Any = None  # claims.UploadSlots, made at the first upload

    @property
    def key(self) -> bytes:
        """The audit key this server signs with (read once per process)."""
        return keys.for_server(self.settings.audit_key_path)

    def policy(self) -> EffectivePolicy:
        """The policy in force, as proven (`registry.trust.proven_policy`): never merely the newest
        row. UnprovenFact when it cannot be established."""
        return EffectivePolicy.for_server(
            self.catalog,
            self.store,
            self.key,
            policy_path=self.settings.policy_path,
            home=self.settings.home,
        )
