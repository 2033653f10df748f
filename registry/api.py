"""`Registry`: the one object a Python user (and the CLI) works through.

It opens the catalog, the store and the effective policy lazily, so a command pays only for what
it touches; every entry point checks access here, in the library, not in the CLI.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.config import Settings
from registry.errors import PermissionDenied
from registry.refs import CheckpointRef, ReleaseRef, parse_checkpoint_ref

if TYPE_CHECKING:
    from policies.loader import Policy
    from policies.resume import ResumeInventory
    from registry.catalog.engine import Catalog
    from registry.catalog.models import Checkpoint, Run
    from registry.progress import Progress
    from registry.storage.base import ObjectStore


class Registry:
    def __init__(self, settings: Settings | None = None, *, user: str | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.user = user or self.settings.user
        self._catalog: Catalog | None = None
        self._store: ObjectStore | None = None
        self._policy: Policy | None = None
        self._policy_source: str | None = None
        self._policy_doc: tuple[str, str] | None = None
        self._outbox_dirty = False

    # -- parts -------------------------------------------------------------------------------
    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            from registry.catalog.engine import Catalog

            self._catalog = Catalog(
                self.settings.catalog_url, busy_timeout_s=self.settings.busy_timeout_s
            )
        return self._catalog

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            from registry.storage import open_store

            store = open_store(self.settings.store_url)
            configure = getattr(store, "configure_lock", None)
            if configure is not None:  # Object Lock for release objects, from [release]
                configure(self.policy.release.object_lock, self.policy.release.lock_days)
            self._store = store
        return self._store

    @property
    def policy(self) -> Policy:
        if self._policy is None:
            self._policy, self._policy_source = self._load_policy()
        return self._policy

    def _load_policy(self) -> tuple[Policy, str]:
        from policies.loader import parse_policy

        text, source = self._policy_text()
        return parse_policy(text, source), source

    def _policy_text(self) -> tuple[str, str]:
        """The effective policy document: the one applied to the catalog wins; local files only
        bootstrap a registry that has none (DESIGN §6)."""
        from policies.loader import DEFAULT_POLICY_PATH
        from registry.errors import PolicyError

        if self._policy_doc is not None:
            return self._policy_doc
        local = self.settings.policy_path or self.settings.home / "policy.toml"
        with self.catalog.dbapi() as (conn, _):
            cursor = conn.cursor()
            cursor.execute(
                "SELECT version, text, applied_by FROM policy_document "
                "ORDER BY version DESC LIMIT 1"
            )
            applied = cursor.fetchone()
            cursor.close()
        if applied is not None:
            if self.settings.policy_path is not None or local.exists():
                warnings.warn(
                    f"ignoring {local}: the catalog has policy v{applied[0]} applied, "
                    "which every client uses",
                    stacklevel=3,
                )
            doc = (applied[1], f"catalog policy v{applied[0]} (applied by {applied[2]})")
        else:
            path = self.settings.policy_path or (local if local.exists() else DEFAULT_POLICY_PATH)
            try:
                doc = (Path(path).read_text(), str(path))
            except OSError as exc:
                raise PolicyError(
                    f"cannot read policy {path}: {exc.strerror}", "check REG_POLICY"
                ) from exc
        self._policy_doc = doc
        return doc

    def reset_policy(self) -> None:
        """Forget the cached policy (after `policy apply`)."""
        self._policy = self._policy_source = self._policy_doc = None

    def _has_grants(self) -> bool:
        """Single-user mode is decided without validating the whole document (fast listings);
        any grant means the full, validated policy decides."""
        import tomllib

        text, _ = self._policy_text()
        try:
            return bool(tomllib.loads(text).get("access", {}).get("grants"))
        except tomllib.TOMLDecodeError:
            return True  # let the full parse report the error

    def close(self) -> None:
        if self._outbox_dirty:
            self._outbox_dirty = False
            from registry.mirror_spawn import spawn_drain

            spawn_drain(self.settings)
        if self._catalog is not None:
            self._catalog.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- access ------------------------------------------------------------------------------
    def authorize(
        self, action: str, *, project: str | None = None, model: str | None = None, target: str = ""
    ) -> None:
        """Raise PermissionDenied (and audit the denial) unless the policy allows it."""
        from policies.access import check

        decision = check(self.policy.access.grants, self.user, action, project=project, model=model)
        if decision.allowed:
            return
        from registry import audit

        with self.catalog.session(write=True) as s:
            audit.record(
                s,
                self.user,
                action,
                target or project or model or "",
                audit.DENIED,
                reason=decision.reason,
            )
        raise PermissionDenied(
            f"{self.user} may not {action} {target or project or model or ''}".rstrip(),
            decision.reason + " (ask an admin to add it to the policy)",
        )

    def authorize_read(self, *, project: str | None = None, model: str | None = None) -> None:
        self.authorize(
            "read",
            project=project,
            model=model,
            target=f"project {project}" if project else f"model {model}" if model else "registry",
        )

    def can_read_project(self, project: str) -> bool:
        if not self._has_grants():
            return True
        from policies.access import can_read_project

        return can_read_project(self.policy.access.grants, self.user, project)

    def can_read_model(self, model: str) -> bool:
        if not self._has_grants():
            return True
        from policies.access import can_read_model

        return can_read_model(self.policy.access.grants, self.user, model)

    # -- helpers for the lifecycles ------------------------------------------------------------
    def classify_resume(self, top_level_keys: Iterable[str]) -> ResumeInventory:
        from policies.resume import classify

        return classify(top_level_keys, self.policy.resume)

    def protection_of(self, project: str, run: Run, ckpt: Checkpoint) -> dict[str, Any]:
        from registry.gc import explain

        return explain(self, project, run, ckpt)

    def after_commit(self) -> None:
        """A catalog change with an outbox event committed: the MLflow mirror drains after the
        command, in a detached process (see `close`)."""
        self._outbox_dirty = True

    # -- checkpoints -------------------------------------------------------------------------
    def push_checkpoint(
        self,
        src: str | Path,
        *,
        run: str,
        step: int,
        project: str = "default",
        world_size: int | None = None,
        metrics: dict[str, float] | None = None,
        progress: Progress | None = None,
        notes: list[str] | None = None,
    ) -> dict[str, Any]:
        from registry import checkpoints

        return checkpoints.push(
            self,
            Path(src),
            run=run,
            step=step,
            project=project,
            world_size=world_size,
            metrics=metrics,
            progress=progress,
            notes=notes,
        )

    def list_checkpoints(
        self, run: str | None = None, project: str | None = None, *, include_deleted: bool = False
    ) -> list[dict[str, Any]]:
        from registry import listing

        return listing.list_checkpoints(self, run, project, include_deleted=include_deleted)

    def show(self, ref: str | CheckpointRef | ReleaseRef) -> dict[str, Any]:
        from registry.refs import parse_ref

        parsed = parse_ref(ref) if isinstance(ref, str) else ref
        if isinstance(parsed, ReleaseRef):
            from registry import releases

            return releases.show(self, parsed)
        from registry import checkpoints

        return checkpoints.show(self, parsed)

    def pull(
        self, ref: str | CheckpointRef, dest: str | Path, *, progress: Progress | None = None
    ) -> dict[str, Any]:
        from registry import checkpoints

        return checkpoints.pull(self, _ckpt(ref), Path(dest), progress=progress)

    def verify(
        self, ref: str | CheckpointRef | ReleaseRef, *, progress: Progress | None = None
    ) -> dict[str, Any]:
        from registry.refs import parse_ref

        parsed = parse_ref(ref) if isinstance(ref, str) else ref
        if isinstance(parsed, ReleaseRef):
            from registry import releases

            return releases.verify(self, parsed, progress=progress)
        from registry import checkpoints

        return checkpoints.verify(self, parsed, progress=progress)

    def pin(self, ref: str | CheckpointRef, reason: str | None = None) -> dict[str, Any]:
        from registry import checkpoints

        return checkpoints.set_pin(self, _ckpt(ref), True, reason)

    def unpin(self, ref: str | CheckpointRef) -> dict[str, Any]:
        from registry import checkpoints

        return checkpoints.set_pin(self, _ckpt(ref), False)

    # -- validation, promotion, releases ------------------------------------------------------
    def validate(
        self,
        ref: str | CheckpointRef,
        *,
        device: str = "auto",
        world_size: int = 1,
        model_factory: str | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        from registry import validation

        return validation.validate(
            self,
            _ckpt(ref),
            device=device,
            world_size=world_size,
            model_factory=model_factory,
            progress=progress,
        )

    def promote(
        self,
        ref: str | CheckpointRef,
        *,
        model: str,
        alias: str | None = None,
        dtype: str | None = None,
        max_shard_size: str = "5GB",
        extras: list[str | Path] | None = None,
        model_factory: str | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        from registry import promotion

        return promotion.promote(
            self,
            _ckpt(ref),
            model=model,
            alias=alias,
            dtype=dtype,
            max_shard_size=max_shard_size,
            extras=[Path(p) for p in extras or []],
            model_factory=model_factory,
            progress=progress,
        )

    def releases(self, model: str | None = None) -> list[dict[str, Any]]:
        from registry import releases

        return releases.list_releases(self, model)

    def pull_release(
        self, ref: str | ReleaseRef, dest: str | Path, *, progress: Progress | None = None
    ) -> dict[str, Any]:
        from registry import releases

        return releases.pull(self, _release(ref), Path(dest), progress=progress)

    def set_alias(self, model: str, alias: str, version: str | int) -> dict[str, Any]:
        from registry import releases

        return releases.set_alias(self, model, alias, version)

    def deprecate(self, ref: str | ReleaseRef) -> dict[str, Any]:
        from registry import releases
        from registry.catalog.models import DEPRECATED

        return releases.set_status(self, _release(ref), DEPRECATED)

    def yank(self, ref: str | ReleaseRef, reason: str) -> dict[str, Any]:
        from registry import releases
        from registry.catalog.models import YANKED

        return releases.set_status(self, _release(ref), YANKED, reason)

    def storage_init(self) -> dict[str, Any]:
        """Check the store and set lifecycle rules (S3); create the root (local)."""
        from registry import audit

        self.authorize("storage", target=self.settings.store_url)
        init = getattr(self.store, "init", None)
        if init is not None:
            out: dict[str, Any] = init()
        else:
            root = Path(self.settings.store_url.removeprefix("file://"))
            root.mkdir(parents=True, exist_ok=True)
            out = {
                "store": self.settings.store_url,
                "kind": "local filesystem",
                "note": "nothing to configure: objects are put-if-absent via link()",
            }
        with self.catalog.session(write=True) as s:
            audit.record(
                s,
                self.user,
                "storage-init",
                self.settings.store_url,
                **{k: v for k, v in out.items() if isinstance(v, bool | str)},
            )
        return out

    def audit_log(
        self, *, since: float | None = None, actor: str | None = None, action: str | None = None
    ) -> list[dict[str, Any]]:
        from registry import audit

        self.authorize("audit", target="audit log")
        with self.catalog.session() as s:
            return audit.query(s, since=since, actor=actor, action=action)


def _release(ref: str | ReleaseRef) -> ReleaseRef:
    from registry.refs import parse_release_ref

    return parse_release_ref(ref) if isinstance(ref, str) else ref


def _ckpt(ref: str | CheckpointRef) -> CheckpointRef:
    return parse_checkpoint_ref(ref) if isinstance(ref, str) else ref
