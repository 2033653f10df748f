"""Named crash points for the crash tests: with `REG_FAULT=NAME` in its environment, a process
dies by SIGKILL (no cleanup, no flush, like a power cut) when it reaches point NAME.

    push-published       every file published, MANIFEST.json not yet written
    push-manifest        MANIFEST.json written, the row not yet committed
    gc-marked            a batch marked `deleting`, none of its objects deleted yet
    promote-consolidated safetensors written, release.json not yet
    promote-documented   release.json written, the row not yet active

Unset (always, outside tests) a point costs one comparison.
"""

from __future__ import annotations

import os
import signal

_ARMED = os.environ.get("REG_FAULT")


def point(name: str) -> None:
    if name == _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)
