"""Who sees what in the MLflow UI: MLflow's auth app (`mlflow[auth]`), its users and
permissions kept in step with reg's grants.

Everyone reg knows (a principal a grant names, or one holding a live token) is an MLflow user
who logs in with a reg token (`mirror.login`); the password MLflow stores for them is
random and never given out. Default permission: none. Each gets READ on the experiment of every
project and on the registered model and releases experiment of every model their grants let
them read; reg's admins get READ on everything. Nobody gets more: every write through MLflow is
refused at the login (`login.writes`), admins' included, because reg trusts what the
mirror wrote there (which experiment serves a model's bytes, which version number is which).
No one is an MLflow admin but, on a registry without grants, the one local user. Synced after
every drain and at each login (the login's principal), so a grant, a revoked token or a new
project shows within one drain.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlmodel import col, or_, select

from registry.catalog.mlflow_names import RELEASES_EXPERIMENT, mirror_name
from registry.catalog.models import ApiToken
from registry.core.timeutil import now
from registry.storage import open_store
from registry.trust.audit_chain import keys
from registry.trust.policy_source import EffectivePolicy
from registry.trust.principal import Principal
from registry.trust.signed_facts import model_owners

if TYPE_CHECKING:
    from collections.abc import Callable

    from registry.catalog.engine import Catalog
    from registry.core.config import Settings

READ = "READ"
ADMIN_USER = "reg-mlflow-admin"  # the auth app's bootstrap admin: nobody can log in as it
LOCAL_USER = "reg-local"  # the one user of a registry without grants (no login)


def auth_db_uri(settings: Settings) -> str:
    return f"sqlite:///{settings.home / 'mlflow-auth.db'}"


def enabled(settings: Settings) -> bool:
    """`reg ui` created the auth store: keep it in step."""
    return (settings.home / "mlflow-auth.db").exists()


@dataclass(frozen=True)
class Wanted:
    """One principal's permissions: experiment id -> level, registered model -> level."""

    experiments: dict[str, str]
    models: dict[str, str]


class AccessSync:
    def __init__(self, settings: Settings, catalog: Catalog) -> None:
        from mlflow import MlflowClient
        from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

        self.settings, self.catalog = settings, catalog
        self.auth = SqlAlchemyStore()
        self.auth.init_db(auth_db_uri(settings))  # type: ignore[no-untyped-call]
        (settings.home / "mlflow-auth.db").chmod(0o600)  # password hashes: the owner's only
        self.client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)

    def principals(self) -> set[str]:
        """Whom a grant names, and whoever holds a live token."""

        policy = self._policy()
        named = {p for grant in policy.access.grants for p in grant.principals}
        with self.catalog.session() as s:
            holders = s.exec(
                select(ApiToken.principal).where(
                    col(ApiToken.revoked_at).is_(None),
                    or_(col(ApiToken.expires_at).is_(None), col(ApiToken.expires_at) > now()),
                )
            ).all()
        return (named | set(holders)) - {ADMIN_USER}

    def sync(self, only: str | None = None) -> dict[str, Any]:
        """Make the auth store say what reg's grants say (for `only`, one principal)."""
        everyone = self.principals()
        targets = {only} & everyone if only is not None else everyone
        projects, models = self._mirrored()
        changed = 0
        for name in sorted(targets):
            changed += self._apply(name, self._wanted(name, projects, models))
        removed = 0
        if only is None:
            if self.auth.has_user(LOCAL_USER, use_primary=True):  # `reg ui` without a login
                changed += self._apply(LOCAL_USER, _everything(projects, models))
            for user in self.auth.list_users():
                if user.username not in everyone | {ADMIN_USER, LOCAL_USER}:
                    self.auth.delete_user(user.username)
                    removed += 1
        return {"users": len(targets), "changed": changed, "removed": removed}

    def open_user(self) -> None:
        """A registry without grants: the one local user, with READ on everything (not an
        MLflow admin: MLflow's own checks stay behind reg's read-only login)."""
        self._user(LOCAL_USER, admin=False)
        self.sync()

    # -- what reg says -------------------------------------------------------------------------
    def _policy(self) -> Any:
        """The policy in force; on the server's host (the audit key readable) the proven one,
        as the server decides with (`registry.trust.proven_policy`): a forged row grants no read."""
        key = keys.optional(self.settings.audit_key_path)
        if key is None:
            return EffectivePolicy.load(
                self.catalog, policy_path=self.settings.policy_path, home=self.settings.home
            )
        return EffectivePolicy.for_server(
            self.catalog,
            open_store(self.settings.store_url, s3=self.settings.s3),
            key,
            policy_path=self.settings.policy_path,
            home=self.settings.home,
        )

    def _mirrored(self) -> tuple[dict[str, str], dict[str, tuple[str, str | None]]]:
        """Project -> experiment id; model -> (registered model name, releases experiment)."""
        from mlflow.entities import ViewType

        # Only what the mirror made counts: its name and its tags agree (nobody else writes
        # there: login.py refuses every write through MLflow).
        projects: dict[str, str] = {}
        releases: dict[str, str] = {}
        for exp in _pages(
            lambda token: self.client.search_experiments(
                view_type=ViewType.ALL, max_results=1_000, page_token=token
            )
        ):
            model = exp.tags.get("reg.model")
            if exp.tags.get("reg.kind") == "releases" and exp.name == RELEASES_EXPERIMENT + str(
                model
            ):
                releases[str(model)] = exp.experiment_id
            elif exp.tags.get("reg.project") == exp.name:
                projects[exp.name] = exp.experiment_id
        models = {}
        for rm in _pages(
            lambda token: self.client.search_registered_models(max_results=1_000, page_token=token)
        ):
            model = rm.tags.get("reg.model")
            if model and mirror_name(model) == rm.name:
                models[model] = (rm.name, releases.get(model))
        return projects, models

    def _wanted(
        self,
        name: str,
        projects: dict[str, str],
        models: dict[str, tuple[str, str | None]],
    ) -> Wanted:
        principal = Principal.under(name, "token", self._policy())
        with self.catalog.session() as s:
            owners = model_owners(s, keys.optional(self.settings.audit_key_path))
        if principal.single_user:
            principal = Principal(name, "token", ())  # as behind reg server: no grant, no access
        experiments: dict[str, str] = {}
        registered: dict[str, str] = {}
        for project, exp_id in projects.items():
            if principal.can_read(project=project):
                experiments[exp_id] = READ
        for model, (rm_name, releases_exp) in models.items():
            if principal.can_read(model=model, model_owner=owners.get(model)):
                registered[rm_name] = READ
                if releases_exp is not None:
                    experiments[releases_exp] = READ
        return Wanted(experiments, registered)

    # -- what MLflow says ----------------------------------------------------------------------
    def _user(self, name: str, *, admin: bool) -> None:
        from mlflow.exceptions import MlflowException

        if not self.auth.has_user(name, use_primary=True):
            with contextlib.suppress(MlflowException):  # a concurrent login created it
                self.auth.create_user(name, secrets.token_urlsafe(32) + "Aa1!", is_admin=admin)
        if self.auth.get_user(name).is_admin != admin:
            self.auth.update_user(name, is_admin=admin)

    def _apply(self, name: str, wanted: Wanted) -> int:
        self._user(name, admin=False)
        auth = self.auth
        experiments = {
            p.experiment_id: p.permission for p in auth.list_experiment_permissions(name)
        }
        models = {p.name: p.permission for p in auth.list_registered_model_permissions(name)}
        return _reconcile(
            experiments,
            wanted.experiments,
            lambda key, level: auth.create_experiment_permission(key, name, level),
            lambda key, level: auth.update_experiment_permission(key, name, level),
            lambda key: auth.delete_experiment_permission(key, name),
        ) + _reconcile(
            models,
            wanted.models,
            lambda key, level: auth.create_registered_model_permission(key, name, level),
            lambda key, level: auth.update_registered_model_permission(key, name, level),
            lambda key: auth.delete_registered_model_permission(key, name),
        )


def _everything(projects: dict[str, str], models: dict[str, tuple[str, str | None]]) -> Wanted:
    experiments = dict.fromkeys(projects.values(), READ)
    experiments.update({exp: READ for _, exp in models.values() if exp is not None})
    return Wanted(experiments, {name: READ for name, _ in models.values()})


def _pages(search: Callable[[str | None], Any]) -> list[Any]:
    """Every item of a paged MLflow search."""
    items: list[Any] = []
    token = None
    while True:
        page = search(token)
        items.extend(page)
        token = page.token
        if not token:
            return items


def _reconcile(
    have: dict[str, str],
    wanted: dict[str, str],
    create: Callable[[str, str], object],
    update: Callable[[str, str], object],
    delete: Callable[[str], object],
) -> int:
    """Make `have` (resource -> level) into `wanted`; how many grants changed."""
    changed = 0
    for key, level in wanted.items():
        if key not in have:
            create(key, level)
        elif have[key] != level:
            update(key, level)
        else:
            continue
        changed += 1
    for key in set(have) - set(wanted):
        delete(key)
        changed += 1
    return changed


def sync_access(settings: Settings, catalog: Catalog, only: str | None = None) -> dict[str, Any]:
    sync = AccessSync(settings, catalog)
    try:
        return sync.sync(only)
    finally:
        sync.auth.engine.dispose()
