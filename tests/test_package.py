"""The packaging contract: public API, top-level packages, import costs kept lazy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import registry

ROOT = Path(__file__).resolve().parent.parent


def test_public_api_is_declared():
    assert sorted(registry.__all__) == registry.__all__
    for name in registry.__all__:
        assert hasattr(registry, name), name


def test_top_level_packages_resolve_to_this_project():
    import cli
    import policies

    for module in (cli, policies, registry):
        assert Path(module.__file__).resolve().is_relative_to(ROOT)


def test_help_and_ls_do_not_import_heavy_dependencies():
    code = (
        "import sys, runpy; sys.argv=['reg','--help']\n"
        "try: runpy.run_module('cli', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "heavy = [m for m in ('torch','boto3','mlflow','sqlalchemy','alembic') "
        "if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "HEAVY=", out.stdout
