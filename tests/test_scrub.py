"""Scrubs: `reg verify` records when every stored byte was last re-hashed and what it found;
`reg verify --all` re-hashes the whole registry, the longest unverified first, within a
bandwidth budget, and `--every` repeats it. Findings show in `reg show`, the audit log and
MLflow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from registry import Registry
from registry.lifecycle.scrub import parse_rate
from tests.conftest import ROOT


@pytest.fixture
def filled(cpu_policy, ckpts):  # type: ignore[no-untyped-def]
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="tiny")
        yield reg


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


def test_a_scrub_goes_longest_unverified_first_and_finds_damage(filled, cli):
    filled.verify("r@step4")
    res = cli("verify", "--all", "--limit", "2", "--json")
    assert res.returncode == 0, res.stderr
    first = json.loads(res.stdout)
    assert first["artifacts"] == 2 and first["ok"]
    # step 2 and the release had never been verified: they went first; step 4 waits.
    at = {ref: filled.show(ref)["verified"]["at"] for ref in ("r@step2", "r@step4", "tiny:v1")}
    assert at["r@step4"] < min(at["r@step2"], at["tiny:v1"])
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
    res = cli("verify", "--all", "--rate", "2MB/s", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["bytes"] > 2_000_000  # enough bytes that the bound shows
    assert out["seconds"] >= out["bytes"] / 2e6 * 0.95
    assert out["bytes_per_second"] <= 2e6 * 1.05 and out["rate_limit"] == 2e6


def test_rates_and_usage_errors_are_one_line():
    assert parse_rate("200MB/s") == 200e6 and parse_rate("50MiB/s") == 50 * 2**20
    assert parse_rate("1.5 GB/s") == 1.5e9 and parse_rate("10kB/s") == 1e4


@pytest.mark.parametrize(
    "args",
    [
        ["verify", "--all", "--rate", "fast"],
        ["verify", "--all", "--rate", "0MB/s"],
        ["verify", "r@step4", "--rate", "1MB/s"],
        ["verify", "--all", "r@step4"],
        ["verify", "--all", "--every", "soon"],
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

    from registry.mlflow_mirror import drain

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
