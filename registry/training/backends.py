"""Where a training loop's saves and restores go: the store itself (embedded mode), or
`reg server` (REG_URL set), which alone holds the catalog and store credentials.

Both answer the same questions for `CheckpointManager`: claim a step (rank 0), give every rank
a sink for its files, keep the claim alive, commit, find the newest step and a reader for it,
and record a restore. Through the server each file streams through it into the store (hashed
there; the server records what it received) and the commit sends no file list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from policies.access import Action
from registry.api.local import LocalRegistry
from registry.catalog import claims
from registry.core.layout import checkpoint_prefix
from registry.core.refs import CheckpointRef, parse_checkpoint_ref
from registry.economics.records import plan_restart, record_heartbeat
from registry.errors import IntegrityError, NotFound, RegistryError, UsageError
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints.costs import record_restore
from registry.lifecycle.checkpoints.read import record_resume
from registry.lifecycle.checkpoints.shared import (
    SharedClaim,
    claim,
    commit_written,
    give_up,
    is_token,
)
from registry.storage.base import PutResult
from registry.training.store_writer import StoreSink

if TYPE_CHECKING:
    from registry.api.contract import Registry
    from registry.storage.base import BaseStore
    from registry.training.store_writer import ObjectSink, Written

SERVER_LEASE_S = 120.0  # a server claim is held by no server process: rank 0 renews it
HEARTBEAT_TIMEOUT_S = 5.0  # one heartbeat request (sent off the training loop)


class Backend(Protocol):
    """What `CheckpointManager` asks of where its saves go: `EmbeddedBackend` (the store and
    catalog themselves) and `ServerBackend` (through `reg server`) both answer it, and mypy
    checks both against it (`backend_for`)."""

    def prepare(self) -> None:
        """Open what a save needs now, so an unreachable store fails here, not mid-save."""

    def claim(self, ref: CheckpointRef) -> SharedClaim:
        """Rank 0's claim of the step."""

    def sink(self, claimed: SharedClaim) -> ObjectSink:
        """Where this rank's files of the claimed step are written."""

    def renew(self, claimed: SharedClaim) -> None:
        """Keep the claim alive."""

    def give_up(self, claimed: SharedClaim) -> None:
        """Release the claim of a save that will not commit."""

    def commit(
        self,
        claimed: SharedClaim,
        written: Written,
        world_size: int,
        metrics: dict[str, float] | None,
        costs: dict[str, Any],
    ) -> dict[str, Any]:
        """Commit the step from every rank's written files; the committed checkpoint."""

    def latest(self, ref: CheckpointRef) -> tuple[int, BaseStore, str, dict[str, str]] | None:
        """The newest committed step, a store to read it from, its prefix and file versions."""

    def resumed(self, ref: CheckpointRef) -> None:
        """Record that the run resumed from `ref` (it protects that step from retention)."""

    def restored(self, ref: CheckpointRef, world_size: int, phases: dict[str, float]) -> None:
        """Record a restore's measured phases (the recovery time)."""

    def heartbeat(self, ref: CheckpointRef, **figures: Any) -> dict[str, Any]:
        """Record the run's progress since the last beat."""

    def plan_restart(self, ref: CheckpointRef) -> None:
        """Announce that the next restore is a planned restart, not a failure."""


def backend_for(registry: Registry) -> Backend:
    """The store itself, or `reg server` when REG_URL is set (every rank alike)."""
    return ServerBackend(registry) if registry.settings.remote else EmbeddedBackend(registry)


class EmbeddedBackend:
    def __init__(self, registry: Registry) -> None:
        assert isinstance(registry, LocalRegistry)
        self.registry: LocalRegistry = registry

    def prepare(self) -> None:
        self.registry.store  # noqa: B018  # opened now: an unreachable store fails here

    def claim(self, ref: CheckpointRef) -> SharedClaim:
        return claim(self.registry.context, ref)

    def sink(self, claimed: SharedClaim) -> ObjectSink:
        return StoreSink(self.registry.store)

    def renew(self, claimed: SharedClaim) -> None:
        claims.renew(self.registry.context.catalog, claimed.catalog_claim())

    def give_up(self, claimed: SharedClaim) -> None:
        give_up(self.registry.context, claimed)

    def commit(
        self,
        claimed: SharedClaim,
        written: Written,
        world_size: int,
        metrics: dict[str, float] | None,
        costs: dict[str, Any],
    ) -> dict[str, Any]:
        result = commit_written(
            self.registry.context,
            claimed,
            written.files,
            world_size=world_size,
            metrics=metrics,
            save_costs=costs,
            upload_seconds=float(costs["persist_seconds"]),
            own_writer=True,
        )
        return result.to_json()

    def latest(self, ref: CheckpointRef) -> tuple[int, BaseStore, str, dict[str, str]] | None:
        """The newest committed step, a store to read it from, its prefix and file versions."""
        try:
            shown = self.registry.show(ref)
        except NotFound:
            return None
        step = int(shown["step"])
        versions = {f["path"]: f["version"] for f in shown["files"] if f.get("version")}
        prefix = checkpoint_prefix(ref.project, ref.run, step)
        return step, self.registry.store, prefix, versions

    def resumed(self, ref: CheckpointRef) -> None:
        context = self.registry.context
        if context.principal.authorize(Action.PUSH, project=ref.project).allowed:
            record_resume(context, ref)

    def restored(self, ref: CheckpointRef, world_size: int, phases: dict[str, float]) -> None:
        context = self.registry.context
        if context.principal.authorize(Action.PUSH, project=ref.project).allowed:
            record_restore(context, ref, world_size, phases)

    def heartbeat(self, ref: CheckpointRef, **figures: Any) -> dict[str, Any]:
        context = self.registry.context
        if not context.principal.authorize(Action.PUSH, project=ref.project).allowed:
            return {"recorded": True}  # a reader's job: nothing to record, nothing to keep
        return record_heartbeat(context, ref.project, ref.run, **figures)

    def plan_restart(self, ref: CheckpointRef) -> None:
        context = self.registry.context
        if context.principal.authorize(Action.PUSH, project=ref.project).allowed:
            plan_restart(context, ref.project, ref.run)


class ServerBackend:
    def __init__(self, registry: Registry) -> None:
        from registry.api.remote.registry import RemoteRegistry

        assert isinstance(registry, RemoteRegistry)
        self.registry = registry

    def prepare(self) -> None:
        pass  # the client was made with the registry (its token checked then)

    def claim(self, ref: CheckpointRef) -> SharedClaim:
        got = self.registry.claim_checkpoint(
            ref.run, ref.step or 0, project=ref.project, lease_s=SERVER_LEASE_S
        )
        return SharedClaim(ref, 0, server_token(got.get("claim")))

    def sink(self, claimed: SharedClaim) -> ObjectSink:
        return ServerSink(self.registry, claimed)

    def renew(self, claimed: SharedClaim) -> None:
        self.registry.renew_claim(claimed.token, SERVER_LEASE_S)

    def give_up(self, claimed: SharedClaim) -> None:
        self.registry.renew_claim(claimed.token, 0)

    def commit(
        self,
        claimed: SharedClaim,
        written: Written,
        world_size: int,
        metrics: dict[str, float] | None,
        costs: dict[str, Any],
    ) -> dict[str, Any]:
        # The server commits from the files it received itself; `written` is not sent.
        return self.registry.commit_claimed(
            claimed.token, world_size=world_size, metrics=metrics, save_costs=costs
        ).to_json()

    def latest(self, ref: CheckpointRef) -> tuple[int, BaseStore, str, dict[str, str]] | None:
        try:
            listing = self.registry.client.call("GET", "/files", params={"ref": str(ref)})
        except NotFound:
            return None
        step = parse_checkpoint_ref(listing["ref"]).step or 0
        prefix = "remote/"  # any key prefix: the reader asks for each file of the ref
        return step, remote_reader(self.registry, listing, prefix), prefix, {}

    def resumed(self, ref: CheckpointRef) -> None:
        self.registry.client.call("POST", "/checkpoints/pulled", body={"ref": str(ref)})

    def restored(self, ref: CheckpointRef, world_size: int, phases: dict[str, float]) -> None:
        body = {"ref": str(ref), "restore": {"world_size": world_size, "phases": phases}}
        self.registry.client.call("POST", "/checkpoints/pulled", body=body)

    def heartbeat(self, ref: CheckpointRef, **figures: Any) -> dict[str, Any]:
        """One heartbeat with a short timeout (the client's own read timeout is hours long):
        a server that does not answer costs the job a dropped beat, never a stuck thread."""
        import httpx

        from registry.api.remote.client import error_from

        client = self.registry.client
        body = {"project": ref.project, "run": ref.run, **figures}
        try:
            response = client.http.post("/runs/heartbeat", json=body, timeout=HEARTBEAT_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise RegistryError(f"heartbeat: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise error_from(response)
        return dict(response.json())

    def plan_restart(self, ref: CheckpointRef) -> None:
        self.registry.plan_restart(ref.run, project=ref.project)


class ServerSink:
    """Each object a PUT of its bytes to `reg server`, streamed as they are produced."""

    def __init__(self, registry: Any, claimed: SharedClaim) -> None:
        self.registry, self.claimed = registry, claimed

    def put_chunks(self, key: str, chunks: Iterator[bytes]) -> PutResult:
        path = key.removeprefix(self.claimed.prefix)
        digest, size = hashlib.sha256(), 0

        def sent() -> Iterator[bytes]:
            nonlocal size
            for chunk in chunks:
                digest.update(chunk)
                size += len(chunk)
                yield chunk

        got = self.registry.put_claimed(self.claimed.token, path, sent())
        if (got.get("size"), got.get("sha256")) != (size, digest.hexdigest()):
            raise IntegrityError(
                f"{key}: the server stored other bytes than were sent",
                "damaged in transit; save again",
            )
        version = got.get("version")
        return PutResult(
            key, size, digest.hexdigest(), version if isinstance(version, str) else None
        )

    def put_bytes(self, key: str, data: bytes) -> PutResult:
        return self.put_chunks(key, iter([data]))


def remote_reader(registry: Any, listing: dict[str, Any], prefix: str) -> Any:
    """A store-like reader of the files `GET /files` listed, through the server (or the
    presigned URLs it hands out), for keys under `prefix`."""
    from registry.api.remote.reader import RemoteReader

    files = [
        FileRecord(f["path"], f["size"], f["sha256"], None, f.get("version"))
        for f in listing["files"]
    ]
    urls = registry.read_urls(listing["ref"], listing["files"])
    return RemoteReader(registry.client, listing["ref"], prefix, files, urls)


def server_token(value: object) -> str:
    if not is_token(value):
        raise UsageError("the server answered the claim without a token", "update reg server")
    return str(value)
