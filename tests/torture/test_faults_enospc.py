"""A full disk mid-write: `REG_FAULT=store-write:enospc` makes the local store's
write of an object's bytes fail with ENOSPC, `pull-write:enospc` a pull's write of a destination
file (registry/core/faults.py). A push or pull that hits it fails with one line naming the full disk
and the path (exit 1, DESIGN §7), leaves no temp file in the store and nothing half-visible, and
the same command completes once space is back (the fault unset)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from registry import Registry
from registry.core import faults
from registry.errors import NotFound, RegistryError


def _store(home: Path) -> Path:
    return home / "store"


def _leftover_temps(store: Path) -> list[str]:
    """Named temp files (the `.tmp/` fallback) and anything else that is not a finished object."""
    found = []
    for dirpath, _, names in os.walk(store):
        for name in names:
            if "/.tmp" in dirpath or "~" in name or ".reg-" in name:
                found.append(os.path.join(dirpath, name))
    return found


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


def _fsck_clean(reg: Registry) -> None:
    if hasattr(reg, "fsck"):
        report = reg.fsck()
        assert report["clean"], f"fsck after a full disk found problems: {report['problems']}"


def test_push_on_a_full_disk_fails_in_one_line_and_pushing_again_completes(ckpts, cli, clean_env):
    src = ckpts.ws2.step_dir(4)
    res = cli(
        "push-ckpt", src, "--run", "full", "--step", "4", env={"REG_FAULT": "store-write:enospc"}
    )
    line = _one_line(res.stderr)
    assert res.returncode == 1, f"a full disk is an operation failure (exit 1): {res.returncode}"
    store = _store(clean_env)
    assert "disk full" in line and str(store) in line, (
        f"the line must say disk full and where: {line}"
    )
    assert _leftover_temps(store) == [], "a failed write left temp files in the store"
    with Registry() as reg:
        assert reg.list_checkpoints() == [], "a push that hit a full disk is visible"
        with pytest.raises(NotFound):
            reg.show("full@step4")
        _fsck_clean(reg)
    again = cli("push-ckpt", src, "--run", "full", "--step", "4", "--json")
    assert again.returncode == 0, f"pushing again once space is back failed: {again.stderr}"
    with Registry() as reg:
        assert reg.verify("full@step4")["ok"]
        _fsck_clean(reg)


@pytest.mark.parametrize("named_temps", [False, True], ids=["unnamed-temp", "named-temp"])
def test_a_full_disk_in_process_leaves_no_temp_file_either_way(
    ckpts, clean_env, monkeypatch, named_temps
):
    """The same through the API, on both ways the local store writes: an unnamed O_TMPFILE and
    the named `.tmp/` fallback (whose file the failed write must remove itself)."""
    src = ckpts.ws2.step_dir(2)
    monkeypatch.setattr(faults, "_ARMED", "store-write:enospc")
    with Registry() as reg:
        if named_temps:
            reg.store._tmpfile = False  # type: ignore[attr-defined]
        with pytest.raises(RegistryError, match=r"disk full: no space left") as failed:
            reg.push_checkpoint(src, run="full", step=2)
        assert "\n" not in str(failed.value)
        assert isinstance(failed.value.__cause__, OSError)
        assert _leftover_temps(_store(clean_env)) == [], "a failed write left temp files"
        assert reg.list_checkpoints() == []
        monkeypatch.setattr(faults, "_ARMED", None)
        out = reg.push_checkpoint(src, run="full", step=2)
        assert out["state"] == "committed" and reg.verify("full@step2")["ok"]
        _fsck_clean(reg)


def test_pull_on_a_full_disk_fails_in_one_line_leaves_nothing_and_pulling_again_completes(
    ckpts, cli, tmp_path
):
    src = ckpts.ws2.step_dir(4)
    with Registry() as reg:
        reg.push_checkpoint(src, run="r", step=4)
    dest = tmp_path / "out" / "back"
    res = cli("pull", "r@step4", dest, env={"REG_FAULT": "pull-write:enospc"})
    line = _one_line(res.stderr)
    assert res.returncode == 1, f"a full disk is an operation failure (exit 1): {res.returncode}"
    assert "disk full" in line and str(dest.parent) in line, f"must say disk full and where: {line}"
    assert not dest.exists(), "a pull that hit a full disk left its destination"
    leftovers = list(dest.parent.iterdir()) if dest.parent.exists() else []
    assert leftovers == [], f"a failed pull left {leftovers}"
    again = cli("pull", "r@step4", dest)
    assert again.returncode == 0, f"pulling again once space is back failed: {again.stderr}"
    for f in src.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes(), f"{f.name} differs after pull"


def test_store_get_file_on_a_full_disk_removes_what_it_wrote(ckpts, tmp_path, monkeypatch):
    """The store's own read into a file (what pull and promote use) removes a partial file."""
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        store = reg.store
        key = next(k.key for k in store.list("ckpt/") if k.key.endswith(".distcp"))
        monkeypatch.setattr(faults, "_ARMED", "pull-write:enospc")
        with pytest.raises(RegistryError, match="disk full") as failed:
            store.get_file(key, tmp_path / "one")
        assert str(tmp_path / "one") in str(failed.value)
        assert not (tmp_path / "one").exists(), "a partial file was left behind"


@pytest.mark.parametrize("named_temps", [False, True], ids=["unnamed-temp", "named-temp"])
def test_a_streaming_writer_on_a_full_disk_leaves_nothing(tmp_path, monkeypatch, named_temps):
    """The writer a training save streams into (`open_writer`): a full disk mid-write is the
    one-line error naming the object's path; discarding it leaves no temp file and no object."""
    from registry.storage.local import LocalStore

    store = LocalStore(tmp_path / "store")
    store._tmpfile = not named_temps
    writer = store.open_writer("ckpt/p/r/step-1/__0_0.distcp")
    writer.write(b"x" * 1024)
    monkeypatch.setattr(faults, "_ARMED", "store-write:enospc")
    with pytest.raises(RegistryError, match="disk full") as failed:
        writer.write(b"y" * 1024)
    assert str(tmp_path / "store" / "ckpt/p/r/step-1/__0_0.distcp") in str(failed.value)
    writer.discard()
    assert _leftover_temps(tmp_path / "store") == []
    assert list(store.list("")) == [], "a writer that failed published an object"
