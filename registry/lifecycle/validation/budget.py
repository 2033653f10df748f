"""The memory a validation may use (`--memory-budget`), and how it is shared out.

Default: half the device's free memory on CUDA, a quarter of the RAM available on CPU. On CPU
the budget covers every buffer the validation holds; on CUDA it bounds what is held on the device
(and the pinned host buffers mirror the device batches). Beyond it, a process has its fixed
overhead (the interpreter and torch) and the store's read pieces (8 MiB per worker).

  batches     a quarter: tensors are loaded and checked a batch at a time (on CUDA two batches
              of an eighth each, at most 256 MiB, one filling while the other is checked)
  held whole  a quarter, shared by the workers: a chunk that cannot be streamed (a view with an
              offset or strides) or a non-tensor item is held whole while it is loaded
  model       half: the model for the probe, when it fits (else the probe is skipped, named)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from policies.loader import parse_size
from registry.core.timeutil import human_bytes
from registry.errors import UsageError

MIN_BUDGET = 16 * 1024 * 1024
CUDA_FRACTION = 0.5
CPU_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class Budget:
    total: int
    source: str  # how it was chosen, as the record shows it

    @property
    def batch(self) -> int:
        return max(1 << 20, self.total // 4)

    def held(self, workers: int) -> int:
        return max(1 << 20, self.total // (4 * max(1, workers)))

    @property
    def model(self) -> int:
        return self.total // 2

    def describe(self) -> str:
        given = self.source == "--memory-budget"
        return human_bytes(self.total) if given else f"{human_bytes(self.total)} ({self.source})"


def choose(text: str | None, device: str) -> Budget:
    """`--memory-budget` (a size such as 512MiB or 4GB), else the default for `device`."""
    if text is not None:
        try:
            size = parse_size(text)
        except ValueError as exc:
            raise UsageError(
                f"--memory-budget: {exc}", "write a size such as 512MiB or 8GB"
            ) from None
        if size is None or size < MIN_BUDGET:
            raise UsageError(
                f"--memory-budget {text}: at least {human_bytes(MIN_BUDGET)} is needed",
                "give a size such as 512MiB or 8GB",
            )
        most, where = device_memory(device)
        if size > most:
            raise UsageError(
                f"--memory-budget {text}: more than the {human_bytes(most)} {where} has",
                "give at most what the device has (the default is a safe fraction of it)",
            )
        return Budget(size, "--memory-budget")
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return Budget(max(MIN_BUDGET, int(free * CUDA_FRACTION)), "half the GPU's free memory")
    return Budget(max(MIN_BUDGET, int(available_ram() * CPU_FRACTION)), "a quarter of free RAM")


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def device_memory(device: str) -> tuple[int, str]:
    """All the memory of `device` (a budget above it is refused) and what to call it."""
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory), "the GPU"
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's RAM"
    except (ValueError, OSError):
        return 2**62, "this machine"


def out_of_memory(device: str, budget: Budget, exc: BaseException) -> str:
    """A failed check's detail: what ran out, and the budget to try."""
    text = str(exc).strip()
    first = text.splitlines()[0][:200] if text else type(exc).__name__
    half = budget.total // 2
    advice = (
        f"try --memory-budget {human_bytes(half)}"
        if half >= MIN_BUDGET
        else f"free memory on the {device} (the smallest budget is {human_bytes(MIN_BUDGET)})"
    )
    used = human_bytes(budget.total)
    return f"out of memory on {device} with --memory-budget {used} ({first}): {advice}"
