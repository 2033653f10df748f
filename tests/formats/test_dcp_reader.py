"""The DCP reader: safe metadata parsing, inventory, and refusal of incomplete directories."""

from __future__ import annotations

import os
import pickle
import re
import shutil

import pytest

from registry.errors import InvalidCheckpoint, UnsafeMetadata
from registry.formats.dcp_metadata import load_metadata
from registry.formats.dcp_scan import scan_directory


def test_inventory_matches_torch_metadata(ckpts):
    import torch.distributed.checkpoint as dcp

    d = ckpts.ws2.step_dir(4)
    scanned = scan_directory(d)
    reference = dcp.FileSystemReader(str(d)).read_metadata()  # trusted: our own fixture
    assert set(scanned.inventory.tensors) | set(scanned.inventory.byte_items) == set(
        reference.state_dict_metadata
    )
    weight = scanned.inventory.tensors["model.blocks.0.up.weight"]
    assert weight.shape == tuple(reference.state_dict_metadata["model.blocks.0.up.weight"].size)
    assert weight.dtype == "float32"
    assert {c.file for c in weight.chunks} == {"__0_0.distcp", "__1_0.distcp"}
    assert scanned.inferred_world_size == 2
    inv = scanned.inventory
    assert {k.split(".", 1)[0] for k in [*inv.tensors, *inv.byte_items]} == {
        "model",
        "optimizer",
        "lr_scheduler",
        "train_state",
        "rng",
        "dataloader",
    }


def test_light_parse_without_torch_matches_torch_classes(ckpts):
    from registry.formats.dcp import inventory

    data = (ckpts.ws3.step_dir(3) / ".metadata").read_bytes()
    light, real = inventory(load_metadata(data, light=True)), inventory(load_metadata(data))
    assert light.tensors == real.tensors
    assert light.byte_items == real.byte_items


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['REG_PWNED']}",))


def test_crafted_metadata_is_refused_and_never_executed(tmp_path, ckpts, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("REG_PWNED", str(marker))
    evil = pickle.dumps(_RunsCode())
    for light in (True, False):
        with pytest.raises(UnsafeMetadata, match="posix.system|os.system"):
            load_metadata(evil, light=light)
    d = ckpts.ws2.copy_step(4, tmp_path / "evil")
    (d / ".metadata").write_bytes(evil)
    with pytest.raises(UnsafeMetadata) as info:
        scan_directory(d)
    assert info.value.exit_code == 2
    assert not marker.exists()


def test_corrupt_metadata_is_a_clear_error(tmp_path, ckpts):
    d = ckpts.ws2.copy_step(4, tmp_path / "c")
    (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:100])
    with pytest.raises(InvalidCheckpoint, match="corrupt"):
        scan_directory(d)


def test_missing_metadata(tmp_path, ckpts):
    d = ckpts.ws2.copy_step(4, tmp_path / "m")
    (d / ".metadata").unlink()
    with pytest.raises(InvalidCheckpoint, match="no .metadata"):
        scan_directory(d)


def test_missing_shard(tmp_path, ckpts):
    d = ckpts.ws2.copy_step(4, tmp_path / "s")
    (d / "__1_0.distcp").unlink()
    with pytest.raises(
        InvalidCheckpoint, match=r"shard __1_0.distcp named in .metadata is missing"
    ):
        scan_directory(d)


def test_truncated_shard(tmp_path, ckpts):
    d = ckpts.ws2.copy_step(4, tmp_path / "t")
    shard = d / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(InvalidCheckpoint, match="__0_0.distcp is truncated"):
        scan_directory(d)


def test_symlinks_and_odd_names_are_refused(tmp_path, ckpts):
    d = ckpts.ws2.copy_step(4, tmp_path / "l")
    (d / "link").symlink_to("/etc/passwd")
    with pytest.raises(InvalidCheckpoint, match="symlink"):
        scan_directory(d)
    (d / "link").unlink()
    (d / "we ird").write_text("x")
    with pytest.raises(InvalidCheckpoint, match="unsafe file name"):
        scan_directory(d)
    (d / "we ird").unlink()
    link_dir = tmp_path / "linkdir"
    link_dir.symlink_to(d)
    with pytest.raises(InvalidCheckpoint, match="symlink"):
        scan_directory(link_dir)


def test_non_dcp_directories(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.pt").write_bytes(b"\x80\x04N.")
    with pytest.raises(InvalidCheckpoint, match="no .metadata"):
        scan_directory(tmp_path / "plain")
    with pytest.raises(InvalidCheckpoint, match="does not exist"):
        scan_directory(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidCheckpoint, match="not a directory"):
        scan_directory(tmp_path / "file")
    shutil.rmtree(tmp_path / "plain")


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]):  # type: ignore[no-untyped-def]
    from registry.formats.dcp import ChunkRange

    return ChunkRange(offsets, sizes, "__0_0.distcp", 0, 1)


@pytest.mark.parametrize(
    ("shape", "chunks", "problem"),
    [
        ((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4))], None),  # FSDP rows
        ((8, 4), [((0, 0), (8, 2)), ((0, 2), (8, 2))], None),  # column shards
        ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], None),
        ((), [((), ())], None),
        ((0, 4), [((0, 0), (0, 4)), ((0, 0), (0, 4))], None),  # empty tensor, empty chunks
        # the same elements twice and the other half never: the count alone looks right
        ((8, 4), [((0, 0), (4, 4)), ((0, 0), (4, 4))], "overlap"),
        ((4, 4), [((0, 0), (3, 4)), ((2, 0), (1, 4))], "overlap"),
        ((8, 4), [((0, 0), (4, 4))], "hold 16 elements, the tensor 32"),
        ((8, 4), [((0, 0), (4, 4)), ((6, 0), (4, 4))], "outside its shape"),
        ((8, 4), [((0, 0), (4, 4)), ((-4, 0), (4, 4))], "outside its shape"),
        ((8,), [((0, 0), (8, 1))], "has 2 dimensions, not 1"),
        ((), [((), ()), ((), ())], "hold 2 elements, the tensor 1"),
    ],
)
def test_chunks_must_tile_their_tensor_exactly(shape, chunks, problem):
    from registry.formats.dcp import cover_problem

    found = cover_problem("w", shape, [_box(o, s) for o, s in chunks])
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_overlapping_chunks_in_a_real_metadata_are_refused_at_push(tmp_path, ckpts):
    """Chunk 1 of a row-sharded weight moved onto chunk 0: the element count still adds up, half
    the tensor would be read twice and the other half never written (uninitialised memory)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    d = ckpts.ws2.copy_step(2, tmp_path / "overlap")
    metadata = pickle.loads((d / ".metadata").read_bytes())  # the test's own file
    fqn, meta = next(
        (k, v)
        for k, v in metadata.state_dict_metadata.items()
        if hasattr(v, "chunks") and len(v.chunks) == 2 and v.chunks[0].sizes == v.chunks[1].sizes
    )
    meta.chunks[1] = ChunkStorageMetadata(
        offsets=meta.chunks[0].offsets, sizes=meta.chunks[1].sizes
    )
    (d / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(InvalidCheckpoint, match=f"two chunks of {fqn} overlap"):
        scan_directory(d)


def _build_on_global(module: str, name: str, attribute: str) -> bytes:
    """A pickle that fetches an allowed global and BUILDs it with slot state: on a class object
    that is `setattr(cls, attribute, set)`, changing the class for the whole process."""
    return (
        b"\x80\x04"
        + f"c{module}\n{name}\n".encode()
        + b"N}"
        + b"X"
        + len(attribute).to_bytes(4, "little")
        + attribute.encode()
        + b"cbuiltins\nset\ns\x86b."
    )


@pytest.mark.parametrize(
    ("module", "name", "attribute"),
    [
        ("pathlib", "PurePosixPath", "__str__"),
        ("pathlib", "PosixPath", "__fspath__"),
        ("torch.distributed.checkpoint.metadata", "Metadata", "__eq__"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex", "__hash__"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "__getstate__"),
    ],
)
@pytest.mark.parametrize("light", [True, False])
def test_the_stream_cannot_change_any_class(ckpts, module, name, attribute, light):
    import importlib

    cls = getattr(importlib.import_module(module), name)
    before = cls.__dict__.get(attribute)
    with pytest.raises(InvalidCheckpoint):
        load_metadata(_build_on_global(module, name, attribute), light=light)
    assert cls.__dict__.get(attribute) is before
    # ... and the next load of a real file is unaffected
    real = (ckpts.ws2.step_dir(2) / ".metadata").read_bytes()
    assert load_metadata(real, light=light).state_dict_metadata


def test_a_memo_index_near_2_to_the_32_costs_nothing():
    """LONG_BINPUT at index 680 million: the C unpickler grows its memo array to that size
    (5 GB, 20 s here, found by the fuzzer); an index out of sequence is refused at once."""
    bomb = b"\x80\x04N" + b"r" + (0x28947D94).to_bytes(4, "little") + b"."
    for light in (True, False):
        with pytest.raises(InvalidCheckpoint, match="memo index 680820116 out of sequence"):
            load_metadata(bomb, light=light)


def _crafted(ckpts, tmp_path, edit):  # type: ignore[no-untyped-def]
    """A copy of a real checkpoint whose .metadata went through `edit(metadata)`."""
    d = ckpts.ws2.copy_step(2, tmp_path / "crafted")
    metadata = pickle.loads((d / ".metadata").read_bytes())  # the test's own file
    edit(metadata)
    (d / ".metadata").write_bytes(pickle.dumps(metadata))
    return d


def _first_tensor(metadata):  # type: ignore[no-untyped-def]
    return next(v for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # numbers a shape never holds: checked before any arithmetic on them
        (lambda m: setattr(_first_tensor(m), "size", (10**30, 4)), "0..2^63"),
        (lambda m: setattr(_first_tensor(m), "size", ("2", 4)), "0..2^63"),
        (lambda m: setattr(_first_tensor(m), "size", tuple([1] * 65)), "is not a shape"),
        (lambda m: setattr(_first_tensor(m), "size", (2**40, 2**40)), "is too large"),
        (
            lambda m: setattr(next(iter(m.storage_data.values())), "offset", 10**5000),
            "0..2^63",
        ),
        (lambda m: setattr(_first_tensor(m).properties, "dtype", "float1024"), "unknown dtype"),
        # a dict keyed by tuples: hashing one built from shared references is exponential
        (lambda m: m.state_dict_metadata.update({("a", "b"): 1}), "as a key"),
    ],
)
def test_numbers_and_shapes_no_checkpoint_has_are_refused(ckpts, tmp_path, edit, message):
    import sys

    sys.set_int_max_str_digits(0)  # so the test itself can write 10^5000
    try:
        d = _crafted(ckpts, tmp_path, edit)
    finally:
        sys.set_int_max_str_digits(4300)
    with pytest.raises(InvalidCheckpoint, match=re.escape(message)):
        scan_directory(d)


def test_a_chunk_layout_too_irregular_to_check_is_refused():
    """A staircase of chunks that tiles its tensor but keeps every chunk in the sweep: the
    check's work is bounded instead of growing with the square of the chunk count."""
    from registry.formats.dcp import cover_problem

    n = 3000  # column c split at row c + 1: each dimension has n distinct offsets
    chunks = [_box((0, c), (c + 1, 1)) for c in range(n)] + [
        _box((c + 1, c), (n - c - 1, 1)) for c in range(n - 1)
    ]
    assert "too irregularly to check" in (cover_problem("w", (n, n), chunks) or "")


def _without_chunk_indices(metadata):  # type: ignore[no-untyped-def]
    """Every storage key's `index` None, as Megatron's planner writes them."""
    import dataclasses

    metadata.storage_data = {
        dataclasses.replace(k, index=None): v for k, v in metadata.storage_data.items()
    }


def test_chunks_are_found_by_offset_when_their_index_is_none(ckpts, tmp_path):
    """Torch finds a chunk's bytes by fqn and offsets (`index` is a hint): with every index
    None each sharded tensor still has each of its chunks, at its own place in its own file."""
    d = _crafted(ckpts, tmp_path, _without_chunk_indices)
    want = scan_directory(ckpts.ws2.step_dir(2)).inventory
    got = scan_directory(d).inventory
    assert got.tensors == want.tensors
    sharded = [t for t in got.tensors.values() if len({c.file for c in t.chunks}) == 2]
    assert sharded, "the fixture shards some tensor over both ranks"


class _SameIndex:
    """Pickles as DCP's MetadataIndex but hashes by identity: two of them are two keys of
    one pickled dict, which torch itself could never write."""

    def __init__(self, fqn: str, offset: object) -> None:
        self.fqn, self.offset = fqn, offset

    def __reduce__(self):  # type: ignore[no-untyped-def]
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return (MetadataIndex, (self.fqn, self.offset, None))


@pytest.mark.parametrize("light", [True, False])
def test_two_storage_locations_for_one_chunk_are_refused(ckpts, tmp_path, light):
    """A crafted file naming two places for one chunk: reg does not pick one."""
    from registry.formats.dcp import inventory

    def duplicate(metadata):  # type: ignore[no-untyped-def]
        key, info = next((k, v) for k, v in metadata.storage_data.items() if k.offset)
        metadata.storage_data = {
            **{_SameIndex(k.fqn, k.offset): v for k, v in metadata.storage_data.items()},
            _SameIndex(key.fqn, key.offset): info,
        }

    d = _crafted(ckpts, tmp_path, duplicate)
    with pytest.raises(InvalidCheckpoint, match="two storage locations"):
        inventory(load_metadata((d / ".metadata").read_bytes(), light=light))


def test_a_bytes_item_stored_at_offsets_is_refused(ckpts, tmp_path):
    """torch looks a bytes item's storage up by its fqn alone: one stored at offsets would
    validate here and then not be found by a restore."""
    import dataclasses

    import torch

    def offset_bytes(metadata):  # type: ignore[no-untyped-def]
        byte = next(k for k in metadata.storage_data if k.offset is None)
        info = metadata.storage_data.pop(byte)
        metadata.storage_data[dataclasses.replace(byte, offset=torch.Size([0]))] = info

    d = _crafted(ckpts, tmp_path, offset_bytes)
    with pytest.raises(InvalidCheckpoint, match="stores the bytes item .* at chunk offsets"):
        scan_directory(d)
