"""A DeepSpeed ZeRO checkpoint (`engine.save_checkpoint`'s `global_stepN/`) read as a root of
the checkpoint, without unpickling anything and without DeepSpeed.

ZeRO-2 writes `mp_rank_00_model_states.pt` (the module, `param_shapes`, `global_steps`,
`dp_world_size`, the LR scheduler) and one `zero_pp_rank_R_mp_rank_00_optim_states.pt` per
data-parallel rank, holding that rank's partition of each parameter group's flat fp32 master
weights and of the optimizer's state; ZeRO-3 writes a model states file per rank too
(placeholders, the real shapes in `param_shapes`). Where each parameter's weights lie in which
file is deepspeed_zero.py's arithmetic; this module reads the files.

Each file is read in a few ranges (`read_root`): its head and tail (the pickle is the first
record, the zip's central directory the last), then the local header of each record a tensor
is taken from, so that a record's bytes are where torch.load would find them. The pickle is
read for its structure only (`torch_pickle_bounds.read_tensors`: tensors and torch.Size as values,
DeepSpeed's LossScaler, ZeroStageEnum and fragment_address opaque stand-ins, nothing imported
or called). Proving the ranges is the caller's, as for a safetensors header (file_roots.py).
Not read: tensor- or pipeline-parallel saves (`mp_rank_01...`), frozen and shared parameters
(refused, naming them), DeepSpeed's universal checkpoints.
"""

from __future__ import annotations

import bisect
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from registry.errors import InvalidCheckpoint
from registry.formats import torch_zip
from registry.formats.dcp import DTYPE_SIZES
from registry.formats.torch_pickle_bounds import StoredTensor, Unbounded, read_tensors

# zero_pp_rank_R_mp_rank_00_optim_states.pt (bf16_ with the BF16 optimizer), and the model
# states: mp_rank_00_model_states.pt (ZeRO-1/2) or zero_pp_rank_R_mp_rank_00_... (ZeRO-3)
NAME = re.compile(
    r"(?P<bf16>bf16_)?(?:zero_pp_rank_(?P<rank>\d{1,6})_)?mp_rank_(?P<mp>\d{2,6})_"
    r"(?P<kind>model|optim)_states\.pt"
)
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
FIRST = 64 * 1024  # read first at each end: the end records, data.pkl's local header
MAX_PICKLE = 8 * 1024 * 1024  # as sidecars.MAX_PICKLE
MAX_DIRECTORY = 16 * 1024 * 1024  # a central directory of MAX_RECORDS entries is about 9 MiB
MAX_RECORDS = 100_000
MAX_USED = 4096  # records a file's tensors come from (a few per parameter group)
MAX_EXTRA = 1024  # a local header's extra field: torch's alignment padding, zip64 sizes
MAX_RANKS = 65_536
_MAGIC = b"reg-deepspeed-ranges/1\n"
AGAIN = "the checkpoint is truncated, corrupt or not DeepSpeed's; save it again"


def is_root_name(path: str) -> bool:
    return "/" not in path and NAME.fullmatch(path) is not None


def roots(paths: Iterable[str]) -> tuple[str, ...]:
    """The DeepSpeed files of a checkpoint (at its top), when it has an optimizer states
    file; else ()."""
    found = tuple(sorted(p for p in paths if is_root_name(p)))
    return found if any(p.endswith("_optim_states.pt") for p in found) else ()


def is_model_states(path: str) -> bool:
    """Rank 0's model states file: read beside the shards too, for the step, LR scheduler and
    world size it records (sidecars.py)."""
    return path in MODEL_STATES


# -- reading a file's ranges ----------------------------------------------------------------


class Ranges:
    """A file's bytes where they were read, as disjoint spans: `read(at, n)` inside one, else
    NotCanonical (torch_zip's readers take it as they take a Region)."""

    def __init__(self, size: int, spans: list[tuple[int, bytes]]) -> None:
        self.size = size
        self.spans: list[tuple[int, bytes]] = []
        self._starts: list[int] = []
        for at, data in spans:
            self.add(at, data)

    def _find(self, at: int) -> int:
        """The index of the last span starting at or before `at` (-1 for none)."""
        return bisect.bisect_right(self._starts, at) - 1

    def covers(self, at: int, n: int) -> bool:
        i = self._find(at)
        return i >= 0 and at + n <= self.spans[i][0] + len(self.spans[i][1])

    def add(self, at: int, data: bytes) -> None:
        """`data` read at `at`, merged with the spans it touches (where two reads overlap,
        the earlier one's bytes stand: the proof of the whole compares them with the file)."""
        if not data:
            return
        lo = max(0, self._find(at))
        merged_at, merged = at, data
        keep: list[tuple[int, bytes]] = []
        for start, held in self.spans[lo:]:
            if start > merged_at + len(merged):
                keep.append((start, held))
                continue
            if start + len(held) < merged_at:
                keep.append((start, held))
                continue
            begin = min(start, merged_at)
            end = max(start + len(held), merged_at + len(merged))
            joined = bytearray(end - begin)
            joined[merged_at - begin : merged_at - begin + len(merged)] = merged
            joined[start - begin : start - begin + len(held)] = held
            merged_at, merged = begin, bytes(joined)
        self.spans = [*self.spans[:lo], *keep, (merged_at, merged)]
        self.spans.sort(key=lambda span: span[0])
        self._starts = [start for start, _ in self.spans]

    def read(self, at: int, n: int) -> bytes:
        if at < 0 or n < 0 or at + n > self.size:
            raise torch_zip.NotCanonical(f"a record points outside the file ({at}+{n})")
        if not self.covers(at, n):
            raise torch_zip.NotCanonical(f"bytes {at}..{at + n} were not read")
        start, data = self.spans[self._find(at)]
        return data[at - start : at - start + n]

    def encode(self) -> bytes:
        out = [_MAGIC, struct.pack("<QI", self.size, len(self.spans))]
        for start, data in self.spans:
            out.append(struct.pack("<QQ", start, len(data)))
            out.append(data)
        return b"".join(out)

    @classmethod
    def decode(cls, blob: bytes, label: str) -> Ranges:
        try:
            if not blob.startswith(_MAGIC):
                raise ValueError
            at = len(_MAGIC)
            size, count = struct.unpack_from("<QI", blob, at)
            at += 12
            spans = []
            for _ in range(count):
                start, length = struct.unpack_from("<QQ", blob, at)
                at += 16
                spans.append((start, blob[at : at + length]))
                at += length
        except (ValueError, struct.error):
            raise InvalidCheckpoint(f"{label}: not the ranges reg read of it", AGAIN) from None
        return cls(size, spans)


@dataclass(frozen=True, slots=True)
class _Archive:
    root: str
    records: dict[str, tuple[int, int]]  # name -> (local header offset, size)
    pickled: bytes


def _archive(ranges: Ranges, label: str) -> _Archive:
    try:
        count, cd_size, cd_at = torch_zip.end_record(ranges, MAX_RECORDS)
        entries = torch_zip.directory(ranges, cd_at, cd_size, count)
        first, offset, size = entries[0]
        root, _, rest = first.partition("/")
        if rest != "data.pkl" or not root or offset != 0 or size > MAX_PICKLE:
            raise torch_zip.NotCanonical("the first record is not ROOT/data.pkl at byte 0")
        records: dict[str, tuple[int, int]] = {}
        seen: set[str] = set()
        for name, at, length in entries:  # torch finds a name whatever its case
            if not name.startswith(root + "/") or name.lower() in seen:
                raise torch_zip.NotCanonical(f"a record {name[:80]!r} outside {root}/ or twice")
            seen.add(name.lower())
            records[name] = (at, length)
        order = records.get(f"{root}/byteorder")
        if order is not None:  # torch swaps the bytes of a big-endian save: refused here
            at = _data_start(ranges, f"{root}/byteorder", *order)
            if ranges.read(at, order[1]) != b"little":
                raise torch_zip.NotCanonical("it was saved big-endian")
        start = _data_start(ranges, first, 0, size)
        return _Archive(root, records, ranges.read(start, size))
    except (torch_zip.NotCanonical, struct.error, UnicodeDecodeError) as exc:
        raise _not_archive(label, exc) from None


def _not_archive(label: str, exc: Exception) -> InvalidCheckpoint:
    why = str(exc) if isinstance(exc, torch_zip.NotCanonical) else "not a zip archive"
    return InvalidCheckpoint(f"{label} is not a torch.save archive reg can read: {why}", AGAIN)


def _data_start(ranges: Ranges, name: str, offset: int, size: int) -> int:
    """Where a record's bytes start, from its local header (which must agree with the
    directory: its name, stored, its sizes)."""
    sig, _, flags, method, _, _, _, csize, usize, nlen, elen = struct.unpack(
        "<IHHHHHIIIHH", ranges.read(offset, 30)
    )
    if sig != torch_zip.LOCAL_HEADER or method or ranges.read(offset + 30, nlen) != name.encode():
        raise torch_zip.NotCanonical(f"the local record of {name[:80]!r} disagrees")
    if not flags & 0x08 and (csize, usize) not in ((size, size), (0xFFFFFFFF, 0xFFFFFFFF)):
        raise torch_zip.NotCanonical(f"the local sizes of {name[:80]!r} disagree")
    return int(offset + 30 + nlen + elen)


def read_root(
    read: Callable[[int, int], bytes], size: int, label: str
) -> tuple[bytes, list[tuple[int, bytes]]]:
    """The ranges of one DeepSpeed file that its tensors are found from, through
    `read(offset, length)`: (what `metadata` takes, [(offset, bytes) read]), the spans for the
    caller to prove. A few reads, each small: the two ends, the central directory, data.pkl,
    and the local header of each record a tensor is taken from."""
    ranges = Ranges(size, [])

    def need(at: int, n: int) -> None:
        n = min(n, size - at)
        if n > 0 and not ranges.covers(at, n):
            ranges.add(at, bytes(read(at, n)))

    need(max(0, size - FIRST), FIRST)
    need(0, FIRST)
    try:
        count, cd_size, cd_at = torch_zip.end_record(ranges, MAX_RECORDS)
        if cd_size > MAX_DIRECTORY:
            raise torch_zip.NotCanonical(f"a central directory of {cd_size} bytes")
        need(cd_at, cd_size)
        entries = torch_zip.directory(ranges, cd_at, cd_size, count)
        first, offset, pickled = entries[0]
        if offset != 0 or pickled > MAX_PICKLE:
            raise torch_zip.NotCanonical("the first record is not ROOT/data.pkl at byte 0")
        order = f"{first.partition('/')[0]}/byteorder"
        for name, at, length in entries:  # data.pkl, and the byte order _archive checks
            if name == first or (name == order and length <= 16):
                _read_local_header(need, ranges, name, at, size)
                nlen, elen = struct.unpack("<HH", ranges.read(at + 26, 4))
                need(at, 30 + nlen + elen + length)
    except (torch_zip.NotCanonical, struct.error, UnicodeDecodeError) as exc:
        raise _not_archive(label, exc) from None
    archive = _archive(ranges, label)
    used = _used_records(archive, label)
    if len(used) > MAX_USED:
        raise InvalidCheckpoint(f"{label}: its tensors are in {len(used)} records", AGAIN)
    for key in sorted(used):
        name = f"{archive.root}/data/{key}"
        found = archive.records.get(name)
        if found is None:
            raise InvalidCheckpoint(f"{label}: its pickle names a record {name[:80]!r} it lacks",
                                    AGAIN)  # fmt: skip
        try:
            _read_local_header(need, ranges, name, found[0], size)
        except (torch_zip.NotCanonical, struct.error) as exc:
            raise _not_archive(label, exc) from None
    return ranges.encode(), list(ranges.spans)


def _read_local_header(
    need: Callable[[int, int], None], ranges: Ranges, name: str, at: int, size: int
) -> None:
    """Read the local header at `at` of the record `name`: its fixed part, then its name and
    extra field, which must be that name and at most MAX_EXTRA bytes (never a large read)."""
    if at >= size:
        raise torch_zip.NotCanonical(f"the record {name[:80]!r} starts past the file's end")
    need(at, 30)
    nlen, elen = struct.unpack("<HH", ranges.read(at + 26, 4))
    if nlen != len(name.encode()) or elen > MAX_EXTRA:
        raise torch_zip.NotCanonical(f"the local header of {name[:80]!r} disagrees")
    need(at, 30 + nlen + elen)


def states_structure(data: bytes, label: str) -> Any:
    """What a DeepSpeed states file's pickle holds (tensors as `StoredTensor`s, DeepSpeed's
    own objects opaque), from its root bytes (`read_root`, never the file's own bytes);
    InvalidCheckpoint, one line, for anything else."""
    return _structure(_archive(Ranges.decode(data, label), label), label)


def _structure(archive: _Archive, label: str) -> Any:
    try:
        return read_tensors(archive.pickled)
    except Unbounded as exc:
        raise InvalidCheckpoint(f"{label}: its pickle would cost too much to read: {exc}",
                                AGAIN) from None  # fmt: skip
    except Exception as exc:  # any malformed pickle: one line
        raise InvalidCheckpoint(f"{label}: its pickle does not read ({type(exc).__name__})",
                                AGAIN) from None  # fmt: skip


def _used_records(archive: _Archive, label: str) -> set[str]:
    """The storage records the tensors reg takes from this file live in."""
    state = _structure(archive, label)
    return {t.key for t in _tensors_used(state)}


def _tensors_used(state: Any) -> list[StoredTensor]:
    """The tensors reg takes: a model states file's buffers; an optimizer states file's fp32
    partitions and optimizer state."""
    if not isinstance(state, dict):
        return []
    names, module = state.get("buffer_names"), state.get("module")
    if isinstance(names, list) and isinstance(module, dict):
        return [
            t for n in names if isinstance(n, str) and isinstance(t := module.get(n), StoredTensor)
        ]
    opt = state.get("optimizer_state_dict")
    if not isinstance(opt, dict):
        return []
    out: list[StoredTensor] = []
    for key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
        groups = opt.get(key)
        if isinstance(groups, list):
            out += [t for t in groups if isinstance(t, StoredTensor)]
    for inner in ("base_optimizer_state", "optimizer_state_dict"):
        base = opt.get(inner)
        per_group = base.get("state") if isinstance(base, dict) else None
        if isinstance(per_group, dict):
            for values in per_group.values():
                if isinstance(values, dict):
                    out += [t for t in values.values() if isinstance(t, StoredTensor)]
    return out


@dataclass(frozen=True, slots=True)
class File:
    path: str
    ranges: Ranges
    archive: _Archive
    state: dict[str, Any]


def open_file(path: str, blob: bytes, label: str) -> File:
    ranges = Ranges.decode(blob, label)
    archive = _archive(ranges, label)
    state = _structure(archive, label)
    if not isinstance(state, dict):
        raise InvalidCheckpoint(f"{label}: its pickle is not a dict", AGAIN)
    return File(path, ranges, archive, state)


def where(file: File, tensor: Any, label: str) -> tuple[str, int, int]:
    """(dtype, where its first element's bytes are, its element count) of a contiguous tensor
    stored in `file`."""
    if not isinstance(tensor, StoredTensor) or tensor.dtype not in DTYPE_SIZES:
        raise InvalidCheckpoint(f"{label} is not a tensor of a known dtype", AGAIN)
    itemsize = DTYPE_SIZES[tensor.dtype]
    numel = math.prod(tensor.shape)
    contiguous = tuple(math.prod(tensor.shape[i + 1 :]) for i in range(len(tensor.shape)))
    if numel and tensor.stride != contiguous:
        raise InvalidCheckpoint(f"{label} is not contiguous (strides {tensor.stride[:8]})",
                                AGAIN)  # fmt: skip
    name = f"{file.archive.root}/data/{tensor.key}"
    record = file.archive.records.get(name)
    if record is None or record[1] != tensor.storage_numel * itemsize:
        raise InvalidCheckpoint(f"{label}: its storage record {name[:80]!r} is missing or of "
                                "another size", AGAIN)  # fmt: skip
    if tensor.offset + numel > tensor.storage_numel:
        raise InvalidCheckpoint(f"{label} runs past its storage", AGAIN)
    try:
        start = _data_start(file.ranges, name, record[0], record[1])
    except (torch_zip.NotCanonical, struct.error) as exc:
        raise InvalidCheckpoint(f"{label}: {exc}", AGAIN) from None
    return tensor.dtype, start + tensor.offset * itemsize, numel
