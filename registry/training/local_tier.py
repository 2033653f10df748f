"""Tier 0 of a training job's saves: each rank's files go to its node's local
directory through DCP's own file writer, at the speed of a bare `dcp.save` there; what the
registry adds runs after `save()` returns, in the background:

    1. each rank hashes the files it wrote (reading them back from the page cache);
    2. the digests go to rank 0 over the manager's own gloo group (never the training loop's);
    3. rank 0 claims the step; each node's first rank moves the node's `step-<N>.partial` to
       `step-<N>` (a save never writes over a copy the catalog records);
    4. rank 0 commits it at tier 0 (`commit_written(local=...)`): the row is `local`, with
       every file's digest and which node holds it, and the replicator's claim;
    5. every rank learns the outcome (a broadcast on the same group) and hands its files to its
       replicator (`replicator.py`), which copies them to the store (tier 1).

One save is in flight at a time: the next `save()` (or `wait()`) waits for step 4 of this one.
The step is restorable once committed at tier 0. Writing needs no claim (the directory is the
job's own); the claim guards the catalog row and the store prefix, as for any save.

Where a node keeps its copies: LOCAL_DIR/<project>/<run>/step-<N>/, the files as DCP names them
and the checkpoint's MANIFEST.json beside `.metadata` on the coordinator's node.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

from registry.core.layout import MANIFEST
from registry.core.refs import check_name
from registry.errors import IntegrityError, UsageError
from registry.formats.documents import FileRecord
from registry.storage.base import hash_stream
from registry.training import ranks

METADATA = ".metadata"


def node_name(node_id: str | None) -> str:
    """This node's id: the one given, else the host name (checked: it names a directory)."""
    name = node_id if node_id is not None else socket.gethostname().split(".")[0]
    check_name(name, "node_id")
    return name


def layout_problem(node: str, local_dir: Path) -> UsageError | None:
    """Every rank, at the first save (a collective): the ranks of a node share its one
    local_dir, a node_id names one host, and no two nodes of a host share a directory. None,
    or the refusal every rank raises (before a byte is written): a rank saving apart from its
    node would leave the node's commit waiting for files it never sees."""
    every = ranks.gathered((socket.gethostname(), node, str(local_dir.resolve())))
    first: dict[str, tuple[int, str, str]] = {}  # node -> (rank, host, dir) of its first rank
    dirs: dict[tuple[str, str], str] = {}  # (host, dir) -> node
    for rank, (host, name, where) in enumerate(every):
        seen = first.setdefault(name, (rank, host, where))
        if seen[1] != host:
            return UsageError(
                f"node_id {name!r} is given on hosts {seen[1]} and {host}",
                "each node needs an id of its own: leave node_id unset (the host name)",
            )
        if seen[2] != where:
            return UsageError(
                f"ranks {seen[0]} and {rank} of node {name!r} save to different local_dirs "
                f"({seen[2]}, {where})",
                "give every rank of a node the same local_dir (/nvme/ckpt, not /nvme/rank<r>), "
                "or each its own node_id",
            )
        other = dirs.setdefault((host, where), name)
        if other != name:
            return UsageError(
                f"local_dir {where} is used by nodes {other!r} and {name!r} on host {host}",
                "give each node a local_dir of its own",
            )
    return None


def step_dir(local_dir: Path, project: str, run: str, step: int) -> Path:
    return local_dir / project / run / f"step-{step}"


def free_bytes(local_dir: Path) -> int:
    """Bytes free for an unprivileged writer on `local_dir`'s filesystem."""
    return shutil.disk_usage(local_dir).free


def local_steps(local_dir: Path, project: str, run: str) -> dict[int, Path]:
    """The steps this node has a directory for (whatever their state)."""
    found: dict[int, Path] = {}
    base = local_dir / project / run
    if not base.is_dir():
        return found
    for entry in base.iterdir():
        number = entry.name.removeprefix("step-")
        if entry.name.startswith("step-") and number.isdigit() and entry.is_dir():
            found[int(number)] = entry
    return found


class LocalWriter(FileSystemWriter):
    """DCP's file writer into this node's step directory, remembering which files this rank
    wrote and how long it took. `fsync`s every file, as a bare `dcp.save` does."""

    def __init__(self, path: Path, *, thread_count: int = 1) -> None:
        path.mkdir(parents=True, exist_ok=True)
        super().__init__(path, thread_count=thread_count, sync_files=True, overwrite=True)
        self.directory = path
        self.written: list[str] = []
        self.seconds = 0.0

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[Any]]:
        started = time.monotonic()
        done = super().write_data(plan, planner)
        results = done.wait()
        self.written = sorted({r.storage_data.relative_path for r in results})
        self.seconds = time.monotonic() - started
        return done


@dataclass(slots=True)
class RankFiles:
    """What one rank reports to rank 0 after hashing: its node and its files."""

    rank: int
    node: str
    files: list[FileRecord] = field(default_factory=list)
    write_seconds: float = 0.0
    hash_seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def hash_own(writer: LocalWriter, node: str) -> RankFiles:
    """Hash the files this rank wrote (and `.metadata` on the coordinator), read back from the
    page cache right after the save."""
    started = time.monotonic()
    rank = ranks.current_rank()
    names = list(writer.written)
    if rank == 0:
        names.append(METADATA)
    files = []
    for name in names:
        with open(writer.directory / name, "rb") as f:
            size, digest = hash_stream(f)
        files.append(FileRecord(name, size, digest, rank if name != METADATA else None))
    return RankFiles(rank, node, files, writer.seconds, time.monotonic() - started)


def nodes_of(reports: list[RankFiles]) -> dict[str, tuple[list[int], list[str]]]:
    """node -> (its ranks, the files it holds)."""
    nodes: dict[str, tuple[list[int], list[str]]] = {}
    for r in reports:
        node_ranks, node_files = nodes.setdefault(r.node, ([], []))
        node_ranks.append(r.rank)
        node_files.extend(f.path for f in r.files)
    return nodes


def reader_of(directory: Path, records: dict[str, FileRecord]) -> Any:
    """A file of the coordinator's step directory, whole, refused unless it is the recorded
    size (the commit checks its digest)."""

    def read(path: str) -> bytes:
        data = (directory / path).read_bytes()
        if len(data) != records[path].size:
            raise IntegrityError(f"{directory / path} changed while the save was committed")
        return data

    return read


def manifest_writer(directory: Path) -> Any:
    def write(data: bytes) -> None:
        temp = directory / f".{MANIFEST}.tmp"
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, directory / MANIFEST)

    return write


def verify_local(directory: Path, records: list[tuple[str, int, str]]) -> tuple[list[str], bool]:
    """Re-hash this node's copies of `records` (path, size, sha256): the problems found, and
    whether one proves the copy gone for good (a file missing, or other bytes than recorded),
    not just unreadable now."""
    problems, gone = [], False
    for path, size, digest in records:
        where = directory / path
        try:
            with open(where, "rb") as f:
                got_size, got = hash_stream(f)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            gone = True
            continue
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
            continue
        if got_size != size:
            problems.append(f"{path}: {got_size} bytes, {size} recorded")
            gone = True
        elif got != digest:
            problems.append(f"{path}: its sha256 is not the one recorded")
            gone = True
    return problems, gone


def file_ids(directory: Path, paths: list[str]) -> dict[str, tuple[int, int, int, int]]:
    """Each present file's identity (device, inode, size, mtime): the same file when equal."""
    out = {}
    for path in paths:
        try:
            st = os.stat(directory / path)
        except OSError:
            continue
        out[path] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def evict(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def check_local_dir(local_dir: str | os.PathLike[str] | None) -> Path | None:
    if local_dir is None:
        return None
    path = Path(local_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"local_dir {path}: {exc.strerror or exc}",
            "give a node-local directory writable on every node",
        ) from None
    return path
