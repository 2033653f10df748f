"""Where things live in the store (DESIGN §3): every storage key the registry builds or parses.

    ckpt/<project>/<run>/step-<N>/<files as in the DCP dir>, MANIFEST.json (written last)
    release/<model>/v<K>/model*.safetensors [+ index], extras, release.json (written last)
    journal/<YYYY-MM-DD>/<ns>-<uid>.json   decisions that live only in the catalog (pins,
                                           yanks, aliases, policies, validations), one object
                                           each, written before the catalog commits them

Names are checked by `registry.core.refs.check_name` before they reach here, so each is one safe
path segment; the inverses refuse anything that is not exactly such a key.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

CHECKPOINTS = "ckpt/"
RELEASES = "release/"
MANIFEST = "MANIFEST.json"
RELEASE_DOCUMENT = "release.json"
JOURNAL = "journal/"

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_CHECKPOINT_PREFIX = re.compile(rf"ckpt/({_NAME})/({_NAME})/step-(0|[1-9][0-9]{{0,17}})/")
_RELEASE_PREFIX = re.compile(rf"release/({_NAME})/v([1-9][0-9]{{0,8}})/")
_JOURNAL_KEY = re.compile(r"journal/([0-9]{4}-[0-9]{2}-[0-9]{2})/([0-9]{20})-([0-9a-f]{32})\.json")


def checkpoint_prefix(project: str, run: str, step: int) -> str:
    return f"{CHECKPOINTS}{project}/{run}/step-{step}/"


def manifest_key(project: str, run: str, step: int) -> str:
    return checkpoint_prefix(project, run, step) + MANIFEST


def release_prefix(model: str, version: int) -> str:
    return f"{RELEASES}{model}/v{version}/"


def release_document_key(model: str, version: int) -> str:
    return release_prefix(model, version) + RELEASE_DOCUMENT


def parse_checkpoint_key(key: str) -> tuple[str, str, int, str] | None:
    """`ckpt/p/r/step-N/rest` -> (p, r, N, rest); None for any other key."""
    match = _CHECKPOINT_PREFIX.match(key)
    if match is None:
        return None
    project, run, step = match.groups()
    if ".." in project or ".." in run:
        return None
    return project, run, int(step), key[match.end() :]


def parse_release_key(key: str) -> tuple[str, int, str] | None:
    """`release/m/vK/rest` -> (m, K, rest); None for any other key."""
    match = _RELEASE_PREFIX.match(key)
    if match is None:
        return None
    model, version = match.groups()
    if ".." in model:
        return None
    return model, int(version), key[match.end() :]


def journal_key(ns: int, uid: str) -> str:
    """The key of the journal event written at `ns` (nanoseconds since the epoch, UTC): keys
    sort by time, and the random `uid` (32 hex digits) keeps two writers apart."""
    day = datetime.fromtimestamp(ns // 10**9, UTC).strftime("%Y-%m-%d")
    return f"{JOURNAL}{day}/{ns:020d}-{uid}.json"


def parse_journal_key(key: str) -> tuple[int, str] | None:
    """`journal/<day>/<ns>-<uid>.json` -> (ns, uid), the day agreeing with ns; None otherwise."""
    match = _JOURNAL_KEY.fullmatch(key)
    if match is None:
        return None
    ns, uid = int(match.group(2)), match.group(3)
    return (ns, uid) if journal_key(ns, uid) == key else None
