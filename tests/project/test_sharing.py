"""The suite's own sharing machinery (tests/sharing.py): a shared tree that a test changes is
named, and a build runs once per session."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from tests.sharing import ExclusiveLock, SharedTrees, build_once


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "step-2").mkdir(parents=True)
    (root / "step-2" / "__0_0.distcp").write_bytes(b"x" * 100)
    (root / "step-2" / ".metadata").write_bytes(b"m")
    return root


def test_a_write_an_addition_and_a_removal_are_each_named_once(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    trees = SharedTrees()
    trees.watch("ckpts", root)
    assert trees.changes() == []
    with open(root / "step-2" / "__0_0.distcp", "r+b") as f:  # same size, new bytes
        f.write(b"y")
    (root / "step-2" / "extra").write_text("z")
    (root / "step-2" / ".metadata").unlink()
    found = trees.changes()
    assert len(found) == 1 and found[0].startswith(f"ckpts ({root}): ")
    assert "added step-2/extra" in found[0] and "removed step-2/.metadata" in found[0]
    assert "changed " in found[0] and "step-2/__0_0.distcp" in found[0]
    assert trees.changes() == []  # reported once: the next test is not blamed for it


def test_a_build_runs_once_and_its_files_lose_their_write_bits(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    calls: list[Path] = []

    def build(path: Path) -> dict[str, int]:
        calls.append(path)
        (path / "f").write_text("built")
        return {"n": len(calls)}

    name = f"selftest-{os.getpid()}-{id(calls)}"
    assert build_once(tmp_path_factory, name, build) == {"n": 1}
    assert build_once(tmp_path_factory, name, build) == {"n": 1} and len(calls) == 1
    assert not (calls[0] / "f").stat().st_mode & 0o222


def test_an_exclusive_holder_keeps_ordinary_tests_out(tmp_path: Path) -> None:
    lock = ExclusiveLock(tmp_path)
    with lock.hold(exclusive=True, next_exclusive=False):
        fd = os.open(lock.machine, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # an ordinary test could not start now
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    fd = os.open(lock.machine, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released after the run
    finally:
        os.close(fd)
