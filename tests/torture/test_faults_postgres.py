"""PostgreSQL restarted under a push. Each test runs against a throwaway cluster of
its module's own (initdb on a free port, never the shared server on 5432) and restarts or stops
it at a chosen moment of a `reg push-ckpt` of a ~200 MB checkpoint, held there by a pausing
fault point (registry/core/faults.py, `NAME:pause`):

    claim      the push's catalog transaction waits on a table lock when the server restarts
    upload     the claim taken, files being published (store-publish), the server down 1.5 s
    published  every file published, before MANIFEST.json (push-published), down 1.5 s after
               an immediate (crash-like) stop
    manifest   MANIFEST.json written, before the commit (push-manifest), a fast restart

Afterwards the push either completed or failed with one line (no traceback); pushing again
completes; nothing is half-visible; what is listed verifies; fsck is clean (or only sweepable).
Where the catalog comes back within REG_CATALOG_RECONNECT, the push must complete: the engine
pings pooled connections and waits for a restarted database (registry/catalog/engine.py)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import NotFound
from tests.conftest import ROOT
from tests.s3server import free_port

pytestmark = pytest.mark.postgres


def _pg_bin() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK):
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class Cluster:
    """A PostgreSQL cluster of the test's own, on 127.0.0.1:`port`, trust authentication."""

    def __init__(self, bindir: Path, base: Path, as_user: list[str]) -> None:
        self.bindir, self.base, self.as_user = bindir, base, as_user
        self.data = base / "data"
        self.port = free_port()

    def _run(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            [*self.as_user, *args],
            check=True,
            capture_output=True,
            timeout=timeout,
            cwd=self.base,
        )

    def _ctl(self, *args: str) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-t", "30", *args)

    def init(self) -> Cluster:
        self._run(
            str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
            "--no-sync",
        )  # fmt: skip
        return self

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.base} "
            "-c fsync=off -c full_page_writes=off -c max_connections=50"
        )
        self._ctl("-l", str(self.base / "log"), "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "stop")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def url(self, db: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{db}"

    def connect(self, db: str = "postgres"):  # type: ignore[no-untyped-def]
        import psycopg

        return psycopg.connect(self.url(db).replace("+psycopg", ""), autocommit=True)


@pytest.fixture(scope="module")
def pg_cluster() -> Iterator[Cluster]:
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("initdb not found (under /usr/lib/postgresql/*/bin or on PATH): no cluster")
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="reg-pg-"))
    if os.geteuid() == 0:  # initdb refuses root: the cluster runs as postgres, in its own dir
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(base)
            pytest.skip("running as root and there is no postgres user to run initdb as")
        os.chown(base, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    cluster = Cluster(bindir, base, as_user).init()
    cluster.start()
    try:
        yield cluster
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            cluster.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_catalog(pg_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh database in the test's cluster, migrated, as this test's REG_CATALOG_URL."""
    db = f"t_{uuid.uuid4().hex[:12]}"
    with pg_cluster.connect() as conn:
        conn.execute(f"CREATE DATABASE {db}")
    monkeypatch.setenv("REG_CATALOG_URL", pg_cluster.url(db))
    with Registry() as reg:
        assert reg.list_checkpoints() == []  # migrates
    return db


def _push_args(src: Path) -> list[str]:
    return [sys.executable, "-m", "cli", "push-ckpt", str(src), "--run", "big", "--step", "1"]


def _push(src: Path, pause_dir: Path, fault: str | None, **env: str) -> subprocess.Popen[str]:
    full = dict(os.environ, REG_FAULT_PAUSE=str(pause_dir), **env)
    if fault:
        full["REG_FAULT"] = fault
    return subprocess.Popen(
        _push_args(src),
        cwd=ROOT,
        env=full,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for(what: str, check, proc: subprocess.Popen[str], timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"the push ended (exit {proc.returncode}) before {what}: {err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the push never reached {what} within {timeout:g}s")
        time.sleep(0.02)


def _finish(proc: subprocess.Popen[str], moment: str) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the push hung after the catalog restart ({moment})")
    return proc.returncode, err


def _check_outcome(rc: int, err: str, moment: str, must_complete: bool) -> None:
    print(f"{moment}: exit {rc} {err.strip()}")  # the figures of a run (pytest -s)
    assert "Traceback" not in err, f"{moment}: a traceback instead of one line:\n{err}"
    if rc == 0:
        return
    assert not must_complete, f"{moment}: the push failed though the catalog came back: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{moment}: the failure is not one line:\n{err}"
    assert rc == 1 and "catalog" in lines[0], f"{moment}: exit {rc}, unclear line: {lines[0]}"


def _check_after(src: Path, moment: str, tmp_path: Path) -> None:
    """Nothing half-visible; pushing again completes; what is listed verifies; fsck clean."""
    with Registry() as reg:
        listed = [c["ref"] for c in reg.list_checkpoints()]
        assert listed in ([], ["big@step1"]), f"{moment}: listed {listed}"
        if not listed:
            with pytest.raises(NotFound):
                reg.show("big@step1")
    again = subprocess.run(
        _push_args(src),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert again.returncode == 0, f"{moment}: pushing again failed: {again.stderr}"
    with Registry() as reg:
        assert [c["ref"] for c in reg.list_checkpoints()] == ["big@step1"]
        shown = reg.show("big@step1")
        assert shown["state"] == "committed"
        assert reg.verify("big@step1")["ok"], f"{moment}: the committed push does not verify"
        if hasattr(reg, "fsck"):
            report = reg.fsck()
            assert report["clean"], f"{moment}: fsck found {report['problems']}"
        reg.pull("big@step1", tmp_path / "back")
    for f in src.iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f"{f.name} differs"


@pytest.fixture
def big_src(big_ckpt) -> Path:  # type: ignore[no-untyped-def]
    return Path(big_ckpt.step_dir(1))


def test_restart_while_the_claim_waits_on_a_lock(pg_cluster, pg_catalog, big_src, tmp_path):
    """The push's catalog transaction is blocked (a table lock held here) when the server
    restarts: its connection dies mid-transaction. It fails in one line or completes."""
    locker = pg_cluster.connect(pg_catalog)
    locker.execute("BEGIN")
    locker.execute("LOCK TABLE checkpoint IN ACCESS EXCLUSIVE MODE")
    proc = _push(big_src, tmp_path, None)

    def waiting() -> bool:
        with pg_cluster.connect(pg_catalog) as probe:
            row = probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            ).fetchone()
        return bool(row and row[0] > 0)

    try:
        _wait_for("a catalog lock wait", waiting, proc)
        pg_cluster.restart("fast")
    finally:
        with contextlib.suppress(Exception):
            locker.close()
    rc, err = _finish(proc, "claim")
    _check_outcome(rc, err, "claim", must_complete=False)
    _check_after(big_src, "claim", tmp_path)


@pytest.mark.parametrize(
    ("moment", "point", "mode"),
    [
        ("upload", "store-publish", "fast"),
        ("published", "push-published", "immediate"),
        ("manifest", "push-manifest", "restart"),
    ],
)
def test_push_survives_a_catalog_restart(
    pg_cluster, pg_catalog, big_src, tmp_path, moment, point, mode
):
    proc = _push(big_src, tmp_path, f"{point}:pause")
    marker = tmp_path / point
    _wait_for(f"{point}", marker.exists, proc)
    with Registry() as reg:  # held mid-push: nothing of it is visible yet
        assert reg.list_checkpoints() == [], f"{moment}: a push in flight is listed"
        with pytest.raises(NotFound):
            reg.show("big@step1")
    if mode == "restart":
        pg_cluster.restart("fast")
        marker.unlink()
    else:  # down while the push goes on, then back
        pg_cluster.stop(mode)
        marker.unlink()
        time.sleep(1.5)
        pg_cluster.start()
    rc, err = _finish(proc, moment)
    _check_outcome(rc, err, moment, must_complete=True)
    _check_after(big_src, moment, tmp_path)


def test_a_catalog_that_stays_down_is_one_line_and_pushing_again_completes(
    pg_cluster, pg_catalog, big_src, tmp_path
):
    """With no reconnect wait (REG_CATALOG_RECONNECT=0), a catalog down at the commit fails the
    push in one line naming the catalog; nothing is visible; pushing again completes."""
    proc = _push(big_src, tmp_path, "push-manifest:pause", REG_CATALOG_RECONNECT="0")
    marker = tmp_path / "push-manifest"
    _wait_for("push-manifest", marker.exists, proc)
    pg_cluster.stop("fast")
    try:
        marker.unlink()
        rc, err = _finish(proc, "down")
    finally:
        pg_cluster.start()
    assert rc == 1, f"a push whose catalog is down must fail (exit 1), got {rc}: {err}"
    _check_outcome(rc, err, "down", must_complete=False)
    assert "unavailable" in err, err
    _check_after(big_src, "down", tmp_path)
