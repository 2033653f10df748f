"""`reg ui` with MLflow's auth app, against a real MLflow server on 127.0.0.1: people log in with
their reg principal and token, see and download only what reg's grants let them read, never a
yanked release's bytes, and cannot edit. The UI is checked in headless Chromium as a viewer of
one project (screenshots for docs/how-to/mlflow.md). SIGTERM stops the server and its workers."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from registry import Registry
from registry.integrations.mirror.drain import drain
from tests.conftest import ROOT
from tests.helpers import start_ui, stock_verify
from tests.integrations.test_mlflow_ui import CHROMIUM, FLAGS
from tests.integrations.test_mlflow_ui import _open as _open_once
from tests.zygote import run_reg

GRANTS = """
[promotion]
require_device = "any"

[[access.grants]]
principals = ["admin"]
role = "admin"

[[access.grants]]
principals = ["alice"]
role = "viewer"
projects = ["team-a"]
models = ["tiny-*"]

[[access.grants]]
principals = ["bob"]
role = "viewer"
projects = ["team-b"]
models = ["other-*"]
"""


@pytest.fixture
def ui(tmp_path, monkeypatch, ckpts):
    """Two projects and two models, mirrored; `reg ui` with the login; tokens of alice and bob."""
    policy = tmp_path / "policy.toml"
    policy.write_text(GRANTS)
    monkeypatch.setenv("REG_POLICY", str(policy))
    monkeypatch.setenv("REG_USER", "admin")
    init = run_reg("server", "init", "--admin", "admin", "--json", timeout=120)
    assert init.returncode == 0, init.stderr
    with Registry() as reg:
        for project, model in (("team-a", "tiny-a"), ("team-b", "other-b")):
            reg.push_checkpoint(ckpts.ws2.step_dir(4), project=project, run="r", step=4)
            reg.promote(f"{project}/r@step4", model=model, alias="prod")
        tokens = {who: reg.create_token(who)["token"] for who in ("alice", "bob")}
        assert drain(reg.catalog, reg.settings, 120)["pending"] == 0
    ui = start_ui()
    yield ui.url, tokens, ui
    ui.kill()


def _open(page, url: str, wait_for: str) -> None:
    """Open `url`, then dismiss what MLflow pops up late (the new-registry modal, the
    assistant panel) so the screenshot shows the page."""
    _open_once(page, url, wait_for)
    for _ in range(2):
        page.wait_for_timeout(700)
        page.keyboard.press("Escape")
        for label in ("Close", "close"):
            for button in page.get_by_role("button", name=label).all():
                with contextlib.suppress(Exception):
                    button.click(timeout=1_000)


def _as(monkeypatch, url: str, who: str, token: str):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", who)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", token)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    return MlflowClient(tracking_uri=url)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_people_see_and_download_only_what_reg_lets_them_read(ui, monkeypatch, tmp_path):
    import mlflow
    from mlflow.exceptions import MlflowException

    url, tokens, running = ui
    tracking_store = os.environ["MLFLOW_TRACKING_URI"]  # the mirror's, not the server's
    alice = _as(monkeypatch, url, "alice", tokens["alice"])
    names = {e.name for e in alice.search_experiments()}
    assert names == {"team-a", "releases/tiny-a"}
    assert [m.name for m in alice.search_registered_models()] == ["tiny-a"]
    got = Path(
        mlflow.artifacts.download_artifacts("models:/tiny-a@prod", dst_path=str(tmp_path / "a"))
    )
    with Registry() as reg:
        stored = Path(reg.pull_release("tiny-a:v1", tmp_path / "pulled")["dest"])
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in stored.iterdir())
    for path in got.iterdir():  # exactly the release's bytes
        assert _sha256(path) == _sha256(stored / path.name)
    # Signed (reg server init made the key): MLflow's download verifies with the stock CLI.
    with Registry() as reg:
        (tmp_path / "reg.pub").write_text(reg.signing_keys()[0].public_pem)
    assert (got / "model.sig").exists() and (got / "provenance.intoto.json").exists()
    verified = stock_verify(got, tmp_path / "reg.pub")
    assert verified.returncode == 0, verified.stderr + verified.stdout
    for uri in ("models:/other-b/1", "models:/other-b@prod"):
        with pytest.raises(MlflowException):
            mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "denied"))
    with pytest.raises(MlflowException):  # a viewer cannot edit
        alice.set_registered_model_tag("tiny-a", "owner", "alice")
    with pytest.raises(MlflowException):
        alice.delete_experiment(alice.get_experiment_by_name("team-a").experiment_id)
    with pytest.raises(MlflowException, match="403|Read-only"):  # no squatting either
        alice.create_experiment("releases/tiny-next")
    with pytest.raises(MlflowException, match="403|Read-only"):
        alice.create_registered_model("tiny-next")

    with Registry() as reg:
        admin_token = reg.create_token("admin")["token"]
    admin = _as(monkeypatch, url, "admin", admin_token)
    assert {e.name for e in admin.search_experiments()} >= {"team-a", "team-b"}
    with pytest.raises(MlflowException, match="403|Read-only"):  # admins change things in reg
        admin.set_registered_model_tag("tiny-a", "owner", "admin")
    with pytest.raises(MlflowException, match="403|Read-only"):
        admin.create_experiment("releases/tiny-next")

    bob = _as(monkeypatch, url, "bob", tokens["bob"])
    assert [m.name for m in bob.search_registered_models()] == ["other-b"]
    bob_dl = mlflow.artifacts.download_artifacts("models:/other-b/1", dst_path=str(tmp_path / "b"))
    assert (Path(bob_dl) / "release.json").exists()

    for who, token in (("alice", tokens["bob"]), ("alice", "reg_nope_nope"), ("admin", "x")):
        mallory = _as(monkeypatch, url, who, token)
        with pytest.raises(MlflowException, match="401|Unauthorized|credentials"):
            mallory.search_registered_models()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_store)
    with Registry() as reg:  # a yank: nothing in MLflow resolves to the bytes any more
        reg.yank("tiny-a:v1", reason="leaked eval data")
        out = drain(reg.catalog, reg.settings, 120)
        assert out["pending"] == 0, out
    alice = _as(monkeypatch, url, "alice", tokens["alice"])
    version = alice.get_model_version("tiny-a", "1")
    assert version.tags["reg.status"] == "yanked" and version.tags["reg.status_by"] == "admin"
    for uri in ("models:/tiny-a@prod", "models:/tiny-a/1"):
        with contextlib.suppress(MlflowException):  # an error, or an empty folder: no bytes
            out = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "y")))
            assert not any(p.is_file() for p in out.rglob("*")), list(out.rglob("*"))

    running.proc.send_signal(signal.SIGTERM)  # as systemd, docker and Kubernetes stop it
    assert running.proc.wait(timeout=30) == 0
    assert running.leftovers() == "", f"left running: {running.leftovers()}"


def test_a_viewer_sees_one_project_in_the_ui(ui, tmp_path):
    """alice (viewer of team-a and tiny-*) sees her project and model, the yanked version with
    who yanked it and why, and nothing of team-b; her browser cannot read other-b by the API."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install chromium` (scripts/test does it)")
    url, tokens, _ = ui
    with Registry() as reg:
        reg.yank("tiny-a:v1", reason="trained on leaked eval data")
        assert drain(reg.catalog, reg.settings, 120)["pending"] == 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        anonymous = browser.new_context()
        assert anonymous.request.get(url).status == 401
        assert anonymous.request.get(f"{url}/ajax-api/2.0/mlflow/experiments/search").status == 401
        context = browser.new_context(
            http_credentials={"username": "alice", "password": tokens["alice"]},
            viewport={"width": 1400, "height": 900},
        )
        page = context.new_page()
        _open(page, f"{url}/#/models", "tiny-a")
        body = page.inner_text("body")
        assert "tiny-a" in body and "other-b" not in body
        models_shot = tmp_path / "mlflow-viewer-models.png"
        page.screenshot(path=str(models_shot))
        _open(page, f"{url}/#/experiments", "team-a")
        body = page.inner_text("body")
        assert "team-a" in body and "team-b" not in body
        experiments_shot = tmp_path / "mlflow-viewer-experiments.png"
        page.screenshot(path=str(experiments_shot))
        _open(page, f"{url}/#/models/tiny-a/versions/1", "YANKED by admin")
        body = page.inner_text("body").replace("\xa0", " ")
        assert "trained on leaked eval data" in body and "reg.status" in body
        yanked_shot = tmp_path / "mlflow-viewer-yanked.png"
        page.screenshot(path=str(yanked_shot))
        denied = context.request.get(f"{url}/api/2.0/mlflow/registered-models/get?name=other-b")
        assert denied.status == 403
        browser.close()
    for shot in (models_shot, experiments_shot, yanked_shot):
        assert shot.stat().st_size > 10_000
        if os.environ.get("SAVE_SCREENSHOTS") == "1":  # refreshes docs/how-to/mlflow.md's pictures
            shutil.copy(shot, ROOT / "docs" / shot.name)


def test_an_s3_store_is_served_with_the_servers_credentials(
    s3_env, s3_server, ckpts, tmp_path, monkeypatch
):
    """No grants (one person): no login. The release bytes are copied inside the bucket, served
    by the MLflow server with its own credentials (the client has none), and removed on a yank."""
    import mlflow

    policy = tmp_path / "policy.toml"
    policy.write_text('[promotion]\nrequire_device = "any"\n')
    monkeypatch.setenv("REG_POLICY", str(policy))
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="m", alias="prod")
        assert drain(reg.catalog, reg.settings, 120)["pending"] == 0
        stored = Path(reg.pull_release("m:v1", tmp_path / "pulled")["dest"])
    bucket = s3_env.removeprefix("s3://").split("/")[0]
    s3 = s3_server.client()  # its own credentials, not whatever boto3's default session cached

    def served() -> list[str]:
        found = s3.list_objects_v2(Bucket=bucket, Prefix="reg/mlflow-artifacts/")
        return sorted(o["Key"].rsplit("/", 1)[1] for o in found.get("Contents", []))

    assert served() == sorted(p.name for p in stored.iterdir())
    ui = start_ui()
    url = ui.url
    tracking_store = os.environ["MLFLOW_TRACKING_URI"]
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    for key in aws:
        monkeypatch.delenv(key)  # the client holds no store credentials
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    try:
        got = Path(
            mlflow.artifacts.download_artifacts("models:/m@prod", dst_path=str(tmp_path / "d"))
        )
        for path in stored.iterdir():
            assert _sha256(got / path.name) == _sha256(path)
        # no login on a registry without grants, but still read-only
        put = httpx.put(
            f"{url}/api/2.0/mlflow-artifacts/artifacts/1/releases/m/v1/x.bin", content=b"x"
        )
        tag = httpx.post(
            f"{url}/api/2.0/mlflow/registered-models/set-tag",
            json={"name": "m", "key": "k", "value": "v"},
        )
        multipart = httpx.post(f"{url}/api/2.0/mlflow-artifacts/mpu/create/1/releases/m/v1/search")
        assert (put.status_code, tag.status_code, multipart.status_code) == (403, 403, 403)
    finally:
        ui.proc.send_signal(signal.SIGHUP)  # a closed terminal stops it too
        ui.proc.wait(timeout=30)
        assert ui.leftovers() == ""
        ui.kill()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_store)
    for key, value in aws.items():
        monkeypatch.setenv(key, value)
    with Registry() as reg:
        reg.yank("m:v1", reason="bad data")
        assert drain(reg.catalog, reg.settings, 120)["pending"] == 0
    assert served() == []


def test_no_login_stays_on_this_machine(cli, tmp_path, monkeypatch):
    res = cli("ui", "--host", "0.0.0.0", "--no-auth")
    assert res.returncode == 2 and "without a login" in res.stderr, res.stderr


READS = {  # every POST of MLflow's API that only reads
    "artifacts/presigned-download-url",
    "experiments/search",
    "logged-models/search",
    "registered-models/get-latest-versions",
    "runs/search",
    "datasets/search",
    "issues/search",
    "traces/search",
}


@pytest.mark.process
def test_every_mlflow_write_is_refused_by_the_login():
    """Every route of MLflow's API that can change something is refused for everyone (with a
    path parameter shaped like a search, too); only the searches pass."""
    from mlflow.server.handlers import get_endpoints

    from registry.integrations.mirror.login import writes

    routes = {(m, path) for path, _, methods in get_endpoints() for m in methods}
    assert len(routes) > 100
    for method, path in routes:
        concrete = re.sub(r"<[^>]+>", "1/releases/m/v1/search", path)
        read = (
            method in ("GET", "HEAD")
            or path == "/graphql"
            or any(path.endswith("/mlflow/" + r) for r in READS)
        )
        assert writes(method, concrete) is not read, (method, path)
