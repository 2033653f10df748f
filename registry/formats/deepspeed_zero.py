"""Where a DeepSpeed ZeRO checkpoint keeps each parameter's fp32 weights, as DeepSpeed's
`zero_to_fp32.py` (0.19.8) rebuilds them, and the DCP metadata that places them
(deepspeed_root.py reads the files).

ZeRO-1/2 (`_zero2`): a parameter group's full flat vector is the ranks' partitions
(`single_partition_of_fp32_groups`) one after another; its parameters lie in it in
`param_shapes` order, each followed by its alignment padding. ZeRO-3 (`_zero3`): each parameter
is split into `ceil(numel / ranks)`-element slices, rank r's at the same place in its
`fp32_flat_groups`. Either way a parameter is pieces of consecutive elements, each in one
rank's file (`Piece`); each piece becomes chunks, boxes of the parameter's real shape whose
elements are contiguous in the record (`boxes`), stored raw (`dcp.RawStorage`). The
optimizer's state: each flat value's partitions, rank after rank, as one tensor; a 0-d value
(Adam's step, the same on every rank) as rank 0 holds it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from registry.errors import InvalidCheckpoint
from registry.formats import safetensors_root as st
from registry.formats.dcp import DTYPE_SIZES, MAX_DIMS, MAX_INT, RawStorage
from registry.formats.deepspeed_root import (
    AGAIN,
    MAX_RANKS,
    MODEL_STATES,
    NAME,
    File,
    Ranges,
    open_file,
    where,
)
from registry.formats.torch_pickle_bounds import StoredTensor

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, first element


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


def build(parts: Mapping[str, bytes]) -> Built:
    """The tensors of a DeepSpeed checkpoint whose files' ranges (`read_root`) are `parts`."""
    optim: dict[int, File] = {}
    model: dict[int, File] = {}
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
        files = optim if found["kind"] == "optim" else model
        if rank in files:  # zero_to_fp32 counts every file: two for one rank are refused
            raise InvalidCheckpoint(
                f"{files[rank].path} and {path} are both rank {rank}'s {found['kind']} states",
                "push the global_stepN/ directory of one save, as DeepSpeed wrote it",
            )
        files[rank] = open_file(path, blob, path)
    if not model:
        raise InvalidCheckpoint("a DeepSpeed checkpoint without its model states file "
                                f"({MODEL_STATES[0]})", AGAIN)  # fmt: skip
    ranks = len(optim)
    if sorted(optim) != list(range(ranks)) or not 0 < ranks <= MAX_RANKS:
        raise InvalidCheckpoint(
            f"DeepSpeed optimizer states for ranks {sorted(optim)[:8]}: not 0..N-1",
            "a rank's *_optim_states.pt is missing; push the whole global_stepN/ directory",
        )
    states = model.get(0)
    if states is None:
        raise InvalidCheckpoint("a DeepSpeed checkpoint without rank 0's model states", AGAIN)
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
    opts: list[dict[str, Any]] = []
    for r in range(ranks):
        opt = optim[r].state.get("optimizer_state_dict")
        if not isinstance(opt, dict):
            raise InvalidCheckpoint(
                f"{optim[r].path} holds no optimizer_state_dict: not DeepSpeed's", AGAIN
            )
        opts.append(opt)
    kinds = {"fp32_flat_groups", "single_partition_of_fp32_groups"} & set(opts[0])
    if kinds == {"fp32_flat_groups"}:
        stage, key, inner = 3, "fp32_flat_groups", "optimizer_state_dict"
    elif kinds == {"single_partition_of_fp32_groups"}:
        stage, key, inner = 2, "single_partition_of_fp32_groups", "base_optimizer_state"
    else:
        raise InvalidCheckpoint(
            f"{optim[0].path} holds {'both ZeRO-2 and ZeRO-3' if kinds else 'no ZeRO'} fp32 "
            "partitions: not a ZeRO-1/2/3 save",
            AGAIN,
        )
    for r, opt in enumerate(opts):
        count = opt.get("partition_count")
        counts = count if isinstance(count, list) else [count]
        whole = bool(counts) and all(type(c) is int for c in counts)
        if not whole or max(counts) != ranks:
            raise InvalidCheckpoint(
                f"{optim[r].path} records partition_count "
                f"{max(counts) if whole else _short(count)}, with {ranks} optimizer states files",
                AGAIN,
            )
    flats = [_flat_groups(optim[r], opts[r].get(key), len(shapes), key) for r in range(ranks)]
    tensors: dict[str, tuple[str, tuple[int, ...], list[Piece]]] = {}
    _buffers(tensors, states)
    if stage == 2:
        paddings = _paddings(opts[0].get("param_alignment_paddings"), shapes, optim[0].path)
        _zero2(tensors, shapes, flats, paddings)
    else:
        _zero3(tensors, shapes, flats)
    _optimizer(tensors, optim, opts, inner)
    step = facts.get("global_steps")
    return Built(tensors, stage, ranks, step if type(step) is int and step >= 0 else None)


def _buffers(tensors: dict[str, Any], states: File) -> None:
    """The module's buffers (`buffer_names`), as the model states file holds them (zero_to_fp32
    casts floating ones to fp32; `reg promote --dtype fp32` does the same)."""
    names, module = states.state.get("buffer_names"), states.state.get("module")
    if names in (None, []):
        return
    if not isinstance(names, list) or not isinstance(module, dict):
        raise InvalidCheckpoint(f"{states.path}: buffer_names is not a list of names", AGAIN)
    for name in names:
        if not isinstance(name, str) or not name or len(name) > 4096:
            raise InvalidCheckpoint(f"{states.path}: buffer_names holds a non-name", AGAIN)
        dtype, at, numel = where(states, module.get(name), f"{states.path}: buffer {name[:80]!r}")
        shape = module[name].shape
        _add(tensors, name, dtype, shape, [Piece(0, numel, states.path, at)] if numel else [])


def _paddings(value: Any, shapes: list[list[tuple[str, tuple[int, ...]]]], label: str) -> Any:
    """param_alignment_paddings: none (an older DeepSpeed), or a whole number per parameter."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == len(shapes)
    ok = ok and all(
        isinstance(pads, list)
        and len(pads) == len(group)
        and all(type(p) is int and 0 <= p <= MAX_INT for p in pads)
        for pads, group in zip(value, shapes, strict=False)
    )
    if not ok:
        raise InvalidCheckpoint(f"{label}: param_alignment_paddings do not match param_shapes",
                                AGAIN)  # fmt: skip
    return value


def _short(value: Any) -> str:
    return repr(value)[:20] if isinstance(value, int | str | None) else type(value).__name__


def _param_shapes(value: Any, label: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    if not isinstance(value, list) or not value:
        raise InvalidCheckpoint(f"{label}: param_shapes is not a list of groups", AGAIN)
    out = []
    for group in value:
        if not isinstance(group, dict):
            raise InvalidCheckpoint(f"{label}: a param_shapes group is not a dict", AGAIN)
        shapes = []
        for name, shape in group.items():
            ok = isinstance(name, str) and 0 < len(name) <= 4096 and isinstance(shape, tuple)
            ok = ok and all(type(d) is int and 0 <= d <= MAX_INT for d in shape)
            if not ok or len(shape) > MAX_DIMS or math.prod(shape) > MAX_INT:
                raise InvalidCheckpoint(f"{label}: param_shapes has an entry that is not a "
                                        "name and a shape", AGAIN)  # fmt: skip
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


def _flat_groups(file: File, value: Any, groups: int, key: str) -> list[_Flat]:
    if not isinstance(value, list) or len(value) != groups:
        raise InvalidCheckpoint(
            f"{file.path}: {key} holds {len(value) if isinstance(value, list) else 'no'} "
            f"groups, param_shapes {groups}",
            AGAIN,
        )
    out = []
    for g, tensor in enumerate(value):
        if not isinstance(tensor, StoredTensor) or len(tensor.shape) != 1:
            raise InvalidCheckpoint(f"{file.path}: {key}[{g}] is not a flat tensor", AGAIN)
        dtype, at, numel = where(file, tensor, f"{file.path}: {key}[{g}]")
        if dtype != "float32":  # the fp32 master weights, whatever the training dtype
            raise InvalidCheckpoint(f"{file.path}: {key}[{g}] is {dtype}, not float32", AGAIN)
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
        pads = paddings[g] if paddings is not None else None  # checked by _paddings
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
                        AGAIN,
                    )
                take = min(offset + numel, starts[r + 1]) - at
                pieces.append(_pieces(parts[r], at - starts[r], take, at - offset))
                at += take
            _add(tensors, name, parts[0].dtype, shape, pieces)
            pad = pads[i] if pads is not None else 0
            if type(pad) is not int or pad < 0:
                raise InvalidCheckpoint("a negative alignment padding", AGAIN)
            offset += numel + pad
        align = 2 * ranks  # as zero_to_fp32 checks: both ends aligned to 2 x world size
        if math.ceil(offset / align) != math.ceil(starts[-1] / align):
            raise InvalidCheckpoint(
                f"group {g}: its parameters take {offset} elements of {starts[-1]}", AGAIN
            )


def _rank_of(starts: list[int], at: int) -> int:
    """Which part of `starts` (cumulative, from 0) holds element `at`; len(starts) - 1 past
    the end."""
    return min(bisect.bisect_right(starts, at) - 1, len(starts) - 1)


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
                                    AGAIN)  # fmt: skip
    offset = 0
    for name, shape in (item for group in shapes for item in group):
        numel = math.prod(shape)
        part = math.ceil(numel / ranks)
        if offset + part > group_starts[-1]:
            raise InvalidCheckpoint(
                f"fp32_flat_groups hold {group_starts[-1]} elements a rank; {name[:80]!r} "
                f"needs {offset + part}",
                AGAIN,
            )
        pieces = []
        for r in range(math.ceil(numel / part) if part else 0):  # the ranks holding some
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
            f"the parameters take {offset} elements of each rank's {group_starts[-1]}", AGAIN
        )


def _add(tensors: dict[str, Any], name: str, dtype: str, shape: tuple[int, ...],
         pieces: list[Piece]) -> None:  # fmt: skip
    key = f"module.{name}"
    if key in tensors:
        raise InvalidCheckpoint(f"param_shapes names {name[:80]!r} twice", AGAIN)
    tensors[key] = (dtype, shape, pieces)


def _optimizer(
    tensors: dict[str, Any], optim: dict[int, File], opts: list[dict[str, Any]], inner: str
) -> None:
    """The optimizer's state: each flat value's partitions, rank after rank, as one tensor;
    a 0-d value (Adam's step, the same on every rank) as rank 0 holds it."""
    per_rank = []
    for r, opt in enumerate(opts):
        base = opt.get(inner)
        state = base.get("state") if isinstance(base, dict) else None
        if not isinstance(state, dict):
            raise InvalidCheckpoint(f"{optim[r].path}: no optimizer state ({inner})", AGAIN)
        per_rank.append(state)
    for g, values in per_rank[0].items():
        if type(g) is not int or not isinstance(values, dict):
            continue
        for name, tensor in values.items():
            if not isinstance(name, str) or not isinstance(tensor, StoredTensor):
                continue
            key = f"optimizer.state.{g}.{name}"
            if not tensor.shape:
                dtype, at, _ = where(optim[0], tensor, f"{optim[0].path}: {key}")
                tensors[key] = (dtype, (), [Piece(0, 1, optim[0].path, at)])
                continue
            pieces, total, dtype = [], 0, tensor.dtype
            for r, state in enumerate(per_rank):
                theirs = state.get(g, {}).get(name) if isinstance(state.get(g), dict) else None
                if not isinstance(theirs, StoredTensor) or len(theirs.shape) != 1:
                    raise InvalidCheckpoint(f"{optim[r].path}: {key} is not a flat tensor "
                                            "like rank 0's", AGAIN)  # fmt: skip
                got, at, numel = where(optim[r], theirs, f"{optim[r].path}: {key}")
                if got != dtype:
                    raise InvalidCheckpoint(f"{optim[r].path}: {key} is {got}, rank 0's "
                                            f"{dtype}", AGAIN)  # fmt: skip
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
                                    f"from {size}", AGAIN)  # fmt: skip
    chunks: dict[str, tuple[str, st.Shape, st.Placed]] = {}
    for key, (dtype, shape, pieces) in built.tensors.items():
        itemsize = DTYPE_SIZES[dtype]
        placed: st.Placed = []
        if not math.prod(shape):  # no element: one empty chunk, no byte read
            zeros = (0,) * len(shape)
            placed.append((zeros, shape, RawStorage(min(parts), 0, 0)))
        for piece in pieces:
            for offsets, box, first in boxes(shape, piece.start, piece.start + piece.count):
                at = piece.at + (first - piece.start) * itemsize
                placed.append((offsets, box, RawStorage(piece.file, at, math.prod(box) * itemsize)))
        chunks[key] = (dtype, shape, placed)
    return st.raw_metadata(chunks, light=light)
