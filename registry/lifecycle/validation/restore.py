"""The device a validation runs on: which one, its name and its driver."""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess

from registry.errors import UsageError


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device cuda: no CUDA device here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda or 'none'})",
            "run this validation on a GPU node, or use --device cpu where the policy allows",
        )
    if device not in ("cuda", "cpu"):
        raise UsageError(f"unknown device {device!r}", "use cuda, cpu or auto")
    return device


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    return platform.processor() or platform.machine() or "cpu"


@functools.cache
def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it; None where it cannot say."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip()[:64] if done.returncode == 0 and lines else None
