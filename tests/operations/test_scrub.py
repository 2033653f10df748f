"""Scrubs: `reg verify` records when every stored byte was last re-hashed and what it found;
`reg verify --all` re-hashes the whole registry, the longest unverified first, within a
bandwidth budget, and `--every` repeats it. Findings show in `reg show`, the audit log and
MLflow."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from registry import Registry
from registry.core.timeutil import parse_rate
from registry.errors import UsageError
from registry.operations.scrub import Throttle
from tests.conftest import ROOT


def _damage(ref_dir: str) -> str:
    shard = sorted((Path(os.environ["REG_HOME"]) / "store" / ref_dir).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[64] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    return shard.name


def test_verify_records_when_and_what_it_found(filled):
    assert filled.show("r@step4")["verified"] is None  # never re-hashed since the push
    assert filled.verify("r@step4")["ok"] and filled.verify("tiny:v1")["ok"]
    shown = filled.show("r@step4")["verified"]
    assert shown["ok"] and shown["problems"] == [] and shown["at"].endswith("Z")
    assert filled.show("tiny:v1")["verified"]["ok"]
    name = _damage("ckpt/default/r/step-4")
    assert not filled.verify("r@step4")["ok"]
    shown = filled.show("r@step4")["verified"]
    assert not shown["ok"] and [p["path"] for p in shown["problems"]] == [name]
    audited = [e for e in filled.audit_log() if e["action"] == "verify"]
    assert [(e["target"], e["outcome"]) for e in audited] == [("r@step4", "failed")]


def _verified_at() -> dict[int, float | None]:
    db = sqlite3.connect(Path(os.environ["REG_HOME"]) / "catalog.db")
    rows = dict(db.execute("SELECT step, verified_at FROM checkpoint").fetchall())
    rows[-1] = db.execute("SELECT verified_at FROM release").fetchone()[0]
    db.close()
    return rows


def test_a_scrub_goes_longest_unverified_first_and_finds_damage(filled, cli):
    filled.verify("r@step4")
    before = _verified_at()
    assert before[4] is not None and before[2] is None and before[-1] is None
    res = cli("verify", "--all", "--limit", "2", "--json")
    assert res.returncode == 0, res.stderr
    first = json.loads(res.stdout)
    assert first["artifacts"] == 2 and first["ok"] and first["skipped"] == 0
    # step 2 and the release had never been verified: they went first; step 4 waited.
    after = _verified_at()
    assert after[4] == before[4] and after[2] is not None and after[-1] is not None
    name = _damage("ckpt/default/r/step-4")
    res = cli("verify", "--all", "--json")
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["artifacts"] == 3 and not out["ok"]
    assert out["damaged"] == [
        {
            "target": "r@step4",
            "problems": [{"path": name, "problem": out["damaged"][0]["problems"][0]["problem"]}],
        }
    ]
    assert "sha256" in out["damaged"][0]["problems"][0]["problem"]
    human = cli("verify", "--all")
    assert human.returncode == 1 and "Traceback" not in human.stderr
    assert f"r@step4: {name}:" in human.stdout
    assert human.stderr.count("\n") == 1 and "1 damaged artifact(s)" in human.stderr
    assert not filled.show("r@step4")["verified"]["ok"]


def test_the_rate_bounds_the_bandwidth(filled, cli):
    res = cli("verify", "--all", "--rate", "1MB/s", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["bytes"] > 2_000_000 and out["rate_limit"] == 1e6  # enough for the bound to show
    # At most one second of bytes comes at once; the rest at the rate.
    assert out["seconds"] >= out["bytes"] / 1e6 - Throttle.BURST_S


def test_rates_parse_in_bytes_within_bounds():
    assert parse_rate("200MB/s") == 200e6 and parse_rate("50MiB/s") == 50 * 2**20
    assert parse_rate("1.5 GB/s") == 1.5e9 and parse_rate("10kB/s") == 1e4
    for bad in ("200Mb/s", "0.5B/s", "100TB/s", "fast", "-1MB/s"):
        with pytest.raises(UsageError):
            parse_rate(bad)


def test_idle_time_does_not_save_up_into_a_burst():
    throttle = Throttle(1e6, None)
    throttle.advance(1)  # the clock starts at the first byte
    time.sleep(1.5)  # idle: at most one second of bytes may come at once after it
    started = time.monotonic()
    for _ in range(30):
        throttle.advance(100_000)  # 3 MB at 1 MB/s
    assert time.monotonic() - started >= 1.9


@pytest.mark.parametrize(
    "args",
    [
        ["verify", "--all", "--rate", "fast"],
        ["verify", "--all", "--rate", "0MB/s"],
        ["verify", "r@step4", "--rate", "1MB/s"],
        ["verify", "--all", "r@step4"],
        ["verify", "--all", "--every", "soon"],
        ["verify", "--all", "--rate", "200Mb/s"],
    ],
)
def test_bad_scrub_usage_is_one_line_exit_2(cli, args):
    res = cli(*args)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_every_repeats_the_scrub_until_sigterm(filled):
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "verify", "--all", "--every", "1s"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = [json.loads(proc.stdout.readline()) for _ in range(2)]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert [(line["ok"], line["artifacts"]) for line in lines] == [(True, 3), (True, 3)]


def test_findings_reach_mlflow(filled, monkeypatch):
    from mlflow import MlflowClient

    from registry.integrations.mirror.drain import drain

    _damage("ckpt/default/r/step-4")
    filled.scrub()
    with Registry() as reg:
        result = drain(reg.catalog, reg.settings, 120)
    assert result["error"] is None and result["pending"] == 0
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("default")
    models = {m.name: m for m in client.search_logged_models([exp.experiment_id])}
    assert models["r-step4"].tags["reg.verify"] == "damaged: 1 file(s)"
    assert (
        models["r-step2"].tags["reg.verify"] == "ok" and models["r-step2"].tags["reg.verified_at"]
    )
    version = client.get_model_version("tiny", "1")
    assert version.tags["reg.verify"] == "ok"


def test_a_scrub_is_an_admin_action_through_the_server(reg_server, cli):
    denied = cli("verify", "--all", env=reg_server.client_env("alice"))
    assert denied.returncode == 4 and "Traceback" not in denied.stderr
    res = cli("verify", "--all", "--rate", "100MB/s", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ok"]


def test_a_viewer_checks_without_writing(filled, tmp_path, monkeypatch):
    """Under a policy with grants, a viewer's `reg verify` reports, and records nothing."""
    policy = tmp_path / "grants.toml"
    policy.write_text(
        (ROOT / "examples" / "cpu-policy.toml").read_text()
        + '\n[[access.grants]]\nprincipals = ["boss"]\nrole = "admin"\n'
        + '[[access.grants]]\nprincipals = ["tester"]\nrole = "viewer"\n'
    )
    monkeypatch.setenv("REG_POLICY", str(policy))
    _damage("ckpt/default/r/step-4")
    with Registry() as reg:
        assert not reg.verify("r@step4")["ok"]
        assert reg.show("r@step4")["verified"] is None
        monkeypatch.setenv("REG_USER", "boss")
    with Registry() as reg:
        assert not reg.verify("r@step4")["ok"]
        assert reg.verify("r@step4")["ok"] is False  # the same verdict again: audited once
        assert not reg.show("r@step4")["verified"]["ok"]
        assert len([e for e in reg.audit_log() if e["action"] == "verify"]) == 1


def test_a_collected_checkpoint_is_not_recorded_damaged(filled):
    from registry.lifecycle.verify import record

    db = sqlite3.connect(Path(os.environ["REG_HOME"]) / "catalog.db")
    with db:
        for state in ("deleting", "deleted"):
            db.execute(f"UPDATE checkpoint SET state = '{state}' WHERE step = 2")
    db.close()
    record(
        filled.context, "ckpt/default/r/step-2/", "r@step2", [{"path": "x", "problem": "missing"}]
    )
    assert _verified_at()[2] is None
    assert not [e for e in filled.audit_log() if e["action"] == "verify"]


def test_the_server_refuses_a_rate_out_of_range(reg_server):
    import httpx

    env = reg_server.client_env("admin")
    for rate in (10**400, 0.5, "fast", True):
        res = httpx.post(
            f"{env['REG_URL']}/v1/scrub",
            json={"rate": rate},
            headers={"Authorization": f"Bearer {env['REG_TOKEN']}"},
        )
        assert res.status_code == 400, (rate, res.text)
