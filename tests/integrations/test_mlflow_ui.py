"""The MLflow UI in a real headless browser (Debian's Chromium driven by Playwright): a release
with its alias and digest, and the run's checkpoints, are visible. Saves the screenshot of
docs/how-to/mlflow.md."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest

from registry import Registry
from registry.integrations.mirror.drain import drain
from tests.conftest import ROOT
from tests.helpers import start_ui

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def ui(tmp_path, monkeypatch, ckpts):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install chromium` (scripts/test does it)")
    policy = tmp_path / "policy.toml"
    policy.write_text('[promotion]\nrequire_device = "any"\n')
    monkeypatch.setenv("REG_POLICY", str(policy))
    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(
                ckpts.ws2.step_dir(step),
                run="run42",
                step=step,
                metrics={"val_loss": 3.0 - step / 10},
            )
        reg.promote("run42@step4", model="tiny-lm", alias="prod")
        assert drain(reg.catalog, reg.settings, 120)["pending"] == 0
    ui = start_ui()
    yield ui.url
    ui.proc.send_signal(signal.SIGINT)  # reg ui stops the server's whole process group
    ui.proc.wait(timeout=30)
    leftovers = ui.leftovers()
    ui.kill()
    assert leftovers == "", f"left running: {leftovers}"


def _open(page, url: str, wait_for: str) -> None:
    page.goto(url)
    page.get_by_text(wait_for).first.wait_for(timeout=30_000)  # the UI polls: no networkidle
    for label in ("Close", "close"):  # the assistant side panel, a first-visit modal
        button = page.get_by_role("button", name=label)
        if button.count():
            with contextlib.suppress(Exception):  # gone already: nothing to close
                button.first.click(timeout=2_000)


def test_release_and_checkpoints_are_visible_in_the_mlflow_ui(ui, tmp_path):
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    version = client.search_model_versions("name = 'tiny-lm'")[0]
    sha = version.tags["reg.sha256"]
    exp_id = client.get_experiment_by_name("default").experiment_id
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        _open(page, f"{ui}/#/models/tiny-lm", "Version 1")
        body = page.inner_text("body").replace("\xa0", " ")
        assert "@ prod" in body and "reg.sha256" in body and sha[:12] in body
        shot = tmp_path / "mlflow-release.png"
        page.screenshot(path=str(shot))
        _open(page, f"{ui}/#/models/tiny-lm/versions/{version.version}", sha)
        body = page.inner_text("body").replace("\xa0", " ")
        assert "reg.source" in body and "run42@step4" in body and "reg.validation" in body
        _open(page, f"{ui}/#/experiments/{exp_id}/models", "run42-step4")
        body = page.inner_text("body").replace("\xa0", " ")
        assert "run42-step2" in body and "run42-step4" in body
        browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("SAVE_SCREENSHOTS") == "1":  # refreshes the picture in docs/how-to/mlflow.md
        shutil.copy(shot, ROOT / "docs" / "mlflow-release.png")
