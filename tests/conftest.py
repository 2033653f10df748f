"""Shared fixtures: a clean environment per test, real checkpoints from torchrun, real catalogs.

Checkpoints are written once per test session by real `torchrun` processes (gloo, CPU, FSDP2)
at world size 2 and 3, shared read-only by every xdist worker (tests/sharing.py: a test that
writes to one fails). The catalog fixture runs each test on SQLite and on the PostgreSQL server
on 127.0.0.1:5432 (database `test`, a fresh schema per test).

The hooks below order the session for two workers (the `exclusive` tests first and back to
back, then the torture run, then the rest), keep the exclusive tests apart from every other
test, keep the quick lane (`--quick`) free of processes, and print what the expensive set-ups
cost.
"""

from __future__ import annotations

import os
import resource
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.helpers import PG_URL, Ckpts, Trained, pg_available, train
from tests.sharing import ExclusiveLock, build_once, session_root

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
    """Real FSDP2 checkpoints: ws2 (steps 2, 4) and ws3 (step 3), with full weights beside.
    Written under real `torchrun` (the other jobs fork their ranks: tests/forkrun.py)."""
    return build_once(
        tmp_path_factory,
        "ckpts",
        lambda base: Ckpts(
            ws2=train(base / "ws2", nproc=2, steps=4, every=2, real=True),
            ws3=train(base / "ws3", nproc=3, steps=3, every=3, real=True),
        ),
    )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real S3 server (SeaweedFS, SigV4 and checksums enforced) for the session, per worker,
    on free ports on 127.0.0.1, in a directory of its own."""
    from tests.s3server import SeaweedServer
    from tests.sharing import timed

    with timed("SeaweedFS S3 server (per worker)"):
        server = SeaweedServer(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the real S3 server and the AWS_* environment pointing at it, with its
    credentials; returns the store URL."""
    for name, value in s3_server.credentials().items():
        monkeypatch.setenv(name, value)
    bucket = f"reg-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/reg"
    monkeypatch.setenv("REG_STORE_URL", url)
    return url


@pytest.fixture(scope="session")
def bad_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trained]:
    """A checkpoint whose last step has a NaN weight, and a weights-only one (ws=2)."""
    return build_once(
        tmp_path_factory,
        "bad_ckpts",
        lambda base: {
            "nan": train(base / "nan", nproc=2, steps=2, every=2, extra=("--poison", "nan")),
            "weights_only": train(
                base / "wo", nproc=2, steps=2, every=2, extra=("--weights-only",)
            ),
        },
    )


LAYOUTS = ("torchtitan", "lightning", "stateful")


@pytest.fixture(scope="session")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trained]:
    """Real ws=2 checkpoints in each trainer's shape (examples/train_tiny.py --layout), and a
    torchtitan model-only one (its last step)."""

    def build(base: Path) -> dict[str, Trained]:
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

    return build_once(tmp_path_factory, "layouts", build)


@pytest.fixture
def cpu_policy(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Promotion after a CPU validation (laptops, CI); the shipped default requires CUDA."""
    path = ROOT / "examples" / "cpu-policy.toml"
    monkeypatch.setenv("REG_POLICY", str(path))
    return path


@pytest.fixture(scope="session")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A ~200 MB ws=2 checkpoint (model + AdamW), big enough to kill a push midway."""
    return build_once(
        tmp_path_factory,
        "big_ckpt",
        lambda base: train(
            base / "ws2",
            nproc=2,
            steps=1,
            every=1,
            env_extra={"TINY_DIM": "1024", "TINY_LAYERS": "2"},
        ),
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
    """Run `reg` as a user does: a process of its own, in the test's environment; returns
    (exit code, stdout, stderr). Forked from this worker's warm zygote (tests/zygote.py), so
    it skips the 1-3 s of imports, not the process."""
    from tests.zygote import run_reg

    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return run_reg(*map(str, args), env=dict(os.environ, **(env or {})), timeout=timeout)

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


# -- the session's order, exclusive tests, and what set-up cost --------------------------------
def _rank(item: pytest.Item) -> int:
    """0: the exclusive tests, back to back (the other worker waits meanwhile: at the start,
    where nothing long is running that they would wait for); 1: the torture run (minutes on one
    worker, while the other takes the rest); 2: the rest, in file order."""
    if item.get_closest_marker("exclusive"):
        return 0
    return 1 if item.get_closest_marker("long") else 2


# Fixtures that start a process or a server (torchrun, `reg`, reg server, S3, PostgreSQL,
# MLflow): a test that uses one, or is marked `process`, is not in the quick lane.
PROCESS_FIXTURES = frozenset(
    {
        "ckpts",
        "bad_ckpts",
        "layouts",
        "big_ckpt",
        "hf_trained",
        "variants",
        "cli",
        "reg_server",
        "deployment",
        "moto_server",
        "s3_server",
        "s3_env",
        "pg_cluster",
        "roles",
        "file_server",
        "tiny_ckpt",
        "big",
        "poisoned",
    }
)


SERVER_PARAMS = frozenset({"postgres", "s3", "s3pg", "remote", "server"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="only the tests that start no process and no server (scripts/test --quick)",
    )


def starts_processes(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return bool(
        item.get_closest_marker("process")
        or item.get_closest_marker("postgres")
        or PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        # a backend chosen by parameter (getfixturevalue inside the fixture): PostgreSQL, S3
        or (callspec is not None and SERVER_PARAMS.intersection(map(str, callspec.params.values())))
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--quick"):
        slow = [item for item in items if starts_processes(item)]
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not starts_processes(item)]
    items.sort(key=_rank)  # stable: the same order on every xdist worker


@pytest.fixture(scope="session", autouse=True)
def quick_lane_starts_no_process(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """In the quick lane, a test or fixture (of any scope) that starts a process after all
    fails, saying how to mark it."""
    if not request.config.getoption("--quick"):
        yield
        return

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        pytest.fail(
            "the quick lane starts no process: mark the test @pytest.mark.process, or add the "
            "fixture that starts it to PROCESS_FIXTURES in tests/conftest.py",
            pytrace=False,
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(os, "fork", refuse)
        patch.setattr(os, "posix_spawn", refuse)
        yield


_LOCK: list[ExclusiveLock] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    """Every test, its set-up included (a session fixture's build), under the machine lock."""
    if not _LOCK:
        _LOCK.append(ExclusiveLock(session_root(item.config._tmp_path_factory)))  # type: ignore[attr-defined]
    exclusive = item.get_closest_marker("exclusive") is not None
    then = nextitem is not None and nextitem.get_closest_marker("exclusive") is not None
    with _LOCK[0].hold(exclusive, then):
        yield


@pytest.fixture(autouse=True)
def shared_fixtures_stay_read_only():  # type: ignore[no-untyped-def]
    """A test that changed a tree the session shares (tests/sharing.py) fails, naming it."""
    from tests.sharing import unchanged_shared_trees

    yield
    problem = unchanged_shared_trees()
    if problem:
        pytest.fail(problem, pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests import zygote
    from tests.sharing import SETUP_TIMES

    zygote.close()  # this worker's zygote, and any reg server a test left running from it

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints it
        workeroutput["setup_times"] = [list(t) for t in SETUP_TIMES]


_WORKER_SETUP: list[tuple[str, str, str, float]] = []


# -- CPU per test: what the suite's time is made of (scripts/test prints the top 25) ------------
def _cpu_seconds() -> float:
    """This worker's CPU, with its children that ended (torchrun jobs, servers, and the reg
    commands its zygote forked)."""
    from tests import zygote

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return cpu + zygote.children_cpu()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    if call.when == "teardown" and _CPU_START in item.stash:
        spent = _cpu_seconds() - item.stash[_CPU_START]  # set-up (shared builds too) to teardown
        item.user_properties.append(("cpu_s", round(spent, 3)))
    yield


_CPU_START = pytest.StashKey[float]()
_TEST_CPU: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "cpu_s":
                _TEST_CPU[report.nodeid] = float(value)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # type: ignore[no-untyped-def]
    worker = node.gateway.id
    for name, how, seconds in node.workeroutput.get("setup_times", []):
        _WORKER_SETUP.append((worker, name, how, seconds))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    from tests.sharing import SETUP_TIMES

    if _TEST_CPU:
        terminalreporter.section("the 25 tests with the most CPU (with their processes)")
        for nodeid, cpu in sorted(_TEST_CPU.items(), key=lambda kv: -kv[1])[:25]:
            terminalreporter.write_line(f"{cpu:8.1f}s  {nodeid}")
        total = sum(_TEST_CPU.values())
        terminalreporter.write_line(f"{total:8.1f}s  in all, over {len(_TEST_CPU)} tests")
        # The many small tests add up too: the files with the most CPU, their tests summed.
        by_file: dict[str, list[float]] = {}
        for nodeid, cpu in _TEST_CPU.items():
            by_file.setdefault(nodeid.split("::", 1)[0], []).append(cpu)
        if len(by_file) > 1:
            terminalreporter.section("the 15 test files with the most CPU")
            for name, cpus in sorted(by_file.items(), key=lambda kv: -sum(kv[1]))[:15]:
                terminalreporter.write_line(f"{sum(cpus):8.1f}s  {name} ({len(cpus)} tests)")

    rows = _WORKER_SETUP or [("main", *t) for t in SETUP_TIMES]
    if not rows:
        return
    terminalreporter.section("expensive set-up (once per session or per worker)")
    built = sum(s for _, _, how, s in rows if how == "built")
    waited = sum(s for _, _, how, s in rows if how != "built")
    for worker, name, how, seconds in sorted(rows, key=lambda r: -r[3]):
        if how == "built" or seconds >= 1:  # a wait: while another worker built it
            verb = "built" if how == "built" else "waited while another worker built it"
            terminalreporter.write_line(f"{seconds:8.1f}s  {worker:>5}  {name}: {verb}")
    terminalreporter.write_line(f"{built:8.1f}s  building, {waited:.1f}s waiting, in all")
