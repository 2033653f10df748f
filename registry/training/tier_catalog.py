"""What tier 0 asks of the registry, embedded or through `reg server`.

`LocalTier` and its `Replicator` ask the same questions either way: claim a step, commit it at
tier 0, copy a file of it to the store under its replication claim, see which files are still
missing, commit it at tier 1, record an eviction, and find what a restore may read. Embedded,
each is a call into `lifecycle.checkpoints` on this process's catalog and store; through the
server (REG_URL), a request to the routes of `registry.server.tier_routes`, which run the same
calls there: the server alone holds the catalog and store credentials, hashes every byte it
stores, and commits at tier 1 only what it received with the digests tier 0 recorded.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from registry.api.local import LocalRegistry
from registry.catalog import claims
from registry.core.layout import checkpoint_prefix
from registry.core.refs import CheckpointRef
from registry.errors import Conflict, IntegrityError, ObjectExists, RegistryError
from registry.formats.dcp_roots import metadata_paths
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints.shared import (
    LocalCopy,
    SharedClaim,
    claim,
    commit_written,
    give_up,
    record_part,
    renew,
)
from registry.lifecycle.checkpoints.tiers import (
    claim_replication,
    commit_replicated,
    missing_parts,
    record_eviction,
    restore_candidates,
    step_states,
    stranded,
)
from registry.lifecycle.transfer import Stored
from registry.training import local_tier
from registry.training.backends import SERVER_LEASE_S, ServerBackend, remote_reader, server_token

if TYPE_CHECKING:
    from registry.api.contract import Registry
    from registry.api.local import LocalRegistry
    from registry.api.remote.registry import RemoteRegistry

CHUNK = 8 << 20
Take = Callable[[int], None]  # the replicator's rate limit: called with each chunk's size


class TierCatalog(Protocol):
    """What tier 0 asks of the registry: `EmbeddedTiers` answers it on this process's catalog
    and store, `ServerTiers` through `reg server`; mypy checks both against it (`tier_catalog`)."""

    def claim(self, ref: CheckpointRef) -> SharedClaim:
        """Rank 0's claim of the step."""

    def give_up(self, claimed: SharedClaim) -> None:
        """Release the claim of a save that will not commit."""

    def commit_local(
        self,
        claimed: SharedClaim,
        files: list[FileRecord],
        *,
        directory: Path,
        nodes: dict[str, tuple[list[int], list[str]]],
        world_size: int,
        metrics: dict[str, float] | None,
        costs: dict[str, Any],
        upload_seconds: float,
        held: bool,
    ) -> tuple[dict[str, Any], tuple[int, str]]:
        """The tier-0 commit: (the committed view, (row id, the replication token))."""

    def evicted(self, ref: CheckpointRef, node: str) -> None:
        """Record that `node` no longer holds its copy of the step."""

    def states(self, project: str, run: str, steps: list[int]) -> dict[int, str]:
        """Each step's state in the catalog."""

    def candidates(self, project: str, run: str) -> list[dict[str, Any]]:
        """The committed steps a restore may read, newest first, with where their copies are."""

    def stranded(self, project: str, run: str, *, live: bool) -> list[dict[str, Any]]:
        """Tier-0 steps whose copy to the store no live claim is making."""

    def adopt(self, ref: CheckpointRef) -> SharedClaim:
        """Take over a stranded step's replication claim."""

    def store_for(self, project: str, run: str, step: int) -> Any:
        """Where a restore reads a committed step's files the node does not hold."""

    def renew(self, claimed: SharedClaim) -> None:
        """Keep the replication claim alive."""

    def put(
        self, claimed: SharedClaim, path: str, source: Path, record: FileRecord | None, take: Take
    ) -> Stored:
        """One file into the step's prefix in the store (`path` MANIFEST: the manifest), refused
        unless it holds the bytes tier 0 recorded (`record`)."""

    def record(self, claimed: SharedClaim, stored: list[Stored]) -> None:
        """Record the files this writer copied."""

    def missing(self, claimed: SharedClaim) -> list[str]:
        """The files no writer has copied yet (MANIFEST when the manifest is not in yet)."""

    def commit_replicated(self, claimed: SharedClaim, seconds: float) -> dict[str, Any]:
        """Commit the step at tier 1 once every file is in the store."""


def tier_catalog(registry: Registry) -> TierCatalog:
    if isinstance(registry, LocalRegistry):
        return EmbeddedTiers(registry)
    return ServerTiers(registry)  # type: ignore[arg-type]


def _chunks(path: Path, take: Take) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            take(len(chunk))
            yield chunk


class EmbeddedTiers:
    """This process opens the catalog and the store itself."""

    def __init__(self, registry: LocalRegistry) -> None:
        self.registry = registry

    @property
    def ctx(self) -> Any:
        return self.registry.context

    def claim(self, ref: CheckpointRef) -> SharedClaim:
        return claim(self.ctx, ref, store_later=True)  # a tier-0 save: the store may be down

    def give_up(self, claimed: SharedClaim) -> None:
        give_up(self.ctx, claimed)

    def commit_local(
        self,
        claimed: SharedClaim,
        files: list[FileRecord],
        *,
        directory: Path,
        nodes: dict[str, tuple[list[int], list[str]]],
        world_size: int,
        metrics: dict[str, float] | None,
        costs: dict[str, Any],
        upload_seconds: float,
        held: bool,
    ) -> tuple[dict[str, Any], tuple[int, str]]:
        """The tier-0 commit: (the committed view, (row id, the replication token))."""
        token = claims.new_token()
        result = commit_written(
            self.ctx,
            claimed,
            files,
            world_size=world_size,
            metrics=metrics,
            save_costs=costs,
            upload_seconds=upload_seconds,
            own_writer=True,
            local=LocalCopy(
                read=local_tier.reader_of(directory, {f.path: f for f in files}),
                nodes=nodes,
                write_manifest=local_tier.manifest_writer(directory),
                token=token,
                held=held,
            ),
        )
        return result.to_json(), (claimed.row_id, token)

    def evicted(self, ref: CheckpointRef, node: str) -> None:
        record_eviction(self.ctx, ref, node)

    def states(self, project: str, run: str, steps: list[int]) -> dict[int, str]:
        return step_states(self.ctx, project, run, steps)

    def candidates(self, project: str, run: str) -> list[dict[str, Any]]:
        return restore_candidates(self.ctx, project, run)

    def stranded(self, project: str, run: str, *, live: bool) -> list[dict[str, Any]]:
        return stranded(self.ctx, project, run, live=live)

    def adopt(self, ref: CheckpointRef) -> SharedClaim:
        return claim_replication(self.ctx, ref)

    def store_for(self, project: str, run: str, step: int) -> Any:
        """Where a restore reads a committed step's files the node does not hold."""
        return self.registry.store

    # -- the replicator -------------------------------------------------------------------------
    def renew(self, claimed: SharedClaim) -> None:
        renew(self.ctx, claimed, 0)

    def put(
        self, claimed: SharedClaim, path: str, source: Path, record: FileRecord | None, take: Take
    ) -> Stored:
        """One file into the step's prefix in the store (`path` MANIFEST: the manifest), refused
        unless it holds the bytes tier 0 recorded (`record`)."""
        store = self.registry.store
        key = claimed.prefix + path

        def produce(write: Callable[[Any], None]) -> None:
            for chunk in _chunks(source, take):
                write(chunk)

        try:
            put = store.put_stream(key, produce)
        except ObjectExists:  # an earlier attempt of this copy, under the same claim
            self._still_ours(claimed)  # never delete what another replicator put
            store.delete(key)
            put = store.put_stream(key, produce)
        if record is not None and (put.size, put.sha256) != (record.size, record.sha256):
            self._still_ours(claimed)
            store.delete(key)
            raise RegistryError(
                f"{source} is not the file the save recorded ({put.size} bytes now, "
                f"{record.size} recorded): the node's copy changed, so it is not copied"
            )
        return Stored(key, put.size, put.sha256, False, put.version)

    def record(self, claimed: SharedClaim, stored: list[Stored]) -> None:
        record_part(self.ctx, claimed, stored)

    def missing(self, claimed: SharedClaim) -> list[str]:
        """The files no writer has copied yet (MANIFEST when the manifest is not in yet)."""
        return missing_parts(self.ctx, claimed)

    def commit_replicated(self, claimed: SharedClaim, seconds: float) -> dict[str, Any]:
        with claims.held(self.ctx.catalog, claimed.catalog_claim()):
            return commit_replicated(self.ctx, claimed, seconds)

    def _still_ours(self, claimed: SharedClaim) -> None:
        if not claims.still_held(self.ctx.catalog, claimed.catalog_claim()):
            raise Conflict(
                f"lost the claim on the copy of {claimed.ref} (another job took it over)",
                "nothing to do: that job copies it",
            )


class ServerTiers:
    """Every question a request to `reg server`; nothing here opens a catalog or a store."""

    def __init__(self, registry: RemoteRegistry) -> None:
        self.registry = registry
        self.client = registry.client

    def claim(self, ref: CheckpointRef) -> SharedClaim:
        return ServerBackend(self.registry).claim(ref)

    def give_up(self, claimed: SharedClaim) -> None:
        self.registry.renew_claim(claimed.token, 0)

    def commit_local(
        self,
        claimed: SharedClaim,
        files: list[FileRecord],
        *,
        directory: Path,
        nodes: dict[str, tuple[list[int], list[str]]],
        world_size: int,
        metrics: dict[str, float] | None,
        costs: dict[str, Any],
        upload_seconds: float,
        held: bool,
    ) -> tuple[dict[str, Any], tuple[int, str]]:
        """The tier-0 commit in the server, from the file records and each `.metadata` (read
        here, checked there against its record): the server builds the manifest, which is
        written here beside the files for the replicator to copy."""
        sizes = {f.path: f.size for f in files}
        metadata = {
            path: base64.b64encode((directory / path).read_bytes()).decode()
            for path in metadata_paths(sizes)
        }
        body = {
            "files": [[f.path, f.size, f.sha256, f.rank] for f in files],
            "nodes": {node: [r, p] for node, (r, p) in nodes.items()},
            "metadata": metadata,
            "world_size": world_size,
            "metrics": metrics or {},
            "save_costs": costs,
            "upload_seconds": upload_seconds,
            "held": held,
        }
        got = self.client.call("POST", f"/claims/{claimed.token}/commit-local", body=body)
        manifest = base64.b64decode(str(got["manifest"]))
        local_tier.manifest_writer(directory)(manifest)
        return dict(got["view"]), (int(got["row"]), server_token(got.get("claim")))

    def evicted(self, ref: CheckpointRef, node: str) -> None:
        self.client.call("POST", "/tiers/evicted", body={"ref": str(ref), "node": node})

    def states(self, project: str, run: str, steps: list[int]) -> dict[int, str]:
        body = {"project": project, "run": run, "steps": steps}
        got = self.client.call("POST", "/tiers/states", body=body)
        return {int(k): str(v) for k, v in dict(got["states"]).items()}

    def candidates(self, project: str, run: str) -> list[dict[str, Any]]:
        got = self.client.call("POST", "/tiers/candidates", body={"project": project, "run": run})
        return [c | {"files": [tuple(f) for f in c["files"]]} for c in list(got["candidates"])]

    def stranded(self, project: str, run: str, *, live: bool) -> list[dict[str, Any]]:
        body = {"project": project, "run": run, "live": live}
        got = self.client.call("POST", "/tiers/stranded", body=body)
        return [
            s | {"files": [tuple(f) for f in s["files"]], "holder": tuple(s["holder"])}
            for s in list(got["stranded"])
        ]

    def adopt(self, ref: CheckpointRef) -> SharedClaim:
        got = self.client.call("POST", "/tiers/adopt", body={"ref": str(ref)})
        return SharedClaim(ref, int(got["row"]), server_token(got.get("claim")))

    def store_for(self, project: str, run: str, step: int) -> Any:
        ref = str(CheckpointRef(project, run, step))
        listing = self.client.call("GET", "/files", params={"ref": ref})
        return remote_reader(self.registry, listing, checkpoint_prefix(project, run, step))

    # -- the replicator -------------------------------------------------------------------------
    def renew(self, claimed: SharedClaim) -> None:
        self.registry.renew_claim(claimed.token, SERVER_LEASE_S)

    def put(
        self, claimed: SharedClaim, path: str, source: Path, record: FileRecord | None, take: Take
    ) -> Stored:
        """One file through the server's push path: hashed and recorded there as it lands (a
        copy of the manifest is refused there unless it is the one tier 0 recorded)."""
        got = self.registry.put_claimed(claimed.token, path, _chunks(source, take))
        size, digest = got.get("size"), got.get("sha256")
        if record is not None and (size, digest) != (record.size, record.sha256):
            raise IntegrityError(
                f"{source} is not the file the save recorded ({size} bytes stored, "
                f"{record.size} recorded): the node's copy changed, so it is not copied"
            )
        version = got.get("version")
        return Stored(
            claimed.prefix + path,
            int(size or 0),
            str(digest),
            False,
            version if isinstance(version, str) else None,
        )

    def record(self, claimed: SharedClaim, stored: list[Stored]) -> None:
        pass  # the server recorded each file as it received it

    def missing(self, claimed: SharedClaim) -> list[str]:
        got = self.client.call("GET", f"/claims/{claimed.token}/missing")
        return [str(p) for p in got["missing"]]

    def commit_replicated(self, claimed: SharedClaim, seconds: float) -> dict[str, Any]:
        body = {"seconds": seconds}
        return dict(self.client.call("POST", f"/claims/{claimed.token}/replicated", body=body))
