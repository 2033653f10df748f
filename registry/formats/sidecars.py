"""Read the files trainers write beside their DCP shards, safely, into key paths.

Lightning writes `meta.pt` (global step, epoch, loop progress, LR schedulers); accelerate writes
`scheduler.bin`, `random_states_N.pkl`, `custom_checkpoint_N.pkl`, `sampler.bin`, `scaler.pt`;
the transformers Trainer `trainer_state.json`, `scheduler.pt`, `rng_state_N.pth` (and, in its
plain save, `optimizer.pt`).
What they hold decides whether a checkpoint can resume, so the registry reads them, never
trusting them:
  - `torch.load(weights_only=True)`: torch's restricted unpickler, nothing imported or called
    beyond tensors and plain containers;
  - accelerate's and the Trainer's RNG files need numpy arrays: exactly the numpy globals they
    reference are allowed (`NUMPY_GLOBALS`), nothing else;
  - a JSON document (`trainer_state.json`) by Python's parser, linear in its length;
  - before torch sees it, the file must be a torch.save archive whose records are stored, not
    compressed (a 3 MB deflated record inflates to gigabytes), and its pickle no larger than
    `MAX_PICKLE` and naming no global longer than `MAX_GLOBAL` characters (torch's refusal
    message is searched by a regex that is quadratic in the name);
  - nor may its pickle make torch's unpickler do more than linear work (`check_pickle`: dict
    keys crafted to share a hash or a probe path, memo indices likewise, one container handed
    on again and again through the memo);
  - a file over `MAX_BYTES` is not read.

A read file becomes entries of the checkpoint's sidecar list (pure strings, recorded in the
catalog with its key paths): `FILE` (present), `FILE:` (read), and `FILE:PATH` for each non-empty
value down to `DEPTH` levels (`meta.pt:global_step`, `meta.pt:loops.fit_loop`). A file that is
present but could not be read is `FILE` and `FILE!WHY`. policies/layouts.py says which entries
are which resume class.
"""

from __future__ import annotations

import functools
import importlib
import io
import itertools
import json
import pickletools
import re
import struct
import threading
import zipfile
from collections.abc import Callable, Iterable
from typing import Any

from policies.layouts import READ as READ_MARK
from policies.layouts import UNREAD as UNREAD_MARK
from registry.errors import InvalidCheckpoint
from registry.formats import deepspeed_root
from registry.formats.torch_pickle_bounds import NotPlain, Unbounded, read_structure
from registry.formats.torch_zip import NotCanonical, Region, archive_pickle

MAX_BYTES = 64 * 1024 * 1024
MAX_JSON = 16 * 1024 * 1024  # parsed JSON takes some 20 times its size in memory
MAX_PICKLE = 8 * 1024 * 1024
MAX_GLOBAL = 200
MAX_RECORDS = 100_000
MAX_WHY = 200
DEPTH = 4
MAX_ENTRIES = 512  # per file

# The numpy globals accelerate's random_states_N.pkl references (numpy's legacy RNG state).
NUMPY_GLOBALS = (
    ("numpy", "ndarray"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),  # the name numpy < 2 pickles
    ("numpy", "dtype"),
    ("numpy.dtypes", "UInt32DType"),
)

# How a sidecar is read: torch.load(weights_only=True), the same with numpy's RNG arrays
# allowed, for its structure alone (no torch: every object an opaque stand-in), or as JSON.
TORCH, TORCH_NUMPY, TORCH_STRUCTURE, JSON = "torch", "torch+numpy", "structure", "json"
# DeepSpeed's model states (rank 0's): a root of the checkpoint too (deepspeed_root.py), read
# for its structure from the ranges read as a root, whatever the file's size
DEEPSPEED_STATES = "deepspeed-states"

# The sidecar files reg reads (file-name patterns) and how.
READ = (
    (re.compile(r"meta\.pt"), TORCH),  # Lightning
    (re.compile(r"scheduler(_\d+)?\.bin"), TORCH),  # accelerate
    (re.compile(r"(sampler|dl_state_dict)(_\d+)?\.bin"), TORCH),
    (re.compile(r"scaler\.pt"), TORCH),  # accelerate and the transformers Trainer
    (re.compile(r"custom_checkpoint_\d+\.pkl"), TORCH),  # register_for_checkpointing
    (re.compile(r"random_states_\d+\.pkl"), TORCH_NUMPY),
    # the transformers Trainer: its step and data position, LR scheduler and each rank's RNG
    (re.compile(r"trainer_state\.json"), JSON),
    (re.compile(r"scheduler\.pt"), TORCH),
    (re.compile(r"rng_state(_\d+)?\.pth"), TORCH_NUMPY),
    (re.compile(r"optimizer\.pt"), TORCH),  # its plain save's optimizer state_dict
    (re.compile(r"adapter_config\.json"), JSON),  # a PEFT adapter's (save_pretrained)
    # Megatron-LM's common state: iteration, LR scheduler, optimizer param groups beside the
    # run's argparse.Namespace, whose values name Megatron's enums: read for its structure only
    (re.compile(r"common\.pt"), TORCH_STRUCTURE),
    (re.compile(r"metadata\.json"), JSON),
    # DeepSpeed: global_steps, lr_scheduler, dp_world_size, data_sampler
    (re.compile(r"(zero_pp_rank_0_)?mp_rank_00_model_states\.pt"), DEEPSPEED_STATES),
)


def readable(path: str) -> str | None:
    """How reg reads `path` (TORCH, TORCH_NUMPY, TORCH_STRUCTURE or JSON); None when it does
    not."""
    for pattern, kind in READ:
        if pattern.fullmatch(path):
            return kind
    return None


# A torch.save archive over MAX_BYTES (the Trainer's optimizer.pt of a real model) is read for
# its structure alone from its first and last bytes: data.pkl is its first record, the central
# directory (at most MAX_RECORDS entries, some 90 bytes each) its end.
ENDS_HEAD = MAX_PICKLE + 64 * 1024
ENDS_TAIL = 16 * 1024 * 1024
# (path, head bytes, tail bytes) -> the file's first and last bytes, proven by the caller
ReadEnds = Callable[[str, int, int], tuple[bytes, bytes]]


def entries(
    paths: Iterable[str],
    sizes: dict[str, int],
    read: Callable[[str], bytes],
    read_ends: ReadEnds | None = None,
) -> list[str]:
    """The sidecar entries of the files `paths` (beside the shards): each file, and for those
    reg reads, what they hold (`read(path)` gives the bytes, proven by the caller; a torch
    archive over MAX_BYTES is read for its structure through `read_ends`, where given)."""
    out: list[str] = []
    for path in sorted(paths):
        out.append(path)
        kind = readable(path)
        if kind is None:
            continue
        try:
            value = _read_one(path, kind, sizes.get(path, 0), read, read_ends)
        except Unreadable as exc:
            out.append(f"{path}{UNREAD_MARK}{str(exc)[:MAX_WHY]}")
            continue
        out.append(f"{path}{READ_MARK}")
        out.extend(f"{path}{READ_MARK}{p}" for p in content_paths(value))
    return out


class Unreadable(Exception):
    """Why a sidecar could not be read (one short line)."""


def _read_one(
    path: str, kind: str, size: int, read: Callable[[str], bytes], read_ends: ReadEnds | None
) -> Any:
    """What one sidecar holds (Unreadable, with the reason, when reg cannot read it safely)."""
    if kind == DEEPSPEED_STATES:  # `read` gives the ranges read of it as a root
        try:
            return deepspeed_root.states_structure(read(path), path)
        except InvalidCheckpoint as exc:
            raise Unreadable(exc.message) from None
    limit = MAX_JSON if kind == JSON else MAX_BYTES
    if size > limit:
        if kind not in (TORCH, TORCH_STRUCTURE) or read_ends is None:
            raise Unreadable(f"it is over {limit >> 20} MiB")
        return large_structure(path, size, read_ends)
    data = read(path)
    return load_json(data) if kind == JSON else load(data, kind=kind)


def large_structure(path: str, size: int, read_ends: ReadEnds) -> Any:
    """The structure of a torch.save archive too large to read whole (tensors opaque, nothing
    run: `torch_pickle_bounds.read_structure`), from its data.pkl found through its two ends."""
    head, tail = read_ends(path, ENDS_HEAD, ENDS_TAIL)
    try:
        region = Region(head, size - len(head) - len(tail), tail)
        pickled = archive_pickle(region, MAX_RECORDS, MAX_PICKLE)
    except (NotCanonical, struct.error, UnicodeDecodeError) as exc:
        why = str(exc) if isinstance(exc, NotCanonical) else "it is not a zip archive"
        raise Unreadable(f"read by its ends (over {MAX_BYTES >> 20} MiB): {why}") from None
    try:
        return read_structure(pickled)
    except Exception as exc:  # any malformed pickle: one line, never a traceback
        raise Unreadable(f"its pickle does not read ({type(exc).__name__})") from None


def load(data: bytes, *, kind: str = TORCH) -> Any:
    structures = precheck(data)
    if kind == TORCH_STRUCTURE:  # what the precheck read is the answer: torch is not used
        if len(structures) != 1:
            raise Unreadable("it does not hold one pickle")
        return structures[0]
    allowed = numpy_globals() if kind == TORCH_NUMPY else []
    try:
        return torch_load(data, allowed)
    except Exception as exc:
        text = str(exc)
        found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", text)
        if found:
            raise Unreadable(f"torch.load(weights_only=True) refuses {found.group(1)}") from None
        raise Unreadable(f"it does not load ({type(exc).__name__})") from None


# torch keeps one process-wide list of the globals `weights_only=True` allows beyond its own,
# and libraries widen it when imported (megatron.core, torchtitan and peft add
# argparse.Namespace and more; lightning ten others). reg's loads allow exactly their own list:
# each swaps it in for the load and puts back what it found, one load at a time (a plain load
# of torch's elsewhere in the process meanwhile allows at most reg's list, never more).
_SAFE_GLOBALS = threading.Lock()


def torch_load(data: bytes, allowed: list[Any]) -> Any:
    """`torch.load(weights_only=True)` of `data` with exactly the globals `allowed` (numpy's,
    for an RNG state's arrays) beyond torch's own, whatever the process imported."""
    import torch

    serialization = torch.serialization
    with _SAFE_GLOBALS:
        found = serialization.get_safe_globals()
        serialization.clear_safe_globals()
        try:
            serialization.add_safe_globals(allowed)
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        finally:
            serialization.clear_safe_globals()
            serialization.add_safe_globals(found)


def load_json(data: bytes) -> Any:
    """A JSON document (Python's parser: linear in its length; text keys hash with the
    process's secret key, and a number of over 4,300 digits is refused)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise Unreadable("it is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise Unreadable("it is not a JSON document") from None


def precheck(data: bytes) -> list[Any]:
    """What torch.load is given: a zip of stored records, pickles of a bounded size naming
    globals of a bounded length (Unreadable otherwise). Each pickle's structure as the bounds
    pass read it (`read_structure`: every object an opaque stand-in), in record order."""
    structures: list[Any] = []
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        raise Unreadable("it is not a torch.save archive") from None
    if len(records) > MAX_RECORDS:
        raise Unreadable(f"it holds {len(records)} records")
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED:
            raise Unreadable(
                f"its record {record.filename[:80]} is compressed (torch.save never is)"
            )
        if record.filename.rsplit("/", 1)[-1] != "data.pkl":
            continue
        if record.file_size > MAX_PICKLE:
            raise Unreadable(f"its pickle is over {MAX_PICKLE >> 20} MiB")
        try:
            pickled = archive.read(record)
            _check_globals(pickled)
            structures.append(read_structure(pickled))
        except Unreadable:
            raise
        except NotPlain as exc:
            raise Unreadable(f"its pickle holds {exc}") from None
        except Unbounded as exc:
            raise Unreadable(f"its pickle would cost torch.load too much: {exc}") from None
        except Exception:
            raise Unreadable("its pickle does not parse") from None
    return structures


def _check_globals(data: bytes) -> None:
    """Every global the pickle names (GLOBAL's argument, STACK_GLOBAL's two strings) is short."""
    recent: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL" and len(str(arg)) > MAX_GLOBAL:
            raise Unreadable(f"it names a global of {len(str(arg))} characters")
        if op.name == "STACK_GLOBAL" and any(len(s) > MAX_GLOBAL for s in recent[-2:]):
            raise Unreadable(f"it names a global of over {MAX_GLOBAL} characters")
        if isinstance(arg, str):
            recent = [*recent[-1:], arg]


@functools.cache
def numpy_globals() -> list[Any]:
    """The allowed numpy globals that this numpy has, under the names pickles use (looked up
    once; callers hand the list on and never change it)."""
    out: list[Any] = []
    for module, name in NUMPY_GLOBALS:
        try:
            target = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        out.append((target, f"{module}.{name}"))
    return out


def content_paths(value: Any) -> list[str]:
    """Dotted paths of the non-empty values in `value`, down to DEPTH levels of dicts (keys
    that are plain text, among each dict's first MAX_ENTRIES; a list is one value), at most
    MAX_ENTRIES, sorted."""
    out: list[str] = []

    def walk(node: Any, prefix: str, depth: int) -> None:
        if len(out) >= MAX_ENTRIES or depth >= DEPTH or not isinstance(node, dict):
            return
        # a bounded look at each dict: one shared by many parents is not scanned whole each time
        for key, child in itertools.islice(node.items(), MAX_ENTRIES):
            if not (isinstance(key, str) and _plain(key)) or _empty(child):
                continue
            if len(out) >= MAX_ENTRIES:
                return
            path = f"{prefix}{key}"
            out.append(path)
            walk(child, path + ".", depth + 1)

    walk(value, "", 0)
    return sorted(out)


_KEY = re.compile(r"[A-Za-z0-9_\-+=/ ]{1,100}")


def _plain(key: str) -> bool:
    return bool(_KEY.fullmatch(key))


def _empty(value: Any) -> bool:
    if value is None:
        return True
    return isinstance(value, dict | list | tuple | set | str) and not value
