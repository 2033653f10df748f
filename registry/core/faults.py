"""Named fault points for the crash and torture tests: with `REG_FAULT=NAME` in its environment,
a process dies by SIGKILL (no cleanup, no flush, like a power cut) when it reaches point NAME.

    push-published       every file published, MANIFEST.json not yet written
    push-manifest        MANIFEST.json written, the row not yet committed
    gc-marked            a batch marked `deleting`, none of its objects deleted yet
    promote-consolidated safetensors written, release.json not yet
    promote-documented   release.json written, the row not yet active
    presigned-assembled  a presigned upload's parts assembled, not yet recorded

    save-written         a training-loop save: every rank's files and .metadata written,
                         the row not yet committed (the coordinator, in DCP's finish)

    store-write          the local store, part-way through writing an object's bytes into its
                         (invisible) temp file
    store-publish        the local store, an object's bytes written and fsynced, about to be
                         linked to its key (in a push: after the claim, while uploading)
    pull-write           a pull or a store read (`get_file`), part-way through writing the
                         destination file

A kind after a colon changes what happens at the point:

    NAME:fail     raise a RegistryError (a failure the caller must surface, not a crash)
    NAME:enospc   raise OSError(ENOSPC), as a full disk does (only meaningful at a write point)
    NAME:pause    the first time a point is reached: create the file `$REG_FAULT_PAUSE/NAME` and
                  wait (at most 120 s) until someone removes it, so a test acts (restarts a
                  database, ...) at that moment; other threads and later passes go on

Unset (always, outside tests) a point costs one comparison.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from registry.errors import RegistryError

# A test in this process arms a point by setting _ARMED; otherwise REG_FAULT is read at each
# point (not at import: a process forked after the import, with its own environment, obeys it).
_ARMED: str | None = None
PAUSE_LIMIT_S = 120.0
_paused: set[str] = set()


def point(name: str, path: object = None) -> None:
    """Reach point `name` (`path`: the file being written there, named by an injected OSError)."""
    armed = _ARMED or os.environ.get("REG_FAULT")
    if armed is None or not armed.startswith(name):
        return
    if armed == name:
        os.kill(os.getpid(), signal.SIGKILL)
    kind = armed[len(name) :]
    if kind == ":fail":
        raise RegistryError(f"injected failure at {name} (REG_FAULT)")
    if kind == ":enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    if kind == ":pause":
        _pause(name)


def _pause(name: str) -> None:
    folder = os.environ.get("REG_FAULT_PAUSE")
    if not folder or name in _paused:
        return  # once per process: the other threads and later passes go on
    _paused.add(name)
    marker = os.path.join(folder, name)
    try:
        with open(marker, "x"):
            pass
    except FileExistsError:
        return  # another thread got here first
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
