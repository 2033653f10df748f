"""Releases in MLflow: one registered model per reg model, one model version per reg version
with the same number, bytes served through MLflow's artifact proxy (`registry.mirror_artifacts`).

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

from registry import mirror_artifacts
from registry.mirror_names import mirror_name, releases_experiment
from registry.timeutil import iso

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.storage.base import BaseStore

RESERVED = "reserved"


@dataclass(frozen=True)
class ReleaseFacts:
    model: str
    version: int
    status: str  # active | deprecated | yanked | reserved
    project: str
    run: str
    tags: dict[str, str]
    description: str
    files: tuple[tuple[str, int], ...]


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
        """The model's releases experiment: its artifact root serves the release bytes."""
        if model not in self._experiments:
            title = releases_experiment(model)
            tags = {"reg.model": model, "reg.kind": "releases"}
            found = self.client.get_experiment_by_name(title)
            if found is None:
                self._experiments[model] = self.client.create_experiment(title, tags=tags)
            elif any(found.tags.get(k) != v for k, v in tags.items()):
                raise RuntimeError(  # its artifacts would be what MLflow serves as releases
                    f"MLflow experiment {title} was not made by the mirror; rename or delete it"
                )
            else:
                self._experiments[model] = found.experiment_id
        return self._experiments[model]

    def _versions(self, name: str) -> list[Any]:
        return list(self.client.search_model_versions(f"name = '{name}'", max_results=10_000))

    def _create(self, name: str, model: str, number: int) -> Any:
        facts = self.facts(model, number)
        created = self.client.create_model_version(
            name,
            source=mirror_artifacts.source_uri(self.experiment(model), model, number),
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
        for key, value in facts.tags.items():
            if found.tags.get(key) != value:
                self.client.set_model_version_tag(name, str(version), key, value)
        if (found.description or "") != facts.description:
            self.client.update_model_version(name, str(version), description=facts.description)
        experiment = self.experiment(model)
        if facts.status == "yanked":
            mirror_artifacts.unpublish(self.store, experiment, model, version)
        elif facts.status != RESERVED:
            mirror_artifacts.publish(self.store, experiment, model, version, facts.files)

    def facts(self, model: str, version: int) -> ReleaseFacts:
        from registry.catalog.models import (
            RELEASE_PENDING,
            Checkpoint,
            Model,
            Project,
            Release,
            ReleaseFile,
            Run,
            Validation,
        )
        from registry.layout import release_prefix

        with self.catalog.session() as s:
            row = s.exec(
                select(Release).join(Model).where(Model.name == model, Release.version == version)
            ).first()
            if row is None or row.status == RELEASE_PENDING:
                return _reserved(model, version, row.created_by if row else None)
            found = s.exec(
                select(Project.name, Run.name)
                .select_from(Checkpoint)
                .join(Run, Run.id == Checkpoint.run_id)  # type: ignore[arg-type]
                .join(Project, Project.id == Run.project_id)  # type: ignore[arg-type]
                .where(Checkpoint.id == row.source_checkpoint_id)
            ).first()
            project, run = found if found else ("", "")
            validation = s.get(Validation, row.validation_id) if row.validation_id else None
            files = tuple(
                (f.path, f.size)
                for f in s.exec(select(ReleaseFile).where(ReleaseFile.release_id == row.id))
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
        return ReleaseFacts(model, version, row.status, project, run, tags, description, files)


def _reserved(model: str, version: int, by: str | None) -> ReleaseFacts:
    return ReleaseFacts(
        model,
        version,
        RESERVED,
        "",
        "",
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
