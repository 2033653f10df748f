"""How reg's names appear in MLflow, one to one.

MLflow refuses `/ : . % " '` in registered-model and LoggedModel names; reg's names may hold `.`
(`registry.core.refs`), so `llama.v2` appears as `llama-v2`. That mapping is not one to one, so the
registry refuses a model whose MLflow name another model already has: `llama.v2` and `llama-v2`
cannot both exist. Checked where a model is first created, in the same write transaction.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sqlmodel import col, func, select

from registry.catalog.models import Model
from registry.errors import Conflict

if TYPE_CHECKING:
    from sqlmodel import Session

_UNSAFE = re.compile(r"[/:.%\"']")
RELEASES_EXPERIMENT = "releases/"  # + model: where MLflow serves a model's release bytes from


def mirror_name(name: str) -> str:
    """The registered-model (or LoggedModel) name MLflow gets for a reg name."""
    return _UNSAFE.sub("-", name)


def releases_experiment(model: str) -> str:
    """The MLflow experiment whose artifact root holds `model`'s release bytes: READ on it
    follows reg's model grants (project names cannot hold `/`, so it never names a project)."""
    return RELEASES_EXPERIMENT + model


def refuse_colliding_model(session: Session, name: str) -> None:
    """Raise Conflict if `name` is new and another model already appears in MLflow under
    `name`'s mirror name."""

    if session.exec(select(Model.id).where(Model.name == name)).first() is not None:
        return  # it exists: its MLflow name was settled when it was created
    wanted = mirror_name(name)
    same_length = session.exec(
        select(Model.name).where(func.length(col(Model.name)) == len(name), Model.name != name)
    ).all()
    clash = next((other for other in same_length if mirror_name(other) == wanted), None)
    if clash is not None:
        raise Conflict(
            f"model name {name!r} would appear in MLflow as {wanted!r}, which model "
            f"{clash!r} already has",
            f"choose another name, or release into {clash!r}",
        )
