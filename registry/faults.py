"""Named crash points for the crash tests: with `REG_FAULT=NAME` in its environment, a process
dies by SIGKILL (no cleanup, no flush, like a power cut) when it reaches point NAME.

    push-published       every file published, MANIFEST.json not yet written
    push-manifest        MANIFEST.json written, the row not yet committed
    gc-marked            a batch marked `deleting`, none of its objects deleted yet
    promote-consolidated safetensors written, release.json not yet
    promote-documented   release.json written, the row not yet active

    save-written         a training-loop save: every rank's files and .metadata written,
                         the row not yet committed (the coordinator, in DCP's finish)

`REG_FAULT=NAME:fail` raises a RegistryError at point NAME instead (a failure the caller must
surface, not a crash). Unset (always, outside tests) a point costs one comparison.
"""

from __future__ import annotations

import os
import signal

_ARMED = os.environ.get("REG_FAULT")


def point(name: str) -> None:
    armed = _ARMED
    if armed is None or not armed.startswith(name):
        return
    if armed == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if armed == f"{name}:fail":
        from registry.errors import RegistryError

        raise RegistryError(f"injected failure at {name} (REG_FAULT)")
