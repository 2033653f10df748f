"""A DeepSpeed ZeRO checkpoint (`engine.save_checkpoint`'s `global_stepN/`), read as the
metadata a DCP root gives, without unpickling anything and without DeepSpeed.

ZeRO-2 writes `mp_rank_00_model_states.pt` (the module, `param_shapes`, `global_steps`,
`dp_world_size`, the LR scheduler) and one `zero_pp_rank_R_mp_rank_00_optim_states.pt` per
data-parallel rank, holding that rank's partition of each parameter group's flat fp32 master
weights (`single_partition_of_fp32_groups`) and of the optimizer's state. ZeRO-3 writes a
`zero_pp_rank_R_mp_rank_00_model_states.pt` per rank (placeholders for the module's tensors,
the real shapes in `param_shapes`) and `fp32_flat_groups`, each parameter split into equal
slices, one per rank, padded at its end. DeepSpeed's `zero_to_fp32.py` rebuilds the full fp32
weights from these; here the same arithmetic (`_zero2` and `_zero3` below, as zero_to_fp32.py
0.19.8 does it) says where each parameter's elements lie in which file, and each piece becomes
chunks whose bytes are raw little-endian elements in a `torch.save` record (`dcp.RawStorage`),
boxes of the parameter's real shape (`boxes`). Key paths: `module.<name>` for the weights as
zero_to_fp32 names them, and `optimizer.state.<group>.<name>` for the optimizer's flat state
(each rank's partition a chunk; a 0-d value such as Adam's step, rank 0's).

Each file is read in a few ranges (`read_root`): its head and tail (the pickle is the first
record, the zip's central directory the last), then the local header of each record a tensor
is taken from, so a record's bytes are where torch.load would find them. The pickle is read
for its structure only (`torch_archive.read_tensors`: tensors and torch.Size as values,
DeepSpeed's LossScaler, ZeroStageEnum and fragment_address opaque stand-ins). Proving the
ranges is the caller's, as for a safetensors header (safetensors_root.py). What is not read:
tensor- or pipeline-parallel saves (`mp_rank_01...`), frozen parameters and ZeRO's
`shared_params` (refused, naming them), DeepSpeed's universal checkpoints.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from registry.errors import InvalidCheckpoint
from registry.formats import safetensors_root as st
from registry.formats import torch_zip
from registry.formats.dcp import DTYPE_SIZES, MAX_DIMS, MAX_INT, RawStorage
from registry.formats.torch_archive import StoredTensor, Unbounded, read_tensors

# zero_pp_rank_R_mp_rank_00_optim_states.pt (bf16_ with the BF16 optimizer), and the model
# states: mp_rank_00_model_states.pt (ZeRO-1/2) or zero_pp_rank_R_mp_rank_00_... (ZeRO-3)
NAME = re.compile(
    r"(?P<bf16>bf16_)?(?:zero_pp_rank_(?P<rank>\d{1,6})_)?mp_rank_(?P<mp>\d{2,6})_"
    r"(?P<kind>model|optim)_states\.pt"
)
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
HEAD = 8 * 1024 * 1024 + 64 * 1024  # a pickle is at most 8 MiB (sidecars.MAX_PICKLE)
TAIL = 16 * 1024 * 1024  # the central directory
MAX_RECORDS = 100_000
MAX_RANKS = 65_536
_MAGIC = b"reg-deepspeed-ranges/1\n"
_AGAIN = "the checkpoint is truncated, corrupt or not DeepSpeed's; save it again"


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
    """A file's bytes where they were read: `read(at, n)` inside one range, else NotCanonical
    (torch_zip's readers take it as they take a Region)."""

    def __init__(self, size: int, spans: list[tuple[int, bytes]]) -> None:
        self.size, self.spans = size, sorted(spans)

    def read(self, at: int, n: int) -> bytes:
        if at < 0 or n < 0 or at + n > self.size:
            raise torch_zip.NotCanonical(f"a record points outside the file ({at}+{n})")
        for start, data in self.spans:
            if start <= at and at + n <= start + len(data):
                return data[at - start : at - start + n]
        raise torch_zip.NotCanonical(f"bytes {at}..{at + n} were not read")

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
            raise InvalidCheckpoint(f"{label}: not the ranges reg read of it", _AGAIN) from None
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
        if rest != "data.pkl" or not root or offset != 0 or size > HEAD - 4096:
            raise torch_zip.NotCanonical("the first record is not ROOT/data.pkl at byte 0")
        records: dict[str, tuple[int, int]] = {}
        for name, at, length in entries:
            if not name.startswith(root + "/") or name in records:
                raise torch_zip.NotCanonical(f"a record {name[:80]!r} outside {root}/ or twice")
            records[name] = (at, length)
        start = _data_start(ranges, first, 0, size)
        return _Archive(root, records, ranges.read(start, size))
    except (torch_zip.NotCanonical, struct.error, UnicodeDecodeError) as exc:
        why = str(exc) if isinstance(exc, torch_zip.NotCanonical) else "not a zip archive"
        raise InvalidCheckpoint(f"{label} is not a torch.save archive reg can read: {why}",
                                _AGAIN) from None  # fmt: skip


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
    return offset + 30 + nlen + elen


def read_root(
    read: Callable[[int, int], bytes], size: int, label: str
) -> tuple[bytes, list[tuple[int, bytes]]]:
    """The ranges of one DeepSpeed file that its tensors are found from, through
    `read(offset, length)`: (what `metadata` takes, [(offset, bytes) read]), the spans for the
    caller to prove."""
    head_n = min(size, HEAD)
    tail_n = min(size - head_n, TAIL)
    spans = [(0, bytes(read(0, head_n)))]
    if tail_n:
        spans.append((size - tail_n, bytes(read(size - tail_n, tail_n))))
    ranges = Ranges(size, spans)
    archive = _archive(ranges, label)
    for key in _used_records(archive, label):
        name = f"{archive.root}/data/{key}"
        found = archive.records.get(name)
        if found is None:
            raise InvalidCheckpoint(f"{label}: its pickle names a record {name[:80]!r} it lacks",
                                    _AGAIN)  # fmt: skip
        at = found[0]
        if _has(ranges, at):
            continue  # read already (a small file is read whole)
        fixed = bytes(read(at, min(30, size - at)))
        more = b""
        if len(fixed) == 30:
            nlen, elen = struct.unpack_from("<HH", fixed, 26)
            more = bytes(read(at + 30, min(nlen + elen, size - at - 30)))
        ranges.spans.append((at, fixed + more))
        ranges.spans.sort()
    return ranges.encode(), list(ranges.spans)


def states_structure(data: bytes, label: str) -> Any:
    """What a DeepSpeed states file's pickle holds (tensors as `StoredTensor`s, DeepSpeed's
    own objects opaque), from its root bytes (`read_root`) or, for a file read whole, its
    bytes; InvalidCheckpoint, one line, for anything else."""
    ranges = (
        Ranges.decode(data, label) if data.startswith(_MAGIC) else Ranges(len(data), [(0, data)])
    )
    return _structure(_archive(ranges, label), label)


def _has(ranges: Ranges, at: int) -> bool:
    """Whether a local header at `at` lies whole in what was read."""
    try:
        nlen, elen = struct.unpack("<HH", ranges.read(at + 26, 4))
        ranges.read(at, 30 + nlen + elen)
    except (torch_zip.NotCanonical, struct.error):
        return False
    return True


def _structure(archive: _Archive, label: str) -> Any:
    try:
        return read_tensors(archive.pickled)
    except Unbounded as exc:
        raise InvalidCheckpoint(f"{label}: its pickle would cost too much to read: {exc}",
                                _AGAIN) from None  # fmt: skip
    except Exception as exc:  # any malformed pickle: one line
        raise InvalidCheckpoint(f"{label}: its pickle does not read ({type(exc).__name__})",
                                _AGAIN) from None  # fmt: skip


def _used_records(archive: _Archive, label: str) -> set[str]:
    """The storage records the tensors reg takes from this file live in."""
    state = _structure(archive, label)
    return {t.key for t in _tensors_used(state)}


def _tensors_used(state: Any) -> list[StoredTensor]:
    if not isinstance(state, dict):
        return []
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


# -- the metadata -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [start, start + count) of a tensor (row-major), stored raw at `at` in `file`."""

    start: int
    count: int
    file: str
    at: int


@dataclass(slots=True)
class Built:
    """What a checkpoint's files say: each tensor (key path -> dtype, shape, pieces) and the
    facts the model states record."""

    tensors: dict[str, tuple[str, tuple[int, ...], list[Piece]]]
    stage: int
    world_size: int
    step: int | None


@dataclass(frozen=True, slots=True)
class _File:
    path: str
    ranges: Ranges
    archive: _Archive
    state: dict[str, Any]


def _open(path: str, blob: bytes, label: str) -> _File:
    ranges = Ranges.decode(blob, label)
    archive = _archive(ranges, label)
    state = _structure(archive, label)
    if not isinstance(state, dict):
        raise InvalidCheckpoint(f"{label}: its pickle is not a dict", _AGAIN)
    return _File(path, ranges, archive, state)


def _where(file: _File, tensor: Any, label: str) -> tuple[str, int, int]:
    """(dtype, where its first element's bytes are, its element count) of a contiguous tensor
    stored in `file`."""
    if not isinstance(tensor, StoredTensor) or tensor.dtype not in DTYPE_SIZES:
        raise InvalidCheckpoint(f"{label} is not a tensor of a known dtype", _AGAIN)
    itemsize = DTYPE_SIZES[tensor.dtype]
    numel = math.prod(tensor.shape)
    contiguous = tuple(math.prod(tensor.shape[i + 1 :]) for i in range(len(tensor.shape)))
    if numel and tensor.stride != contiguous:
        raise InvalidCheckpoint(f"{label} is not contiguous (strides {tensor.stride[:8]})",
                                _AGAIN)  # fmt: skip
    name = f"{file.archive.root}/data/{tensor.key}"
    record = file.archive.records.get(name)
    if record is None or record[1] != tensor.storage_numel * itemsize:
        raise InvalidCheckpoint(f"{label}: its storage record {name[:80]!r} is missing or of "
                                "another size", _AGAIN)  # fmt: skip
    if tensor.offset + numel > tensor.storage_numel:
        raise InvalidCheckpoint(f"{label} runs past its storage", _AGAIN)
    try:
        start = _data_start(file.ranges, name, record[0], record[1])
    except (torch_zip.NotCanonical, struct.error) as exc:
        raise InvalidCheckpoint(f"{label}: {exc}", _AGAIN) from None
    return tensor.dtype, start + tensor.offset * itemsize, numel


def build(parts: Mapping[str, bytes]) -> Built:
    """The tensors of a DeepSpeed checkpoint whose files' ranges (`read_root`) are `parts`."""
    optim: dict[int, _File] = {}
    model: dict[int, _File] = {}
    for path, blob in sorted(parts.items()):
        found = NAME.fullmatch(path)
        if found is None:
            raise InvalidCheckpoint(f"{path} is not a DeepSpeed states file")
        if found["mp"] != "00":
            raise InvalidCheckpoint(
                f"{path}: a tensor- or pipeline-parallel DeepSpeed save (mp_rank "
                f"{found['mp']}); reg reads data-parallel ZeRO saves only",
                "consolidate it with DeepSpeed first, or save without model parallelism",
            )
        rank = int(found["rank"] or 0)
        (optim if found["kind"] == "optim" else model)[rank] = _open(path, blob, path)
    if not model:
        raise InvalidCheckpoint("a DeepSpeed checkpoint without its model states file "
                                f"({MODEL_STATES[0]})", _AGAIN)  # fmt: skip
    ranks = len(optim)
    if sorted(optim) != list(range(ranks)) or not 0 < ranks <= MAX_RANKS:
        raise InvalidCheckpoint(
            f"DeepSpeed optimizer states for ranks {sorted(optim)[:8]}: not 0..N-1",
            "a rank's *_optim_states.pt is missing; push the whole global_stepN/ directory",
        )
    states = model.get(0)
    if states is None:
        raise InvalidCheckpoint("a DeepSpeed checkpoint without rank 0's model states", _AGAIN)
    facts = states.state
    dp, mp = facts.get("dp_world_size"), facts.get("mp_world_size")
    if type(dp) is not int or type(mp) is not int or mp != 1 or dp != ranks:
        raise InvalidCheckpoint(
            f"{states.path} records dp_world_size {_short(dp)} and mp_world_size {_short(mp)}"
            f", with {ranks} optimizer states files",
            "a rank's *_optim_states.pt is missing or left from another save; push the whole "
            "global_stepN/ directory of one save",
        )
    for what in ("frozen_param_shapes", "shared_params", "frozen_param_fragments"):
        if facts.get(what):
            raise InvalidCheckpoint(
                f"{states.path} records {what}: reg does not rebuild DeepSpeed's frozen or "
                "shared parameters yet",
                "train with every parameter trainable and untied, or convert with zero_to_fp32",
            )
    shapes = _param_shapes(facts.get("param_shapes"), states.path)
    opts = [optim[r].state.get("optimizer_state_dict") for r in range(ranks)]
    if not all(isinstance(o, dict) for o in opts):
        raise InvalidCheckpoint("a DeepSpeed optimizer states file without its "
                                "optimizer_state_dict", _AGAIN)  # fmt: skip
    if "fp32_flat_groups" in opts[0]:
        stage, key, inner = 3, "fp32_flat_groups", "optimizer_state_dict"
    elif "single_partition_of_fp32_groups" in opts[0]:
        stage, key, inner = 2, "single_partition_of_fp32_groups", "base_optimizer_state"
    else:
        raise InvalidCheckpoint(
            f"{optim[0].path} holds no ZeRO fp32 partitions: not a ZeRO-1/2/3 save", _AGAIN
        )
    flats = [_flat_groups(optim[r], opts[r].get(key), len(shapes), key) for r in range(ranks)]
    tensors: dict[str, tuple[str, tuple[int, ...], list[Piece]]] = {}
    if stage == 2:
        paddings = opts[0].get("param_alignment_paddings")
        _zero2(tensors, shapes, flats, paddings)
    else:
        _zero3(tensors, shapes, flats)
    _optimizer(tensors, optim, opts, inner)
    step = facts.get("global_steps")
    return Built(tensors, stage, ranks, step if type(step) is int and step >= 0 else None)


def _short(value: Any) -> str:
    return repr(value)[:20] if isinstance(value, int | str | None) else type(value).__name__


def _param_shapes(value: Any, label: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    if not isinstance(value, list) or not value:
        raise InvalidCheckpoint(f"{label}: param_shapes is not a list of groups", _AGAIN)
    out = []
    for group in value:
        if not isinstance(group, dict):
            raise InvalidCheckpoint(f"{label}: a param_shapes group is not a dict", _AGAIN)
        shapes = []
        for name, shape in group.items():
            ok = isinstance(name, str) and 0 < len(name) <= 4096 and isinstance(shape, tuple)
            if not ok or len(shape) > MAX_DIMS or math.prod(shape) > MAX_INT:
                raise InvalidCheckpoint(f"{label}: param_shapes has an entry that is not a "
                                        "name and a shape", _AGAIN)  # fmt: skip
            shapes.append((name, shape))
        out.append(shapes)
    return out


@dataclass(frozen=True, slots=True)
class _Flat:
    """One rank's flat fp32 partition of one parameter group, in its file."""

    file: str
    dtype: str
    at: int  # its first element's byte
    numel: int


def _flat_groups(file: _File, value: Any, groups: int, key: str) -> list[_Flat]:
    if not isinstance(value, list) or len(value) != groups:
        raise InvalidCheckpoint(
            f"{file.path}: {key} holds {len(value) if isinstance(value, list) else 'no'} "
            f"groups, param_shapes {groups}",
            _AGAIN,
        )
    out = []
    for g, tensor in enumerate(value):
        if not isinstance(tensor, StoredTensor) or len(tensor.shape) != 1:
            raise InvalidCheckpoint(f"{file.path}: {key}[{g}] is not a flat tensor", _AGAIN)
        dtype, at, numel = _where(file, tensor, f"{file.path}: {key}[{g}]")
        out.append(_Flat(file.path, dtype, at, numel))
    return out


def _pieces(flat: _Flat, start: int, count: int, into: int) -> Piece:
    return Piece(into, count, flat.file, flat.at + start * DTYPE_SIZES[flat.dtype])


def _zero2(
    tensors: dict[str, Any],
    shapes: list[list[tuple[str, tuple[int, ...]]]],
    flats: list[list[_Flat]],
    paddings: Any,
) -> None:
    """ZeRO-1/2: a group's full flat vector is the ranks' partitions one after another; its
    parameters lie in it in param_shapes order, each followed by its alignment padding."""
    ranks = len(flats)
    for g, group in enumerate(shapes):
        parts = [flats[r][g] for r in range(ranks)]
        starts = [0]
        for part in parts:
            starts.append(starts[-1] + part.numel)
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        if pads is not None and (not isinstance(pads, list) or len(pads) != len(group)):
            raise InvalidCheckpoint(f"param_alignment_paddings of group {g} do not match its "
                                    "parameters", _AGAIN)  # fmt: skip
        offset = 0
        for i, (name, shape) in enumerate(group):
            numel = math.prod(shape)
            pieces = []
            at = offset
            while at < offset + numel:
                r = _rank_of(starts, at)
                if r >= ranks:
                    raise InvalidCheckpoint(
                        f"group {g}'s partitions hold {starts[-1]} elements; {name[:80]!r} "
                        f"needs {offset + numel}",
                        _AGAIN,
                    )
                take = min(offset + numel, starts[r + 1]) - at
                pieces.append(_pieces(parts[r], at - starts[r], take, at - offset))
                at += take
            _add(tensors, name, parts[0].dtype, shape, pieces)
            pad = pads[i] if pads is not None else 0
            if type(pad) is not int or pad < 0:
                raise InvalidCheckpoint("a negative alignment padding", _AGAIN)
            offset += numel + pad
        align = 2 * ranks  # as zero_to_fp32 checks: both ends aligned to 2 x world size
        if math.ceil(offset / align) != math.ceil(starts[-1] / align):
            raise InvalidCheckpoint(
                f"group {g}: its parameters take {offset} elements of {starts[-1]}", _AGAIN
            )


def _rank_of(starts: list[int], at: int) -> int:
    for r in range(len(starts) - 1):
        if starts[r] <= at < starts[r + 1]:
            return r
    return len(starts) - 1


def _zero3(
    tensors: dict[str, Any],
    shapes: list[list[tuple[str, tuple[int, ...]]]],
    flats: list[list[_Flat]],
) -> None:
    """ZeRO-3: each parameter (param_shapes order, groups one after another) is split into
    `ceil(numel / ranks)`-element slices, rank r holding slice r at the same place in its
    flat groups (one after another); the last slice is padded."""
    ranks = len(flats)
    group_starts = [0]
    for flat in flats[0]:
        group_starts.append(group_starts[-1] + flat.numel)
    for r in range(1, ranks):
        if [f.numel for f in flats[r]] != [f.numel for f in flats[0]]:
            raise InvalidCheckpoint(f"rank {r}'s fp32_flat_groups differ in size from rank 0's",
                                    _AGAIN)  # fmt: skip
    offset = 0
    for name, shape in (item for group in shapes for item in group):
        numel = math.prod(shape)
        part = math.ceil(numel / ranks)
        if offset + part > group_starts[-1]:
            raise InvalidCheckpoint(
                f"fp32_flat_groups hold {group_starts[-1]} elements a rank; {name[:80]!r} "
                f"needs {offset + part}",
                _AGAIN,
            )
        pieces = []
        for r in range(ranks):
            want_from, want_to = r * part, min((r + 1) * part, numel)
            at = offset
            while want_from < want_to:
                g = _rank_of(group_starts, at)  # the group holding this rank-local element
                take = min(want_to - want_from, group_starts[g + 1] - at)
                pieces.append(_pieces(flats[r][g], at - group_starts[g], take, want_from))
                want_from += take
                at += take
        _add(tensors, name, flats[0][0].dtype, shape, pieces)
        offset += part
    if offset != group_starts[-1]:
        raise InvalidCheckpoint(
            f"the parameters take {offset} elements of each rank's {group_starts[-1]}", _AGAIN
        )


def _add(tensors: dict[str, Any], name: str, dtype: str, shape: tuple[int, ...],
         pieces: list[Piece]) -> None:  # fmt: skip
    key = f"module.{name}"
    if key in tensors:
        raise InvalidCheckpoint(f"param_shapes names {name[:80]!r} twice", _AGAIN)
    tensors[key] = (dtype, shape, pieces)


def _optimizer(
    tensors: dict[str, Any], optim: dict[int, _File], opts: list[dict[str, Any]], inner: str
) -> None:
    """The optimizer's state: each flat value's partitions, rank after rank, as one tensor;
    a 0-d value (Adam's step, the same on every rank) as rank 0 holds it."""
    per_rank = []
    for r, opt in enumerate(opts):
        base = opt.get(inner)
        state = base.get("state") if isinstance(base, dict) else None
        if not isinstance(state, dict):
            raise InvalidCheckpoint(f"{optim[r].path}: no optimizer state ({inner})", _AGAIN)
        per_rank.append(state)
    for g, values in per_rank[0].items():
        if type(g) is not int or not isinstance(values, dict):
            continue
        for name, tensor in values.items():
            if not isinstance(name, str) or not isinstance(tensor, StoredTensor):
                continue
            key = f"optimizer.state.{g}.{name}"
            if not tensor.shape:
                dtype, at, _ = _where(optim[0], tensor, f"{optim[0].path}: {key}")
                tensors[key] = (dtype, (), [Piece(0, 1, optim[0].path, at)])
                continue
            pieces, total, dtype = [], 0, tensor.dtype
            for r, state in enumerate(per_rank):
                theirs = state.get(g, {}).get(name) if isinstance(state.get(g), dict) else None
                if not isinstance(theirs, StoredTensor) or len(theirs.shape) != 1:
                    raise InvalidCheckpoint(f"{optim[r].path}: {key} is not a flat tensor "
                                            "like rank 0's", _AGAIN)  # fmt: skip
                got, at, numel = _where(optim[r], theirs, f"{optim[r].path}: {key}")
                if got != dtype:
                    raise InvalidCheckpoint(f"{optim[r].path}: {key} is {got}, rank 0's "
                                            f"{dtype}", _AGAIN)  # fmt: skip
                pieces.append(Piece(total, numel, optim[r].path, at))
                total += numel
            tensors[key] = (dtype, (total,), pieces)


# -- boxes ---------------------------------------------------------------------------------------


def boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes (offsets, sizes, first element) covering elements [start, stop) of a row-major
    tensor of `shape`, in order, each contiguous in memory: at most 2 x dims - 1 of them."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    rest = tuple(0 for _ in shape[1:])
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    row = start // inner
    if start % inner:  # a partial first row
        end = min(stop, (row + 1) * inner)
        for o, s, f in boxes(shape[1:], start - row * inner, end - row * inner):
            out.append(((row, *o), (1, *s), f + row * inner))
        start, row = end, row + 1
    full = (stop - start) // inner
    if full:  # whole rows
        out.append(((row, *rest), (full, *shape[1:]), start))
        start, row = start + full * inner, row + full
    if start < stop:  # a partial last row
        for o, s, f in boxes(shape[1:], 0, stop - start):
            out.append(((row, *o), (1, *s), f + row * inner))
    return out


def metadata(
    parts: Mapping[str, bytes], *, light: bool, sizes: Mapping[str, int] | None = None
) -> Any:
    """One DCP metadata for a DeepSpeed checkpoint whose files' ranges are `parts`: each tensor
    a chunk per box of each piece, stored raw. `light`: stand-ins, no torch."""
    built = build(parts)
    for path, blob in parts.items():
        size = Ranges.decode(blob, path).size
        if sizes is not None and path in sizes and sizes[path] != size:
            raise InvalidCheckpoint(f"{path} is {sizes[path]} bytes; its ranges were read "
                                    f"from {size}", _AGAIN)  # fmt: skip
    chunks: dict[
        str, tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...], RawStorage]]]
    ] = {}
    for key, (dtype, shape, pieces) in built.tensors.items():
        itemsize = DTYPE_SIZES[dtype]
        placed = []
        if not math.prod(shape):
            zeros = (0,) * len(shape)
            placed.append((zeros, shape, RawStorage(pieces[0].file if pieces else "", 0, 0)))
        for piece in pieces:
            for offsets, box, first in boxes(shape, piece.start, piece.start + piece.count):
                at = piece.at + (first - piece.start) * itemsize
                placed.append((offsets, box, RawStorage(piece.file, at, math.prod(box) * itemsize)))
        chunks[key] = (dtype, shape, placed)
    if light:
        out = st._Metadata()
        for key, (dtype, shape, placed) in chunks.items():
            out.state_dict_metadata[key] = st._Tensor(
                st._Props(st._Dtype(dtype)), shape, [st._Chunk(o, s) for o, s, _ in placed]
            )
            for o, _, storage in placed:
                out.storage_data[st._Index(key, o)] = storage
        return out
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key, (dtype, shape, placed) in chunks.items():
        props = TensorProperties(dtype=getattr(torch, dtype))
        state[key] = TensorStorageMetadata(
            props,
            torch.Size(shape),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in placed],
        )
        for o, _, raw in placed:
            storage[MetadataIndex(key, torch.Size(o), 0)] = raw
    return Metadata(state_dict_metadata=state, storage_data=storage)
