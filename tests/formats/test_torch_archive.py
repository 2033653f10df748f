"""A DCP chunk read as it streams (registry/formats/torch_archive.py) must be read exactly as
torch reads it, or refused: a crafted archive that shows validation one tensor and torch (a
resume) or promotion (a release) another is the attack these tests play."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.errors import IntegrityError
from registry.formats.dcp_load import stored_tensor_view
from registry.formats.torch_archive import ArchiveStream, NotStreamable
from tests.helpers import saved

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.uint16,
]


def stream(data: bytes, dtype: str, sizes: tuple[int, ...], piece: int) -> bytes:
    """The storage bytes ArchiveStream hands on, fed `piece` bytes at a time."""
    reader = ArchiveStream(len(data), dtype, sizes, "t in f")
    out = bytearray()
    for i in range(0, len(data), piece):
        for part in reader.feed(memoryview(data[i : i + piece])):
            out += part
    reader.finish()
    return bytes(out)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
    piece=st.integers(1, 5000),
)
def test_what_streams_is_what_torch_loads(dtype, shape, piece):
    tensor = (torch.randn(shape) * 4).to(dtype)
    data = saved(tensor)
    got = stream(data, name(dtype), tuple(shape), piece)
    want = torch.load(io.BytesIO(data), weights_only=True)
    assert got == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    view = stored_tensor_view(bytearray(data), name(dtype), tuple(shape))  # what promotion reads
    assert view is not None and view.view(-1).view(torch.uint8).numpy().tobytes() == got


def test_a_view_with_an_offset_does_not_stream_and_keeps_every_byte():
    data = saved(torch.randn(10, 10)[2:5])
    reader = ArchiveStream(len(data), "float32", (3, 10), "v in f")
    with pytest.raises(NotStreamable, match="not a plain contiguous tensor"):
        reader.feed(memoryview(data))
    assert bytes(reader.head) == data  # the caller holds it whole and loads it with torch


def repack(data: bytes, rename=None, extra=(), drop=(), comment=b"", order=None) -> bytes:
    """The archive's records written again by Python's zipfile (a valid zip), changed."""
    source = zipfile.ZipFile(io.BytesIO(data))
    records = [(i.filename, source.read(i)) for i in source.infolist() if i.filename not in drop]
    if rename:
        records = [(rename.get(n, n), body) for n, body in records]
    records += list(extra)
    if order:
        records.sort(key=lambda r: order(r[0]))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n, body in records:
            z.writestr(n, body)
        z.comment = comment
    return out.getvalue()


CLEAN = torch.tensor([1.0, 2.0, 3.0, 4.0])
POISON = torch.tensor([1.0, float("nan"), 3.0, float("inf")])


def poisoned_record() -> bytes:
    body = zipfile.ZipFile(io.BytesIO(saved(POISON)))
    return body.read("archive/data/0")


def test_a_faithful_repack_is_still_read_the_same_way():
    data = repack(saved(CLEAN))
    assert stream(data, "float32", (4,), 3) == CLEAN.numpy().tobytes()


@pytest.mark.parametrize(
    "crafted",
    [
        # a second tensor under another root: torch reads the root of the first name
        lambda d: repack(d, rename={"archive/data.pkl": "archive/sub/data.pkl"}),
        # the same name twice, the poisoned copy last (zipfile's and torch's readers differ)
        lambda d: repack(d, extra=[("archive/data/0", poisoned_record())]),
        # a name torch looks up ignoring case
        lambda d: repack(d, extra=[("archive/BYTEORDER", b"big")]),
        # a record torch.save never writes
        lambda d: repack(d, extra=[("archive/data/1", poisoned_record())]),
        # no version record: torch refuses to load it
        lambda d: repack(d, drop=("archive/version",)),
        # a comment after the end record: a second directory could hide there
        lambda d: repack(d, comment=b"PK\x05\x06" + bytes(18)),
        # cut short inside the central directory
        lambda d: d[: d.rfind(b"PK\x01\x02") + 10],
    ],
)
def test_an_archive_torch_save_does_not_write_is_refused(crafted):
    data = crafted(saved(CLEAN))
    reader = ArchiveStream(len(data), "float32", (4,), "w in __0_0.distcp")
    try:
        reader.feed(memoryview(data))
        reader.finish()
    except (IntegrityError, NotStreamable) as exc:
        assert "w in __0_0.distcp" in str(exc)
    else:
        pytest.fail("a crafted archive was read as a clean tensor")
    assert stored_tensor_view(bytearray(data), "float32", (4,)) is None  # promotion asks torch


def with_pickle(data: bytes, change) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in source.infolist():
            body = source.read(info)
            z.writestr(info.filename, change(body) if info.filename.endswith("data.pkl") else body)
    return out.getvalue()


def decoy(storage: str, numel: int) -> bytes:
    """A storage reference left on the pickle's stack: torch keeps the first reference's dtype
    for a key, so the bytes would be read as `storage`."""
    return (
        b"(X\x07\x00\x00\x00storagectorch\n" + storage.encode() + b"\nX\x01\x00\x00\x000"
        b"X\x03\x00\x00\x00cpuJ" + numel.to_bytes(4, "little") + b"tQ"
    )


@pytest.mark.parametrize(
    "data",
    [
        # the same float32 bytes that torch reads as float16 (NaN and Inf where float32 is finite)
        with_pickle(saved(CLEAN), lambda p: p[:2] + decoy("HalfStorage", 8) + p[2:]),
        # torch.save of a negated view: the metadata argument makes torch negate the bytes
        saved(torch._neg_view(CLEAN)),
    ],
    ids=["decoy-storage-reference", "negative-view"],
)
def test_a_layout_torch_reads_differently_is_never_streamed(data):
    """Such chunks are held whole and loaded with torch, so validation checks what torch (a
    resume) and promotion (which then asks torch too) read."""
    reader = ArchiveStream(len(data), "float32", (4,), "w in f")
    with pytest.raises(NotStreamable):
        reader.feed(memoryview(data))
        reader.finish()
    assert stored_tensor_view(bytearray(data), "float32", (4,)) is None
