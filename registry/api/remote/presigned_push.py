"""The client of a presigned push (`registry.lifecycle.checkpoints.presigned`): hash, ask, upload
straight to S3, complete.

1. Hash every file once (and each part of a large one) on a pool of threads: the URLs sign each
   sha256, so the digests come first.
2. `begin`: the server checks the list, claims the step and answers with URLs.
3. Upload every item (a whole file, or one part) in parallel from the descriptors the scan
   checked; a URL that expired is asked for again, transient failures are retried. A multipart
   file is assembled by the server (`assemble`) as soon as its last part is up.
4. `complete`: the server assembles, checks, inventories and commits. On any failure the
   upload is abandoned (`abort`), so a rerun takes over at once.

The bearer token goes to the server only, never to S3.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx

from registry.core.progress import Counter
from registry.errors import IntegrityError, RegistryError
from registry.lifecycle.checkpoints.upload_plan import LEASE_S, part_sizes

if TYPE_CHECKING:
    from registry.api.remote.client import Client
    from registry.core.progress import Progress
    from registry.formats.dcp_scan import ScannedDir

PIECE = 1 << 20
RETRIES = 4
BATCH = 64  # URLs per request: asked for just before they are used (they live ~2 minutes)


def hash_files(scanned: ScannedDir, workers: int) -> list[dict[str, Any]]:
    """Each file's path, size, sha256 and, for a multipart file, each part's sha256: one read."""

    def one(path: str) -> dict[str, Any]:
        size = scanned.files[path]
        whole = hashlib.sha256()
        parts = part_sizes(size)
        digests = []
        with os.fdopen(scanned.open(path), "rb", buffering=0) as f:
            for part in parts or [size]:
                h = hashlib.sha256()
                left = part
                while left:
                    data = f.read(min(8 * PIECE, left))
                    if not data:
                        raise IntegrityError(
                            f"{scanned.root / path} shrank while being hashed",
                            "push a checkpoint that is no longer being written",
                        )
                    h.update(data)
                    whole.update(data)
                    left -= len(data)
                digests.append(h.hexdigest())
        return {
            "path": path,
            "size": size,
            "sha256": whole.hexdigest(),
            "parts": digests if parts else None,
        }

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, sorted(scanned.files, key=lambda p: -scanned.files[p])))


class PresignedPush:
    def __init__(
        self,
        client: Client,
        scanned: ScannedDir,
        header: dict[str, Any],
        workers: int,
        progress: Progress | None,
    ) -> None:
        self.client, self.scanned, self.header = client, scanned, header
        self.workers = max(1, workers)
        self.counter = Counter(progress)
        self.s3 = httpx.Client(timeout=httpx.Timeout(60.0), follow_redirects=False)
        self.ref = ""
        self.upload = ""
        self.lock = threading.Lock()

    def run(self) -> dict[str, Any]:
        self.files = files = hash_files(self.scanned, self.workers)
        body = {**self.header, "files": files}
        begun = self.client.call("POST", "/checkpoints/push/begin", body=body)
        if "unchanged" in begun:
            return dict(begun["unchanged"])
        self.ref, self.upload = begun["ref"], begun["upload"]
        try:
            with self._renewing():
                self._upload_all(begun)
            out = dict(self.client.call("POST", "/checkpoints/push/complete", body=self._id()))
        except BaseException:
            self._abandon()
            raise
        finally:
            self.s3.close()
        return out

    def _id(self) -> dict[str, Any]:
        return {"ref": self.ref, "upload": self.upload}

    def _upload_all(self, begun: dict[str, Any]) -> None:
        """Every item, in parallel; a multipart file is assembled (on another thread) as soon
        as its last part is up, so the store assembles it while the rest uploads."""
        total, start, batch = int(begun["items"]), 0, list(begun["urls"])
        reused = set(begun["reused"])
        self.parts_left = {
            f["path"]: len(f["parts"]) for f in self.files if f["parts"] and f["path"] not in reused
        }
        with (
            ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="reg-s3put") as pool,
            ThreadPoolExecutor(max_workers=2, thread_name_prefix="reg-assemble") as assembler,
        ):
            self.assembling: list[Future[Any]] = []
            self.assembler = assembler
            while start < total:
                if not batch:
                    batch = self._urls(start, BATCH)
                indexed = list(enumerate(batch, start=start))
                for _ in pool.map(lambda item: self._put(*item), indexed):
                    pass
                start += len(batch)
                batch = []
            for done in self.assembling:
                done.result()

    def _uploaded(self, item: dict[str, Any]) -> None:
        if not item["part"]:
            return
        with self.lock:
            self.parts_left[item["path"]] -= 1
            last = self.parts_left[item["path"]] == 0
        if last:
            body = {**self._id(), "path": item["path"]}
            call = self.client.call
            self.assembling.append(
                self.assembler.submit(call, "POST", "/checkpoints/push/assemble", body=body)
            )

    @contextlib.contextmanager
    def _renewing(self) -> Iterator[None]:
        """Keep the claim while the bytes go up: a request for no URLs renews it."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(LEASE_S / 4):
                with contextlib.suppress(RegistryError):
                    self._urls(0, 0)

        thread = threading.Thread(target=beat, name="reg-claim", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _urls(self, start: int, count: int) -> list[dict[str, Any]]:
        got = self.client.call(
            "POST", "/checkpoints/push/urls", body={**self._id(), "start": start, "count": count}
        )
        return list(got["urls"])

    def _put(self, index: int, item: dict[str, Any]) -> None:
        for attempt in range(RETRIES + 1):
            try:
                response = self.s3.put(
                    item["url"],
                    content=self._body(item),
                    headers={**item["headers"], "content-length": str(item["size"])},
                )
            except httpx.HTTPError as exc:
                if attempt == RETRIES:
                    raise RegistryError(
                        f"upload of {item['path']} to the store failed: {type(exc).__name__}",
                        "check the network to the bucket; push again",
                    ) from exc
                self._backoff(attempt)
                continue
            if response.status_code < 300:
                self._uploaded(item)
                return
            if response.status_code == 403 and attempt < RETRIES:  # expired: a fresh URL
                item = self._urls(index, 1)[0]
                continue
            if response.status_code >= 500 and attempt < RETRIES:
                self._backoff(attempt)
                continue
            raise RegistryError(
                f"the store refused {item['path']}"
                f"{' part ' + str(item['part']) if item['part'] else ''}: "
                f"HTTP {response.status_code} {_s3_error(response.text)}",
                "push again; if it keeps failing, the bucket's policy or the file changed",
            )

    def _body(self, item: dict[str, Any]) -> Iterator[bytes]:
        """The item's bytes from the descriptor the scan checked, counted for progress."""
        fd = self.scanned.open(item["path"])
        try:
            left, offset = int(item["size"]), int(item["offset"])
            while left:
                data = os.pread(fd, min(8 * PIECE, left), offset)
                if not data:
                    raise IntegrityError(
                        f"{self.scanned.root / item['path']} shrank while being pushed",
                        "push a checkpoint that is no longer being written",
                    )
                offset += len(data)
                left -= len(data)
                self.counter(len(data))
                yield data
        finally:
            os.close(fd)

    @staticmethod
    def _backoff(attempt: int) -> None:
        time.sleep(min(8.0, 0.2 * 2**attempt) * (0.5 + random.random()))

    def _abandon(self) -> None:
        # If this fails too, the claim runs out by itself and GC sweeps what was uploaded.
        with contextlib.suppress(RegistryError):
            self.client.call("POST", "/checkpoints/push/abort", body=self._id())


def _s3_error(text: str) -> str:
    """The <Code> of an S3 error body, if it has one."""
    start, end = text.find("<Code>"), text.find("</Code>")
    return text[start + 6 : end] if 0 <= start < end else ""
