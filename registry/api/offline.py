"""What the API answers without opening a registry (no catalog, no store, no server): a pulled
folder checked against the document it keeps, a pinned public key read, and the step a save
directory records. The CLI asks these before (or instead of) opening one.

Each imports its module when called: a command pays only for the check it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from registry.lifecycle.checkpoints.pulled import FolderReport


def read_public_key(path: Path) -> str:
    """The PEM public key in `path` (the one `reg keys public` printed), checked."""
    # at use: cryptography's key loading (70 ms) for the commands that verify a signature
    from registry.trust.release_signing.bundle import read_public_key as read

    return read(path)


def verify_folder(
    root: Path, *, expect_sha256: str | None = None, public_key: str | None = None
) -> FolderReport:
    """Check a folder `reg pull` or `reg pull-release` wrote against the document it keeps
    (MANIFEST.json or release.json), every byte; with `public_key` (a pinned PEM) a release's
    model.sig must sign exactly its files."""
    # at use: the folder checks (0.36 s of imports) for `reg verify DIR` alone
    from registry.lifecycle.checkpoints.pulled import verify_folder as verify

    return verify(root, expect_sha256=expect_sha256, public_key=public_key)


def recorded_step(directory: Path, step: int | None, world_size: int | None) -> int:
    """The step to push `directory` as: `step`, else the one its own files record; a step or
    world size that disagrees with them, or a step neither gives, is a UsageError before a byte
    moves."""
    # at use: the trainers' layouts (0.29 s of imports) for a push alone
    from registry.formats.recorded import recorded_step as recorded

    return recorded(directory, step, world_size)
