"""`RemoteRegistry`: the `Registry` API through `reg server` (`REG_URL`).

Same methods, same typed results, same errors as the embedded Registry; identity comes only
from the token. The client never opens the catalog or the store: pushes stream through the
server, pulls and validations read through it, and promotion, GC and policy changes run in it.

A contract method that declares its route (`@http`, `registry.api.wire`) is sent as declared: those
methods are derived at the end of this module, not written here. What is written here is the
client's own work: the data path, a validation on this machine's device, a promotion's extras,
a policy file, a heartbeat's figures.
"""

from __future__ import annotations

import base64
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from policies.layouts import check_layout, known_layout
from registry.api.contract import Registry
from registry.api.remote.client import Client
from registry.api.remote.reader import RemoteReader
from registry.api.results import (
    CheckpointPulled,
    CheckpointPushed,
    HeartbeatRecorded,
    PartPushed,
    PolicyApplied,
    ReleaseFetched,
    ReleasePromoted,
    ReleasePulled,
    ValidationReport,
)
from registry.api.wire import Route, routes
from registry.core.config import Settings
from registry.core.layout import checkpoint_prefix
from registry.core.refs import (
    CheckpointRef,
    ReleaseRef,
    as_checkpoint_ref,
    as_release_ref,
    parse_checkpoint_ref,
)
from registry.errors import PolicyError, RegistryError, UsageError
from registry.formats.documents import FileRecord

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.core.progress import Progress
    from registry.lifecycle.context import Context
    from registry.storage.base import BaseStore
    from registry.trust.policy_source import EffectivePolicy


class RemoteRegistry(Registry):
    def __init__(self, settings: Settings | None = None, *, user: str | None = None) -> None:
        self.settings = settings or self.settings  # read by Registry.__new__
        if user is not None:
            raise UsageError(
                "a remote registry takes no user name: the token says who you are",
                "drop user=..., or use the embedded mode",
            )
        assert self.settings.url is not None
        self.client = Client(
            self.settings.url, self.settings.token, allow_http=self.settings.allow_http
        )
        self._whoami: dict[str, Any] | None = None
        self._data: dict[str, Any] | None = None

    # -- parts: none of them live here -------------------------------------------------------
    def _server_only(self, what: str) -> UsageError:
        return UsageError(
            f"remote mode: the {what} belongs to reg server ({self.settings.url})",
            "use the Registry methods; they run in the server",
        )

    @property
    def user(self) -> str:
        if self._whoami is None:
            self._whoami = self.client.call("GET", "/whoami")
        return str(self._whoami["principal"])

    @property
    def catalog(self) -> Catalog:
        raise self._server_only("catalog")

    @property
    def store(self) -> BaseStore:
        raise self._server_only("store")

    @property
    def context(self) -> Context:
        raise self._server_only("context")

    @property
    def policy(self) -> EffectivePolicy:
        from registry.trust.policy_source import EffectivePolicy

        out = self.policy_show()
        return EffectivePolicy(out["document"], out["source"])

    def close(self) -> None:
        self.client.close()

    def whoami(self) -> dict[str, Any]:
        return dict(self.client.call("GET", "/whoami"))

    def call(self, route: Route, arguments: dict[str, Any]) -> Any:
        """One contract method over HTTP, as its `@http` describes it (`registry.api.wire`)."""
        path, sent = route.request(arguments)
        if route.query:
            return route.result(self.client.call(route.verb, path, params=sent))
        return route.result(self.client.call(route.verb, path, body=sent or None))

    def _read_urls(
        self, ref: str, listed: list[dict[str, Any]]
    ) -> Callable[[], dict[str, str]] | None:
        """Presigned GETs of `ref`'s files (S3 behind the server): the listing's first, then a
        fresh listing whenever the reader finds them expired."""
        if not any("url" in f for f in listed):
            return None
        first = [{f["path"]: f["url"] for f in listed}]

        def fresh() -> dict[str, str]:
            if first:
                return first.pop()
            again = self.client.call("GET", "/files", params={"ref": ref})
            kept = [again["manifest"]] if "manifest" in again else []
            return {f["path"]: f["url"] for f in [*again["files"], *kept] if "url" in f}

        return fresh

    def _data_path(self) -> dict[str, Any]:
        """How bytes move: streamed through the server, or presigned straight to S3."""
        if self._data is None:
            self._data = dict(self.client.call("GET", "/data-path"))
        return self._data

    # -- access: decided by the server on every request ----------------------------------------
    def authorize(
        self,
        action: str,
        *,
        project: str | None = None,
        model: str | None = None,
        target: str = "",
    ) -> None:
        raise self._server_only("access check")

    def authorize_read(self, *, project: str | None = None, model: str | None = None) -> None:
        raise self._server_only("access check")

    # -- checkpoints -----------------------------------------------------------------------------
    def push_checkpoint(
        self,
        src: str | Path,
        *,
        run: str,
        step: int | None = None,
        project: str = "default",
        world_size: int | None = None,
        metrics: dict[str, float] | None = None,
        progress: Progress | None = None,
        notes: list[str] | None = None,
        layout: str | None = None,
    ) -> CheckpointPushed:
        from registry.api.remote.presigned_push import PresignedPush
        from registry.api.remote.push_stream import body
        from registry.formats.dcp_scan import scan_directory
        from registry.formats.recorded import recorded_step
        from registry.lifecycle.checkpoints.pulled import KeptManifest
        from registry.lifecycle.checkpoints.push import check_metrics, check_request

        if step is None:  # the server checks it against the files again
            step = recorded_step(Path(src), None, world_size)
        check_request(project, run, step)  # refused here as embedded, before a byte moves
        check_layout(layout)
        metrics = check_metrics(metrics or {})
        kept = KeptManifest.of(Path(src))  # a pulled folder: checked whole before it is sent
        scanned = scan_directory(Path(src), skip=kept.skip if kept else frozenset())
        if kept is not None:
            kept.check_files(scanned.files)
            kept.check_folder()
        order = sorted(scanned.files)
        header: dict[str, Any] = {
            "project": project,
            "run": run,
            "step": step,
            "world_size": world_size,
            "metrics": metrics or {},
            "layout": layout,
        }
        if progress:
            progress.start(f"push {project}/{run}@step{step}", sum(scanned.files.values()))
        try:
            if self._data_path()["push"] == "presigned":  # S3: the bytes go straight there
                workers = self.settings.workers * 2
                out = PresignedPush(self.client, scanned, header, workers, progress).run()
            else:
                header["files"] = [{"path": p, "size": scanned.files[p]} for p in order]
                stream = body(header, scanned, order, progress)
                out = dict(self.client.call("POST", "/checkpoints/push", content=stream))
        finally:
            if progress:
                progress.finish()
        for n in out.pop("notes", []):
            if notes is not None:
                notes.append(n)
        return CheckpointPushed.from_json(out)

    # -- a checkpoint written by several writers under one claim --------------------
    def renew_claim(self, claim: str, seconds: float) -> dict[str, Any]:
        """Keep the claim alive `seconds` more (0: give it up); the claim's ref."""
        from registry.lifecycle.checkpoints.shared import check_token

        body = {"claim": check_token(claim), "seconds": seconds}
        return dict(self.client.call("POST", "/claims/renew", body=body))

    def put_claimed(self, claim: str, path: str, chunks: Iterable[bytes]) -> dict[str, Any]:
        """One file of the claimed step, streamed; the server's size and sha256 of it."""
        from registry.lifecycle.checkpoints.shared import check_token

        where = f"/claims/{check_token(claim)}/files/{quote(path, safe='/')}"
        got = self.client.call("PUT", where, content=chunks)
        if not isinstance(got, dict):
            raise RegistryError(
                f"{self.settings.url} answered a file upload with {type(got).__name__}"
            )
        return got

    def push_checkpoint_part(
        self,
        src: str | Path,
        *,
        claim: str,
        run: str,
        step: int,
        project: str = "default",
        progress: Progress | None = None,
    ) -> PartPushed:
        from registry.api.remote.claims import push_part

        ref = CheckpointRef(project, run, step)
        return PartPushed.from_json(push_part(self, Path(src), claim, ref, progress))

    def commit_claimed(
        self,
        claim: str,
        *,
        world_size: int | None = None,
        metrics: dict[str, float] | None = None,
        layout: str | None = None,
        save_costs: dict[str, Any] | None = None,
    ) -> CheckpointPushed:
        from registry.lifecycle.checkpoints.shared import check_token

        body = {
            "world_size": world_size,
            "metrics": metrics or {},
            "layout": layout,
            "save_costs": save_costs,
        }
        return CheckpointPushed.from_json(
            dict(self.client.call("POST", f"/claims/{check_token(claim)}/commit", body=body))
        )

    def read_urls(
        self, ref: str, listed: list[dict[str, Any]]
    ) -> Callable[[], dict[str, str]] | None:
        return self._read_urls(ref, listed)

    def pull(
        self, ref: str | CheckpointRef, dest: str | Path, *, progress: Progress | None = None
    ) -> CheckpointPulled:
        parsed = as_checkpoint_ref(ref)
        where = self._download(str(parsed), Path(dest), progress)
        out = dict(self.client.call("POST", "/checkpoints/pulled", body={"ref": where[0]}))
        out["dest"] = str(where[1])
        out["kept"] = "MANIFEST.json" if (where[1] / "MANIFEST.json").is_file() else None
        return CheckpointPulled.from_json(out)

    def _download(
        self,
        ref: str,
        dest: Path,
        progress: Progress | None,
        check: Callable[[Path, list[FileRecord]], None] | None = None,
    ) -> tuple[str, Path, Any]:
        from registry.lifecycle.transfer import download

        listing = self.client.call("GET", "/files", params={"ref": ref})
        # A checkpoint's MANIFEST.json is kept beside its files (`reg verify --dir`)
        listed = [*listing["files"], *([listing["manifest"]] if "manifest" in listing else [])]
        files = [_record(f) for f in listed]
        full = listing["ref"]
        prefix = "remote/"  # any key prefix: the reader asks for each file of `full`
        reader = RemoteReader(self.client, full, prefix, files, self._read_urls(full, listed))

        def still_there(folder: Path) -> None:  # collected or yanked meanwhile: not published
            self.client.call("GET", "/files", params={"ref": full})
            if check is not None:
                check(folder, files)

        with reader:
            where = download(
                reader,
                prefix,
                files,
                dest,
                label=full,
                workers=self.settings.workers,
                progress=progress,
                before_publish=still_there,
            )
        return full, where, listing["view"]

    # -- validation, promotion, releases ---------------------------------------------------------
    def validate(
        self,
        ref: str | CheckpointRef,
        *,
        device: str = "auto",
        world_size: int = 1,
        model_factory: str | None = None,
        progress: Progress | None = None,
        layout: str | None = None,
        strip_prefix: str | None = None,
        memory_budget: str | None = None,
        with_optimizer: bool = False,
    ) -> ValidationReport:
        """Validate on this machine's device, reading through the server, and report it: only
        a validator may (refused before any work otherwise)."""
        from policies.loader import parse_policy
        from registry.lifecycle.validation import Attempt, Request, run_checks

        parsed = as_checkpoint_ref(ref)
        request = Request(
            device, world_size, model_factory, layout, strip_prefix, memory_budget, with_optimizer
        ).checked()
        if request.world_size > 1:
            raise UsageError(
                "--world-size > 1 through reg server: the validation ranks read the store "
                "directly, which only the server can",
                "validate at --world-size 1 here, or run the sharded validation embedded "
                "where the store is reachable",
            )
        begun = self.client.call("POST", "/validations/begin", body={"ref": str(parsed)})
        full = parse_checkpoint_ref(begun["ref"])
        files = [_record(f) for f in begun["files"]]
        prefix = checkpoint_prefix(full.project, full.run, full.step or 0)
        reader = RemoteReader(
            self.client, str(full), prefix, files, self._read_urls(str(full), begun["files"])
        )
        request = replace(request, layout=check_layout(layout) or known_layout(begun.get("layout")))
        with reader:
            outcome = run_checks(
                reader,
                self.settings.workers,
                parse_policy(begun["policy"], "the server's policy"),
                full,
                dict(begun["metrics"]),
                files,
                request,
                progress,
            )
        attempt = Attempt.of(outcome, request)
        body = {"ref": str(full), "attempt": attempt.to_json(), "hold": begun.get("hold")}
        return ValidationReport.from_json(
            {**self.client.call("POST", "/validations", body=body), **outcome.resume}
        )

    def promote(
        self,
        ref: str | CheckpointRef,
        *,
        model: str,
        alias: str | None = None,
        dtype: str | None = None,
        max_shard_size: str = "5GB",
        extras: list[str | Path] | None = None,
        model_factory: str | None = None,
        progress: Progress | None = None,
        layout: str | None = None,
        allow_unclassified: bool = False,
        strip_prefix: str | None = None,
        convert: str | None = None,
        base: str | None = None,
    ) -> ReleasePromoted:
        sent = []
        for given in extras or []:
            p = Path(given)
            if not p.is_file() or p.is_symlink():
                raise UsageError(
                    f"--extra {p}: not a regular file", "give files such as config.json"
                )
            sent.append({"name": p.name, "data": base64.b64encode(p.read_bytes()).decode()})
        body = {
            "ref": str(ref),
            "model": model,
            "alias": alias,
            "dtype": dtype,
            "max_shard_size": max_shard_size,
            "extras": sent,
            "model_factory": model_factory,
            "layout": layout,
            "allow_unclassified": allow_unclassified,
            "strip_prefix": strip_prefix,
            "convert": convert,
            "base": base,
        }
        return ReleasePromoted.from_json(dict(self.client.call("POST", "/promote", body=body)))

    def pull_release(
        self,
        ref: str | ReleaseRef,
        dest: str | Path,
        *,
        public_key: str | None = None,
        progress: Progress | None = None,
    ) -> ReleasePulled:
        from registry.trust.release_signing.bundle import check_pulled

        asked = as_release_ref(ref)

        def signed(folder: Path, files: list[FileRecord]) -> None:
            # The files as written and checked: never what the server says of them elsewhere.
            if public_key is not None:
                written = [(f.path, f.sha256) for f in files]
                check_pulled(folder, written, public_key, asked.model, asked.version)

        _, where, view = self._download(str(ref), Path(dest), progress, signed)
        out = dict(view)
        out["dest"] = str(where)
        return ReleasePulled.from_json(out)

    def fetch_release(
        self,
        ref: str | ReleaseRef,
        *,
        public_key: str | None = None,
        cache_dir: str | Path | None = None,
        hf_cache: str | Path | None = None,
        progress: Progress | None = None,
    ) -> ReleaseFetched:
        from registry.api.consumers.fetch import fetch_release

        return fetch_release(
            self,
            ref,
            public_key=public_key,
            cache_dir=cache_dir,
            hf_cache=hf_cache,
            progress=progress,
        )

    # -- administration --------------------------------------------------------------------------
    def heartbeat(self, run: str, *, project: str = "default", **figures: Any) -> HeartbeatRecorded:
        body = {"project": project, "run": run, **figures}
        return HeartbeatRecorded.from_json(
            dict(self.client.call("POST", "/runs/heartbeat", body=body))
        )

    def apply_policy(self, path: str | Path) -> PolicyApplied:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PolicyError(f"cannot read policy {path}: {exc.strerror}") from exc
        body = {"text": text, "name": str(path)}
        return PolicyApplied.from_json(dict(self.client.call("POST", "/policy", body=body)))


def _record(doc: dict[str, Any]) -> FileRecord:
    return FileRecord(
        doc["path"], int(doc["size"]), doc["sha256"], doc.get("rank"), doc.get("version")
    )


def _over_http(route: Route) -> Callable[..., Any]:
    """The remote method of a contract method that declares its route: its arguments bound as
    the contract's signature binds them (defaults included), then sent."""
    contract = getattr(Registry, route.method)
    signature = inspect.signature(contract)

    @functools.wraps(contract)
    def method(self: RemoteRegistry, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return self.call(route, bound.arguments)

    return method


for _route in routes(Registry):
    setattr(RemoteRegistry, _route.method, _over_http(_route))
