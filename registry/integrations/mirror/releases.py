"""Releases in MLflow: one registered model per reg model, one model version per reg version
with the same number, bytes served through MLflow's artifact proxy (`storage.mlflow_artifacts`).

Every event is answered from the catalog as it is now, not from the event's payload, so a
replay or a late drain never writes a stale fact. Numbers match because versions are created in
reg's order: when v2 is mirrored before v1 (two concurrent promotions committed in the other
order), v1 is created first from the catalog. A version reg reserved and has not released (a
promotion in flight, or one that died: a rerun can still finish it) becomes a placeholder
version tagged `reg.status=reserved`, with the source its number fixes and no bytes behind it;
it turns active in place when the release commits. A placeholder is not deleted: MLflow never
gives a number back, so a deleted one could not become the release it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlmodel import select

from registry.catalog.mlflow_names import mirror_name, releases_experiment
from registry.catalog.models import RELEASE_PENDING, Checkpoint, Model, Project, Release, Run
from registry.core.layout import release_prefix
from registry.core.timeutil import iso
from registry.lifecycle.releases import stored_files
from registry.lifecycle.views import ReleaseView
from registry.storage import mlflow_artifacts as artifacts

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.storage.base import BaseStore

RESERVED = "reserved"
SERVED = ("active", "deprecated")  # the statuses whose bytes MLflow serves


@dataclass(frozen=True)
class ReleaseFacts:
    model: str
    version: int
    status: str  # active | deprecated | yanked | reserved
    project: str
    run: str
    tags: dict[str, str]
    description: str
    files: tuple[artifacts.ServedFile, ...]


class ReleaseMirror:
    def __init__(self, client: Any, catalog: Catalog, store: BaseStore, run_id: Any) -> None:
        self.client, self.catalog, self.store = client, catalog, store
        self._run_id = run_id  # (project, run) -> the MLflow run id (created if missing)
        self._experiments: dict[str, str] = {}

    # -- events --------------------------------------------------------------------------------
    def created(self, model: str, version: int) -> None:
        """Versions 1..`version` of `model` exist in MLflow with reg's numbers; `version` shows
        what the catalog says of it now."""
        name = self.registered_model(model)
        present = {int(v.version): v for v in self._versions(name)}
        for number in range(max(present, default=0) + 1, version + 1):
            present[number] = self._create(name, model, number)
        self.refresh(model, version, present[version])

    def changed(self, model: str, version: int) -> None:
        """A status change (deprecate, yank): tags, description and served bytes follow."""
        name = self.registered_model(model)
        found = next((v for v in self._versions(name) if int(v.version) == version), None)
        if found is None:
            self.created(model, version)
        else:
            self.refresh(model, version, found)

    def reconcile(self) -> int:
        """Remove served bytes no active release explains (yanked meanwhile, an experiment id
        the tracking store no longer has, leftovers of a crash), and check that what stays is
        the releases' own bytes (replaced where not); the files removed."""
        known: dict[str, str | None] = {}
        kept: list[tuple[str, ReleaseFacts]] = []

        def keep(experiment_id: str, model: str, version: int) -> bool:
            if model not in known:
                known[model] = self._existing_experiment(model)
            facts = self.facts(model, version)
            if known[model] != experiment_id or facts.status not in SERVED:
                return False
            kept.append((experiment_id, facts))
            return True

        removed = artifacts.reconcile(self.store, keep)
        for experiment_id, facts in kept:
            self._serve(facts, experiment_id)
        return removed

    # -- parts ---------------------------------------------------------------------------------
    def registered_model(self, model: str) -> str:
        name = mirror_name(model)
        try:
            found = self.client.get_registered_model(name)
        except Exception:
            found = None
        if found is None:
            self.client.create_registered_model(
                name, tags={"reg.model": model}, description=f"reg model {model}"
            )
        elif found.tags.get("reg.model") != model:
            raise RuntimeError(
                f"MLflow model {name} was not made by the mirror for reg model {model} "
                f"(its reg.model tag: {found.tags.get('reg.model')!r}); rename or delete it"
            )
        return name

    def experiment(self, model: str) -> str:
        """The model's releases experiment (created if missing): its artifact root serves the
        release bytes."""
        if model not in self._experiments:
            found = self._existing_experiment(model)
            self._experiments[model] = found or self.client.create_experiment(
                releases_experiment(model), tags=_releases_tags(model)
            )
        return self._experiments[model]

    def _existing_experiment(self, model: str) -> str | None:
        title = releases_experiment(model)
        found = self.client.get_experiment_by_name(title)
        if found is None:
            return None
        if any(found.tags.get(k) != v for k, v in _releases_tags(model).items()):
            raise RuntimeError(  # its artifacts would be what MLflow serves as releases
                f"MLflow experiment {title} was not made by the mirror; rename or delete it"
            )
        return str(found.experiment_id)

    def _versions(self, name: str) -> list[Any]:
        return list(self.client.search_model_versions(f"name = '{name}'", max_results=10_000))

    def _create(self, name: str, model: str, number: int) -> Any:
        facts = self.facts(model, number)
        created = self.client.create_model_version(
            name,
            source=artifacts.source_uri(self.experiment(model), model, number),
            run_id=self._run_id(facts.project, facts.run) if facts.project else None,
            tags=facts.tags,
            description=facts.description,
        )
        if int(created.version) != number:
            self.client.delete_model_version(name, created.version)
            raise RuntimeError(
                f"MLflow numbered {model}:v{number} as version {created.version}: the MLflow "
                f"model {name} has versions reg did not make; numbers cannot match"
            )
        return created

    def refresh(self, model: str, version: int, found: Any) -> None:
        facts = self.facts(model, version)
        name = mirror_name(model)
        if found.tags.get("reg.version") != str(version):
            raise RuntimeError(f"MLflow {name} version {version} is not reg's {model}:v{version}")
        # The bytes first: a version shows active once its bytes are all there (an S3 publish
        # is not atomic), and yanked once they are gone.
        self._serve(facts)
        for key, value in facts.tags.items():
            if found.tags.get(key) != value:
                self.client.set_model_version_tag(name, str(version), key, value)
        if (found.description or "") != facts.description:
            self.client.update_model_version(name, str(version), description=facts.description)

    def _serve(self, facts: ReleaseFacts, experiment: str | None = None) -> None:
        """Serve an active or deprecated release's bytes; take a yanked one's away. A release
        yanked while it was being published is taken away again (a yank does not wait for the
        drain's lease)."""
        model, version = facts.model, facts.version
        if facts.status == "yanked":
            artifacts.unpublish_everywhere(self.store, model, version)
        elif facts.status != RESERVED:
            where = experiment or self.experiment(model)
            artifacts.publish(self.store, where, model, version, facts.files)
            if self.facts(model, version).status not in SERVED:
                artifacts.unpublish_everywhere(self.store, model, version)

    def facts(self, model: str, version: int) -> ReleaseFacts:
        """What the catalog says of `model:v<version>` now."""
        with self.catalog.session() as s:
            found = s.exec(
                select(Model, Release)
                .join(Release, Release.model_id == Model.id)  # type: ignore[arg-type]
                .where(Model.name == model, Release.version == version)
            ).first()
            if found is None:
                return _reserved(model, version, None, ("", ""))
            model_row, row = found
            source = self._source_run(s, row.source_checkpoint_id)
            if row.status == RELEASE_PENDING:
                return _reserved(model, version, row.created_by, source)
            view = ReleaseView.load(s, model_row, row)
        validation = view.validation
        served = tuple(
            artifacts.ServedFile(f.path, f.size, f.sha256, f.version) for f in stored_files(view)
        )
        uri = self.store.describe(release_prefix(model, version))
        tags = {
            "reg.model": model,
            "reg.version": str(version),
            "reg.release": f"{model}:v{version}",
            "reg.status": row.status,
            "reg.sha256": row.sha256 or "",
            "reg.source": row.source_ref,
            "reg.uri": uri,
            "reg.created_by": row.created_by,
            "reg.created_at": iso(row.created_at) or "",
        }
        tags.update(verified_tags(row.verified_at, len(row.verify_findings or [])))
        if validation is not None:
            tags["reg.validation"] = "passed" if validation.passed else "failed"
            tags["reg.validation.device"] = validation.device
            tags["reg.validation.mode"] = validation.mode or "whole"
        description = (
            f"{model}:v{version}: {uri} (sha256 {row.sha256}), promoted from {row.source_ref} "
            f"by {row.created_by}"
        )
        if row.status != "active":
            tags["reg.status_reason"] = row.status_reason or ""
            tags["reg.status_by"] = row.status_changed_by or ""
            tags["reg.status_at"] = iso(row.status_changed_at) or ""
            description = (
                f"{row.status.upper()} by {row.status_changed_by} at "
                f"{iso(row.status_changed_at)}: {row.status_reason or 'no reason given'}."
                + (" Its bytes are no longer served." if row.status == "yanked" else "")
                + "\n\n"
                + description
            )
        project, run = source
        return ReleaseFacts(model, version, row.status, project, run, tags, description, served)

    @staticmethod
    def _source_run(session: Any, checkpoint_id: int) -> tuple[str, str]:
        found = session.exec(
            select(Project.name, Run.name)
            .select_from(Checkpoint)
            .join(Run, Run.id == Checkpoint.run_id)  # type: ignore[arg-type]
            .join(Project, Project.id == Run.project_id)  # type: ignore[arg-type]
            .where(Checkpoint.id == checkpoint_id)
        ).first()
        return (found[0], found[1]) if found else ("", "")


def _releases_tags(model: str) -> dict[str, str]:
    return {"reg.model": model, "reg.kind": "releases"}


def _reserved(model: str, version: int, by: str | None, source: tuple[str, str]) -> ReleaseFacts:
    return ReleaseFacts(
        model,
        version,
        RESERVED,
        source[0],
        source[1],
        {
            "reg.model": model,
            "reg.version": str(version),
            "reg.release": f"{model}:v{version}",
            "reg.status": RESERVED,
            "reg.created_by": by or "",
        },
        f"{model}:v{version} is reserved by a promotion that has not committed (yet): "
        "no bytes are served. It turns into the release when that promotion commits.",
        (),
    )


def verified_tags(at: float | None, damaged: int) -> dict[str, str]:
    """The last re-hash of every stored byte, as MLflow tags (none before the first)."""
    if at is None:
        return {}
    verdict = f"damaged: {damaged} file(s)" if damaged else "ok"
    return {"reg.verified_at": iso(at) or "", "reg.verify": verdict}
