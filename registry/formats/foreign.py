"""What a directory with no DCP `.metadata` is, when a trainer wrote it: a refusal that names
the stack and the one thing that would work.

Decided from file names at the top of the directory (a few thousand looked at at most) and,
for Megatron-LM's tracker, one small file: `latest_checkpointed_iteration.txt` must hold a
number (or `release`) whose directory is a plain subdirectory, never a path. DeepSpeed's
`latest` is read the same way. Nothing here is trusted beyond choosing the message.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from registry.errors import InvalidCheckpoint
from registry.formats import deepspeed_root

HF_INDEX = "model.safetensors.index.json"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_LATEST = "latest"
MAX_NAMES = 10_000
MAX_POINTER = 256  # a tracker or `latest` holds a short name
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_ITERATION = re.compile(r"iter_\d{7,18}/")  # a subdirectory (names() marks them with "/")


def refuse_foreign(root: Path, *, has_metadata: bool) -> bool:
    """InvalidCheckpoint naming what `root` is, when its files say; else whether it is a
    checkpoint reg takes without DCP metadata: the transformers Trainer's plain save, its
    model in safetensors (`safetensors_root.py`). A directory with DCP metadata
    (`has_metadata`, at the top or one level down) is refused only when it is Megatron-LM's
    save directory: its iter_N/ subdirectories are checkpoints of their own, not roots of
    one."""
    names = _names(root)
    if not has_metadata and (safetensors_checkpoint(names) or deepspeed_root.roots(names)):
        return True
    checks = (
        (_megatron_save_dir,)
        if has_metadata
        else (
            _megatron_save_dir,
            _deepspeed,
            _trainer,
            _peft_adapter,
            _accelerate_save_state,
            _safetensors_directory,
        )
    )
    for check in checks:
        problem = check(root, names)
        if problem is not None:
            raise problem
    return False


def safetensors_checkpoint(names: set[str]) -> bool:
    """The Trainer's save without FSDP: trainer_state.json beside its model in safetensors
    (`model.safetensors`, the sharded `model-0000K-of-0000N.safetensors`, or a PEFT adapter's
    `adapter_model.safetensors`); or a PEFT adapter as save_pretrained writes it."""
    if "adapter_config.json" in names and "adapter_model.safetensors" in names:
        return True
    return "trainer_state.json" in names and any(
        n.endswith(".safetensors") and not n.endswith("/") for n in names
    )


def _names(root: Path) -> set[str]:
    out: set[str] = set()
    with os.scandir(root) as entries:
        for i, entry in enumerate(entries):
            if i >= MAX_NAMES:
                break
            out.add(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
    return out


def pointer(root: Path, name: str) -> str | None:
    """The sibling a pointer file (`latest`, Megatron's tracker) names, if it is one plain
    name of a subdirectory of `root`; None for anything else (a path, a link, a big file)."""
    try:  # never a link, never a FIFO that would block: the regular file itself
        fd = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_POINTER:
            return None
        text = os.read(fd, MAX_POINTER).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    if not _PLAIN.fullmatch(text) or text in {".", ".."}:
        return None
    return text


def _subdirectory(root: Path, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(root / name).st_mode)
    except OSError:
        return False


def _megatron_save_dir(root: Path, names: set[str]) -> InvalidCheckpoint | None:
    """Megatron-LM's --save directory: iter_NNNNNNN/ checkpoints and the tracker naming the
    latest."""
    iterations = sorted(n.rstrip("/") for n in names if _ITERATION.fullmatch(n))
    if MEGATRON_TRACKER not in names:
        if not iterations:
            return None
        return InvalidCheckpoint(
            f"{root} is a Megatron-LM save directory ({', '.join(iterations[:3])}"
            f"{', ...' if len(iterations) > 3 else ''}), not one checkpoint",
            f"push one of its iter_NNNNNNN/ directories: reg push-ckpt {root / iterations[-1]} "
            "--run RUN --world-size TPxPPxDP",
        )
    text = pointer(root, MEGATRON_TRACKER)
    iteration = None
    if text == "release":
        iteration = "release"
    elif text is not None and text.isdigit() and len(text) <= 18:
        iteration = f"iter_{int(text):07d}"
    if iteration is None or not _subdirectory(root, iteration):
        return InvalidCheckpoint(
            f"{root} is a Megatron-LM save directory whose {MEGATRON_TRACKER} names no "
            "checkpoint directory in it",
            "push one of its iter_NNNNNNN/ directories with --world-size",
        )
    return InvalidCheckpoint(
        f"{root} is a Megatron-LM save directory, not one checkpoint: its latest is {iteration}/",
        f"push that directory: reg push-ckpt {root / iteration} --run RUN --world-size TPxPPxDP",
    )


def _deepspeed(root: Path, names: set[str]) -> InvalidCheckpoint | None:
    """DeepSpeed's save_checkpoint directory: `latest` naming global_stepN/, the checkpoint
    (its model states and per-rank *_optim_states.pt); or a global_stepN/ missing its
    optimizer states."""
    if any(deepspeed_root.is_root_name(n) for n in names):
        return InvalidCheckpoint(
            f"{root} holds DeepSpeed model states but no *_optim_states.pt: a save without "
            "ZeRO (its optimizer pickled inside), or one missing its ranks' optimizer states",
            "train with zero_optimization stage 1, 2 or 3, and push the whole global_stepN/ "
            "directory save_checkpoint wrote",
        )
    if DEEPSPEED_LATEST not in names or not any(n.startswith("global_step") for n in names):
        return None
    step = pointer(root, DEEPSPEED_LATEST)
    if step is None or not _subdirectory(root, step):
        return InvalidCheckpoint(
            f"{root} is a DeepSpeed save directory whose `latest` names no checkpoint in it",
            "push one of its global_stepN/ directories",
        )
    return InvalidCheckpoint(
        f"{root} is a DeepSpeed save directory, not one checkpoint: its latest is {step}/",
        f"push that directory: reg push-ckpt {root / step} --run RUN (never run the "
        "zero_to_fp32.py stored beside it on a checkpoint you did not write)",
    )


def _trainer(root: Path, names: set[str]) -> InvalidCheckpoint | None:
    """The transformers Trainer without FSDP's sharded state dict: weights in safetensors (or
    a PEFT adapter) beside a pickled optimizer.pt."""
    if "trainer_state.json" not in names:
        return None
    if names & {"pytorch_model.bin", "adapter_model.bin"}:
        return InvalidCheckpoint(
            f"{root} is a transformers Trainer checkpoint with a pickled model "
            "(pytorch_model.bin): reg reads models in safetensors, never by unpickling",
            "train with save_safetensors=True (the default), then push checkpoint-N/",
        )
    if "pytorch_model_fsdp.bin" in names or "pytorch_model_fsdp_0.bin" in names:
        what = "FSDP's FULL_STATE_DICT (pytorch_model_fsdp.bin)"
    else:
        what = "no model reg can read"
    return InvalidCheckpoint(
        f"{root} is a transformers Trainer checkpoint with {what}: reg takes the Trainer's "
        "sharded saves and its plain ones (model.safetensors), not this one",
        'train with fsdp="full_shard" and fsdp_config {"version": 2, "state_dict_type": '
        '"SHARDED_STATE_DICT"} (pytorch_model_fsdp_0/, optimizer_0/), then push checkpoint-N/',
    )


def _peft_adapter(root: Path, names: set[str]) -> InvalidCheckpoint | None:
    if "adapter_config.json" not in names:
        return None
    return InvalidCheckpoint(
        f"{root} is a PEFT adapter without adapter_model.safetensors (a pickled "
        "adapter_model.bin?): reg reads adapters in safetensors, never by unpickling",
        "save it again with save_pretrained(..., safe_serialization=True), the default",
    )


def _accelerate_save_state(root: Path, names: set[str]) -> InvalidCheckpoint | None:
    """accelerate's `save_state` layouts that are no DCP (its optimizer or RNG files beside a
    model file)."""
    if not names & {"optimizer.bin", "optimizer_0.bin", "random_states_0.pkl"}:
        return None
    if names & {"pytorch_model_fsdp.bin", "pytorch_model_fsdp_0.bin"}:
        what = "accelerate save_state with FSDP's FULL_STATE_DICT (pytorch_model_fsdp.bin)"
    elif names & {"model.safetensors", "pytorch_model.bin"}:
        what = "accelerate save_state without FSDP (model.safetensors and a pickled optimizer.bin)"
    else:
        what = "accelerate save_state without a sharded model"
    return InvalidCheckpoint(
        f"{root} is {what}: not a DCP checkpoint",
        'push-ckpt takes DCP checkpoints: save with FSDP and state_dict_type="SHARDED_STATE_DICT"'
        " (pytorch_model_fsdp_0/, optimizer_0/)",
    )


def _safetensors_directory(root: Path, names: set[str]) -> InvalidCheckpoint | None:
    """A directory of safetensors without .metadata is Hugging Face's layout (save_pretrained,
    or DCP's HuggingFaceStorageWriter), not an unfinished DCP save."""
    found = sorted(n for n in names if n.endswith(".safetensors") or n == HF_INDEX)
    if not found:
        return None
    return InvalidCheckpoint(
        f"{root} is a Hugging Face safetensors directory ({found[0]}, ...), as "
        "save_pretrained or DCP's HuggingFaceStorageWriter write it, not a DCP checkpoint",
        "push-ckpt takes DCP checkpoints (dcp.save with FileSystemWriter); inference "
        "weights become releases through `reg promote`",
    )
