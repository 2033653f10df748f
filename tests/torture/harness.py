"""The torture harness: SIGKILL registry operations at random moments, then check invariants.

    python -m tests.torture.harness --backends local,s3pg,server --n 50 --seed 7 --out report.json

One long-lived process (this one, the *zygote*) imports the registry, torch, boto3, psycopg and
mlflow once and runs every operation once on a throwaway registry (the lazy imports), then forks
a child per operation: the child builds its own `Registry` after the fork (no catalog
connection, boto client or thread crosses a fork: the warm-up's registry is closed and its
threads gone before the first), says "started", and runs the operation. The zygote SIGKILLs
it after a random delay drawn around the operation's measured duration, or arms a named crash
point (registry/core/faults.py) in the child instead. A forked checker then checks the invariants,
the killed operation is run again to completion, and the checker runs once more:

  - no partial artifact visible: list/show return only committed artifacts; a killed push's
    step is listed only if it committed, and then it verifies; a killed pull leaves the
    destination absent or complete;
  - no committed byte lost: every artifact committed before the kill is still listed and
    verifies (`Registry.verify`; the operation's own artifacts and a random sample of the
    ledger after each kill, everything at the end of a campaign);
  - catalog and store agree: `Registry.fsck()` (registry/operations/fsck.py) reports only
    sweepable problems, where the registry has it (see `catalog_store_problems`);
  - rerunning the killed command completes, and its artifact is then visible and verifies.

Backends: `local` (local store + SQLite), `s3pg` (S3 on SeaweedFS over HTTP + PostgreSQL on
127.0.0.1:5432) and `server` (a client through `reg server`, itself on a local store + SQLite).
Campaigns (one per backend and operation) run round-robin, one kill each per round, until their
counts or the time budget. Every random choice comes from one seed per (backend, operation); a
violation names the seed, the iteration, the moment of the kill and what broke, and
`--backends B --ops OP --seed S` makes the same choices again (crash points, and delays as
fractions of the measured duration, so a timing-dependent landing may still differ).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import shutil
import signal
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import PG_URL, pg_available
from tests.s3server import SeaweedServer

ROOT = Path(__file__).resolve().parent.parent.parent

OPS = ("push", "pull", "promote", "alias", "gc", "rebuild", "mlflow")
SERVER_OPS = ("push", "pull", "promote", "alias")
BACKENDS = ("local", "s3pg", "server")
# Named crash points on each operation's path (registry/core/faults.py).
FAULTS: dict[str, tuple[str, ...]] = {
    "push": ("push-published", "push-manifest"),
    "promote": ("promote-consolidated", "promote-documented"),
    "gc": ("gc-marked",),
}
FAULT_SHARE = 0.3  # of the kills on an operation that has crash points
# Crash points before the catalog commit: an operation killed there must have left nothing
# visible (its step not listed, no new release).
BEFORE_COMMIT = ("push-published", "push-manifest", "promote-consolidated", "promote-documented")

POLICY = """
[promotion]
require_device = "any"

[retention.projects."gcp"]
keep_last = 1
keep_every_steps = 0
ttl = "0s"
"""


# -- one forked child --------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int  # os.waitstatus_to_exitcode: -9 killed, 0 done, 1 raised
    landed: bool  # SIGKILLed while it still ran
    started: bool = False  # it said "started": its preparation is done
    result: Any = None
    error: str = ""
    elapsed: float = 0.0  # from "started" to the end (or the kill)

    @property
    def killed(self) -> bool:
        return self.status == -signal.SIGKILL


def fork_call(
    env: dict[str, str],
    fn: Callable[..., Any],
    arg: dict[str, Any],
    *,
    kill_after: float | None = None,
    fault: str | None = None,
    timeout: float = 300.0,
) -> Outcome:
    """Run `fn(arg)` in a forked child under `env`. `fn` may call `started()` (given in `arg`
    as the key "started") once its preparation is done: the kill timer starts there. With
    `kill_after`, the child is SIGKILLed that many seconds after it started (if it still runs);
    with `fault`, it dies at that crash point of its own."""
    r_start, w_start = os.pipe()
    out_path = Path(env["TORTURE_TMP"]) / f"out-{uuid.uuid4().hex}.json"
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(r_start)
            os.environ.clear()
            os.environ.update(env)
            from registry.core import faults

            faults._ARMED = fault  # read at import, in the zygote: armed here, per child

            def started() -> None:
                os.write(w_start, b"s")

            try:
                result = fn(dict(arg, started=started))
                _write_atomic(out_path, {"result": result})
                code = 0
            except BaseException as exc:
                text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
                _write_atomic(out_path, {"error": text})
        finally:
            os._exit(code)
    os.close(w_start)
    pidfd = os.pidfd_open(pid)
    t0 = time.monotonic()
    try:
        # Wait for "started" (or an early end).
        ready, _, _ = select.select([r_start], [], [], timeout)
        t0 = time.monotonic()
        landed = False
        began = bool(ready) and os.read(r_start, 1) == b"s"
        if kill_after is not None and began:
            done, _, _ = select.select([pidfd], [], [], kill_after)
            if not done:
                os.kill(pid, signal.SIGKILL)
                landed = True
        done, _, _ = select.select([pidfd], [], [], timeout)
        if not done:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
        os.close(r_start)
    elapsed = time.monotonic() - t0
    code = os.waitstatus_to_exitcode(status)
    landed = (landed or fault is not None) and code == -signal.SIGKILL
    out = Outcome(code, landed, began, elapsed=elapsed)
    if out_path.exists():
        data = json.loads(out_path.read_text())
        out_path.unlink()
        out.result, out.error = data.get("result"), data.get("error", "")
    elif code not in (0, -signal.SIGKILL):
        out.error = f"child ended with {code} and no report"
    return out


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    """A kill while writing leaves no half report: the zygote sees all of it or none."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


# -- what runs in the children -----------------------------------------------------------------
def _registry(env_key: str = "") -> Any:
    """A Registry on this child's environment, or (env_key) on the one named in it."""
    from registry import Registry
    from registry.core.config import Settings

    if env_key:
        return Registry(Settings.from_env(json.loads(os.environ[env_key])))
    return Registry()


def _ready(reg: Any) -> None:
    """Touch the catalog (and the store) so the kill window covers the operation itself."""
    if not reg.settings.remote:
        _ = reg.context
    else:
        reg.list_checkpoints(run="warm")


def child_op(arg: dict[str, Any]) -> Any:
    """Setup (unkilled), then "started", then the operation under test."""
    op, spec = arg["op"], arg["spec"]
    with _registry() as reg:
        for step in spec.get("setup_push", []) if arg.get("setup", True) else []:
            src, project, run, s = step  # the preparation: never killed, never rerun
            reg.push_checkpoint(src, run=run, step=s, project=project)
        if spec.get("setup_validate") and arg.get("setup", True):
            reg.validate(spec["setup_validate"], device="cpu")
        _ready(reg)
        arg["started"]()
        t = time.monotonic()
        waited = 0.0
        while True:
            try:
                result = run_op(reg, op, spec)
                break
            except Exception as exc:
                # A rerun through reg server may find the killed client's request still running
                # there (the server goes on without it): the error says to wait for it.
                if not arg.get("wait_live") or not _live_claim(exc) or waited > WAIT_LIVE_S:
                    raise
                time.sleep(0.25)
                waited = time.monotonic() - t
        out = {"op": result, "seconds": time.monotonic() - t - waited, "waited": waited}
    if arg.get("check") is not None:  # the rerun's check, in the same child (one fork less)
        out["check"] = child_check(dict(arg["check"], started=lambda: None))
    return out


WAIT_LIVE_S = 90.0  # a dead holder's claim expires within 60 s (registry.catalog.claims)


def _live_claim(exc: Exception) -> bool:
    return type(exc).__name__ == "Conflict" and " is being " in str(exc)


def run_op(reg: Any, op: str, spec: dict[str, Any]) -> Any:
    if op == "push":
        out = reg.push_checkpoint(
            spec["src"], run=spec["run"], step=spec["step"], project=spec["project"]
        )
        return {"state": out["state"]}
    if op == "pull":
        out = reg.pull(spec["ref"], spec["dest"])
        return {"ok": True}
    if op == "promote":
        out = reg.promote(spec["ref"], model=spec["model"])
        return {"version": out.get("version"), "existing": out.get("existing", False)}
    if op == "alias":
        reg.set_alias(spec["model"], spec["alias"], spec["version"])
        return {"ok": True}
    if op == "gc":
        out = reg.gc()
        return {
            "deleted": len([d for d in out.get("decisions", []) if d.get("action") == "delete"])
        }
    if op == "rebuild":
        out = reg.rebuild_catalog()
        return {k: v for k, v in out.items() if isinstance(v, int | float | str)}
    if op == "mlflow":
        out = reg.mlflow_sync(budget_s=120)
        if out.get("error") or out.get("pending"):
            raise RuntimeError(f"the drain did not complete: {out}")
        return {
            "applied": out.get("applied"),
            "pending": out.get("pending"),
            "error": out.get("error"),
        }
    raise ValueError(op)


def fsck_available() -> bool:
    from registry import Registry

    return hasattr(Registry, "fsck")


def catalog_store_problems(
    reg: Any, expected: tuple[str, ...] = (), project: str | None = None
) -> list[str]:
    """`Registry.fsck()` where it exists: every problem that GC would not sweep is a violation.
    Until it lands this returns nothing (and the report says fsck was not run)."""
    if not hasattr(reg, "fsck"):
        return []
    # After each kill: the campaign's project, a few objects re-hashed (verify re-hashes the
    # operation's own artifacts); at the end: everything, with fsck's default sample.
    report = reg.fsck(project) if project is None else reg.fsck(project, sample=4)
    return [
        f"fsck: {p.get('kind')} {p.get('target')} {p.get('key')}: {p.get('detail')}"
        for p in report.get("problems", [])
        if not p.get("sweepable") and p.get("kind") not in expected
    ]


def child_check(arg: dict[str, Any]) -> Any:
    """Every invariant after a kill (phase "killed") or after the rerun ("rerun")."""
    spec, phase = arg["spec"], arg["phase"]
    bad: list[str] = []
    arg["started"]()
    clock = {"start": time.monotonic()}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(_registry())
        direct = stack.enter_context(_registry("TORTURE_DIRECT_ENV")) if spec["server"] else client
        ledger_ckpts: list[str] = spec["ledger_ckpts"]
        ledger_releases: list[str] = spec["ledger_releases"]
        mortal: set[str] = set(spec.get("mortal", []))  # GC may take these
        targets_c: set[str] = set(spec.get("target_ckpts", []))
        targets_r: set[str] = set(spec.get("target_releases", []))
        if spec["op"] == "mlflow" and phase == "rerun":  # before the checks add events
            from registry.integrations.mirror.drain import pending_count

            if pending := pending_count(direct.catalog):
                bad.append(f"mlflow: {pending} events still pending after the rerun")
        # Visibility: only committed, known artifacts are listed; and every one of them is.
        listed = {_ckpt_ref(c) for c in client.list_checkpoints()}
        for ref in sorted(listed - set(ledger_ckpts) - targets_c - mortal):
            bad.append(f"{ref} is listed but no operation committed it")
        for ref in sorted(set(ledger_ckpts) - listed - mortal):
            bad.append(f"{ref} was committed before and is no longer listed")
        releases = {_release_ref(r) for r in client.releases()}
        if spec.get("uncommitted"):
            pushed = targets_c if spec["op"] == "push" else set()
            for ref in sorted(pushed & listed - set(ledger_ckpts)):
                bad.append(f"{ref} is listed though its push was killed before the commit")
            new_of = spec.get("new_releases_of")
            for ref in sorted(
                r for r in releases - set(ledger_releases) if new_of and r.startswith(new_of + ":v")
            ):
                bad.append(f"{ref} is listed though its promotion was killed before the commit")
        elif spec.get("new_releases_of"):
            targets_r |= {r for r in releases if r.startswith(spec["new_releases_of"] + ":v")}
        for ref in sorted(releases - set(ledger_releases) - targets_r):
            bad.append(f"{ref} is listed but no operation made it")
        for ref in sorted(set(ledger_releases) - releases):
            bad.append(f"{ref} was released before and is no longer listed")
        clock["listed"] = time.monotonic()
        # Bytes: the operation's own artifacts (where visible), a sample of the ledger.
        to_verify = sorted((targets_c & listed) | (targets_r & releases))
        to_verify += [r for r in spec.get("sample", []) if r in listed or r in releases]
        for ref in to_verify:
            try:
                report = direct.verify(ref)
            except Exception as exc:
                bad.append(f"verify {ref} raised {type(exc).__name__}: {exc}")
                continue
            if not report.get("ok"):
                bad.append(f"verify {ref}: {json.dumps(report.to_json(), default=str)[:600]}")
            try:
                shown = client.show(ref)
            except Exception as exc:
                bad.append(f"show {ref} raised {type(exc).__name__}: {exc}")
                continue
            if shown.get("state", "committed") not in ("committed", "validated") and "@" in ref:
                bad.append(f"show {ref}: state {shown.get('state')}")
        clock["verified"] = time.monotonic()
        # Per operation.
        bad += _op_checks(client, direct, spec, phase, listed, releases)
        if spec.get("fsck"):
            # A killed rebuild has not yet added what it is there to add.
            expected = ("uncataloged",) if spec["op"] == "rebuild" and phase == "killed" else ()
            try:
                bad += catalog_store_problems(direct, expected, spec.get("fsck_project"))
            except Exception as exc:
                bad.append(f"fsck raised {type(exc).__name__}: {exc}")
    clock["fsck"] = time.monotonic()
    t = clock.pop("start")
    timing = {k: round(v - t, 3) for k, v in clock.items()}
    notes = []
    if spec["op"] == "pull" and phase == "rerun":  # not an invariant: noted, counted
        dest = Path(spec["dest"].removesuffix("-again"))
        notes += [p.name for p in dest.parent.glob(f".{dest.name}.reg-pull-*")]
    return {"violations": bad, "timing": timing, "notes": notes}


def _op_checks(
    client: Any, direct: Any, spec: dict[str, Any], phase: str, listed: set[str], releases: set[str]
) -> list[str]:
    op, bad = spec["op"], []
    if phase == "rerun":
        for ref in spec.get("target_ckpts", []):
            if ref not in listed:
                bad.append(f"{ref} is not listed after the rerun completed")
        for ref in spec.get("target_releases", []):
            if ref not in releases:
                bad.append(f"{ref} is not listed after the rerun completed")
    if op == "pull":
        dest = Path(spec["dest"])
        if dest.exists() or phase == "rerun":
            bad += _same_files(Path(spec["src"]), dest)
    if op == "alias":
        try:
            shown = client.show(f"{spec['model']}@{spec['alias']}")
            version = f"v{shown.get('version')}"
            if phase == "rerun" and version != f"v{spec['version']}":
                bad.append(f"alias {spec['alias']} is {version} after the rerun")
            if version not in {f"v{v}" for v in spec["versions"]}:
                bad.append(f"alias {spec['alias']} points to {version}, never set")
            ref = f"{spec['model']}:{version}"
            if not direct.verify(ref).get("ok"):
                bad.append(f"{ref} (alias {spec['alias']}) does not verify")
        except Exception as exc:
            if phase == "rerun" or spec.get("alias_set_before"):
                bad.append(f"show {spec['model']}@{spec['alias']}: {type(exc).__name__}: {exc}")
    if op == "gc":
        newest = spec["gc_newest"]
        if newest not in listed:
            bad.append(f"gc: the newest step {newest} of the run is gone")
        gc_listed = sorted(r for r in listed if r.startswith("gcp/"))
        if phase == "rerun" and gc_listed != [newest]:
            bad.append(f"gc: after the rerun {gc_listed} are listed, expected [{newest}]")
    if op == "mlflow" and phase == "rerun":
        from mlflow import MlflowClient

        mlc = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
        exp = mlc.get_experiment_by_name(spec["mlflow_experiment"])
        names = {m.name for m in mlc.search_logged_models([exp.experiment_id])} if exp else set()
        want = spec["mlflow_model"]
        if want not in names:
            bad.append(f"mlflow: logged model {want} missing after the rerun")
    return bad


def _same_files(src: Path, dest: Path) -> list[str]:
    if not dest.is_dir():
        return [f"pull: {dest} is not a folder"]
    bad = []
    for f in sorted(src.iterdir()):
        got = dest / f.name
        if not got.is_file() or got.read_bytes() != f.read_bytes():
            bad.append(f"pull: {dest.name}/{f.name} is missing or differs from the source")
    return bad


def _ckpt_ref(c: dict[str, Any]) -> str:
    return f"{c['project']}/{c['run']}@step{c['step']}"


def _release_ref(r: dict[str, Any]) -> str:
    return f"{r['model']}:v{r['version']}"


def child_make_source(arg: dict[str, Any]) -> Any:
    """A small resumable DCP checkpoint written by one process (`dcp.save`, no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    arg["started"]()
    dest, dim, seed = Path(arg["dest"]), int(arg["dim"]), int(arg["seed"])
    gen = torch.Generator().manual_seed(seed)
    names = ["embed.weight", "block.up.weight", "block.down.weight", "head.weight"]
    model = {n: torch.randn(dim, dim, generator=gen) for n in names}
    model["head.bias"] = torch.zeros(dim)
    optim = {
        "state": {
            n: {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t), "step": 1.0}
            for n, t in model.items()
        },
        "param_groups": [{"lr": 1e-3, "params": list(model)}],
    }
    state = {
        "model": model,
        "optimizer": optim,
        "lr_scheduler": {"last_epoch": 1},
        "train_state": {"step": 1},
        "rng": {"rank0": torch.get_rng_state()},
        "dataloader": {"rank0": {"position": 8}},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dest)))
    return sum(f.stat().st_size for f in dest.iterdir())


def child_setup(arg: dict[str, Any]) -> Any:
    """Unkilled preparation in a backend: pushes, validations, promotions, aliases, a drain."""
    arg["started"]()
    out: dict[str, Any] = {"releases": []}
    with _registry() as reg:
        for src, project, run, step in arg.get("push", []):
            reg.push_checkpoint(src, run=run, step=step, project=project)
        for ref, model in arg.get("promote", []):
            reg.validate(ref, device="cpu")
            res = reg.promote(ref, model=model)
            out["releases"].append(f"{model}:v{res['version']}")
        for model, alias, version in arg.get("alias", []):
            reg.set_alias(model, alias, version)
        if arg.get("drain"):
            out["drain"] = reg.mlflow_sync(budget_s=300).to_json()
    return out


# -- a campaign: one backend, one operation, n kills --------------------------------------------
@dataclass
class Stats:
    kills: int = 0
    landed: int = 0
    faults: int = 0
    reruns: int = 0
    waited: int = 0  # reruns that waited for the server to finish the killed client's request
    leftovers: int = 0  # a killed pull's temporary folder still beside its destination
    violations: list[dict[str, Any]] = field(default_factory=list)
    op_seconds: list[float] = field(default_factory=list)  # plain, unkilled runs (the reruns)
    cycle_seconds: list[float] = field(default_factory=list)  # kill + check + rerun + check
    wall: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds spent, summed

    def phase(self, name: str, since: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - since

    def to_json(self) -> dict[str, Any]:
        return {
            "kills": self.kills,
            "landed": self.landed,
            "fault_points": self.faults,
            "reruns": self.reruns,
            "reruns_waited": self.waited,
            "leftovers": self.leftovers,
            "violations": self.violations,
            "op_median_s": statistics.median(self.op_seconds) if self.op_seconds else None,
            "cycle_median_s": statistics.median(self.cycle_seconds) if self.cycle_seconds else None,
            "wall_s": self.wall,
            "phases_s": {k: round(v, 2) for k, v in self.phases.items()},
        }


@dataclass
class Backend:
    name: str
    env: dict[str, str]  # a client's (for server: REG_URL + REG_TOKEN)
    direct_env: dict[str, str] | None  # the registry's own (server only)
    ledger_ckpts: list[str] = field(default_factory=list)
    ledger_releases: list[str] = field(default_factory=list)
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def fresh_catalog(self, name: str) -> str:
        raise NotImplementedError

    def side_store(self, name: str) -> str:
        raise NotImplementedError

    def child_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(self.env, **(extra or {}))
        if self.direct_env is not None:
            env["TORTURE_DIRECT_ENV"] = json.dumps(self.direct_env)
        return env


class Campaign:
    def __init__(
        self,
        backend: Backend,
        op: str,
        *,
        n: int,
        seed: int,
        deadline: float,
        src: Path,
        work: Path,
        use_fsck: bool,
        sample: int = 3,
        log: Callable[[str], None] = print,
    ) -> None:
        self.b, self.op, self.n, self.seed = backend, op, n, seed
        self.rng = random.Random(f"{seed}:{backend.name}:{op}")
        self.deadline, self.src, self.work = deadline, src, work
        self.use_fsck, self.sample, self.log = use_fsck, sample, log
        self.stats = Stats()
        self.expected = 0.3  # seconds; follows the measured plain runs
        self.run = f"{op}-{uuid.uuid4().hex[:6]}"
        # A project per campaign: its checks list and fsck what it touched, not everything.
        self.project = "gcp" if op == "gc" else f"p-{op}"
        # The ledger: what is committed and must stay so. The MLflow drain runs on a catalog
        # and store of its own: its settle step reconciles every release, and this campaign
        # should not pay for the releases the others made.
        self.extra_env: dict[str, str] = {}
        self.lc, self.lr = backend.ledger_ckpts, backend.ledger_releases
        if op == "mlflow":
            self.extra_env = {
                "REG_CATALOG_URL": backend.fresh_catalog(f"mlf{self.run[-6:]}"),
                "REG_STORE_URL": backend.side_store(f"mlf-{self.run}"),
                "MLFLOW_TRACKING_URI": f"sqlite:///{work / ('mlflow-' + self.run + '.db')}",
            }
            self.lc, self.lr = [], []

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return self.b.child_env(self.extra_env | (extra or {}))

    # the moment of the kill: a crash point, or a delay around the operation's duration
    def moment(self) -> tuple[float | None, str | None]:
        faults = FAULTS.get(self.op, ())
        if self.b.name != "server" and faults and self.rng.random() < FAULT_SHARE:
            return None, self.rng.choice(faults)
        return self.rng.uniform(0.0, 1.3 * self.expected), None

    def spec(self, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the operation's spec, extra environment) of iteration i."""
        op, src = self.op, str(self.src)
        s: dict[str, Any] = {"op": op, "src": src}
        extra: dict[str, str] = {}
        if op == "push":
            ref = f"{self.project}/{self.run}@step{i + 1}"
            s.update(run=self.run, step=i + 1, project=self.project, target_ckpts=[ref])
        elif op == "pull":
            s.update(ref=self.pull_ref, dest=str(self.work / f"pull-{self.run}-{i}"))
        elif op == "promote":
            ref = f"{self.project}/{self.run}@step{i + 1}"
            s.update(setup_push=[[src, self.project, self.run, i + 1]], ref=ref, model=self.model)
            s["new_releases_of"] = self.model  # the next version may appear if it completes
            if self.rng.random() < 0.5:  # else promote validates on its own
                s["setup_validate"] = ref
            s["target_ckpts"] = s["setup_ckpts"] = [ref]
        elif op == "alias":
            version = self.versions[i % len(self.versions)]
            s.update(model=self.model, alias="prod", version=version, versions=self.versions)
            s["alias_set_before"] = i > 0
        elif op == "gc":
            a, b = 2 * i + 1, 2 * i + 2
            s["setup_push"] = [[src, "gcp", self.run, a], [src, "gcp", self.run, b]]
            s["gc_newest"] = f"gcp/{self.run}@step{b}"
            s["mortal"] = [f"gcp/{self.run}@step{k}" for k in range(1, b)]
            s["target_ckpts"] = s["setup_ckpts"] = [s["gc_newest"]]
        elif op == "rebuild":
            extra["REG_CATALOG_URL"] = self.fresh_catalog(i)
            extra["REG_STORE_URL"] = self.b.side_store("rb")
            s["rb"] = True
            s["target_ckpts"] = self.rb_ckpts
            s["target_releases"] = self.rb_releases
        elif op == "mlflow":
            s["setup_push"] = [[src, self.project, self.run, i + 1]]
            s["target_ckpts"] = s["setup_ckpts"] = [f"{self.project}/{self.run}@step{i + 1}"]
            s["mlflow_experiment"] = self.project
            s["mlflow_model"] = f"{self.run}-step{i + 1}"
        return s, extra

    def prepare(self) -> None:
        """What the operation needs before its first kill (unkilled)."""
        env, src = self.env(), str(self.src)
        if self.op == "pull":
            self.pull_ref = f"{self.project}/{self.run}@step1"
            self._setup(env, push=[[src, self.project, self.run, 1]])
            self.lc.append(self.pull_ref)
        elif self.op in ("promote", "alias"):
            self.model = f"m-{self.run}"
        if self.op == "alias":
            base = f"{self.run}-base"
            push = [[src, self.project, base, 1], [src, self.project, base, 2]]
            refs = [f"{self.project}/{base}@step1", f"{self.project}/{base}@step2"]
            out = self._setup(env, push=push, promote=[[r, self.model] for r in refs])
            self.lc += refs
            self.lr += out["releases"]
            self.versions = [int(r.rsplit(":v", 1)[1]) for r in out["releases"]]
        if self.op == "rebuild":
            self.rb_ckpts = self.b.rb_ckpts  # type: ignore[attr-defined]
            self.rb_releases = self.b.rb_releases  # type: ignore[attr-defined]
        if self.op == "mlflow":
            self._setup(env, drain=True)  # MLflow's first use (its migrations) is not the test

    def _setup(self, env: dict[str, str], **arg: Any) -> Any:
        out = fork_call(env, child_setup, arg, timeout=600)
        if out.status != 0:
            raise RuntimeError(f"{self.b.name}:{self.op} setup failed: {out.error}")
        return out.result

    def fresh_catalog(self, i: int) -> str:
        return self.b.fresh_catalog(f"rb{i}")  # type: ignore[attr-defined,no-any-return]

    def check_spec(self, s: dict[str, Any]) -> dict[str, Any]:
        c = dict(s, server=self.b.direct_env is not None, fsck=self.use_fsck)
        c["fsck_project"] = None if s.get("rb") else self.project
        if s.get("rb"):  # a catalog of its own: only the rebuilt artifacts are there
            c.update(ledger_ckpts=[], ledger_releases=[])
            return c
        ledger = self.lc + self.lr
        c.update(ledger_ckpts=self.lc, ledger_releases=self.lr)
        c["sample"] = self.rng.sample(ledger, min(self.sample, len(ledger)))
        return c

    def check(self, s: dict[str, Any], env: dict[str, str], phase: str) -> list[str]:
        out = fork_call(env, child_check, {"spec": self.check_spec(s), "phase": phase})
        if out.status != 0:
            return [f"the check itself failed: {out.error[:1500]}"]
        if os.environ.get("TORTURE_VERBOSE"):
            self.log(f"  check {phase}: {out.elapsed:.3f}s {out.result['timing']}")
        return list(out.result["violations"])

    def iteration(self, i: int) -> None:
        t_cycle = time.monotonic()
        s, extra = self.spec(i)
        env = self.env(extra)
        if self.op == "mlflow":
            env["REG_MLFLOW"] = "off"  # no detached drain: the killed one is the test
        delay, fault = self.moment()
        moment = f"fault point {fault}" if fault else f"{delay:.3f}s after start"
        t_phase = time.monotonic()
        out = fork_call(env, child_op, {"op": self.op, "spec": s}, kill_after=delay, fault=fault)
        self.stats.phase("kill", t_phase)
        st = self.stats
        if os.environ.get("TORTURE_VERBOSE"):
            self.log(
                f"  {self.b.name}:{self.op} #{i} {moment}: status {out.status} landed "
                f"{out.landed} elapsed {out.elapsed:.3f} {out.result} {out.error[:300]}"
            )
        where = f"seed {self.seed} {self.b.name}:{self.op} iteration {i} ({moment})"
        if out.status not in (0, -signal.SIGKILL):
            st.violations.append({"where": where, "what": f"the operation failed: {out.error}"})
            return
        st.kills += 1
        st.landed += out.landed
        st.faults += bool(fault) and out.landed
        if out.status == 0 and out.result:
            st.op_seconds.append(out.result["seconds"])
        t_phase = time.monotonic()
        killed = dict(s)
        if fault and out.landed and fault in BEFORE_COMMIT:  # known to die before its commit
            killed["uncommitted"] = True
        for what in self.check(killed, env, "killed"):
            st.violations.append({"where": where, "phase": "after the kill", "what": what})
        st.phase("check", t_phase)
        # The rerun: the same command, to completion.
        if self.op == "pull" and Path(s["dest"]).exists():  # it completed: pull once more
            s["dest"] += "-again"
        if out.started:  # what the preparation committed stays committed
            self.lc += [r for r in s.get("setup_ckpts", []) if r not in self.lc]
        rerun = {"op": self.op, "spec": s, "setup": False, "wait_live": self.b.name == "server"}
        rerun["check"] = {"spec": self.check_spec(s), "phase": "rerun"}
        t_phase = time.monotonic()
        again = fork_call(env, child_op, rerun)
        st.phase("rerun+check", t_phase)
        if again.status != 0:
            what = f"the rerun failed ({again.status}): {again.error[:1500]}"
            st.violations.append({"where": where, "phase": "rerun", "what": what})
            return
        st.reruns += 1
        st.waited += again.result["waited"] > 0
        st.op_seconds.append(again.result["seconds"])
        self.expected = statistics.median(st.op_seconds[-20:])
        self.record(s, again.result)
        st.leftovers += len(again.result["check"].get("notes", []))
        for what in again.result["check"]["violations"]:
            st.violations.append({"where": where, "phase": "after the rerun", "what": what})
        st.cycle_seconds.append(time.monotonic() - t_cycle)

    def record(self, s: dict[str, Any], result: dict[str, Any]) -> None:
        """What the completed rerun committed joins the ledger."""
        op = self.op
        if op == "push":
            self.lc += s["target_ckpts"]
        if op == "promote":
            ref = f"{self.model}:v{result['op']['version']}"
            if ref not in self.lr:
                self.lr.append(ref)
        if op == "gc":
            for ref in s["mortal"]:
                if ref in self.lc:
                    self.lc.remove(ref)

    def finish(self) -> None:
        if self.extra_env:  # a catalog of its own: its own final check
            self.stats.violations += _final_check(
                f"{self.b.name}:{self.op}",
                self.env(),
                self.lc,
                self.lr,
                self.b.direct_env is not None,
                self.use_fsck,
            )


# -- backends ----------------------------------------------------------------------------------
def base_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REG_", "AWS_", "MLFLOW_"))}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(
        PYTHONPATH=path,
        OMP_NUM_THREADS="1",
        REG_USER="torture",
        REG_MLFLOW="off",  # no detached drains behind the harness's back
        REG_POLICY=str(work / "policy.toml"),
        TORTURE_TMP=str(work / "tmp"),
    )
    return env


class LocalBackend(Backend):
    def __init__(self, work: Path) -> None:
        home = work / "local"
        env = base_env(work) | {
            "REG_HOME": str(home / "home"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        }
        super().__init__("local", env, None)
        self.home = home

    def side_store(self, name: str) -> str:
        return (self.home / f"{name}-store").as_uri()

    def fresh_catalog(self, name: str) -> str:
        return f"sqlite:///{self.home / (name + '.db')}"


class S3PgBackend(Backend):
    def __init__(self, work: Path, s3: dict[str, str]) -> None:
        self.schemas: list[str] = []
        self.bucket = f"torture-{uuid.uuid4().hex[:10]}"
        env = (
            base_env(work)
            | s3
            | {
                "REG_HOME": str(work / "s3pg" / "home"),
                "MLFLOW_TRACKING_URI": f"sqlite:///{work / 's3pg' / 'mlflow.db'}",
                "REG_STORE_URL": f"s3://{self.bucket}/reg",
            }
        )
        super().__init__("s3pg", env, None)
        self.env["REG_CATALOG_URL"] = self.fresh_catalog("main")
        self.cleanup.append(self.drop_schemas)

    def fresh_catalog(self, name: str) -> str:
        import psycopg

        schema = f"tt_{uuid.uuid4().hex[:10]}_{name}"
        with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        self.schemas.append(schema)
        return f"{PG_URL}?options=-csearch_path%3D{schema}"

    def side_store(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def drop_schemas(self) -> None:
        import psycopg

        with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
            for schema in self.schemas:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


class ServerBackend(Backend):
    def __init__(self, work: Path) -> None:
        from tests.serverproc import RegServer, server_env

        home = work / "server"
        catalog = f"sqlite:///{home / 'server-home' / 'catalog.db'}"
        self.server = RegServer(server_env(home / "server-home", catalog), home / "server-home")
        self.server.env["REG_POLICY"] = str(work / "policy.toml")
        self.server.init().start()
        env = base_env(work) | {"REG_HOME": str(home / "client")} | self.server.client_env("admin")
        # The registry's own side, as its operator (admin) on the server's host has it.
        direct = {k: v for k, v in self.server.env.items() if k != "REG_POLICY"}
        direct["REG_USER"] = "admin"
        super().__init__("server", env, direct)
        self.cleanup.append(lambda: self.server.stop())


def create_bucket(arg: dict[str, Any]) -> Any:
    import boto3

    arg["started"]()
    # A session of its own: boto3's default one keeps the credentials it first resolved.
    s3 = boto3.session.Session().client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    s3.create_bucket(Bucket=arg["bucket"])
    return True


def preload(with_mlflow: bool) -> None:
    """Everything a child would import, imported once here (the point of the zygote)."""
    import boto3  # noqa: F401
    import httpx  # noqa: F401
    import psycopg  # noqa: F401
    import safetensors.torch  # noqa: F401
    import sqlalchemy.orm
    import torch
    import torch.distributed.checkpoint  # noqa: F401

    import registry.api.remote.registry
    import registry.catalog.engine
    import registry.catalog.models
    import registry.lifecycle.checkpoints.listing
    import registry.lifecycle.checkpoints.push
    import registry.lifecycle.checkpoints.read
    import registry.lifecycle.promotion.run
    import registry.lifecycle.releases
    import registry.lifecycle.validation
    import registry.operations.gc
    import registry.operations.rebuild
    import registry.storage.local
    import registry.storage.s3
    import tests.serverproc  # noqa: F401

    if with_mlflow:
        import mlflow

        # The tracking and model-registry stores a drain opens: importing them (alembic, their
        # ORM models) was 1.5 s of each mlflow child's 2 s.
        import mlflow.store.model_registry.sqlalchemy_store
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

        import registry.integrations.mirror.drain  # noqa: F401
    sqlalchemy.orm.configure_mappers()
    warm_s3_models()


def warm_s3_models() -> None:
    """botocore's S3 model and endpoint rules, parsed once here: a forked child's client is then
    made in milliseconds (registry/storage/s3_client.py keeps one data loader a process)."""
    from registry.storage.s3_client import new_client

    new_client()


def warm_up(work: Path, src: Path) -> None:
    """Every operation once, here in the zygote, on a throwaway local registry: what the
    registry imports lazily (the Context, policies, validation, consolidation, fsck) is then
    imported once for every child. Nothing of it stays open: the catalog is disposed and the
    transfer threads end before the first fork."""
    import threading

    from registry import Registry
    from registry.core.config import Settings

    home = work / "warm-up"
    env = base_env(work) | {"REG_HOME": str(home)}
    with Registry(Settings.from_env(env)) as reg:
        reg.push_checkpoint(src, run="w", step=1)
        reg.push_checkpoint(src, run="w", step=2)
        reg.list_checkpoints()
        reg.show("w@step1")
        reg.verify("w@step1")
        reg.pull("w@step1", home / "pulled")
        reg.validate("w@step1", device="cpu")
        reg.promote("w@step1", model="w")
        reg.promote("w@step2", model="w")
        reg.releases()
        reg.verify("w:v1")
        reg.set_alias("w", "prod", 2)
        reg.show("w@prod")
        reg.gc()
        reg.rebuild_catalog(dry_run=True)
        if hasattr(reg, "fsck"):
            reg.fsck()
    deadline = time.monotonic() + 10
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(home, ignore_errors=True)


# -- the whole run -----------------------------------------------------------------------------
def parse_counts(text: str, backends: list[str]) -> dict[str, int]:
    """`25` (every backend) or `local=35,s3pg=15,server=15`: kills per operation, by backend."""
    if "=" not in text:
        return dict.fromkeys(backends, int(text))
    counts = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    return {b: counts.get(b, 0) for b in backends}


def run_torture(
    *,
    backends: list[str],
    ops: list[str],
    n: dict[str, int],
    seed: int,
    budget_s: float,
    work: Path,
    src: Path | None,
    dim: int,
    use_fsck: bool | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Every (backend, operation) campaign, round-robin: one kill each per round until each
    has had its count (`n[backend]`) or the time budget is spent, so a run cut short by the
    budget still spreads its kills evenly."""
    import threading

    started = time.monotonic()
    deadline = started + budget_s
    preload("mlflow" in ops)
    if threading.active_count() != 1:  # a fork copies one thread: locks others held stay held
        raise RuntimeError(f"the zygote runs {threading.active_count()} threads after imports")
    fsck = fsck_available() if use_fsck is None else use_fsck
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    (work / "policy.toml").write_text(POLICY)
    if src is None:
        src = work / "src"
        out = fork_call(
            base_env(work), child_make_source, {"dest": str(src), "dim": dim, "seed": seed}
        )
        if out.status != 0:
            raise RuntimeError(f"could not write the source checkpoint: {out.error}")
    src_bytes = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    warm_up(work, src)
    if threading.active_count() != 1:
        raise RuntimeError(f"the zygote runs {threading.active_count()} threads after warm-up")
    report: dict[str, Any] = {
        "seed": seed,
        "n": n,
        "src_bytes": src_bytes,
        "fsck": fsck,
        "campaigns": {},
        "skipped": {},
    }
    s3_server: SeaweedServer | None = None
    live: list[Backend] = []
    campaigns: list[Campaign] = []
    try:
        for name in backends:
            if n.get(name, 0) <= 0:
                continue
            if name == "s3pg" and not pg_available():
                report["skipped"][name] = "PostgreSQL is not reachable on 127.0.0.1:5432"
                continue
            backend: Backend
            if name == "local":
                backend = LocalBackend(work)
            elif name == "s3pg":
                s3_server = SeaweedServer(work / "seaweed").start()
                backend = S3PgBackend(work, s3_server.credentials())
                out = fork_call(backend.child_env(), create_bucket, {"bucket": backend.bucket})  # type: ignore[attr-defined]
                if out.status != 0:
                    raise RuntimeError(out.error)
            else:
                backend = ServerBackend(work)
            live.append(backend)
            Path(backend.env["REG_HOME"]).mkdir(parents=True, exist_ok=True)
            if "rebuild" in ops and name != "server":
                _rebuild_store(backend, src)
            for op in ops:
                if name == "server" and op not in SERVER_OPS:
                    continue
                campaign = Campaign(
                    backend,
                    op,
                    n=n[name],
                    seed=seed,
                    deadline=deadline,
                    src=src,
                    work=work / name,
                    use_fsck=fsck,
                    log=log,
                )
                campaign.prepare()
                campaigns.append(campaign)
        for i in range(max((c.n for c in campaigns), default=0)):
            k = i % max(1, len(campaigns))  # each round starts elsewhere: a cut-off is even
            for campaign in campaigns[k:] + campaigns[:k]:
                if i < campaign.n and time.monotonic() < deadline:
                    t = time.monotonic()
                    campaign.iteration(i)
                    campaign.stats.wall += time.monotonic() - t
        for campaign in campaigns:
            campaign.finish()
            name = f"{campaign.b.name}:{campaign.op}"
            report["campaigns"][name] = campaign.stats.to_json()
            log(_line(name, campaign.stats))
        for backend in live:
            final = _final_check(
                backend.name,
                backend.child_env(),
                backend.ledger_ckpts,
                backend.ledger_releases,
                backend.direct_env is not None,
                fsck,
            )
            report["campaigns"][f"{backend.name}:final"] = {"violations": final}
            if final:
                log(f"{backend.name}: final check: {len(final)} violations")
    finally:
        for backend in live:
            for fn in backend.cleanup:
                with contextlib.suppress(Exception):
                    fn()
        if s3_server is not None:
            s3_server.stop()
    report["wall_s"] = time.monotonic() - started
    report["violations"] = sum(len(c["violations"]) for c in report["campaigns"].values())
    return report


def _rebuild_store(backend: Backend, src: Path) -> None:
    """A store of its own for the rebuild campaign: two checkpoints and a release."""
    catalog = backend.fresh_catalog("rbmain")  # type: ignore[attr-defined]
    env = backend.child_env({"REG_STORE_URL": backend.side_store("rb"), "REG_CATALOG_URL": catalog})
    refs = ["default/rb@step1", "default/rb@step2"]
    arg = {"push": [[str(src), "default", "rb", 1], [str(src), "default", "rb", 2]]}
    arg["promote"] = [[refs[1], "rbm"]]
    out = fork_call(env, child_setup, arg, timeout=600)
    if out.status != 0:
        raise RuntimeError(f"the rebuild store could not be made: {out.error}")
    backend.rb_ckpts = refs  # type: ignore[attr-defined]
    backend.rb_releases = out.result["releases"]  # type: ignore[attr-defined]


def _final_check(
    where: str, env: dict[str, str], lc: list[str], lr: list[str], server: bool, fsck: bool
) -> list[dict[str, Any]]:
    """Everything the ledger holds is listed and verifies at the end (not a sample)."""
    spec = {
        "op": "final",
        "server": server,
        "fsck": fsck,
        "ledger_ckpts": lc,
        "ledger_releases": lr,
        "sample": lc + lr,
        "mortal": [],
    }
    out = fork_call(env, child_check, {"spec": spec, "phase": "final"}, timeout=900)
    if out.status != 0:
        return [{"where": f"{where} final", "what": out.error[:1500]}]
    return [{"where": f"{where} final", "what": v} for v in out.result["violations"]]


def _line(name: str, s: Stats) -> str:
    j = s.to_json()
    cycle = f"{j['cycle_median_s']:.2f}s" if j["cycle_median_s"] is not None else "-"
    op = f"{j['op_median_s']:.3f}s" if j["op_median_s"] is not None else "-"
    return (
        f"{name:<16} kills {s.kills:4d}  landed {s.landed:4d}  (fault points {s.faults:3d})  "
        f"reruns {s.reruns:4d}  violations {len(s.violations):3d}  op {op}  cycle {cycle}  "
        f"wall {s.wall:6.1f}s  {j['phases_s']}"
    )


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"torture: seed {report['seed']}, kills per operation up to {report['n']}, "
        f"source {report['src_bytes'] / 1e6:.2f} MB, fsck {'on' if report['fsck'] else 'off'}, "
        f"{report['wall_s']:.0f}s"
    ]
    for name, c in report["campaigns"].items():
        if "kills" not in c:
            continue
        cycle = f"{c['cycle_median_s']:.2f}s" if c["cycle_median_s"] is not None else "-"
        op = f"{c['op_median_s']:.3f}s" if c["op_median_s"] is not None else "-"
        lines.append(
            f"  {name:<16} kills {c['kills']:4d}  landed {c['landed']:4d}  "
            f"(fault points {c['fault_points']:3d})  reruns {c['reruns']:4d}  "
            f"violations {len(c['violations']):3d}  op {op}  cycle {cycle}"
        )
    left = {n: c["leftovers"] for n, c in report["campaigns"].items() if c.get("leftovers")}
    if left:
        lines.append(f"  noted (not an invariant): a killed pull's temporary folder left: {left}")
    for name, why in report["skipped"].items():
        lines.append(f"  {name}: skipped ({why})")
    for name, c in report["campaigns"].items():
        for v in c["violations"]:
            lines.append(f"  VIOLATION {name}: {json.dumps(v)[:2000]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument(
        "--n", default="50", help="kills per operation and backend: 50, or local=35,s3pg=15,..."
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--src", type=Path, default=None, help="a DCP checkpoint to push")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--fsck", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--out", type=Path, default=None, help="the report as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"reg-torture-{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"torture: seed {seed}, work {work}", flush=True)
    report = run_torture(
        backends=args.backends.split(","),
        ops=args.ops.split(","),
        n=parse_counts(args.n, args.backends.split(",")),
        seed=seed,
        budget_s=args.budget_s,
        work=work,
        src=args.src,
        dim=args.dim,
        use_fsck={"auto": None, "on": True, "off": False}[args.fsck],
        log=lambda line: print(line, flush=True),
    )
    print(format_report(report), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    if not report["violations"] and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
