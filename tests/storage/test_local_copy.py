"""The local store's file copy: direct I/O for the store's own writes, the kernel's copy for a
pull, and on every filesystem the exact bytes and their sha256 whatever the size (empty, under
a disk block, unaligned tails, several chunks)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from registry.storage.base import CHUNK
from registry.storage.local import DIRECT_ALIGN, LocalStore

SIZES = [0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, CHUNK + DIRECT_ALIGN + 17, 2 * CHUNK]


def _roots(tmp_path: Path) -> list[Path]:
    """A store on the disk, and one on tmpfs where this machine has it (O_DIRECT is refused
    or supported there depending on the kernel: either way the copy must be exact)."""
    roots = [tmp_path / "store"]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        roots.append(Path("/dev/shm") / f"reg-test-{os.getpid()}-{tmp_path.name}")
    return roots


@pytest.mark.parametrize("size", SIZES)
def test_put_and_pull_of_a_file_are_exact_at_every_size(tmp_path, size):
    data = os.urandom(size)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    for root in _roots(tmp_path):
        try:
            for named_temp in (False, True):
                store = LocalStore(root)
                store._tmpfile = not named_temp
                key = f"ckpt/p/r/step-{int(named_temp)}/f.bin"
                put = store.put_file(key, src)
                assert (put.size, put.sha256) == (size, want), root
                assert (root / key).read_bytes() == data, f"{root}: stored bytes differ"
                staged = store.stage_file(f"{key}.staged", src)
                assert staged.digest() == (size, want)
                staged.publish()
                staged.discard()
                assert (root / f"{key}.staged").read_bytes() == data
                dest = tmp_path / f"pulled-{root.name}-{int(named_temp)}"
                got = store.get_file(key, dest)
                assert (got.size, got.sha256) == (size, want)
                assert dest.read_bytes() == data, f"{root}: pulled bytes differ"
        finally:
            if root.is_relative_to("/dev/shm"):  # tmp_path does not clean this one
                shutil.rmtree(root, ignore_errors=True)
