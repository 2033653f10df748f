"""S3 through a faulty proxy: push, pull, promote, pull-release and gc run with 1%, 10%
and 30% of the S3 requests failing (500, 503 SlowDown, connections dropped before or after the
request was carried out), answered slowly, or answered with a body cut short
(tests/s3server.py FaultyProxy).

At 1% and 10% every operation completes (the client's and the store's retries carry it) and
everything verifies. At 30%, with fewer attempts allowed, an operation either completes
correctly or fails with one line (a RegistryError), leaves nothing half-visible, and the same
operation run again straight against the server completes. Whatever happens, a pulled file
always has the sha256 its manifest records: never a silently wrong byte."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from registry import Registry
from registry.errors import NotFound, RegistryError
from tests.s3server import FaultyProxy

KINDS = ("500", "503", "drop", "lost", "slow", "truncate")
RETENTION = '\n[retention]\nkeep_last = 1\nttl = "0s"\norphan_grace = "0s"\n'
# (fault rate, AWS_MAX_ATTEMPTS): at 30% one retry only, so that some operations do fail.
RATES = [(0.01, 10), (0.10, 10), (0.30, 2)]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def _check_pulled(record: dict[str, Any], dest: Path, src: Path | None) -> None:
    """Every pulled file has its recorded sha256 (and, where known, the source's bytes)."""
    for f in record["files"]:
        got = _sha256(dest / f["path"])
        assert got == f["sha256"], f"{dest / f['path']}: pulled sha256 {got} != recorded"
        if src is not None:
            assert got == _sha256(src / f["path"]), f"{f['path']} differs from the source"


def _check_everything_visible_verifies(phase: str) -> None:
    with Registry() as reg:
        for ckpt in reg.list_checkpoints():
            report = reg.verify(ckpt["ref"])
            assert report["ok"], f"after {phase}: listed {ckpt['ref']} does not verify: {report}"
        for rel in reg.releases():
            if rel["status"] == "active":
                report = reg.verify(rel["release"])
                assert report["ok"], f"after {phase}: {rel['release']} does not verify: {report}"
        if hasattr(reg, "fsck"):
            fsck = reg.fsck()
            assert fsck["clean"], f"after {phase}: fsck found {fsck['problems']}"


@pytest.mark.parametrize(("rate", "attempts"), RATES, ids=[f"{r:.0%}" for r, _ in RATES])
def test_operations_through_a_faulty_s3(
    rate, attempts, s3_env, s3_server, ckpts, big_ckpt, cpu_policy, monkeypatch, tmp_path
):
    policy = tmp_path / "policy.toml"
    policy.write_text(cpu_policy.read_text() + RETENTION)
    monkeypatch.setenv("REG_POLICY", str(policy))
    monkeypatch.setenv("REG_S3_RETRY_MODE", "standard")
    # The smallest parts S3 allows: more requests per operation, so more faults hit each one.
    monkeypatch.setattr("registry.storage.s3.part_size_for", lambda size: 5 * 1024 * 1024)
    must_complete = rate <= 0.10
    proxy = FaultyProxy(
        s3_server.port, rate, seed=int(rate * 1000), kinds=KINDS, slow_s=0.3
    ).start()

    def through_proxy() -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", str(attempts))

    def direct() -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
        monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)

    big, small = big_ckpt.step_dir(1), ckpts.ws2
    pulls = iter(range(1000))

    def pull(ref: str, src: Path) -> Callable[[Registry], None]:
        def run(reg: Registry) -> None:
            dest = tmp_path / f"pull-{next(pulls)}"
            try:
                reg.pull(ref, dest)
            except BaseException:
                assert not dest.exists(), f"a failed pull of {ref} left {dest}"
                raise
            _check_pulled(reg.show(ref), dest, src)

        return run

    def pull_release(reg: Registry) -> None:
        dest = tmp_path / f"release-{next(pulls)}"
        try:
            reg.pull_release("tiny@prod", dest)
        except BaseException:
            assert not dest.exists(), f"a failed pull-release left {dest}"
            raise
        _check_pulled(reg.show("tiny@prod"), dest, None)

    def gc(reg: Registry) -> None:
        reg.gc()

    ops: list[tuple[str, Callable[[Registry], Any]]] = [
        ("push big@step1", lambda reg: reg.push_checkpoint(big, run="big", step=1)),
        ("push r@step2", lambda reg: reg.push_checkpoint(small.step_dir(2), run="r", step=2)),
        ("push r@step4", lambda reg: reg.push_checkpoint(small.step_dir(4), run="r", step=4)),
        ("pull big@step1", pull("big@step1", big)),
        ("pull r@step4", pull("r@step4", small.step_dir(4))),
        ("promote r@step4", lambda reg: reg.promote("r@step4", model="tiny", alias="prod")),
        ("pull-release tiny@prod", pull_release),
        ("gc", gc),
    ]
    outcomes: dict[str, str] = {}
    started = time.monotonic()
    try:
        for name, op in ops:
            through_proxy()
            t0 = time.monotonic()
            try:
                with Registry() as reg:
                    op(reg)
                outcomes[name] = f"completed in {time.monotonic() - t0:.1f}s"
            except RegistryError as exc:
                assert not must_complete, (
                    f"{name} failed with {rate:.0%} of S3 requests faulty, where retries "
                    f"should carry it: {exc}"
                )
                assert "\n" not in str(exc), f"{name}: the error is not one line: {exc!r}"
                outcomes[name] = f"failed: {exc}"
                direct()
                _check_everything_visible_verifies(f"{name} failed")
                with Registry() as reg:
                    op(reg)  # run again straight against the server: it completes
            direct()
        _check_everything_visible_verifies("every operation")
    finally:
        proxy.stop()
        summary = (
            f"{rate:.0%}: {proxy.requests} requests, {proxy.faults} faults {proxy.by_kind}, "
            f"{time.monotonic() - started:.1f}s; "
            + "; ".join(f"{k}: {v}" for k, v in outcomes.items())
        )
        print(summary)
    assert proxy.faults > 0 and proxy.requests > 50, f"too few faults to mean much: {summary}"
    if rate >= 0.3:
        assert set(proxy.by_kind) == set(KINDS), f"not every kind of fault was injected: {summary}"
    with Registry() as reg:
        steps = {c["ref"] for c in reg.list_checkpoints()}
        assert steps == {"big@step1", "r@step4"}, f"gc left {steps} ({summary})"
        with pytest.raises(NotFound):
            reg.pull("r@step2", tmp_path / "collected")
        assert [r["release"] for r in reg.releases("tiny")] == ["tiny:v1"], summary


def test_bodies_cut_short_are_read_again_and_never_returned_wrong(s3_env, s3_server, monkeypatch):
    """A quarter of the replies cut short: ranged reads, streams (resumed at their offset) and the
    store's re-hash still return exactly the stored bytes."""
    import os

    from registry.storage import open_store

    data = os.urandom(12 * 1024 * 1024 + 123)
    open_store(s3_env).put_bytes("ckpt/p/r/step-1/blob", data)
    proxy = FaultyProxy(s3_server.port, 0.25, seed=7, kinds=("truncate",)).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(s3_env)
        for i in range(6):
            assert store.get_bytes("ckpt/p/r/step-1/blob") == data, f"stream {i} differs"
            offset, length = 1_000_003 * (i + 1), 5 * 1024 * 1024
            got = store.read_range("ckpt/p/r/step-1/blob", offset, length)
            assert bytes(got) == data[offset : offset + length], f"range {i} differs"
        assert store.sha256("ckpt/p/r/step-1/blob") == hashlib.sha256(data).hexdigest()
    finally:
        proxy.stop()
    assert proxy.by_kind.get("truncate", 0) >= 3, f"too few bodies were cut: {proxy.by_kind}"
