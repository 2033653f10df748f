"""Mirror the catalog into MLflow (with `releases`, `access` and `login` beside it,
the only modules that import mlflow).

The catalog is the source of truth; MLflow is a view. Outbox events are applied in order, each
idempotently (objects are found by `reg.*` tags before anything is created), so a replay after a
crash or an outage creates no duplicates. A drain has a time budget: if MLflow is down or slow it
gives up, the events wait, and a later drain (the next command, `reg mlflow sync`) catches up.

Mapping: project -> experiment; run -> MLflow run of the same name, "created by" the principal
who pushed first, ended by `reg run finish` / `CheckpointManager.close()`; checkpoint -> an
external LoggedModel (nothing copied) named like `run42-step9000`, linked to the run at its step,
with params (step, world size, bytes, store URI, manifest digest) and tags (state, expiry, pin,
and `reg.resumable` / `reg.missing_state`, which follow a policy change that changes them), and
the push metrics logged on the run at that step; model -> registered model (names one to one,
`catalog.mlflow_names`) plus a `releases/<model>` experiment whose artifacts are the release
bytes; release -> model version with reg's number, its bytes served by MLflow's artifact proxy
until it is yanked (`mirror.releases`, `storage.mlflow_artifacts`); aliases as set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, update
from sqlmodel import col, select

from registry.catalog import leases
from registry.catalog.engine import Catalog
from registry.catalog.mlflow_names import mirror_name
from registry.catalog.models import OutboxEvent
from registry.core.config import Settings
from registry.core.timeutil import iso, now
from registry.errors import NotFound
from registry.integrations.mirror import access
from registry.integrations.mirror.releases import ReleaseMirror, verified_tags
from registry.storage import open_store
from registry.text import redact

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.core.config import Settings
    from registry.lifecycle.context import Context

DRAIN_LEASE = "mlflow-drain"


class Mirror:
    def __init__(self, settings: Settings, catalog: Catalog) -> None:
        import mlflow  # noqa: F401 - seconds of import, paid only by the drain
        from mlflow import MlflowClient

        self.settings = settings
        self.client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        self.store = open_store(settings.store_url, s3=settings.s3)
        self.releases = ReleaseMirror(self.client, catalog, self.store, self.run)
        self._experiments: dict[str, str] = {}
        self._runs: dict[tuple[str, str], str] = {}

    # -- lookups (create if missing) -----------------------------------------------------------
    def experiment(self, project: str) -> str:
        if project not in self._experiments:
            exp = self.client.get_experiment_by_name(project)
            if exp is None:
                artifacts = (self.settings.home / "mlflow-artifacts" / project).as_uri()
                exp_id = self.client.create_experiment(
                    project, artifact_location=artifacts, tags={"reg.project": project}
                )
            else:
                exp_id = exp.experiment_id
            self._experiments[project] = exp_id
        return self._experiments[project]

    def run(self, project: str, run: str, creator: str | None = None) -> str:
        key = (project, run)
        if key not in self._runs:
            exp = self.experiment(project)
            found = self.client.search_runs(
                [exp], filter_string=f"tags.`reg.run` = '{run}'", max_results=1
            )
            if found:
                self._runs[key] = found[0].info.run_id
            else:
                tags = {"reg.run": run, "reg.project": project}
                if creator:  # MLflow's "Created by": the principal who pushed first
                    tags["mlflow.user"] = creator
                created = self.client.create_run(exp, run_name=run, tags=tags)
                self._runs[key] = created.info.run_id
        return self._runs[key]

    def logged_model(self, project: str, ref: str) -> Any | None:
        found = self.client.search_logged_models(
            experiment_ids=[self.experiment(project)],
            filter_string=f"tags.`reg.ref` = '{ref}'",
            max_results=1,
        )
        return found[0] if found else None

    def settle(self) -> None:
        """After the events: MLflow's permissions follow reg's grants (when `reg ui` runs the
        auth app), and only active releases are served."""
        if access.enabled(self.settings):
            access.sync_access(self.settings, self.releases.catalog)
        self.releases.reconcile()

    # -- events --------------------------------------------------------------------------------
    def apply(self, kind: str, p: dict[str, Any]) -> None:
        getattr(self, "on_" + kind.replace(".", "_"))(p)

    def on_checkpoint_committed(self, p: dict[str, Any]) -> None:
        run_id = self.run(p["project"], p["run"], p.get("pushed_by"))
        info = self.client.get_run(run_id).info
        committed_ms = int(p.get("committed_at", 0) * 1000)
        if info.status != "RUNNING" and (info.end_time or 0) < committed_ms:
            self.client.update_run(run_id, status="RUNNING")  # a job said it ended, then saved
        existing = self.logged_model(p["project"], p["ref"])
        if existing is None:
            import mlflow
            from mlflow.entities import LoggedModelOutput

            params = {
                "step": str(p["step"]),
                "world_size": str(p["world_size"]),
                "bytes": str(p["bytes"]),
                "uri": p["uri"],
                "manifest_sha256": p["manifest_sha256"],
            }
            model = mlflow.create_external_model(
                name=mirror_name(f"{p['run']}-step{p['step']}"),
                source_run_id=run_id,
                model_type="checkpoint",
                experiment_id=self.experiment(p["project"]),
                params=params,
                tags={
                    "reg.ref": p["ref"],
                    "reg.kind": "checkpoint",
                    "step": str(p["step"]),
                    "state": "committed",
                    "reg.expires_at": iso(p.get("expires_at")) or "never",
                    "reg.uri": p["uri"],
                    **_resume_tags(p),
                },
            )
            self.client.log_outputs(run_id, [LoggedModelOutput(model.model_id, p["step"])])
        for key, value in sorted((p.get("metrics") or {}).items()):
            history = self.client.get_metric_history(run_id, key)
            if not any(m.step == p["step"] for m in history):
                self.client.log_metric(run_id, key, float(value), step=p["step"])

    def on_checkpoint_validated(self, p: dict[str, Any]) -> None:
        model = self.logged_model(p["project"], p["ref"])
        if model is not None:
            self.client.set_logged_model_tags(
                model.model_id,
                {
                    "reg.validation": "passed" if p["passed"] else "failed",
                    "reg.validation.device": f"{p['device']} ({p['device_name']})",
                    "reg.validation.mode": str(p.get("mode") or "whole"),
                    "reg.restore_seconds": str(p["seconds"]),
                },
            )

    def on_checkpoint_resume(self, p: dict[str, Any]) -> None:
        model = self.logged_model(p["project"], p["ref"])
        if model is not None:
            self.client.set_logged_model_tags(model.model_id, _resume_tags(p))

    def on_checkpoint_collected(self, p: dict[str, Any]) -> None:
        model = self.logged_model(p["project"], p["ref"])
        if model is not None:
            self.client.set_logged_model_tags(
                model.model_id, {"state": "deleted", "reg.delete_reason": p.get("reason") or ""}
            )

    def on_checkpoint_verified(self, p: dict[str, Any]) -> None:
        model = self.logged_model(p["project"], p["ref"])
        if model is not None:
            self.client.set_logged_model_tags(model.model_id, verified_tags(p["at"], p["damaged"]))

    def on_release_verified(self, p: dict[str, Any]) -> None:
        self.releases.changed(p["model"], p["version"])

    def on_release_signed(self, p: dict[str, Any]) -> None:
        """`reg sign-release` added the signature, provenance and card: served with the rest
        (an MLflow download then verifies with the stock model_signing CLI)."""
        self.releases.changed(p["model"], p["version"])

    def on_release_created(self, p: dict[str, Any]) -> None:
        self.releases.created(p["model"], p["version"])

    def on_release_status(self, p: dict[str, Any]) -> None:
        self.releases.changed(p["model"], p["version"])

    def on_release_alias(self, p: dict[str, Any]) -> None:
        """The alias follows reg's: on a yank it stays where it was, as reg's does, and
        resolves to a version whose bytes are no longer served."""
        self.releases.created(p["model"], p["version"])  # its version exists first
        self.client.set_registered_model_alias(mirror_name(p["model"]), p["alias"], p["version"])

    def on_alias_requested(self, p: dict[str, Any]) -> None:
        """A protected alias's request and its decisions are for webhooks and `reg
        requests`: MLflow shows the alias once it moves (release.alias)."""

    on_alias_approved = on_alias_rejected = on_alias_requested

    def on_run_finished(self, p: dict[str, Any]) -> None:
        status = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}[p["status"]]
        run_id = self.run(p["project"], p["run"])
        self.client.set_terminated(run_id, status, end_time=int(p["ended_at"] * 1000))

    def on_run_economics(self, p: dict[str, Any]) -> None:
        """`reg advise`'s measured figures as metrics of the run, at the step reached."""
        run_id = self.run(p["project"], p["run"])
        for key in ("c_eff_s", "rto_s", "advised_interval_s"):
            if isinstance(p.get(key), int | float):
                self.client.log_metric(run_id, f"reg.{key}", float(p[key]), step=int(p["step"]))

    def on_checkpoint_protection(self, p: dict[str, Any]) -> None:
        model = self.logged_model(p["project"], p["ref"])
        if model is not None:
            tags = {
                "reg.pinned": "true" if p["pinned"] else "false",
                "reg.expires_at": p.get("expires_at") or "never",
                "reg.retention": p.get("retention") or "",
            }
            if p["pinned"] and "pinned_by" in p:  # a pin (a policy change does not say)
                tags["reg.pinned_by"] = p.get("pinned_by") or ""
                tags["reg.pin_reason"] = p.get("pin_reason") or ""
            self.client.set_logged_model_tags(model.model_id, tags)


def _resume_tags(p: dict[str, Any]) -> dict[str, str]:
    tags = {
        "reg.resumable": str(bool(p["resumable"])).lower(),
        "reg.missing_state": ",".join(p.get("missing_state") or []) or "none",
    }
    if p.get("layout"):
        tags["reg.layout"] = p["layout"]
    return tags


def drain(
    catalog: Catalog,
    settings: Settings,
    budget_s: float = 30.0,
    *,
    wait: bool = False,
    holder: str = "detached drain",
) -> dict[str, Any]:
    """Apply pending outbox events in order until done or out of time. One drain at a time:
    with `wait`, a running drain is waited for (within the budget), else this one skips.
    `holder` names who runs it, in the lease (`reg mlflow sync`: the principal)."""
    started = time.monotonic()
    seconds = budget_s + 60

    def take() -> str | None:
        return leases.try_acquire(catalog, DRAIN_LEASE, holder, seconds)[0]

    token = take()
    while token is None and wait and time.monotonic() - started < budget_s:
        time.sleep(0.5)
        token = take()
    if token is None:
        return {"applied": 0, "pending": pending_count(catalog), "skipped": "another drain runs"}
    applied, error = 0, None
    try:
        settings.home.mkdir(parents=True, exist_ok=True)  # the catalog may live elsewhere
        os.chdir(settings.home)  # MLflow's SQLite store writes ./mlruns: keep it here
        mirror = Mirror(settings, catalog)
    except Exception as exc:  # MLflow not importable or unreachable at start-up, and the like
        leases.release(catalog, DRAIN_LEASE, token)
        return {"applied": 0, "pending": pending_count(catalog), "error": _first_line(exc)}
    # The lease is renewed while the drain works (a slow MLflow call or a large S3 copy outlasts
    # its first term), and checked before each event: two drains never apply the same events.
    lost = False
    with leases.renewed(catalog, DRAIN_LEASE, token, seconds):
        while True:
            try:
                applied += _apply_pending(catalog, mirror, token, seconds, started, budget_s)
            except _Stop as stop:
                applied += stop.applied
                error, lost = stop.error, stop.lost
            except Exception as exc:  # MLflow unreachable, and the like
                error = _first_line(exc)
            if lost:
                break  # the new holder settles
            # Whatever the events did: who may see what, and what is served, follow the catalog.
            try:
                mirror.settle()
            except Exception as exc:
                error = error or _first_line(exc)
            # Events that came meanwhile (a yank during the settle) are this drain's too: the
            # drain started after them found the lease held.
            if error or not pending_count(catalog) or time.monotonic() - started >= budget_s:
                break
    return {"applied": applied, "pending": pending_count(catalog), "error": error}


def _apply_pending(
    catalog: Catalog, mirror: Mirror, token: str, seconds: float, started: float, budget_s: float
) -> int:
    """Apply pending events in order while time remains; the number applied. Raises _Stop at
    the first failing event, or when the lease is no longer ours."""
    applied = 0
    while time.monotonic() - started < budget_s:
        with catalog.session() as s:
            batch = s.exec(
                select(OutboxEvent)
                .where(col(OutboxEvent.done_at).is_(None))
                .order_by(col(OutboxEvent.id))
                .limit(50)
            ).all()
        if not batch:
            break
        for event in batch:
            if time.monotonic() - started >= budget_s:
                break
            if not leases.renew(catalog, DRAIN_LEASE, token, seconds):
                raise _Stop(applied, "another drain took over", lost=True)
            try:
                mirror.apply(event.kind, event.payload)
            except Exception as exc:
                error = redact(f"{event.kind} #{event.id}: {type(exc).__name__}: {exc}")
                _note_failure(catalog, event.id or 0, error)
                raise _Stop(applied, error) from exc
            _mark_done(catalog, event.id or 0)
            applied += 1
    return applied


def _mark_done(catalog: Catalog, event_id: int) -> None:
    with catalog.session(write=True) as s:
        s.exec(update(OutboxEvent).where(col(OutboxEvent.id) == event_id).values(done_at=now()))


def _first_line(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return redact(f"{type(exc).__name__}: {first}")


class _Stop(Exception):
    """Stop at the first failing event: order matters (a version before its alias)."""

    def __init__(self, applied: int, error: str, *, lost: bool = False) -> None:
        super().__init__(error)
        self.applied, self.error, self.lost = applied, error, lost


def skip_event(ctx: Context, event_id: int) -> dict[str, Any]:
    """Set one pending event aside (admin, audited), so a drain that stops at it goes on; what
    it would have mirrored is not mirrored (a later event about the same object may be)."""
    with ctx.catalog.session(write=True) as s:
        event = s.get(OutboxEvent, event_id)
        if event is None or event.done_at is not None:
            raise NotFound(
                f"no pending MLflow event #{event_id}",
                "`reg mlflow sync` names the event it stopped at",
            )
        kind, was = event.kind, event.last_error
        event.done_at = now()
        event.last_error = f"skipped by {ctx.actor}" + (f" after: {was}" if was else "")
        s.add(event)
        ctx.audit(s, "mlflow-skip", f"MLflow event #{event_id}", kind=kind, error=was)
    return {"skipped": event_id, "kind": kind, "error": was}


def pending_count(catalog: Catalog) -> int:
    with catalog.session() as s:
        return int(
            s.exec(
                select(func.count())
                .select_from(OutboxEvent)
                .where(col(OutboxEvent.done_at).is_(None))
            ).one()
        )


def _note_failure(catalog: Catalog, event_id: int, error: str) -> None:
    with catalog.session(write=True) as s:
        s.exec(
            update(OutboxEvent)
            .where(col(OutboxEvent.id) == event_id)
            .values(attempts=OutboxEvent.attempts + 1, last_error=error[:1000])
        )


def main() -> None:
    """The detached drain started after a command
    (`python -m registry.integrations.mirror.drain`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=30.0)
    args = parser.parse_args()

    settings = Settings.from_env()
    catalog = Catalog.of(settings.catalog)
    try:
        result = drain(catalog, settings, args.budget)
    finally:
        catalog.dispose()
    print(f"{iso(now())} drain: {result}", file=sys.stderr)


if __name__ == "__main__":
    main()
