"""Refs name what the registry holds; they parse by shape (DESIGN §1).

    run42@step9000            checkpoint (project `default`)
    team-a/run42@latest       checkpoint, newest committed step
    llama-tiny:v3             release version
    llama-tiny@prod           release alias

Names match ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` and never contain ``..``, so a name is always
one safe path segment of the store layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from registry.errors import MalformedRef, UsageError
from registry.text import inert

DEFAULT_PROJECT = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_STEP = re.compile(r"step(0|[1-9][0-9]{0,17})")
_VERSION = re.compile(r"v([1-9][0-9]{0,8})")


def check_name(name: str, what: str = "name") -> str:
    """Return `name` if it is a valid project, run, model or alias name, else raise MalformedRef."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise MalformedRef(
            f"invalid {what} {name!r}",
            "names are 1-128 of A-Z a-z 0-9 . _ -, start with a letter or digit, no '..'",
        )
    return name


def check_alias(alias: str) -> str:
    check_name(alias, "alias")
    if alias == "latest" or alias.startswith("step"):
        raise MalformedRef(
            f"invalid alias {alias!r}",
            "'latest' and names starting with 'step' name checkpoints, not aliases",
        )
    return alias


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    project: str
    run: str
    step: int | None  # None = latest committed

    def __str__(self) -> str:
        at = "latest" if self.step is None else f"step{self.step}"
        prefix = "" if self.project == DEFAULT_PROJECT else f"{self.project}/"
        return f"{prefix}{self.run}@{at}"

    @property
    def run_label(self) -> str:
        return self.run if self.project == DEFAULT_PROJECT else f"{self.project}/{self.run}"


@dataclass(frozen=True, slots=True)
class ReleaseRef:
    model: str
    version: int | None = None
    alias: str | None = None

    def __str__(self) -> str:
        if self.version is not None:
            return f"{self.model}:v{self.version}"
        if self.alias is not None:
            return f"{self.model}@{self.alias}"
        return self.model


Ref = CheckpointRef | ReleaseRef


def parse_ref(text: str, project: str | None = None) -> Ref:
    """Parse any ref. `project` is the default project for checkpoint refs without one."""
    if not isinstance(text, str) or not text:
        raise MalformedRef("empty ref", "expected RUN@stepN, RUN@latest, MODEL:vK or MODEL@ALIAS")
    if ":" in text:
        model, _, version = text.partition(":")
        match = _VERSION.fullmatch(version)
        if not match:
            raise MalformedRef(
                f"malformed release ref {text!r}", "expected MODEL:vK with K >= 1, e.g. llama:v3"
            )
        return ReleaseRef(check_name(model, "model name"), version=int(match.group(1)))
    if "@" not in text:
        raise MalformedRef(
            f"malformed ref {text!r}",
            "expected RUN@stepN, RUN@latest, MODEL:vK or MODEL@ALIAS",
        )
    name, _, at = text.rpartition("@")
    if at == "latest" or at.startswith("step"):
        return _checkpoint_ref(text, name, at, project)
    if "/" in name:
        raise MalformedRef(f"malformed release ref {text!r}", "model names contain no '/'")
    return ReleaseRef(check_name(name, "model name"), alias=check_alias(at))


def parse_checkpoint_ref(text: str, project: str | None = None) -> CheckpointRef:
    ref = parse_ref(text, project)
    if not isinstance(ref, CheckpointRef):
        raise MalformedRef(
            f"{text!r} names a release, not a checkpoint",
            "this command takes a checkpoint, RUN@stepN or RUN@latest; a release is shown with "
            f"`reg show {text}` and copied out with `reg pull-release {text} DIR`",
        )
    return ref


def parse_release_ref(text: str) -> ReleaseRef:
    ref = parse_ref(text)
    if not isinstance(ref, ReleaseRef):
        raise MalformedRef(
            f"{text!r} names a checkpoint, not a release", "expected MODEL:vK or MODEL@ALIAS"
        )
    return ref


def _checkpoint_ref(text: str, name: str, at: str, project: str | None) -> CheckpointRef:
    proj, slash, run = name.rpartition("/")
    if not slash:
        proj = project or DEFAULT_PROJECT
    elif "/" in proj:
        raise MalformedRef(f"malformed ref {text!r}", "expected [PROJECT/]RUN@stepN")
    check_name(proj, "project name")
    check_name(run, "run name")
    if at == "latest":
        return CheckpointRef(proj, run, None)
    match = _STEP.fullmatch(at)
    if not match:
        raise MalformedRef(
            f"malformed ref {text!r}",
            "steps are written stepN with N a whole number, e.g. @step9000",
        )
    return CheckpointRef(proj, run, int(match.group(1)))


MAX_REASON = 500  # characters in a pin, yank or deprecation reason


def check_reason(reason: str | None, what: str = "reason") -> str | None:
    """A free-text reason as recorded: one printable line of at most MAX_REASON characters."""
    if reason is None:
        return None
    if len(reason) > MAX_REASON:
        raise UsageError(
            f"the {what} is {len(reason)} characters", f"keep it to {MAX_REASON} or fewer"
        )
    if not reason.isprintable():
        raise UsageError(
            f"the {what} {inert(reason[:60])!r} holds control characters",
            "write it on one line, printable characters only",
        )
    return reason


def split_run(text: str, project: str | None = None) -> tuple[str, str]:
    """`project/run` or `run` (in `project`, default `default`)."""
    if "/" in text:
        head, _, tail = text.partition("/")
        if project is not None and project != head:
            raise UsageError(
                f"run {text} names project {head}, and the project given is {project}",
                "give the run as PROJECT/RUN or the project apart, not both",
            )
        return head, tail
    return project or "default", text


def as_ref(ref: str | Ref) -> Ref:
    """`ref` parsed by its shape, or as given when it is parsed already."""
    return parse_ref(ref) if isinstance(ref, str) else ref


def as_checkpoint_ref(ref: str | CheckpointRef) -> CheckpointRef:
    """`ref` parsed, or as given when it is parsed already."""
    return parse_checkpoint_ref(ref) if isinstance(ref, str) else ref


def as_release_ref(ref: str | ReleaseRef) -> ReleaseRef:
    """`ref` parsed, or as given when it is parsed already."""
    return parse_release_ref(ref) if isinstance(ref, str) else ref
