"""One pass over a stored file: every byte hashed, the byte ranges a caller asked for handed to
it as they pass.

Validation and promotion read a checkpoint's shards through this one reader: a file is read
once, front to back (on a versioned bucket, the version the manifest recorded), each piece goes
through sha256, and the pieces of the requested spans are delivered in order. A file that is
longer or shorter than recorded, or hashes to another digest, raises `IntegrityError` naming it
no later than its last byte; whatever the caller built from its pieces is then not to be trusted
and is thrown away by the caller.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry.errors import IntegrityError, NotFound, RegistryError
from registry.formats import deepspeed_root, file_roots
from registry.formats.safetensors_root import LENGTH_BYTES, header_length

if TYPE_CHECKING:
    from registry.formats.documents import FileRecord
    from registry.storage.base import BaseStore


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes [start, end) of a file, with the caller's handle for them."""

    start: int
    end: int
    key: Any


# deliver(key, at, view): `view` holds the span's bytes from `at` (relative to span.start); the
# view is only valid during the call.
Deliver = Callable[[Any, int, memoryview], None]


def read_verified(
    store: BaseStore,
    prefix: str,
    record: FileRecord,
    spans: Sequence[Span],
    deliver: Deliver,
    *,
    label: str,
    stop: threading.Event | None = None,
    advance: Callable[[int], None] | None = None,
) -> int:
    """Stream `prefix + record.path` once, hashing it, delivering `spans` (sorted by start);
    the bytes read. Raises IntegrityError naming the file when it is missing, of another size
    or digest, or a span lies outside it; stops with IntegrityError when `stop` is set."""
    ordered = sorted(spans, key=lambda s: (s.start, s.end))
    for s in ordered:
        if s.start < 0 or s.end < s.start or s.end > record.size:
            raise IntegrityError(
                f"{label}: .metadata puts bytes {s.start}...{s.end} in {record.path}, which has "
                f"{record.size}",
                "the checkpoint metadata is inconsistent",
            )
    digest, pos, first = hashlib.sha256(), 0, 0
    try:
        pieces = store.stream(prefix + record.path, version=record.version)
        for piece in pieces:
            if stop is not None and stop.is_set():
                raise IntegrityError(f"{label}: stopped", "another file failed first")
            view = memoryview(piece)
            end = pos + len(view)
            if end > record.size:
                raise changed(label, record, f"it is longer than the {record.size} bytes recorded")
            digest.update(view)  # releases the GIL for large pieces
            while first < len(ordered) and ordered[first].end <= pos:
                first += 1
            j = first
            while j < len(ordered) and ordered[j].start < end:
                span = ordered[j]
                lo, hi = max(span.start, pos), min(span.end, end)
                if hi > lo:
                    deliver(span.key, lo - span.start, view[lo - pos : hi - pos])
                j += 1
            pos = end
            if advance is not None:
                advance(len(view))
    except NotFound:
        raise IntegrityError(
            f"{label}: {record.path} is missing from the store",
            f"the stored copy lost a file after the push: run `reg verify {label}`",
        ) from None
    if pos != record.size:
        raise changed(label, record, f"it has {pos} bytes, the manifest recorded {record.size}")
    actual = digest.hexdigest()
    if actual != record.sha256:
        raise changed(label, record, f"sha256 {actual[:16]}..., recorded {record.sha256[:16]}...")
    return pos


def changed(label: str, record: FileRecord, detail: str) -> IntegrityError:
    return IntegrityError(
        f"{label}: {record.path} is not the file that was pushed ({detail})",
        f"the stored copy changed after the push: run `reg verify {label}`",
    )


def verified_header(
    store: BaseStore, key: str, *, size: int, sha256: str, version: str | None, label: str
) -> bytes:
    """A safetensors file's header (its length, then the JSON), proven: the whole object is
    streamed through sha256 and must be `size` bytes of `sha256`; only the header is kept.
    (One pass over the model file: its digest is the only one recorded.)"""
    digest, kept, need, total = hashlib.sha256(), bytearray(), LENGTH_BYTES, 0
    for piece in store.stream(key, version=version):
        digest.update(piece)
        total += len(piece)
        if total > size:
            break
        view = memoryview(piece)
        while len(kept) < need and len(view):
            take = need - len(kept)
            kept += view[:take]
            view = view[take:]
            if need == LENGTH_BYTES and len(kept) == LENGTH_BYTES:
                try:
                    need += header_length(bytes(kept), size, label)
                except RegistryError:
                    break  # said below, once the bytes are proven to be the pushed ones
    if total != size or digest.hexdigest() != sha256:
        raise IntegrityError(
            f"{label} does not match the catalog's sha256", "run `reg verify` on the checkpoint"
        )
    return bytes(kept)


def verified_ends(
    store: BaseStore,
    key: str,
    *,
    size: int,
    sha256: str,
    version: str | None,
    label: str,
    head: int,
    tail: int,
) -> tuple[bytes, bytes]:
    """A file's first `head` and last `tail` bytes (never overlapping), proven: the whole
    object is streamed through sha256 and must be `size` bytes of `sha256`."""
    head = min(head, size)
    tail = min(tail, size - head)
    digest, first, last, total = hashlib.sha256(), bytearray(), bytearray(), 0
    for piece in store.stream(key, version=version):
        digest.update(piece)
        if len(first) < head:
            first += piece[: head - len(first)]
        start = size - tail  # where the tail begins
        if total + len(piece) > start:
            last += piece[max(0, start - total) :]
        total += len(piece)
        if total > size:
            break
    if total != size or digest.hexdigest() != sha256:
        raise IntegrityError(
            f"{label} does not match the catalog's sha256", "run `reg verify` on the checkpoint"
        )
    return bytes(first), bytes(last)


def verified_root(
    store: BaseStore,
    prefix: str,
    path: str,
    *,
    size: int,
    sha256: str,
    version: str | None,
    label: str,
) -> bytes:
    """A file root's bytes (file_roots.read_root: a safetensors header, a DeepSpeed archive's
    ranges), proven: the ranges are read, then the whole object is streamed through sha256,
    must be `size` bytes of `sha256` and hold those ranges where they were read."""
    key = prefix + path
    if not deepspeed_root.is_root_name(path):
        return verified_header(store, key, size=size, sha256=sha256, version=version, label=label)

    def read(at: int, n: int) -> bytes:
        return bytes(store.read_range(key, at, min(n, size - at), version=version)) if n else b""

    root, spans = file_roots.read_root(path, read, size, label)
    wanted = [Span(at, at + len(data), data) for at, data in spans if data]
    mismatched: list[int] = []

    def compare(data: Any, at: int, view: memoryview) -> None:
        if bytes(view) != data[at : at + len(view)]:
            mismatched.append(at)

    record = _Record(path, size, sha256, version)
    read_verified(store, prefix, record, wanted, compare, label=label)  # type: ignore[arg-type]
    if mismatched:
        raise IntegrityError(f"{label} changed while it was read", "run `reg verify` on it")
    return root


@dataclass(frozen=True, slots=True)
class _Record:
    """What read_verified needs of a FileRecord."""

    path: str
    size: int
    sha256: str
    version: str | None
