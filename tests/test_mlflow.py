"""The MLflow mirror against a real tracking store: every mapping, idempotent replays, outages."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from registry import Registry
from registry.mlflow_mirror import drain

POLICY = '[retention]\nkeep_last = 1\nttl = "0s"\n[promotion]\nrequire_device = "any"\n'


@pytest.fixture
def policy(tmp_path, monkeypatch):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    monkeypatch.setenv("REG_POLICY", str(path))


def _history(ckpts):
    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(
                ckpts.ws2.step_dir(step),
                run="run42",
                step=step,
                metrics={"probe_loss": ckpts.ws2.probe_loss(step), "val_loss": 3.0 - step / 10},
            )
        reg.validate("run42@step4", device="cpu")
        reg.promote("run42@step4", model="tiny.lm", alias="prod")
        reg.set_alias("tiny.lm", "canary", "v1")
        reg.deprecate("tiny.lm:v1")
        reg.gc()  # collects step 2


def _client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])


def _drain():
    with Registry() as reg:
        return drain(reg.catalog, reg.settings, 120)


def test_every_mapping(policy, ckpts):
    _history(ckpts)
    result = _drain()
    assert result["error"] is None and result["pending"] == 0 and result["applied"] == 8
    client = _client()
    exp = client.get_experiment_by_name("default")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_name for r in runs] == ["run42"]
    run_id = runs[0].info.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val_loss")] == [
        (2, pytest.approx(2.8)),
        (4, pytest.approx(2.6)),
    ]
    models = {m.name: m for m in client.search_logged_models([exp.experiment_id])}
    assert set(models) == {"run42-step2", "run42-step4", "tiny-lm-v1"}
    step4 = models["run42-step4"]
    assert step4.params["world_size"] == "2" and "resumable" not in step4.params
    assert step4.tags["reg.resumable"] == "true" and step4.tags["reg.layout"] == "dcp"
    assert step4.params["uri"].endswith("/ckpt/default/run42/step-4/")
    assert step4.tags["state"] == "committed" and step4.tags["reg.validation"] == "passed"
    assert step4.tags["reg.validation.mode"] == "streamed"
    assert models["run42-step2"].tags["state"] == "deleted"
    found = client.search_logged_models([exp.experiment_id], filter_string="tags.step = '4'")
    assert [m.name for m in found] == ["run42-step4"]
    version = client.search_model_versions("name = 'tiny-lm'")[0]
    assert version.tags["reg.version"] == "1" and version.tags["reg.status"] == "deprecated"
    assert version.tags["reg.source"] == "run42@step4" and len(version.tags["reg.sha256"]) == 64
    assert "release/tiny.lm/v1/" in version.description
    assert version.source == f"models:/{models['tiny-lm-v1'].model_id}"
    rm = client.get_registered_model("tiny-lm")
    assert rm.aliases == {"prod": version.version, "canary": version.version}
    assert not list(Path.cwd().glob("mlruns"))  # nothing written where the command ran


def test_resumable_tag_follows_a_policy_change(policy, ckpts, tmp_path):
    _history(ckpts)
    _drain()
    stricter = tmp_path / "stricter.toml"
    stricter.write_text(POLICY + '[resume]\nrequired = ["model", "optimizer", "grad_scaler"]\n')
    with Registry() as reg:
        applied = reg.apply_policy(stricter)
    assert applied["resume_changed"] == 1  # step 4; step 2 was collected
    assert _drain()["applied"] == 1
    client = _client()
    exp = client.get_experiment_by_name("default")
    models = {m.name: m for m in client.search_logged_models([exp.experiment_id])}
    assert models["run42-step4"].tags["reg.resumable"] == "false"
    assert models["run42-step4"].tags["reg.missing_state"] == "grad_scaler"
    with Registry() as reg:  # the catalog's answer is the same
        assert reg.show("run42@step4")["missing_state"] == ["grad_scaler"]
        assert reg.apply_policy(stricter)["resume_changed"] == 0  # nothing changes twice


def test_replays_are_idempotent(policy, ckpts):
    _history(ckpts)
    _drain()
    with Registry() as reg, reg.catalog.engine.begin() as conn:
        from sqlalchemy import text

        conn.execute(text("UPDATE outbox_event SET done_at = NULL"))
    assert _drain()["applied"] == 8
    client = _client()
    exp = client.get_experiment_by_name("default")
    assert len(client.search_runs([exp.experiment_id])) == 1
    assert len(client.search_logged_models([exp.experiment_id])) == 3
    assert len(client.search_model_versions("name = 'tiny-lm'")) == 1
    run_id = client.search_runs([exp.experiment_id])[0].info.run_id
    assert len(client.get_metric_history(run_id, "val_loss")) == 2


def test_mlflow_outage_loses_nothing(policy, ckpts, monkeypatch, cli):
    good = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("REG_MLFLOW", "on")  # the detached drain runs, and fails, after the push
    start = time.monotonic()
    res = cli("push-ckpt", ckpts.ws2.step_dir(4), "--run", "r", "--step", "4")
    assert res.returncode == 0 and time.monotonic() - start < 20
    monkeypatch.setenv("REG_MLFLOW", "off")
    with Registry() as reg:
        out = drain(reg.catalog, reg.settings, 20)
    assert out["applied"] == 0 and out["pending"] == 1 and out["error"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", good)
    res = cli("mlflow", "sync", "--json")
    assert res.returncode == 0, res.stderr
    assert '"pending": 0' in res.stdout
    client = _client()
    exp = client.get_experiment_by_name("default")
    assert [m.name for m in client.search_logged_models([exp.experiment_id])] == ["r-step4"]


def test_the_command_returns_and_the_detached_drain_mirrors(policy, ckpts, monkeypatch, cli):
    monkeypatch.setenv("REG_MLFLOW", "on")
    res = cli("push-ckpt", ckpts.ws2.step_dir(2), "--run", "r", "--step", "2")
    assert res.returncode == 0
    deadline = time.monotonic() + 120
    while True:
        with Registry() as reg:
            from sqlalchemy import text

            with reg.catalog.engine.connect() as conn:
                pending = conn.execute(
                    text("SELECT count(*) FROM outbox_event WHERE done_at IS NULL")
                ).scalar()
        if pending == 0:
            break
        assert time.monotonic() < deadline, (
            Path(os.environ["REG_HOME"]) / "mlflow-drain.log"
        ).read_text()
        time.sleep(1)
    exp = _client().get_experiment_by_name("default")
    assert [m.name for m in _client().search_logged_models([exp.experiment_id])] == ["r-step2"]
