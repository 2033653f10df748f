"""A run's end: `reg run finish RUN [--status failed]` and `CheckpointManager.close()` say the
training job ended, so the MLflow run stops showing RUNNING. Recorded in the audit log (who said
it, when, with which status) and mirrored; saying it again is harmless."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlmodel import select

from policies.access import Action
from registry.catalog.models import Project, Run
from registry.core.refs import check_name
from registry.core.timeutil import iso, now
from registry.errors import NotFound, UsageError
from registry.journal import outbox as events

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

RUN_STATUSES = ("finished", "failed", "killed")


def finish_run(ctx: Context, project: str, run: str, status: str = "finished") -> dict[str, Any]:
    """Mark `project/run` ended with `status` (finished, failed or killed)."""

    check_name(project, "project name")
    check_name(run, "run name")
    if status not in RUN_STATUSES:
        raise UsageError(f"unknown run status {status!r}", "use " + ", ".join(RUN_STATUSES))
    target = f"{project}/{run}"
    ctx.authorize(Action.PUSH, project=project, target=target)
    with ctx.catalog.session(write=True) as s:
        found = s.exec(
            select(Run).join(Project).where(Project.name == project, Run.name == run)
        ).first()
        if found is None:
            raise NotFound(f"no run {target}", "reg ls shows the runs")
        ended = now()
        ctx.audit(s, "finish-run", target, status=status)
        ctx.events.emit(
            s, events.RUN_FINISHED, project=project, run=run, status=status, ended_at=ended
        )
    return {"project": project, "run": run, "status": status, "ended_at": iso(ended)}
