"""A checkpoint pushed node by node under one claim: `reg claim-ckpt`, `reg push-ckpt DIR
--claim TOKEN`, `reg commit-ckpt --claim TOKEN`, with a real 2-rank DCP checkpoint split as two
nodes without a shared disk would hold it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Ckpts


def _nodes(ckpts: Ckpts, tmp_path: Path) -> tuple[Path, Path]:
    """Node A wrote rank 0's shard and (as the coordinator) .metadata; node B rank 1's."""
    src = ckpts.ws2.step_dir(2)
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    a.mkdir()
    b.mkdir()
    for name in (".metadata", "__0_0.distcp"):
        shutil.copy(src / name, a / name)
    shutil.copy(src / "__1_0.distcp", b / "__1_0.distcp")
    return a, b


def _ok(res: Any) -> str:
    assert res.returncode == 0, res.stderr
    return str(res.stdout)


def _fails(res: Any, code: int, text: str) -> None:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_nodes_push_their_parts_and_one_commit_makes_the_step(
    cli: Any, ckpts: Ckpts, tmp_path: Path, catalog_url: str
) -> None:
    a, b = _nodes(ckpts, tmp_path)
    token = _ok(cli("claim-ckpt", "--run", "multi", "--step", "2")).strip()
    assert len(token) == 32
    _fails(cli("claim-ckpt", "--run", "multi", "--step", "2"), 5, "multi@step2 is being pushed")
    pushed = json.loads(
        _ok(cli("push-ckpt", a, "--claim", token, "--run", "multi", "--step", "2", "--json"))
    )
    assert sorted(f["path"] for f in pushed["files"]) == [".metadata", "__0_0.distcp"]
    # Not yet: rank 1's shard is on the other node.
    _fails(
        cli("commit-ckpt", "--claim", token),
        1,
        "1 file(s) of rank(s) 1 that .metadata names were not pushed (__1_0.distcp)",
    )
    assert cli("show", "multi@step2").returncode == 3  # nothing visible
    _ok(cli("push-ckpt", b, "--claim", token, "--run", "multi", "--step", "2"))
    # A node that pushes again (a retried launcher step) is a no-op.
    again = cli("push-ckpt", b, "--claim", token, "--run", "multi", "--step", "2", "--json")
    assert json.loads(_ok(again))["reused_files"] == 1
    out = json.loads(_ok(cli("commit-ckpt", "--claim", token, "--world-size", "2", "--json")))
    assert out["ref"] == "multi@step2" and out["world_size"] == 2 and out["resumable"] is True
    assert sorted(f["path"] for f in out["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "verified" in _ok(cli("verify", "multi@step2"))
    # The parts' records are gone; the token is spent.
    store = tmp_path / "reg-home" / "store" / "ckpt" / "default" / "multi" / "step-2"
    assert sorted(p.name for p in store.iterdir()) == [
        ".metadata",
        "MANIFEST.json",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    _fails(cli("commit-ckpt", "--claim", token), 3, "no checkpoint is being written")
    _fails(cli("claim-ckpt", "--run", "multi", "--step", "2"), 5, "already committed")
    pulled = tmp_path / "pulled"
    _ok(cli("pull", "multi@step2", pulled))
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        assert (pulled / name).read_bytes() == (ckpts.ws2.step_dir(2) / name).read_bytes()


def test_bad_claims_and_parts_are_refused_in_one_line(
    cli: Any, ckpts: Ckpts, tmp_path: Path
) -> None:
    a, b = _nodes(ckpts, tmp_path)
    token = _ok(cli("claim-ckpt", "--run", "multi", "--step", "3")).strip()
    _fails(cli("commit-ckpt", "--claim", "../../etc"), 2, "not a claim token")
    _fails(cli("commit-ckpt", "--claim", "0" * 32), 3, "no checkpoint is being written")
    _fails(
        cli("push-ckpt", a, "--claim", token, "--run", "multi", "--step", "4"),
        2,
        "the claim is for multi@step3, not multi@step4",
    )
    _fails(cli("commit-ckpt", "--claim", token), 1, "nothing was pushed under this claim")
    # A part may not carry the registry's reserved names (a forged part record).
    (b / ".reg-claim-forged.json").write_text("{}")
    _fails(
        cli("push-ckpt", b, "--claim", token, "--run", "multi", "--step", "3"),
        2,
        "a name the registry reserves",
    )
    (b / ".reg-claim-forged.json").unlink()
    (b / "link").symlink_to(a / ".metadata")
    _fails(cli("push-ckpt", b, "--claim", token, "--run", "multi", "--step", "3"), 2, "symlink")
    (b / "link").unlink()
    # Two nodes with different bytes under one name: the second is a conflict, not a replace.
    _ok(cli("push-ckpt", b, "--claim", token, "--run", "multi", "--step", "3"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "__1_0.distcp").write_bytes(b"not the shard")
    _fails(cli("push-ckpt", other, "--claim", token, "--run", "multi", "--step", "3"), 5, "")
    _ok(cli("push-ckpt", a, "--claim", token, "--run", "multi", "--step", "3"))
    out = json.loads(_ok(cli("commit-ckpt", "--claim", token, "--json")))
    assert out["world_size"] == 2  # inferred from the rank files


@pytest.mark.parametrize("lease", ["0s", "8d", "soon"])
def test_a_lease_out_of_range_is_refused(cli: Any, lease: str) -> None:
    res = cli("claim-ckpt", "--run", "multi", "--step", "1", "--lease", lease)
    assert res.returncode == 2 and "--lease" in res.stderr and "Traceback" not in res.stderr
