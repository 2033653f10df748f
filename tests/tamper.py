"""Damage stored objects behind the registry's back, on any backend.

The store API refuses overwrites and release deletes by design, so tests that play a disk
error or an attacker with write access to the bucket go around it, one way per backend.
"""

from __future__ import annotations

import os

from registry.storage.base import BaseStore
from registry.storage.local import LocalStore
from registry.storage.memory import MemoryStore


def replace(store: BaseStore, key: str, body: bytes) -> None:
    """Put `body` at `key` as if the registry had never written it."""
    if isinstance(store, LocalStore):
        path = store.root / key
        if path.exists():
            os.chmod(path, 0o644)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    elif isinstance(store, MemoryStore):
        with store._lock:
            store._objects[key] = bytes(body)
    else:  # S3: an unconditional PutObject, as anyone with write access could do
        store.client.put_object(Bucket=store.bucket, Key=store._key(key), Body=body)


def remove(store: BaseStore, key: str) -> None:
    if isinstance(store, LocalStore):
        (store.root / key).unlink()
    elif isinstance(store, MemoryStore):
        with store._lock:
            del store._objects[key]
    else:
        store.client.delete_object(Bucket=store.bucket, Key=store._key(key))


def flip_byte(store: BaseStore, key: str, offset: int | None = None) -> None:
    """Flip one byte (the middle one by default), keeping the size."""
    body = bytearray(store.get_bytes(key))
    i = len(body) // 2 if offset is None else offset
    body[i] ^= 0xFF
    replace(store, key, bytes(body))


def truncate(store: BaseStore, key: str, size: int) -> None:
    replace(store, key, store.get_bytes(key)[:size])
