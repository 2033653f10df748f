"""One suite for the `Registry` contract, run against both implementations, as the store's
conformance suite runs against every backend: the embedded `LocalRegistry` and
`RemoteRegistry` through a real `reg server` (SQLite catalog, local store, the CPU policy)
answer each method with the same typed result and refuse the same input with the same error.

Each test names the contract methods it covers; `test_the_suite_covers_the_contract` keeps the
list honest as the contract grows.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from registry import Registry
from registry.api import results
from registry.api.local import LocalRegistry
from registry.api.remote.registry import RemoteRegistry
from registry.errors import MalformedRef, NotFound, RegistryError, UsageError
from tests.helpers import Ckpts
from tests.serverproc import RegServer, server_env

pytestmark = pytest.mark.process

# The contract methods the tests below call, each under its test; what no test here calls is
# covered elsewhere and named in ELSEWHERE with where.
COVERED = {
    "checkpoints": ("user", "push_checkpoint", "list_checkpoints", "show", "pull", "verify"),
    "pins_and_runs": ("pin", "unpin", "finish_run", "heartbeat", "plan_restart"),
    "releases": (
        *("validate", "promote", "releases", "pull_release", "set_alias", "alias_requests"),
        *("deprecate", "yank"),
    ),
    "administration": ("gc", "fsck", "audit_log", "policy_show", "list_tokens", "scrub"),
}
ELSEWHERE = {
    "policy": "a property both implementations answer from their own side (test_contract.py)",
    "close": "every fixture here closes its registry",
    "claim_checkpoint": "test_claims.py, test_server_claims.py",
    "push_checkpoint_part": "test_claims.py, test_server_claims.py",
    "commit_claimed": "test_claims.py, test_server_claims.py",
    "fetch_release": "test_release_cache.py (both registries)",
    "approve": "test_release_workflow.py, test_release_workflow_server.py",
    "reject": "test_release_workflow.py, test_release_workflow_server.py",
    "rebuild_catalog": "test_rebuild.py",
    "advise": "test_advise_e2e.py",
    "recovery": "test_advise_e2e.py",
    "storage_init": "test_s3.py",
    "audit_verify": "test_audit_chain.py",
    "audit_seal": "test_audit_chain.py",
    "apply_policy": "test_server.py, test_access.py",
    "export_policy": "test_access.py",
    "create_token": "test_server.py",
    "revoke_token": "test_server.py",
    "sign_release": "test_sign_release.py",
    "signing_keys": "test_signing.py",
    "webhooks": "test_webhooks.py",
    "test_webhook": "test_webhooks.py",
    "webhook_deliveries": "test_webhooks.py",
    "deliver_webhooks": "test_webhooks.py",
    "mlflow_sync": "test_mlflow.py",
}


@pytest.fixture(params=["local", "remote"])
def registry(
    request: pytest.FixtureRequest,
    cpu_policy: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Registry]:
    """`Registry()` as a user opens it: embedded, or with REG_URL and a token set."""
    if request.param == "local":
        with Registry() as reg:
            assert isinstance(reg, LocalRegistry)
            yield reg
        return
    home = tmp_path / "server-home"
    server = RegServer(server_env(home, f"sqlite:///{home / 'catalog.db'}"), home)
    server.init().start()
    try:
        for key, value in server.client_env("admin").items():
            monkeypatch.setenv(key, value)
        with Registry() as reg:
            assert isinstance(reg, RemoteRegistry)
            yield reg
    finally:
        server.stop()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_checkpoints(registry: Registry, ckpts: Ckpts, tmp_path: Path) -> None:
    src = ckpts.ws2.step_dir(2)
    assert registry.user in ("tester", "admin")
    pushed = registry.push_checkpoint(src, run="r", step=2, metrics={"loss": 1.5})
    assert isinstance(pushed, results.CheckpointPushed)
    assert (pushed.ref, pushed.step, pushed.world_size, pushed.state) == (
        "r@step2",
        2,
        2,
        "committed",
    )
    assert {f["path"]: f["sha256"] for f in pushed.files} == {
        p.name: _digest(p) for p in src.iterdir() if p.is_file()
    }
    again = registry.push_checkpoint(src, run="r", step=2)
    assert again.unchanged and again.files == pushed.files  # identical content: exit 0, no copy
    registry.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)

    listed = registry.list_checkpoints("r")
    assert [c.ref for c in listed] == ["r@step2", "r@step4"]
    assert all(isinstance(c, results.CheckpointSummary) for c in listed)
    shown = registry.show("r@latest")
    assert isinstance(shown, results.CheckpointDetails)
    assert (shown.ref, shown.world_size, shown.tensor_count > 0) == ("r@step4", 2, True)
    assert registry.show("r@step2").metrics == {"loss": 1.5}

    pulled = registry.pull("r@step2", tmp_path / "out")
    assert isinstance(pulled, results.CheckpointPulled)
    for f in pushed.files:  # every byte as pushed
        assert _digest(tmp_path / "out" / f["path"]) == f["sha256"]
    report = registry.verify("r@step2")
    assert isinstance(report, results.VerifyReport)
    assert (report.ok, report.files, report.problems) == (
        True,
        len(pushed.files) + 1,
        [],
    )  # +MANIFEST

    # the same refusals, with the same errors and exit codes
    with pytest.raises(NotFound) as missing:
        registry.show("r@step99")
    assert missing.value.exit_code == 3 and "r has steps 2, 4" in str(missing.value)
    with pytest.raises(MalformedRef) as malformed:
        registry.show("r@stepX")
    assert malformed.value.exit_code == 2
    with pytest.raises(UsageError):
        registry.push_checkpoint(tmp_path / "nothing", run="r", step=6)
    with pytest.raises(MalformedRef):
        registry.pull("r@latest/../x", tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()
    assert [c.ref for c in registry.list_checkpoints("r")] == ["r@step2", "r@step4"]


def test_pins_and_runs(registry: Registry, ckpts: Ckpts) -> None:
    registry.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
    pinned = registry.pin("r@step2", reason="the paper's run")
    assert isinstance(pinned, results.CheckpointFacts)
    assert pinned.pinned and registry.show("r@step2").pin_reason == "the paper's run"
    assert not registry.unpin("r@step2").pinned
    with pytest.raises(NotFound):
        registry.pin("r@step8")
    for bad in ("r@stepX", "../r@step2", "r@step2@step2"):  # a derived method parses it first
        with pytest.raises(MalformedRef) as malformed:
            registry.pin(bad)
        assert malformed.value.exit_code == 2 and "\n" not in str(malformed.value)

    beat = registry.heartbeat("r", step=2, seconds=5.0, step_seconds=0.5)
    assert isinstance(beat, results.HeartbeatRecorded)
    planned = registry.plan_restart("r")
    assert isinstance(planned, results.RestartPlanned)
    finished = registry.finish_run("r")
    assert isinstance(finished, results.RunFinished)
    assert finished.status == "finished"
    with pytest.raises(RegistryError) as bad:
        registry.finish_run("r", status="exploded")
    assert bad.value.exit_code == 2


def test_releases(registry: Registry, ckpts: Ckpts, tmp_path: Path) -> None:
    registry.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
    validated = registry.validate("r@step4", device="cpu")
    assert isinstance(validated, results.ValidationReport)
    assert validated.passed and validated.device == "cpu" and validated.world_size == 1

    promoted = registry.promote("r@step4", model="tiny", alias="prod")
    assert isinstance(promoted, results.ReleasePromoted)
    assert (promoted.release, promoted.version, promoted.existing) == ("tiny:v1", 1, False)
    assert registry.promote("r@step4", model="tiny").existing  # the same bytes, answered again

    listed = registry.releases("tiny")
    assert [(r.release, r.aliases) for r in listed] == [("tiny:v1", ["prod"])]
    shown = registry.show("tiny@prod")
    assert isinstance(shown, results.ReleaseDetails) and shown.release == "tiny:v1"

    got = registry.pull_release("tiny@prod", tmp_path / "model")
    assert isinstance(got, results.ReleasePulled)
    for f in shown.files:
        assert _digest(tmp_path / "model" / f["path"]) == f["sha256"]

    moved = registry.set_alias("tiny", "staging", 1)
    assert isinstance(moved, results.AliasMoved)
    assert registry.alias_requests("tiny") == []  # no protected alias: nothing waits
    assert registry.deprecate("tiny:v1", reason="superseded").status == "deprecated"
    yanked = registry.yank("tiny:v1", reason="a bad tokenizer")
    assert isinstance(yanked, results.ReleaseStatusChanged) and yanked.status == "yanked"
    with pytest.raises(NotFound):
        registry.show("tiny:v7")


def test_administration(registry: Registry, ckpts: Ckpts) -> None:
    registry.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
    plan = registry.gc(dry_run=True)
    assert isinstance(plan, results.GcReport)
    assert not plan.applied and [d["ref"] for d in plan.decisions] == ["r@step2"]
    assert plan.decisions[0]["action"] == "keep"  # the newest of its run

    fsck = registry.fsck()
    assert isinstance(fsck, results.FsckReport) and fsck.problems == []
    scrub = registry.scrub()
    assert isinstance(scrub, results.ScrubReport)

    events = registry.audit_log(action="push")
    assert [(e.action, e.target, e.outcome) for e in events][-1:] == [
        ("push", "r@step2", "allowed")
    ]
    policy = registry.policy_show()
    assert isinstance(policy, results.PolicyInForce)
    assert all(isinstance(t, results.TokenInfo) for t in registry.list_tokens())


def test_the_suite_covers_the_contract() -> None:
    contract = {
        name
        for name, member in vars(Registry).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }
    here = {name for names in COVERED.values() for name in names}
    assert here.isdisjoint(ELSEWHERE)
    assert here | set(ELSEWHERE) == contract, sorted(contract ^ (here | set(ELSEWHERE)))
