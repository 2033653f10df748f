"""Shared fixtures: a clean environment per test, real checkpoints from torchrun, real catalogs.

Checkpoints are written once per test session by real `torchrun` processes (gloo, CPU, FSDP2)
at world size 2 and 3. The catalog fixture runs each test on SQLite and on the PostgreSQL server
on 127.0.0.1:5432 (database `test`, a fresh schema per test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import PG_URL, Ckpts, Trained, pg_available, train

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for key in list(os.environ):
        if key.startswith(("REG_", "AWS_", "MLFLOW_")):
            monkeypatch.delenv(key)
    home = tmp_path / "reg-home"
    monkeypatch.setenv("REG_HOME", str(home))
    monkeypatch.setenv("REG_USER", "tester")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("REG_MLFLOW", "off")
    return home


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    """Real FSDP2 checkpoints: ws2 (steps 2, 4) and ws3 (step 3), with full weights beside."""
    base = tmp_path_factory.mktemp("ckpts")
    return Ckpts(
        ws2=train(base / "ws2", nproc=2, steps=4, every=2),
        ws3=train(base / "ws3", nproc=3, steps=3, every=3),
    )


@pytest.fixture(scope="session")
def moto_server():  # type: ignore[no-untyped-def]
    """One S3-compatible server (moto) for the session, on a free port on 127.0.0.1."""
    from tests.s3server import MotoServer

    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(moto_server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket and the AWS_* environment pointing at the test server; returns the URL."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.url)
    bucket = f"reg-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_server.url).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/reg"
    monkeypatch.setenv("REG_STORE_URL", url)
    return url


@pytest.fixture(scope="session")
def bad_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trained]:
    """A checkpoint whose last step has a NaN weight, and a weights-only one (ws=2)."""
    base = tmp_path_factory.mktemp("bad")
    return {
        "nan": train(base / "nan", nproc=2, steps=2, every=2, extra=("--poison", "nan")),
        "weights_only": train(base / "wo", nproc=2, steps=2, every=2, extra=("--weights-only",)),
    }


LAYOUTS = ("torchtitan", "lightning", "stateful")


@pytest.fixture(scope="session")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trained]:
    """Real ws=2 checkpoints in each trainer's shape (examples/train_tiny.py --layout), and a
    torchtitan model-only one (its last step)."""
    base = tmp_path_factory.mktemp("layouts")
    out = {
        name: train(base / name, nproc=2, steps=2, every=2, extra=("--layout", name))
        for name in LAYOUTS
    }
    out["model-only"] = train(
        base / "model-only",
        nproc=2,
        steps=2,
        every=2,
        extra=("--layout", "torchtitan", "--weights-only"),
    )
    return out


@pytest.fixture
def cpu_policy(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Promotion after a CPU validation (laptops, CI); the shipped default requires CUDA."""
    path = ROOT / "examples" / "cpu-policy.toml"
    monkeypatch.setenv("REG_POLICY", str(path))
    return path


@pytest.fixture(scope="session")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A ~200 MB ws=2 checkpoint (model + AdamW), big enough to kill a push midway."""
    return train(
        tmp_path_factory.mktemp("big") / "ws2",
        nproc=2,
        steps=1,
        every=1,
        env_extra={"TINY_DIM": "1024", "TINY_LAYERS": "2"},
    )


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'reg-home' / 'catalog.db'}"
    else:
        if not pg_available():
            pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 (.ci/run starts it)")
        schema = f"t_{uuid.uuid4().hex[:12]}"
        import psycopg

        with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        request.addfinalizer(lambda: _drop_schema(schema))
        url = f"{PG_URL}?options=-csearch_path%3D{schema}"
    monkeypatch.setenv("REG_CATALOG_URL", url)
    return url


def _drop_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
def reg(catalog_url: str):  # type: ignore[no-untyped-def]
    """A registry on each catalog (SQLite, PostgreSQL) with the local store."""
    from registry import Registry

    with Registry() as r:
        yield r


@pytest.fixture
def filled(cpu_policy, ckpts):  # type: ignore[no-untyped-def]
    """A registry (SQLite, local store) holding r@step2, r@step4 and tiny:v1 made from step 4."""
    from registry import Registry

    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="tiny")
        yield reg


@pytest.fixture
def cli():  # type: ignore[no-untyped-def]
    """Run `reg` as a user does: a subprocess; returns (exit code, stdout, stderr)."""

    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        full_env = dict(os.environ, **(env or {}))
        return subprocess.run(
            [sys.executable, "-m", "cli", *map(str, args)],
            cwd=ROOT,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def reg_server(catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """`reg server` on this test's catalog (SQLite or PostgreSQL) and a local store, with the
    team policy applied (tests/serverproc.py); the test's own environment becomes a client's:
    REG_URL and the admin's token, no catalog or store settings."""
    from tests.serverproc import RegServer, server_env, team_policy

    server = RegServer(server_env(tmp_path / "server-home", catalog_url), tmp_path / "server-home")
    server.init().start()
    server.apply_policy(team_policy())
    monkeypatch.delenv("REG_CATALOG_URL", raising=False)
    for key, value in server.client_env("admin").items():
        monkeypatch.setenv(key, value)
    yield server
    server.stop()


@pytest.fixture(params=["embedded", "remote"])
def deployment(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The CLI matrix twice: embedded, and through `reg server` (the test's environment then
    holds only REG_URL and the admin's token; the server has the test's catalog, a local store
    and the CPU policy). `direct()` is what an operator on the server host has."""
    from tests.serverproc import Deployment, RegServer, server_env

    if request.param == "embedded":
        yield Deployment(None)
        return
    catalog = (
        request.getfixturevalue("catalog_url")
        if "catalog_url" in request.fixturenames
        else f"sqlite:///{tmp_path / 'server-home' / 'catalog.db'}"
    )
    server = RegServer(server_env(tmp_path / "server-home", catalog), tmp_path / "server-home")
    server.init().start()
    monkeypatch.delenv("REG_CATALOG_URL", raising=False)
    for key, value in server.client_env("admin").items():
        monkeypatch.setenv(key, value)
    yield Deployment(server)
    server.stop()
