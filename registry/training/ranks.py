"""What every rank of a training job must agree on, and the state that differs by rank.

- `from_rank0(call)`: rank 0's answer (or error) on every rank; `agree(error)`: any rank's
  error raised on every rank. A rank that failed alone would leave the others waiting in a
  collective that never comes.
- `with_per_rank` / `per_rank_to_load`: per-rank state (an RNG, a data position) saved as
  `<class>.rank_<r>`, and what of it carries over at another world size.
- `unloadable(state)`: a value `restore` could not load back (weights_only), found at save.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from registry.errors import RegistryError, UsageError
from registry.formats.dcp_load import load_object


def with_per_rank(state: dict[str, Any], per_rank: dict[str, Any] | None) -> dict[str, Any]:
    """`state` with this rank's per-rank values under `<class>.rank_<r>` (a new dict)."""
    if not per_rank:
        return state
    clash = sorted(set(per_rank) & set(state))
    if clash:
        raise UsageError(
            f"per_rank class {clash[0]!r} is also a key of the state",
            "keep per-rank state out of the state dict (or rename the class)",
        )
    return {**state, **{cls: {f"rank_{current_rank()}": value} for cls, value in per_rank.items()}}


def per_rank_to_load(
    metadata: Any, per_rank: dict[str, Any] | None
) -> tuple[dict[str, Any], list[str]]:
    """Which per-rank classes this rank can load from the checkpoint, and notes on the rest
    (rank 0 also names saved ranks beyond the current world size)."""
    if not per_rank:
        return {}, []
    rank, world = current_rank(), world_size()
    saved: dict[str, set[int]] = {cls: set() for cls in per_rank}
    for fqn in metadata.state_dict_metadata:
        cls, _, rest = fqn.partition(".rank_")
        if cls in saved and rest.split(".", 1)[0].isdigit():
            saved[cls].add(int(rest.split(".", 1)[0]))
    load, notes = {}, []
    for cls, template in per_rank.items():
        ranks = saved[cls]
        if rank in ranks:
            load[cls] = template
        elif not ranks:
            notes.append(f"{cls}: the checkpoint has no per-rank {cls}; rank {rank} keeps its own")
        else:
            notes.append(
                f"{cls}: saved for ranks 0-{max(ranks)}, not for rank {rank}; it keeps its own"
            )
        beyond = sorted(r for r in ranks if r >= world)
        if rank == 0 and beyond:
            notes.append(
                f"{cls}: the state of rank(s) {', '.join(map(str, beyond))} is not loaded "
                f"(world size {world} now)"
            )
    return load, notes


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def unloadable(state: dict[str, Any]) -> RegistryError | None:
    """A value `restore` could not load back (it unpickles with weights_only=True): found
    at save time, not after the crash that needs the checkpoint."""

    flat, _ = flatten_state_dict(state)
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            continue
        data = io.BytesIO()
        try:
            torch.save(value, data)
            load_object(data.getvalue(), fqn)
        except RegistryError as exc:
            return UsageError(
                f"{exc.message.removesuffix('; refused')} on restore: nothing was saved",
                "save tensors, numbers, strings, lists and dicts (an RNG's state as a tensor)",
            )
        except Exception as exc:
            return UsageError(f"{fqn} cannot be saved: {type(exc).__name__}: {exc}")
    return None


def agree(error: RegistryError | None) -> None:
    """Every rank raises if any rank found `error` (the first rank's), so that no rank goes on
    into a collective the others left."""
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, error)
        error = next((e for e in every if e is not None), None)
    if error is not None:
        raise error


def from_rank0(call: Any) -> Any:
    """`call()` on rank 0, its answer (or its error) on every rank: a failure on rank 0 must
    not leave the other ranks waiting in a collective that never comes."""
    got: list[Any] = [None]
    if current_rank() == 0:
        try:
            got[0] = call()
        except RegistryError as exc:
            got[0] = exc
        except Exception as exc:  # what else failed, in a form every rank can unpickle
            got[0] = RegistryError(f"rank 0 failed: {type(exc).__name__}: {exc}")
            if not distributed():
                raise
    broadcast(got)
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def distributed() -> bool:
    return dist.is_initialized()


def broadcast(values: list[Any]) -> None:
    if dist.is_initialized():
        dist.broadcast_object_list(values, src=0)


def gather_max(phases: dict[str, float]) -> dict[str, float]:
    """Each phase's slowest rank (the job waits for it)."""
    if not dist.is_initialized():
        return phases
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, phases)
    return {k: max(float(p[k]) for p in every) for k in phases}


def gathered(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (this rank's alone outside torch.distributed)."""
    if not dist.is_initialized():
        return [value]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def summarised_notes(notes: list[str]) -> list[str]:
    """Every rank's resume notes: rank 0 (where loops log) gets its own and each other rank's,
    named (`rank 2: rng: ...`); the other ranks keep their own."""
    every = gathered(notes)
    if current_rank() != 0:
        return notes
    return notes + [f"rank {r}: {note}" for r, mine in enumerate(every) if r for note in mine]
