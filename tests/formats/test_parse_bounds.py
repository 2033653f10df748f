"""Parsing costs time linear in the input, whatever it holds: `.metadata`, sidecars
and the pickles of DCP chunks crafted to make an unpickler quadratic, about 1 MB each, are
refused or read within a fixed CPU bound.

What makes a 1 MB pickle cost minutes: dict keys that share one hash (ints that are multiples
of 2^61-1, floats and tuples that hash as they do), distinct small ints chosen to crowd one
probe path of a dict (as keys or as memo indices), and one container handed to call after call
through the memo. Before the fix (CPU seconds here, one file each): the 1 MB `.metadata` of
colliding ints 58 s, its crowded memo 6 s at 426 KB, its container handed again over 150; the
1 MB meta.pt of colliding ints 59 s (floats 60, tuples 90), crowded keys 5 s at 501 KB; storage
keys sharing a hash 28 s (41 merged); a 1 MB byte item of a shard 60 s.
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
import time
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from registry.errors import IntegrityError, InvalidCheckpoint
from registry.formats import sidecars
from registry.formats.dcp_metadata import load_metadata

BOUND = 2.0  # CPU seconds for about 1 MB, far below what the same files cost before the fix
MB = 1 << 20
P = 2**61 - 1  # k and k + P hash alike
BASE = 12345  # every colliding key below hashes to this


def cheap(parse: Callable[[], Any]) -> Any:
    """What `parse()` returns or raises, once it has cost under BOUND of this thread's CPU (the
    parsers run in the caller's thread; the process's time would count whatever threads earlier
    tests in this worker left running). The least of up to three tries: on a loaded, shared
    machine a try's CPU time only ever grows (2.1 s once in CI for a 0.3 s parse), while a parse
    that is not linear costs tens of seconds every time."""
    spent = []
    for _ in range(3):
        start = time.thread_time()
        try:
            outcome: Any = ("returned", parse())
        except Exception as exc:  # what is measured is often a refusal
            outcome = ("raised", exc)
        spent.append(time.thread_time() - start)
        if spent[-1] < BOUND:
            break
    assert min(spent) < BOUND, f"{min(spent):.1f} s of CPU"
    if outcome[0] == "raised":
        raise outcome[1]
    return outcome[1]


# -- crafting ---------------------------------------------------------------------------------


def long1(k: int) -> bytes:
    body = k.to_bytes((k.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(body)]) + body


def colliding(kind: str) -> Iterator[bytes]:
    """Pickle ops pushing distinct keys that all hash to BASE, endlessly."""
    i = 0
    while True:
        i += 1
        if kind == "float" and i <= 16:  # BASE * 2^(61 j) is BASE modulo 2^61-1, and a float
            yield b"G" + struct.pack(">d", float(BASE * 2 ** (61 * i)))
        elif kind == "tuple":  # a tuple's hash is a function of its items' hashes
            yield long1(BASE + i * P) + b"\x85"
        else:
            yield long1(BASE + i * P)


def dict_pickle(keys: Iterator[bytes], size: int = MB) -> bytes:
    """A pickled dict of `keys` (each to None), about `size` bytes."""
    out = [b"\x80\x02}("]
    total = 0
    for key in keys:
        out.append(key + b"N")
        total += len(key) + 1
        if total >= size:
            break
    return b"".join(out) + b"u."


@functools.cache
def crowded_ints(bits: int = 17) -> tuple[int, ...]:
    """Distinct ints below 2^(bits+5) that, in this order, crowd one probe path of a dict with a
    2^bits table (an int hashes to itself): the first third lie along the table's final probe
    cycle (i -> 5i + 1), and each of the rest has every perturbed probe land among those taken
    before it, then enters the cycle inside that run and walks the rest of it."""
    size = 1 << bits
    mask = size - 1
    order = np.empty(size, dtype=np.int64)
    slot = 0
    for n in range(size):
        order[n] = slot
        slot = (5 * slot + 1) & mask
    place = np.empty(size, dtype=np.int64)  # where each slot lies along the cycle
    place[order] = np.arange(size)
    run, end = size // 3 + 1, (2 * size) // 3  # the table is 2^bits from 1/3 full to 2/3
    chosen = [order[:run]]
    rng = np.random.default_rng(0)
    while run < end:
        h = rng.integers(size, size << 5, size=1 << 19, dtype=np.int64)
        i, perturb = h & mask, h.copy()
        ok = place[i] < run
        for _ in range(5):
            perturb >>= 5
            i = (5 * i + 1 + perturb) & mask
            ok &= (place[i] < run) | (perturb == 0)
        found = np.unique(h[ok & (place[i] < run)])
        found = found[~np.isin(found, np.concatenate(chosen))][: end - run]
        chosen.append(found)
        run += len(found)
    return tuple(int(v) for v in np.concatenate(chosen))


def crowded_dict_pickle() -> bytes:
    return dict_pickle(iter(long1(k) for k in crowded_ints()), size=4 * MB)


def crowded_memo_pickle() -> bytes:
    """LONG_BINPUT of one value at crowded indices."""
    puts = (b"r" + k.to_bytes(4, "little") for k in crowded_ints())
    return b"\x80\x02N" + b"".join(puts) + b"."


def handed_again_pickle(pairs: int = 60_000, size: int = MB) -> bytes:
    """One list of pairs, memoised, handed to OrderedDict() call after call (each result set as
    the same key's value, so the last is the only one kept): each call costs the list's length,
    so the work is the square of the stream's. Only opcodes torch's unpickler takes."""
    items = b"".join(b"X" + struct.pack("<I", 8) + b"k%07d" % i + b"N\x86" for i in range(pairs))
    head = b"\x80\x02}X\x01\x00\x00\x00kq\x00ccollections\nOrderedDict\nq\x01s"
    head += b"h\x00](" + items + b"eq\x02s"  # d = {"k": ...}: OrderedDict is 1, the list 2
    call = b"h\x00h\x01h\x02\x85Rs"  # d["k"] = OrderedDict(list)
    return head + call * ((size - len(head)) // len(call)) + b"."


def archive(pickled: bytes) -> bytes:
    """A torch.save-shaped archive holding `pickled` as its data.pkl."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")
        z.writestr("archive/.data/serialization_id", b"0" * 20)
    return buf.getvalue()


def sidecar_entries(name: str, data: bytes) -> list[str]:
    import torch  # noqa: F401  (imported before the clock starts: it takes seconds)

    return cheap(lambda: sidecars.entries([name], {name: len(data)}, lambda _: data))


# -- .metadata --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int", "float", "tuple"])
@pytest.mark.parametrize("light", [True, False])
def test_metadata_keys_crafted_to_share_a_hash_are_refused_at_once(kind, light):
    """DCP keys its dicts by names and MetadataIndex objects only: a number or a tuple as a key
    is refused before it is hashed (the int file took 58 s before)."""
    crafted = dict_pickle(colliding(kind))
    with pytest.raises(InvalidCheckpoint, match="as a key") as info:
        cheap(lambda: load_metadata(crafted, light=light))
    assert info.value.exit_code == 2
    assert "\n" not in str(info.value)


def test_a_crafted_metadata_is_refused_at_push_within_the_bound(ckpts, tmp_path):
    from registry.formats.dcp_scan import scan_directory

    d = ckpts.ws2.copy_step(2, tmp_path / "crafted")
    (d / ".metadata").write_bytes(dict_pickle(colliding("int")))
    with pytest.raises(InvalidCheckpoint, match="as a key") as info:
        cheap(lambda: scan_directory(d))
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    ("crafted", "message"),
    [
        (crowded_memo_pickle, "out of sequence"),  # 6 s at 426 KB before
        (handed_again_pickle, "steps of work per byte"),  # over 150 s before
    ],
)
def test_metadata_crowded_memo_and_containers_handed_again_are_refused(crafted, message):
    blob = crafted()
    with pytest.raises(InvalidCheckpoint, match=message):
        cheap(lambda: load_metadata(blob, light=True))


def _indexes_sharing_one_hash(count: int) -> bytes:
    """A Metadata whose storage_data holds `count` MetadataIndex keys of one fqn whose offsets
    hash alike: a 0 lets the other dimensions be any values equal modulo 2^61-1."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    class Pairs:  # pickles as OrderedDict() and SETITEMS, never hashing a key here
        def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
            self.pairs = pairs

        def __reduce__(self):  # type: ignore[no-untyped-def]
            from collections import OrderedDict

            return (OrderedDict, (), None, None, iter(self.pairs))

    info = _StorageInfo("__0_0.distcp", 0, 4)
    keys = []
    for n in range(count):
        digits = [(n >> (2 * d)) & 3 for d in range(8)]
        keys.append(MetadataIndex("w", (0, *(BASE + j * P for j in digits)), 0))
    metadata = Metadata(state_dict_metadata={}, storage_data=Pairs([(k, info) for k in keys]))
    return pickle.dumps(metadata, protocol=2)


def test_storage_keys_sharing_one_hash_are_refused():
    """torch's MetadataIndex hashes its offsets: built from the stand-ins (load_metadata with
    light=False) or merged from several roots, keys sharing one hash are refused."""
    from registry.formats.dcp_roots import merged_metadata

    crafted = _indexes_sharing_one_hash(10_000)
    assert len(crafted) > MB
    with pytest.raises(InvalidCheckpoint, match="share one hash"):
        cheap(lambda: load_metadata(crafted))
    with pytest.raises(InvalidCheckpoint, match="share one hash"):
        cheap(lambda: merged_metadata({"a/.metadata": crafted, "b/.metadata": crafted}, light=True))


# -- sidecars (torch.load) --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int", "float", "tuple"])
def test_a_sidecar_with_keys_sharing_one_hash_is_left_unread(kind):
    """A 1 MB meta.pt whose dict keys all hash alike: torch's unpickler would compare each with
    every one before it (59 s before); it is never handed over."""
    got = sidecar_entries("meta.pt", archive(dict_pickle(colliding(kind))))
    assert got == [
        "meta.pt",
        "meta.pt!its pickle would cost torch.load too much: over 2048 keys that are neither "
        "names nor whole numbers in sequence",
    ]


@pytest.mark.parametrize(
    ("crafted", "reason"),
    [
        (crowded_dict_pickle, "neither names nor whole numbers in sequence"),
        (crowded_memo_pickle, "out of sequence"),
        (handed_again_pickle, "steps of work per byte"),
    ],
)
def test_a_sidecar_crowding_a_dict_or_handing_a_container_again_is_left_unread(crafted, reason):
    """Distinct small ints (any bound on their size would let them through) chosen to crowd
    one probe path, as keys or as memo indices; one container handed to call after call."""
    got = sidecar_entries("custom_checkpoint_0.pkl", archive(crafted()))
    assert len(got) == 2 and reason in got[1], got


@pytest.mark.parametrize(("depth", "reason"), [(30, "more work"), (40, "nested over 32 deep")])
def test_a_sidecar_keyed_by_a_tuple_of_shared_references_is_left_unread(depth, reason):
    """(t, t) with t = (t', t') and so on: its hash visits 2^depth leaves (27 levels, 150
    bytes, took torch 2.3 s before; 40 would take hours), and a deep one crashes the
    interpreter."""
    key = b"K\x01\x85q\x00"  # t0 = (1,), then t(i+1) = (ti, ti)
    key += b"".join(b"h" + bytes([i]) + b"\x86q" + bytes([i + 1]) for i in range(depth))
    got = sidecar_entries("meta.pt", archive(b"\x80\x02}" + key + b"Ns."))
    assert len(got) == 2 and reason in got[1], got


def test_a_sidecar_keyed_by_whole_numbers_in_sequence_is_read():
    """What an optimizer's state looks like (parameters 0, 1, 2, ...), half a MB of it: read."""
    import torch

    buf = io.BytesIO()
    torch.save({"state": {i: {"step": i} for i in range(35_000)}, "global_step": 3}, buf)
    assert buf.tell() > MB // 2
    got = sidecar_entries("meta.pt", buf.getvalue())
    assert got == ["meta.pt", "meta.pt:", "meta.pt:global_step", "meta.pt:state"]


# -- the pickles of DCP chunks ----------------------------------------------------------------


@pytest.mark.parametrize(
    "crafted",
    [
        lambda: dict_pickle(colliding("int")),
        crowded_memo_pickle,
        lambda: b"\x80\x02N" + b"r" + (0x28947D94).to_bytes(4, "little") + b".",
    ],
)
def test_a_chunk_pickle_that_would_be_quadratic_is_refused(crafted: Callable[[], bytes]):
    """A chunk's layout (read without torch) and a chunk or byte item handed to torch.load."""
    from registry.formats.dcp_load import load_object
    from registry.formats.torch_archive import read_layout

    blob = crafted()
    with pytest.raises((pickle.UnpicklingError, EOFError)):
        cheap(lambda: read_layout(blob))
    with pytest.raises(IntegrityError, match="does not load"):
        cheap(lambda: load_object(archive(blob), "__0_0.distcp: optimizer.step"))
