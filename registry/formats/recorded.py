"""The step and world size a checkpoint's own files record, so `push-ckpt` need not be told.

  - the transformers Trainer: `trainer_state.json`'s `global_step`; one `rng_state_R.pth` per
    rank (`rng_state.pth` alone: one process);
  - Megatron-LM: `common.pt`'s `iteration` (read for its structure only), which the
    directory's name, `iter_NNNNNNN`, must agree with (its `latest_checkpointed_iteration.txt`
    names that directory in the parent). Megatron records no world size: TP x PP x DP is
    given on the command line (`requires_world_size`);
  - DeepSpeed: the model states' `global_steps`, and `dp_world_size` x `mp_world_size`
    (read for their structure only, from the ranges the push read: deepspeed_root.py).

A value given on the command line that disagrees with one recorded is refused (exit 2): one of
them names the wrong checkpoint. Files are read through the caller's `read` (bounded, proven
where they come from a store) and never trusted further than a whole number.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from registry.errors import InvalidCheckpoint, UsageError
from registry.formats import deepspeed_root
from registry.formats.dcp_scan import check_kind
from registry.formats.sidecars import MAX_BYTES, TORCH_STRUCTURE, Unreadable, load

TRAINER_STATE = "trainer_state.json"
MAX_TRAINER_STATE = 16 * 1024 * 1024  # a long run's log_history is a few MiB
MAX_STEP = 10**18
_RNG_FILE = re.compile(r"rng_state_(\d{1,9})\.pth")
MEGATRON_ITERATION = re.compile(r"iter_(\d{7,18})")
MEGATRON_FILES = ("metadata.json", "common.pt")


@dataclass(frozen=True, slots=True)
class Recorded:
    step: int | None = None
    step_source: str | None = None  # e.g. "trainer_state.json:global_step"
    world_size: int | None = None
    world_source: str | None = None
    requires_world_size: str | None = None  # why --world-size must be given, when it must


def recorded(name: str, files: Mapping[str, int], read: Callable[[str], bytes]) -> Recorded:
    """What the files (path -> size) of a checkpoint directory called `name` record."""
    step, step_source = _trainer_step(files, read)
    requires = None
    if all(f in files for f in MEGATRON_FILES):
        requires = "Megatron records no world size (TP x PP x DP)"
        if step is None:
            step, step_source = _megatron_step(name, files, read)
    world, world_source = _trainer_world(files)
    if step is None and world is None:
        step, step_source, world, world_source = _deepspeed(files, read)
    return Recorded(step, step_source, world, world_source, requires)


def _deepspeed(
    files: Mapping[str, int], read: Callable[[str], bytes]
) -> tuple[int | None, str | None, int | None, str | None]:
    name = next((n for n in deepspeed_root.MODEL_STATES if n in files), None)
    if name is None:
        return None, None, None, None
    try:
        states = deepspeed_root.states_structure(read(name), name)
    except (InvalidCheckpoint, OSError):
        return None, None, None, None  # the push's scan says what is wrong with it
    if not isinstance(states, dict):
        return None, None, None, None
    step, dp, mp = (states.get(k) for k in ("global_steps", "dp_world_size", "mp_world_size"))
    step_ok = type(step) is int and 0 <= step < MAX_STEP
    world = dp * mp if type(dp) is int and type(mp) is int else 0
    world_ok = 0 < world <= 1 << 20
    return (
        step if step_ok else None,
        f"{name}:global_steps" if step_ok else None,
        world if world_ok else None,
        f"{name}:dp_world_size x mp_world_size" if world_ok else None,
    )


def recorded_in(directory: Path) -> Recorded:
    """`recorded` for a local directory (its top-level files only: what it reads is there)."""
    try:  # regular files, never through a link (the push's scan refuses links anyway)
        files = {
            p.name: p.lstat().st_size
            for p in directory.iterdir()
            if stat.S_ISREG(p.lstat().st_mode)
        }
    except OSError:
        return Recorded()  # the push's scan says what is wrong with the directory

    def read(path: str) -> bytes:
        fd = os.open(directory / path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if deepspeed_root.is_root_name(path):  # by its ranges, as the push reads it
                size = os.fstat(fd).st_size
                return deepspeed_root.read_root(lambda at, n: os.pread(fd, n, at), size, path)[0]
            return f.read(MAX_TRAINER_STATE + 1)

    return recorded(directory.resolve().name, files, read)


def _trainer_step(
    files: Mapping[str, int], read: Callable[[str], bytes]
) -> tuple[int | None, str | None]:
    if TRAINER_STATE not in files or files[TRAINER_STATE] > MAX_TRAINER_STATE:
        return None, None
    try:
        state = json.loads(read(TRAINER_STATE))
    except (ValueError, UnicodeDecodeError, RecursionError, OSError):
        return None, None  # the resume check reports it as present but unread
    step = state.get("global_step") if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
        return None, None
    return step, f"{TRAINER_STATE}:global_step"


def _megatron_step(
    name: str, files: Mapping[str, int], read: Callable[[str], bytes]
) -> tuple[int | None, str | None]:
    """common.pt's iteration, which the directory's name iter_N must agree with; the name's
    when common.pt cannot be read."""
    named = MEGATRON_ITERATION.fullmatch(name)
    iteration = None
    if files["common.pt"] <= MAX_BYTES:
        try:
            common = load(read("common.pt"), kind=TORCH_STRUCTURE)
        except (Unreadable, OSError):
            common = None
        found = common.get("iteration") if isinstance(common, dict) else None
        if type(found) is int and 0 <= found < MAX_STEP:
            iteration = found
    if iteration is None:
        return (int(named.group(1)), f"the directory name {name}") if named else (None, None)
    if named and int(named.group(1)) != iteration:
        raise UsageError(
            f"the directory name {name} disagrees with common.pt:iteration, which says {iteration}",
            "push the directory Megatron saved at that iteration, under its own name",
        )
    return iteration, "common.pt:iteration"


def _trainer_world(files: Mapping[str, int]) -> tuple[int | None, str | None]:
    """The Trainer's: one rng_state_R.pth per process, R = 0..N-1; rng_state.pth alone: one
    process (another trainer's rng files may follow other rules: not read as a world size)."""
    if TRAINER_STATE not in files:
        return None, None
    ranks = {int(m.group(1)) for f in files if (m := _RNG_FILE.fullmatch(f))}
    if ranks and ranks == set(range(len(ranks))):
        n = len(ranks)
        return n, f"rng_state_0..{n - 1}.pth" if n > 1 else "rng_state_0.pth"
    if not ranks and "rng_state.pth" in files:
        return 1, "rng_state.pth"
    return None, None


def resolve_step(given: int | None, found: Recorded) -> int:
    """The step to push: the one given, which must agree with a recorded one, else the one
    recorded (UsageError when neither exists)."""
    if given is None:
        if found.step is None:
            raise UsageError(
                "--step is required: the checkpoint's files record no step",
                "pass --step N, the training step it was saved at",
            )
        return found.step
    if found.step is not None and given != found.step:
        raise UsageError(
            f"--step {given} disagrees with {found.step_source}, which says {found.step}",
            "leave --step out to use the recorded step, or push the checkpoint of that step",
        )
    return given


def resolve_world_size(given: int | None, found: Recorded) -> int | None:
    """The world size to record: given (checked against a recorded one), else recorded, else
    None (inferred from the shard files). UsageError where it must be given and is not."""
    if given is None:
        if found.world_size is None and found.requires_world_size:
            raise UsageError(
                f"--world-size is required: {found.requires_world_size}",
                "pass --world-size N, the number of processes that saved it",
            )
        return found.world_size
    if found.world_size is not None and given != found.world_size:
        raise UsageError(
            f"--world-size {given} disagrees with {found.world_source}, which show "
            f"{found.world_size} ranks",
            "leave --world-size out to use the recorded one",
        )
    return given


def recorded_step(src: Path, step: int | None, world_size: int | None) -> int:
    """The step to push `src` as: the one given, else the one the checkpoint's own files record
    (the Trainer's, DeepSpeed's, Megatron's). A step or world size given that disagrees with
    them is a UsageError here, before a byte moves; so is a step neither gives. What the
    directory is gets said first (a save directory rather than the checkpoint in it, another
    stack's save), since that is why nothing would be found."""
    check_kind(src)
    found = recorded_in(src)
    step = resolve_step(step, found)
    resolve_world_size(world_size, found)
    return step
