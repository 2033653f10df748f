"""What push reads is what it checked, and what the store writes is not world-readable.

A file swapped for a symlink (or another file) between the scan and the copy is refused, not
followed; hard links are refused; stored objects and the catalog get the store's modes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from registry import Registry
from registry.errors import InvalidCheckpoint
from registry.formats import dcp_scan


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(b"root-only system file" * 1000)
    path.chmod(0o600)
    return path


def _swap_after_scan(monkeypatch, swap):  # type: ignore[no-untyped-def]
    """Run `swap(root)` right after push has scanned and checked the directory."""
    scan = dcp_scan.scan_directory

    def scanned_then_swapped(root: Path, **kw: Any) -> dcp_scan.ScannedDir:
        out = scan(root, **kw)
        swap(Path(root))
        return out

    from registry.lifecycle.checkpoints import push

    monkeypatch.setattr(push, "scan_directory", scanned_then_swapped)


@pytest.mark.parametrize(
    "how", ["symlink", "other-file", "symlinked-directory", "metadata-rewritten-in-place"]
)
def test_a_file_swapped_after_the_scan_is_refused_not_followed(
    ckpts, tmp_path, secret, monkeypatch, how
):
    src = ckpts.ws2.copy_step(2, tmp_path / "src")
    target = src / "__0_0.distcp"
    size = target.stat().st_size

    def swap(root: Path) -> None:
        if how == "symlink":
            target.unlink()
            target.symlink_to(secret)
        elif how == "other-file":  # same size, other inode
            (root / "other").write_bytes(b"x" * size)
            os.replace(root / "other", target)
        elif how == "symlinked-directory":  # the whole directory replaced by a symlink to a copy
            os.rename(root, tmp_path / "moved")
            root.symlink_to(tmp_path / "moved")
        else:  # same inode, same size, other bytes: the .metadata that was checked is gone
            metadata = root / ".metadata"
            data = bytearray(metadata.read_bytes())
            data[-20] ^= 0x01
            with open(metadata, "r+b") as f:
                f.write(data)

    _swap_after_scan(monkeypatch, swap)
    with Registry() as reg:
        with pytest.raises(InvalidCheckpoint) as info:
            reg.push_checkpoint(src, run="r", step=2)
        assert info.value.exit_code == 2
        assert "cannot be opened safely" in str(info.value) or "is not the file that was" in str(
            info.value
        )
        assert reg.list_checkpoints("r") == []
        stored = [p for p in (reg.settings.home / "store").rglob("*") if p.is_file()]
        assert all(p.read_bytes()[:21] != b"root-only system file" for p in stored)


def test_hard_links_are_refused(ckpts, tmp_path, cli):
    src = ckpts.ws2.copy_step(2, tmp_path / "src")
    os.link(src / "__0_0.distcp", tmp_path / "elsewhere")
    res = cli("push-ckpt", src, "--run", "r", "--step", "2")
    assert res.returncode == 2
    assert "__0_0.distcp has 2 hard links; refused" in res.stderr
    assert json.loads(cli("ls", "--json").stdout) == []


def test_stored_objects_and_the_catalog_are_not_world_readable(cpu_policy, ckpts, tmp_path):
    src = ckpts.ws2.copy_step(4, tmp_path / "src")
    (src / "__1_0.distcp").chmod(0o600)  # a private source stays private
    with Registry() as reg:
        reg.push_checkpoint(src, run="r", step=4)
        reg.promote("r@step4", model="tiny")
        home = reg.settings.home
    store = home / "store"
    ckpt = store / "ckpt" / "default" / "r" / "step-4"

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(ckpt / "__0_0.distcp") == 0o640
    assert mode(ckpt / "__1_0.distcp") == 0o600
    assert mode(ckpt) == 0o750 and mode(ckpt.parent) == 0o750
    assert mode(store / "release" / "tiny" / "v1" / "model.safetensors") == 0o440
    assert mode(store / "release" / "tiny" / "v1" / "release.json") == 0o440
    assert not mode(home / "catalog.db") & 0o007
    group = store.stat().st_gid
    assert all(p.stat().st_gid == group for p in ckpt.iterdir())


def test_storage_init_brings_an_older_store_to_the_modes(ckpts, cpu_policy):
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        store = reg.settings.home / "store"
        shard = store / "ckpt" / "default" / "r" / "step-2" / "__0_0.distcp"
        shard.chmod(0o644)  # what an older reg left
        shard.parent.chmod(0o755)
        out = reg.storage_init()
    assert out["modes_tightened"] == 2
    assert stat.S_IMODE(shard.stat().st_mode) == 0o640
    assert stat.S_IMODE(shard.parent.stat().st_mode) == 0o750
