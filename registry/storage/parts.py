"""How bytes become upload parts: part sizes that fit S3's 10,000-part limit, a file read part by
part, and a producer's stream cut into parts for a consumer on another thread with bounded memory.
Pure Python: no store, no network."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

from registry.storage.base import Producer

MIN_PART = 8 * 1024 * 1024
MAX_PARTS = 10_000
T = TypeVar("T")


class _ProducerFailed(Exception):
    """Raised into the consumer when the producer failed midway."""


def part_size_for(size: int) -> int:
    """Smallest part size (whole MiB, >= 8 MiB) that fits `size` in 10,000 parts."""
    needed = -(-size // MAX_PARTS)
    mib = 1024 * 1024
    return max(MIN_PART, -(-needed // mib) * mib)


def file_parts(f: BinaryIO, part: int) -> Iterator[bytes]:
    while data := f.read(part):
        yield data


def stream_parts(produce: Producer, part: int, consume: Callable[[Iterator[bytes]], T]) -> T:
    """Run `produce(write)` on this thread while `consume(parts)` runs on another, reading
    what was written cut into `part`-sized pieces (the last may be shorter). At most two parts
    wait between them, so memory stays bounded; a failure on either side stops both, and a
    producer that fails midway makes the consumer fail too, never finish with part of the data."""
    buffer = bytearray()
    pending: list[bytes | BaseException | None] = []
    lock = threading.Condition()
    result: list[T] = []
    failure: list[BaseException] = []

    def write(data: Any) -> None:
        buffer.extend(memoryview(data).cast("B"))
        while len(buffer) >= part:
            chunk = bytes(buffer[:part])
            del buffer[:part]
            with lock:
                while len(pending) >= 2 and not failure:  # bounded memory
                    lock.wait(0.1)
                if failure:
                    raise failure[0]
                pending.append(chunk)
                lock.notify_all()

    def parts() -> Iterator[bytes]:
        while True:
            with lock:
                while not pending:
                    lock.wait()
                item = pending.pop(0)
                lock.notify_all()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item  # the producer failed: the consumer must not finish a partial object
            yield item

    def run() -> None:
        try:
            result.append(consume(parts()))
        except BaseException as exc:
            failure.append(exc)
            with lock:
                lock.notify_all()

    consumer = threading.Thread(target=run, name="reg-parts")
    consumer.start()
    try:
        produce(write)
    except BaseException as exc:
        with lock:
            pending.append(_ProducerFailed(f"the writer of this object failed: {exc!r}"))
            lock.notify_all()
        consumer.join()
        raise
    with lock:
        if buffer:
            pending.append(bytes(buffer))
        pending.append(None)
        lock.notify_all()
    consumer.join()
    if failure:
        raise failure[0]
    return result[0]
