"""A checkpoint pushed node by node under one claim: `reg claim-ckpt`, `reg push-ckpt DIR
--claim TOKEN`, `reg commit-ckpt --claim TOKEN`, with a real 2-rank DCP checkpoint split as two
nodes without a shared disk would hold it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Ckpts, split_as_nodes
from tests.zygote import Running


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
    a, b = split_as_nodes(ckpts, tmp_path)
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
    a, b = split_as_nodes(ckpts, tmp_path)
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


def test_a_lease_refused_claims_nothing(cli: Any) -> None:
    assert cli("claim-ckpt", "--run", "multi", "--step", "1", "--lease", "30d").returncode == 2
    assert cli("claim-ckpt", "--run", "multi", "--step", "1").returncode == 0


def test_a_taken_over_claim_writes_nothing_into_the_next_attempt(
    cli: Any, ckpts: Ckpts, tmp_path: Path
) -> None:
    """Claim A's lease runs out, claim B takes the step: A's late part is refused, and B's
    commit holds only what B's writers recorded."""
    import time

    a, b = split_as_nodes(ckpts, tmp_path)
    first = _ok(cli("claim-ckpt", "--run", "multi", "--step", "5", "--lease", "1s")).strip()
    time.sleep(1.5)
    second = _ok(cli("claim-ckpt", "--run", "multi", "--step", "5")).strip()
    assert second != first
    _fails(
        cli("push-ckpt", b, "--claim", first, "--run", "multi", "--step", "5"),
        3,
        "no checkpoint is being written under this claim",
    )
    _ok(cli("push-ckpt", a, "--claim", second, "--run", "multi", "--step", "5"))
    _fails(cli("commit-ckpt", "--claim", second), 1, "of rank(s) 1 that .metadata names")


def test_a_forged_part_record_is_refused(cli: Any, ckpts: Ckpts, tmp_path: Path) -> None:
    import hashlib

    a, b = split_as_nodes(ckpts, tmp_path)
    token = _ok(cli("claim-ckpt", "--run", "multi", "--step", "6")).strip()
    _ok(cli("push-ckpt", a, "--claim", token, "--run", "multi", "--step", "6"))
    _ok(cli("push-ckpt", b, "--claim", token, "--run", "multi", "--step", "6"))
    store = tmp_path / "reg-home" / "store" / "ckpt" / "default" / "multi" / "step-6"
    tag = hashlib.sha256(token.encode()).hexdigest()[:24]
    forged = store / f".reg-claim-{tag}-forged.json"
    for files in (
        [{"path": ".reg-claim-other.json", "size": 2, "sha256": "0" * 64}],
        [{"path": "../../x", "size": 2, "sha256": "0" * 64}],
        [{"path": "__1_0.distcp", "size": 2, "sha256": None}],
        [{"path": ["x"], "size": 2, "sha256": "0" * 64}],
        [{"path": "x", "size": 1e400, "sha256": "0" * 64}],
    ):
        forged.write_text(json.dumps({"files": files}))
        _fails(cli("commit-ckpt", "--claim", token), 1, "is not a part record")
    forged.write_text("[" * 100_000)
    _fails(cli("commit-ckpt", "--claim", token), 1, "is not a part record")
    forged.unlink()
    out = json.loads(_ok(cli("commit-ckpt", "--claim", token, "--json")))
    assert sorted(f["path"] for f in out["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_two_commits_of_one_claim_record_the_manifest_that_is_stored(
    ckpts: Ckpts, tmp_path: Path
) -> None:
    """Launchers that commit from every node: one commit wins, the other finds the claim
    gone, and the catalog's manifest digest is the stored MANIFEST.json's."""
    import hashlib

    from registry import Registry

    a, b = split_as_nodes(ckpts, tmp_path)
    with Registry() as reg:
        token = reg.claim_checkpoint("multi", 7)["claim"]
        reg.push_checkpoint_part(a, claim=token, run="multi", step=7)
        reg.push_checkpoint_part(b, claim=token, run="multi", step=7)
    procs = [Running(("commit-ckpt", "--claim", token)) for _ in range(2)]
    codes = sorted(p.wait(timeout=120) for p in procs)
    assert codes[0] == 0 and codes[1] in (3, 5), [p.err() for p in procs]
    with Registry() as reg:
        shown = reg.show("multi@step7")
    stored = tmp_path / "reg-home" / "store" / "ckpt" / "default" / "multi" / "step-7"
    digest = hashlib.sha256((stored / "MANIFEST.json").read_bytes()).hexdigest()
    assert shown["manifest_sha256"] == digest
