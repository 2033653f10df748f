"""The results of the release methods: promotion, listing, show, pull, aliases, status."""

from __future__ import annotations

from typing import Any

from registry.api.results.base import Result
from registry.api.results.checkpoints import RESULT


@RESULT
class ReleaseSummary(Result):
    """A release version as `reg releases` lists it."""

    release: str
    model: str
    version: int
    sha256: str
    files: list[dict[str, Any]]
    source: str
    aliases: list[str]
    status: str
    status_reason: str | None
    bytes: int
    tensor_count: int
    dtype: str | None
    tied: list[Any]
    created_at: str
    created_by: str
    validation: dict[str, Any] | None
    verified: dict[str, Any] | None = None
    convert: str | None = None  # the converter of its names (Megatron's layers, an adapter)
    base: dict[str, Any] | None = None  # an adapter's base model: name, sha256, verified
    # model.sig: key_id, key_state (active, retired, revoked), sha256, provenance_sha256,
    # signed_at, signed_by; None for a release made unsigned
    signature: dict[str, Any] | None = None


@RESULT
class ReleasePromoted(ReleaseSummary):
    """A promotion: the release, where it is, and `existing` when these exact bytes were
    promoted before (the same version is answered again)."""

    uri: str
    existing: bool = False
    hf: dict[str, Any] | None = None
    hf_config: dict[str, Any] | None = None
    code_extras: list[str] | None = None
    # `--alias` named a protected alias: the request opened instead of a move
    alias_request: dict[str, Any] | None = None

    def hf_warning(self) -> str | None:
        """One line when the release is not a complete Hugging Face model folder."""
        if not self.hf:
            return None
        # at use: the folder rules load only for a promotion's message
        from registry.formats.hf_folder import Completeness

        return Completeness(self.hf["complete"], self.hf["missing"], self.hf["notes"]).warning()


@RESULT
class ReleaseSigned(ReleaseSummary):
    """A release signed after its promotion (`reg sign-release`): the files the signing added
    (provenance statement, model card, model.sig) and the bytes it re-hashed first."""

    uri: str
    added: list[str]
    rehashed: int


@RESULT
class ReleaseDetails(ReleasePromoted):
    """Everything known about one release (`reg show MODEL:vK`)."""

    alias_history: list[dict[str, Any]] | None = None


@RESULT
class ReleasePulled(ReleaseSummary):
    """A release copied out: where its files are now."""

    dest: str


@RESULT
class ReleaseFetched(ReleaseSummary):
    """A release as a verified folder on this machine, kept by its release.json digest
    (`reg fetch-release`): where it is, whether it was there already (`cached`: nothing was
    downloaded), whether a pinned key's signature was checked, and in the Hugging Face hub
    cache the snapshot's revision."""

    path: str
    cached: bool
    signature_verified: bool = False
    hf_revision: str | None = None


@RESULT
class AliasRequest(Result):
    """A request to move a protected alias (`reg requests`, `reg approve`, `reg reject`, and
    `reg alias set` on a protected alias, which moves nothing): its state is open, approved
    (the alias moved), rejected, cancelled (the version was withdrawn) or expired."""

    request: int
    model: str
    alias: str
    version: int
    release: str
    state: str
    requested_by: str
    requested_at: str
    expires_at: str
    approvals_needed: int
    approved_by: list[str]
    closed_by: str | None
    reason: str | None
    rule: str
    moved: bool = False  # this call's approval was the last one needed: the alias moved
    previous: str | None = None  # the version the alias left, when it moved
    advisory: str | None = None  # embedded: identities are asserted, not proven


@RESULT
class AliasMoved(ReleaseSummary):
    """An alias moved to this release; `previous` is the version it pointed at before."""

    alias: str
    previous: str | None = None


@RESULT
class ReleaseStatusChanged(ReleaseSummary):
    """A release deprecated or yanked; a yank counts the served copies it removed."""

    served_files_removed: int | None = None
    requests_cancelled: list[int] | None = None  # protected aliases' requests to move to it
