"""The MLflow mirror against a real tracking store: every mapping, idempotent replays, outages."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from registry import Registry
from registry.integrations.mirror.drain import drain
from tests.zygote import run_reg

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
    assert set(models) == {"run42-step2", "run42-step4"}
    assert runs[0].data.tags["mlflow.user"] == os.environ["REG_USER"]  # "Created by"
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
    assert version.tags["reg.model"] == "tiny.lm" and version.run_id == run_id
    assert "release/tiny.lm/v1/" in version.description
    assert version.description.startswith("DEPRECATED by ")
    releases = client.get_experiment_by_name("releases/tiny.lm")
    assert version.source == f"mlflow-artifacts:/{releases.experiment_id}/releases/tiny.lm/v1"
    served = Path(os.environ["REG_HOME"]) / "store" / "mlflow-artifacts"
    folder = served / releases.experiment_id / "releases" / "tiny.lm" / "v1"
    stored = Path(os.environ["REG_HOME"]) / "store" / "release" / "tiny.lm" / "v1"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in stored.iterdir())
    for path in folder.iterdir():  # linked, not copied
        assert path.stat().st_ino == (stored / path.name).stat().st_ino
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
    assert len(client.search_logged_models([exp.experiment_id])) == 2
    assert len(client.search_model_versions("name = 'tiny-lm'")) == 1
    run_id = client.search_runs([exp.experiment_id])[0].info.run_id
    assert len(client.get_metric_history(run_id, "val_loss")) == 2


@pytest.mark.exclusive
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


def _published(model: str, version: int) -> Path:
    exp = _client().get_experiment_by_name(f"releases/{model}")
    return (
        Path(os.environ["REG_HOME"])
        / "store"
        / "mlflow-artifacts"
        / (f"{exp.experiment_id}/releases/{model}/v{version}")
    )


def test_versions_keep_reg_numbers_when_mirrored_out_of_order(policy, ckpts):
    """v1 reserved by a promotion that died, v2 released meanwhile: MLflow numbers them as reg
    does. v1 is a placeholder without bytes until a rerun of its promotion commits it."""
    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step)
    died = run_reg("promote", "r@step2", "--model", "m", fault="promote-documented")
    assert died.returncode == -signal.SIGKILL, died.stderr
    with Registry() as reg:
        assert reg.promote("r@step4", model="m")["version"] == 2
    assert _drain()["error"] is None
    client = _client()
    versions = {int(v.version): v for v in client.search_model_versions("name = 'm'")}
    assert versions[2].tags["reg.version"] == "2" and versions[2].tags["reg.source"] == "r@step4"
    assert versions[1].tags["reg.status"] == "reserved" and "reserved" in versions[1].description
    assert not _published("m", 1).exists() and (_published("m", 2) / "release.json").exists()
    with Registry() as reg:  # the rerun takes v1 over and commits it
        assert reg.promote("r@step2", model="m")["version"] == 1
    assert _drain()["error"] is None
    v1 = client.get_model_version("m", "1")
    assert v1.tags["reg.status"] == "active" and v1.tags["reg.source"] == "r@step2"
    assert (_published("m", 1) / "release.json").exists()


def test_a_yank_takes_the_bytes_out_of_mlflow_and_says_who_and_why(policy, ckpts):
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="m", alias="prod")
    _drain()
    assert (_published("m", 1) / "release.json").exists()
    with Registry() as reg:  # no drain yet (REG_MLFLOW=off): the yank itself stops serving it
        out = reg.yank("m:v1", reason="trained on leaked eval data")
    assert out["served_files_removed"] == 2 and not _published("m", 1).exists()
    assert _drain()["error"] is None
    client = _client()
    v1 = client.get_model_version("m", "1")
    assert v1.tags["reg.status"] == "yanked" and v1.tags["reg.status_by"] == "tester"
    assert v1.tags["reg.status_reason"] == "trained on leaked eval data"
    assert v1.description.startswith("YANKED by tester") and "no longer served" in v1.description
    assert client.get_registered_model("m").aliases == {"prod": v1.version}  # as reg's stays
    assert not _published("m", 1).exists()
    stored = Path(os.environ["REG_HOME"]) / "store" / "release" / "m" / "v1" / "release.json"
    assert stored.exists()  # reg keeps the bytes; only MLflow stops serving them


def test_runs_end_and_checkpoint_tags_follow_pins(policy, ckpts, cli):
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.pin("r@step4", reason="paper figure")
    res = cli("run", "finish", "r", "--status", "failed", "--json")
    assert res.returncode == 0 and '"status": "failed"' in res.stdout, res.stderr
    assert cli("run", "finish", "nope").returncode == 3
    assert cli("run", "finish", "r", "--status", "exploded").returncode == 2
    assert _drain()["error"] is None
    client = _client()
    exp = client.get_experiment_by_name("default")
    run = client.search_runs([exp.experiment_id])[0]
    assert run.info.status == "FAILED" and run.info.end_time
    model = client.search_logged_models([exp.experiment_id])[0]
    assert model.tags["reg.pinned"] == "true" and model.tags["reg.expires_at"] == "never"
    assert model.tags["reg.pin_reason"] == "paper figure"
    assert model.tags["reg.retention"] == "kept: pinned by tester (paper figure)"
    with Registry() as reg:
        reg.unpin("r@step4")
        expected = reg.show("r@step4")
    assert _drain()["error"] is None
    model = client.search_logged_models([exp.experiment_id])[0]
    assert model.tags["reg.pinned"] == "false", model.tags
    assert model.tags["reg.retention"] == expected["protection"]["reason"]


def test_model_names_map_one_to_one(policy, ckpts, cli):
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="llama.v2")
    res = cli("promote", "r@step4", "--model", "llama-v2")
    assert res.returncode == 5 and res.stderr.count("\n") == 1, res.stderr
    assert "would appear in MLflow as 'llama-v2'" in res.stderr
    with Registry() as reg:
        assert [r["model"] for r in reg.releases()] == ["llama.v2"]


def test_a_resume_moves_the_protection_tags(policy, ckpts, tmp_path):
    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step)
    _drain()
    exp = _client().get_experiment_by_name("default")

    def tags() -> dict[str, str]:
        found = _client().search_logged_models([exp.experiment_id], filter_string="tags.step = '2'")
        return found[0].tags

    with Registry() as reg:
        reg.pull("r@step2", tmp_path / "resume")  # the run resumes from step 2: retention keeps it
        expected = reg.show("r@step2")["protection"]
    assert _drain()["error"] is None
    assert expected["protected"] and tags()["reg.retention"] == expected["reason"]
    assert "resum" in tags()["reg.retention"]


def test_only_the_releases_own_bytes_are_served(policy, ckpts):
    """A drain removes what no active release explains and replaces what is not the release's
    own file (a crash's leftovers, an experiment id the tracking store does not have, a file
    written over)."""
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="m")
    _drain()
    served = _published("m", 1)
    stored = Path(os.environ["REG_HOME"]) / "store" / "release" / "m" / "v1"
    stray = served.parent.parent.parent.parent / "999" / "releases" / "m" / "v1"
    stray.mkdir(parents=True)
    (stray / "model.safetensors").write_bytes(b"not the release")
    leftover = served.with_name(".v1.partial-deadbeef")
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    weights = served / "model.safetensors"
    weights.unlink()
    weights.write_bytes(b"someone else's weights")  # same name, another file
    (served / "extra.bin").write_bytes(b"x")
    assert _drain()["error"] is None
    assert not stray.exists() and not leftover.exists()
    assert sorted(p.name for p in served.iterdir()) == sorted(p.name for p in stored.iterdir())
    assert weights.stat().st_ino == (stored / "model.safetensors").stat().st_ino


def test_a_retention_change_moves_the_expiry_tags(policy, ckpts, tmp_path):
    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step)
    _drain()
    looser = tmp_path / "looser.toml"
    looser.write_text(POLICY.replace("keep_last = 1", "keep_last = 5"))
    with Registry() as reg:
        assert reg.apply_policy(looser)["expiry_changed"] == 1  # step 2: deleted -> kept
        expected = reg.show("r@step2")["protection"]
        assert reg.apply_policy(looser)["expiry_changed"] == 0
    assert _drain()["error"] is None
    exp = _client().get_experiment_by_name("default")
    found = _client().search_logged_models([exp.experiment_id], filter_string="tags.step = '2'")
    assert found[0].tags["reg.retention"] == expected["reason"]


def test_an_event_that_can_never_apply_can_be_set_aside(policy, ckpts, cli):
    from registry.catalog.models import OutboxEvent
    from registry.core.timeutil import now

    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        with reg.catalog.session(write=True) as s:
            s.add(OutboxEvent(ts=now(), kind="no.such", payload={}))
    res = cli("mlflow", "sync")
    assert res.returncode == 1 and "stopped at: no.such #2" in res.stdout, res.stdout
    assert "--skip ID" in res.stderr
    res = cli("mlflow", "sync", "--skip", "2", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["pending"] == 0 and out["skipped"]["kind"] == "no.such"
    assert cli("mlflow", "sync", "--skip", "2").returncode == 3  # not pending any more
    with Registry() as reg:
        audit = reg.audit_log(action="mlflow-skip")
    assert [e["target"] for e in audit] == ["MLflow event #2"]


@pytest.mark.process
def test_a_drain_needs_no_reg_home_on_disk(tmp_path, monkeypatch):
    """With the catalog and store elsewhere, REG_HOME may not exist yet: the drain makes it."""
    home = tmp_path / "not-yet"
    monkeypatch.setenv("REG_HOME", str(home))
    monkeypatch.setenv("REG_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("REG_STORE_URL", f"file://{tmp_path / 'store'}")
    with Registry() as reg:
        reg.list_checkpoints()
        assert not home.exists()
        result = drain(reg.catalog, reg.settings, 60)
    assert result.get("error") is None, result
    assert home.is_dir()


def test_a_release_signed_later_is_served_with_its_signature(policy, ckpts, tmp_path):
    """`reg sign-release` adds files to a release MLflow already serves: the drain serves them
    too, and what MLflow serves verifies with the stock model_signing CLI."""
    from tests.helpers import stock_verify

    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="m")
    assert _drain()["error"] is None
    assert not (_published("m", 1) / "model.sig").exists()
    with Registry() as reg:
        key = reg.create_signing_key()
        reg.sign_release("m:v1")
    assert _drain()["error"] is None
    served = _published("m", 1)
    assert sorted(p.name for p in served.iterdir()) == [
        "README.md",
        "model.safetensors",
        "model.sig",
        "provenance.intoto.json",
        "release.json",
    ]
    pem = tmp_path / "reg.pub"
    pem.write_text(key.public_pem)
    verified = stock_verify(served, pem)
    assert verified.returncode == 0, verified.stderr + verified.stdout
