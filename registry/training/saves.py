"""What `CheckpointManager` keeps of one save and one restore while they run: a save's claim
(renewed by rank 0 until it ends), its stall and its committed result; a background save's
overlapped step times; a restore's phases. And `checked`: DCP's errors as one registry line."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from torch.distributed.checkpoint.api import CheckpointException

from registry.catalog.leases import Heartbeat
from registry.core import faults
from registry.core.refs import CheckpointRef
from registry.errors import RegistryError
from registry.training import ranks
from registry.training.backends import SERVER_LEASE_S

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future

    from registry.lifecycle.checkpoints.shared import SharedClaim
    from registry.training.backends import Backend
    from registry.training.store_writer import Written


class SaveOwner(Protocol):
    """What a save reads of its `CheckpointManager`: where saves go (read when used)."""

    @property
    def backend(self) -> Backend: ...


class RestoreRecord:
    def __init__(self, ref: CheckpointRef, phases: dict[str, float], planned: bool) -> None:
        self.ref, self.phases = ref, {k: round(v, 4) for k, v in phases.items()}
        self.planned = planned
        self.ended = time.monotonic()


class Track:
    """A background save in flight (rank 0) and the step times it overlapped. `done`: whether
    its background work ended (default: its DCP future's); `prefix`: of its figures' names
    (`copy_`: a tier-0 step's copy to the store, measured apart from the save)."""

    def __init__(
        self,
        save: Any,
        step: int,
        done: Callable[[], bool] | None = None,
        prefix: str = "",
    ) -> None:
        self.save, self.step, self.prefix = save, step, prefix
        self.during: list[float] = []
        self._done = done

    def done(self) -> bool:
        if self._done is not None:
            return self._done()
        return bool(self.save.future is None or self.save.future.done())


class Save:
    """One save: its claim (renewed by rank 0 until the save ends), when it started, what it
    staged, and the committed result (rank 0's, shared with every rank by `result`)."""

    def __init__(
        self,
        manager: SaveOwner,
        shared: SharedClaim,
        started: float,
        metrics: dict[str, float] | None,
        async_: bool,
    ) -> None:
        self.manager, self.shared, self.started = manager, shared, started
        self.metrics, self.async_ = metrics, async_
        self.future: Future[Any] | None = None
        self.stall: float | None = None
        self._stall_known = threading.Event()
        self._heartbeat: Any = None
        self.committed: dict[str, Any] | None = None

    def hold(self) -> None:
        if ranks.current_rank() != 0:
            return

        backend, shared = self.manager.backend, self.shared
        self._heartbeat = Heartbeat(lambda: backend.renew(shared), SERVER_LEASE_S / 4)
        self._heartbeat.__enter__()

    def release(self, *, failed: bool) -> None:
        if self._heartbeat is not None:
            self._heartbeat.__exit__(None, None, None)
            self._heartbeat = None
        if failed and ranks.current_rank() == 0:
            with contextlib.suppress(RegistryError):  # the save's own error matters more
                self.manager.backend.give_up(self.shared)

    def staged(self, seconds: float) -> None:
        self.stall = seconds
        self._stall_known.set()

    def commit(self, written: Written) -> None:
        """Rank 0, in DCP's finish (a background thread for an async save)."""
        faults.point("save-written")
        persist = time.monotonic() - self.started
        if self.async_:
            self._stall_known.wait(timeout=600)
        stall = self.stall if self.async_ and self.stall is not None else persist
        costs = {
            "async": self.async_,
            "stall_seconds": round(stall, 4),
            "persist_seconds": round(persist, 4),
            "bytes": sum(f.size for f in written.files),
            "world_size": ranks.world_size(),
            "ranks": written.rank_costs(),
        }
        self.committed = self.manager.backend.commit(
            self.shared, written, ranks.world_size(), self.metrics, costs
        )

    def result(self, *, sync: bool) -> dict[str, Any]:
        """Every rank: the committed view (rank 0's, broadcast for a synchronous save; an
        async save's `wait()` returns rank 0's there and a short view elsewhere)."""
        self.release(failed=False)
        if sync:
            got: list[Any] = [self.committed]
            ranks.broadcast(got)
            return dict(got[0] or {})
        if self.committed is not None:
            return self.committed
        return {"ref": str(self.shared.ref), "state": "committed"}


def checked(call: Any, what: str = "save") -> Any:
    """DCP's own errors are a BaseException (`CheckpointException`) carrying each rank's; the
    registry's error of the first failing rank is raised as it is (one line for the user)."""
    try:
        return call()
    except CheckpointException as exc:
        for _, failure in sorted(exc.failures.items()):
            error = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(error, RegistryError):
                raise error from None
        first = next(iter(exc.failures.values()), None)
        cause = first[0] if isinstance(first, tuple) else first
        raise RegistryError(
            f"the checkpoint {what} failed on rank(s) {sorted(exc.failures)}: {cause}",
            "nothing was committed; the step can be saved again"
            if what == "save"
            else "the state may be partly loaded: restore again before training",
        ) from exc
