"""The packaging contract: public API, top-level packages, import costs kept lazy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import registry

ROOT = Path(__file__).resolve().parents[2]


def test_public_api_is_declared():
    assert sorted(registry.__all__) == registry.__all__
    for name in registry.__all__:
        assert hasattr(registry, name), name


def test_top_level_packages_resolve_to_this_project():
    import cli
    import policies

    for module in (cli, policies, registry):
        assert Path(module.__file__).resolve().is_relative_to(ROOT)


HEAVY = ("torch", "boto3", "mlflow", "sqlalchemy", "alembic")  # (typer itself imports pydantic)


def _imported(*args: str) -> set[str]:
    """Top-level packages a `reg` command imports (from `python -X importtime`)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln.split("|")[-1].strip() for ln in out.stderr.splitlines() if "import time:" in ln]
    return {name.split(".")[0] for name in lines}


@pytest.mark.process
def test_help_and_ls_do_not_import_heavy_dependencies():
    assert _imported("--help") & set(HEAVY) == set()
    _imported("ls")  # the first command creates and migrates the catalog
    assert _imported("ls", "--json") & set(HEAVY) == set()
