"""Checkpoint layouts: where each kind of trainer keeps the model and the rest of its resume state.

A layout is a fact about how a checkpoint was written, not a policy: it says under which dotted
key path the model lives (and so which prefix a release strips from its names), which key paths
hold which resume-state class, which files beside the DCP shards (or a safetensors model) carry
state, and which classes a
resume of that trainer needs (required) or should have (recommended: missing ones are warnings).

  megatron    Megatron-core's torch_dist: model keys at the top, optimizer.*, rng_state/shard_*,
              beside metadata.json and common.pt
  deepspeed   DeepSpeed ZeRO's global_stepN/: module.* (the fp32 weights) and optimizer.* read
              from the ranks' *_optim_states.pt, beside the model states file
  lightning   {"state_dict": ..., "optimizer_0": ...} and the `meta.pt` sidecar Lightning writes
  transformers  the Trainer's sharded FSDP save: accelerate's DCP roots beside trainer_state.json,
              scheduler.pt and rng_state_N.pth; or its plain save, model.safetensors (or a PEFT
              adapter's adapter_model.safetensors) beside optimizer.pt and the same files
  peft        a PEFT adapter's save_pretrained folder: adapter_model.safetensors beside
              adapter_config.json (weights alone: not resumable)
  accelerate  DCP roots pytorch_model_fsdp_0/ and optimizer_0/ (their key paths prefixed with the
              root's name) beside scheduler.bin, random_states_N.pkl
  dcp         {"model": ..., "optimizer": ..., "lr_scheduler": ..., "train_state": ...}
  stateful    one wrapper key holding "model" and "optim" (the DCP tutorial's AppState)
  torchtitan  the model's own names at the top level beside "optimizer", "lr_scheduler", ...

Sidecar files count by what reg read in them (registry/formats/sidecars.py records entries
`FILE:PATH` for their contents, `FILE!WHY` for a file it could not read): a layout's
`SidecarRule`s say which content paths are which class.

`detect` picks one from the key paths and files; `--layout NAME` forces one. Pure: no torch.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from registry.errors import UsageError

# The classes the registry knows, in the order they are reported.
RESUME_CLASSES = (
    "model",
    "optimizer",
    "lr_scheduler",
    "train_state",
    "rng",
    "dataloader",
    "grad_scaler",
)

# Sidecar entries (registry/formats/sidecars.py): FILE, FILE:PATH (read), FILE!WHY (unread).
READ = ":"
UNREAD = "!"

# What a resume loses without each class: the warning a missing recommended class carries.
CONSEQUENCES = {
    "optimizer": "a resume restarts the optimizer's moments from zero",
    "lr_scheduler": "a resume restarts the learning-rate schedule",
    "train_state": "a resume does not know its step or token count",
    "rng": "a resume does not reproduce the random streams (dropout, sampling)",
    "dataloader": "a resume does not know its data position and may repeat or skip data",
    "grad_scaler": "an fp16 resume restarts the loss scale",
}

# The names most trainers use for each class under the place their state lives.
_COMMON: dict[str, tuple[str, ...]] = {
    "optimizer": ("optimizer", "optim"),
    "lr_scheduler": ("lr_scheduler", "scheduler"),
    "train_state": ("train_state", "step"),
    "rng": ("rng",),
    "dataloader": ("dataloader", "data_loader"),
    "grad_scaler": ("grad_scaler", "scaler"),
}


@dataclass(frozen=True, slots=True)
class SidecarRule:
    """Files named `file` (a pattern) that hold `path` (a dotted content path; "" = the file
    was read) provide `cls`."""

    file: str
    path: str
    cls: str

    def matches(self, file: str, path: str) -> bool:
        if not re.fullmatch(self.file, file):
            return False
        return not self.path or path == self.path or path.startswith(self.path + ".")


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    summary: str
    model: str  # the model's key path; "" = every key no other class claims (torchtitan)
    classes: Mapping[str, tuple[str, ...]]  # class -> key paths from the top
    required: tuple[str, ...]
    recommended: tuple[str, ...]
    sidecars: tuple[SidecarRule, ...] = ()
    files: str = ""  # the sidecar files this layout reads (a pattern), for "present but unread"
    # file -> the classes a file recorded before reg read sidecars is assumed to hold
    legacy: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # files the trainer always writes: without them the layout is never suggested
    marks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Placement:
    """A layout resolved against one checkpoint's keys (the stateful wrapper found)."""

    layout: Layout
    model: str
    classes: Mapping[str, tuple[str, ...]]
    wrapper: str | None = None
    note: str | None = None  # how the layout was chosen, when that is worth saying
    # Optimizer state is found by its shape among the keys; not where every key is a model
    # file's tensor (a safetensors save: its optimizer is a file beside it, never a key)
    shapes: bool = True

    @property
    def name(self) -> str:
        return self.layout.name


DCP = Layout(
    "dcp",
    'top-level "model", "optimizer", "lr_scheduler", "train_state", "rng", "dataloader" keys',
    model="model",
    classes=_COMMON,
    required=("model", "optimizer", "train_state"),
    recommended=("lr_scheduler", "rng", "dataloader"),
)
TORCHTITAN = Layout(
    "torchtitan",
    'the model\'s own names at the top level beside "optimizer", "lr_scheduler", '
    '"train_state", "dataloader"',
    model="",
    classes={
        "optimizer": ("optimizer",),
        "lr_scheduler": ("lr_scheduler",),
        "train_state": ("train_state",),
        "rng": ("rng",),
        "dataloader": ("dataloader",),
    },
    required=("model", "optimizer", "lr_scheduler", "train_state"),
    recommended=("dataloader", "rng"),
)
LIGHTNING = Layout(
    "lightning",
    '"state_dict" (ModelParallelStrategy) or "model" (FSDPStrategy, Fabric) and "optimizer_N" '
    "keys, and the meta.pt sidecar (epoch, global step, loops, schedulers)",
    model="state_dict",  # or "model" where there is no "state_dict" (place)
    classes=_COMMON,  # and optimizer_0, optimizer_1...: found by their structure
    required=("model", "optimizer", "train_state"),
    recommended=("lr_scheduler", "dataloader", "rng"),
    sidecars=(
        SidecarRule(r"meta\.pt", "global_step", "train_state"),
        SidecarRule(r"meta\.pt", "loops.fit_loop", "train_state"),
        SidecarRule(r"meta\.pt", "lr_schedulers", "lr_scheduler"),
        # a stateful dataloader's position (Lightning saves it only for one)
        SidecarRule(r"meta\.pt", "loops.fit_loop.state_dict.combined_loader", "dataloader"),
        SidecarRule(r"meta\.pt", "MixedPrecision", "grad_scaler"),
    ),
    files=r"meta\.pt",
    legacy={"meta.pt": ("train_state", "lr_scheduler", "dataloader")},
)
ACCELERATE = Layout(
    "accelerate",
    "accelerate's sharded FSDP save_state: DCP roots pytorch_model_fsdp_0/ (model) and "
    "optimizer_0/, beside scheduler.bin, random_states_N.pkl, sampler.bin, scaler.pt",
    model="pytorch_model_fsdp_0.model",
    classes={},  # optimizer_0.optimizer: found by its structure
    required=("model", "optimizer"),
    recommended=("train_state", "lr_scheduler", "rng", "dataloader"),
    sidecars=(
        SidecarRule(r"scheduler(_\d+)?\.bin", "", "lr_scheduler"),
        # accelerate keeps no training step of its own (random_states' "step" counts gradient
        # accumulation): the objects a trainer registers with register_for_checkpointing do
        SidecarRule(r"custom_checkpoint_\d+\.pkl", "", "train_state"),
        SidecarRule(r"random_states_\d+\.pkl", "random_state", "rng"),
        SidecarRule(r"random_states_\d+\.pkl", "torch_manual_seed", "rng"),
        SidecarRule(r"(sampler|dl_state_dict)(_\d+)?\.bin", "", "dataloader"),
        SidecarRule(r"scaler\.pt", "", "grad_scaler"),
    ),
    files=r"scheduler(_\d+)?\.bin|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl"
    r"|(sampler|dl_state_dict)(_\d+)?\.bin|scaler\.pt",
)
MEGATRON = Layout(
    "megatron",
    "Megatron-core dist_checkpointing (torch_dist), as Megatron-LM saves iter_N/: the model's "
    'sharded keys at the top level beside "optimizer.*" and "rng_state/shard_*", and '
    "metadata.json, common.pt (iteration, LR scheduler, optimizer param groups, args)",
    model="",
    classes={"optimizer": ("optimizer",), "rng": ("rng_state",)},
    required=("model", "optimizer", "lr_scheduler", "train_state"),
    recommended=("rng", "dataloader"),
    sidecars=(
        SidecarRule(r"common\.pt", "iteration", "train_state"),
        # Megatron-LM restarts its sampler at the samples consumed: the iteration's worth for a
        # constant global batch (a batch-size ramp keeps it in args, which reg does not read)
        SidecarRule(r"common\.pt", "iteration", "dataloader"),
        SidecarRule(r"common\.pt", "opt_param_scheduler", "lr_scheduler"),
        SidecarRule(r"common\.pt", "optimizer.param_groups", "optimizer"),
    ),
    files=r"common\.pt",
    marks=("metadata.json", "common.pt"),
)
# rank 0's model states: ZeRO-1/2's, or ZeRO-3's per-rank file
_DS_STATES = r"(zero_pp_rank_0_)?mp_rank_00_model_states\.pt"
_DS_MODEL_STATES = frozenset(
    {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"}
)
DEEPSPEED = Layout(
    "deepspeed",
    "DeepSpeed ZeRO's save_checkpoint (global_stepN/): the fp32 weights as zero_to_fp32 "
    "rebuilds them from every rank's *_optim_states.pt (\"module.*\"), the optimizer's flat "
    'state ("optimizer.*"), and the model states file\'s global_steps, lr_scheduler and '
    "data_sampler",
    model="module",
    classes={"optimizer": ("optimizer",)},
    required=("model", "optimizer", "train_state"),
    recommended=("lr_scheduler", "rng", "dataloader"),
    sidecars=(
        SidecarRule(_DS_STATES, "global_steps", "train_state"),
        SidecarRule(_DS_STATES, "lr_scheduler", "lr_scheduler"),
        # DeepSpeed's own data sampler (data efficiency); a loop of its own keeps none here
        SidecarRule(_DS_STATES, "data_sampler", "dataloader"),
    ),
    files=_DS_STATES,
    marks=("mp_rank_00_model_states.pt",),  # or ZeRO-3's rank-0 file (`detect`)
)
TRANSFORMERS = Layout(
    "transformers",
    "the transformers Trainer: with FSDP's SHARDED_STATE_DICT accelerate's DCP roots "
    "pytorch_model_fsdp_0/ and optimizer_0/, else model.safetensors and optimizer.pt; beside "
    "them trainer_state.json, scheduler.pt, rng_state_N.pth",
    model="pytorch_model_fsdp_0.model",  # or every key without it (place)
    classes={},  # optimizer_0.optimizer: found by its structure
    required=("model", "optimizer", "lr_scheduler", "train_state", "dataloader"),
    recommended=("rng",),
    sidecars=(
        SidecarRule(r"trainer_state\.json", "global_step", "train_state"),
        # the plain save: the optimizer's state_dict, torch.save'd
        SidecarRule(r"optimizer\.pt", "state", "optimizer"),
        # the Trainer keeps no data-loader state: it skips global_step batches of its
        # (seeded) sampler on resume, so the step is the data position
        SidecarRule(r"trainer_state\.json", "global_step", "dataloader"),
        SidecarRule(r"scheduler\.pt", "", "lr_scheduler"),
        SidecarRule(r"rng_state(_\d+)?\.pth", "", "rng"),
        SidecarRule(r"scaler\.pt", "", "grad_scaler"),
    ),
    files=r"trainer_state\.json|optimizer\.pt|scheduler\.pt|rng_state(_\d+)?\.pth|scaler\.pt",
    marks=("trainer_state.json",),
)
PEFT = Layout(
    "peft",
    "a PEFT adapter as save_pretrained writes it: adapter_model.safetensors (every name "
    'under "base_model") beside adapter_config.json; the adapter\'s weights alone, no '
    "optimizer (not resumable; it promotes as an adapter, which needs no resume state)",
    model="",
    classes={},
    required=("model", "optimizer"),
    recommended=(),
    files=r"adapter_config\.json",
    marks=("adapter_config.json",),
)
STATEFUL = Layout(
    "stateful",
    'one wrapper key (e.g. "app") holding "model" and "optim", as in the DCP tutorial',
    model="{wrapper}.model",
    classes=_COMMON,  # under the wrapper, and at the top level beside it
    required=("model", "optimizer"),
    recommended=("train_state", "lr_scheduler", "rng", "dataloader"),
)
LAYOUTS: dict[str, Layout] = {
    lay.name: lay
    for lay in (
        MEGATRON,
        DEEPSPEED,
        LIGHTNING,
        TRANSFORMERS,
        PEFT,
        ACCELERATE,
        DCP,
        STATEFUL,
        TORCHTITAN,
    )
}  # in detection order


def check_layout(name: str | None) -> str | None:
    """A `--layout` value: None (detect) or a known layout's name."""
    if name is None or name in LAYOUTS:
        return name
    raise UsageError(f"unknown layout {name!r}", f"choose one of {', '.join(LAYOUTS)}")


def known_layout(name: object) -> str | None:
    """A recorded layout this reg knows, else None (one a newer reg wrote: detect again)."""
    return name if isinstance(name, str) and name in LAYOUTS else None


# Megatron's ShardedObject keys end in /shard_<offsets>_<shape>, numbers joined by dots
# (`rng_state/shard_0.1_1.2`): dots that are no path separators.
_SHARD_SUFFIX = re.compile(r"/shard_\d+(?:\.\d+)*_\d+(?:\.\d+)*$")


def class_path(key: str) -> str:
    """The dotted path a key is classified by: the key, less a ShardedObject's shard suffix
    (at its end only)."""
    return _SHARD_SUFFIX.sub("", key) if "/shard_" in key else key


def children(keys: Sequence[str], path: str) -> set[str]:
    """The next key segment under `path` ("" = the top level) over sorted `keys`."""
    out = set()
    prefix = f"{path}." if path else ""
    for key in keys if not prefix else _under(keys, prefix):
        out.add(key[len(prefix) :].split(".", 1)[0])
    return out


def has_path(keys: Sequence[str], path: str) -> bool:
    """Whether a key equals `path` or starts with `path.` (sorted `keys`: a binary search)."""
    i = bisect_left(keys, path)
    if i < len(keys) and keys[i] == path:
        return True
    j = bisect_left(keys, path + ".")
    return j < len(keys) and keys[j].startswith(path + ".")


def count_under(keys: Sequence[str], path: str) -> int:
    """How many of sorted `keys` equal `path` or lie under it (two binary searches)."""
    i = bisect_left(keys, path)
    exact = 1 if i < len(keys) and keys[i] == path else 0
    start = bisect_left(keys, path + ".")
    return exact + bisect_left(keys, path + "/", lo=start) - start  # "/" sorts right after "."


def _under(keys: Sequence[str], prefix: str) -> Iterable[str]:
    for key in keys[bisect_left(keys, prefix) :]:
        if not key.startswith(prefix):
            return
        yield key


def detect(keys: Sequence[str], sidecars: Iterable[str]) -> Layout:
    """The layout the key paths and files show: Megatron's metadata.json and common.pt;
    DeepSpeed's model states beside the "module" its files give;
    Lightning's "state_dict" or meta.pt; the Trainer's trainer_state.json; PEFT's
    adapter_config.json beside its saved names (all under "base_model"); accelerate's
    pytorch_model_fsdp_N root; a top-level "model"; a wrapper holding "model"; else the model
    at the top (torchtitan)."""
    sidecars = set(sidecars)
    if set(MEGATRON.marks) <= sidecars:
        return MEGATRON
    top = children(keys, "")
    if "module" in top and sidecars & _DS_MODEL_STATES:  # the weights read from its files
        return DEEPSPEED
    if "state_dict" in top or "meta.pt" in sidecars:
        return LIGHTNING
    if set(TRANSFORMERS.marks) <= sidecars:
        return TRANSFORMERS
    if set(PEFT.marks) <= sidecars and top == {"base_model"}:  # PEFT's saved names
        return PEFT
    if any(re.fullmatch(r"pytorch_model_fsdp_\d+", name) for name in top):
        return ACCELERATE
    if "model" in top:
        return DCP
    if _wrappers(keys, top):
        return STATEFUL
    return TORCHTITAN


# Top-level names that are a class, never a stateful wrapper.
_CLASS_NAMES = frozenset({"model", "state_dict", *(n for names in _COMMON.values() for n in names)})


def _wrappers(keys: Sequence[str], top: set[str]) -> list[str]:
    """Top-level keys holding "model" that are not themselves a class name; those that also
    hold an optimizer ("optim" or "optimizer") first, then by name."""
    found = [w for w in top if w not in _CLASS_NAMES and has_path(keys, f"{w}.model")]
    return sorted(
        found,
        key=lambda w: (not (has_path(keys, f"{w}.optim") or has_path(keys, f"{w}.optimizer")), w),
    )


def place(layout: Layout, keys: Sequence[str]) -> Placement:
    """`layout` against these keys: Lightning's model is "state_dict", or "model" where there
    is none (FSDPStrategy, Fabric); the Trainer's is "pytorch_model_fsdp_0.model", or every
    key where there is none (its plain save: the tensors of model.safetensors); the stateful
    wrapper is the top-level key holding "model" (one that holds an optimizer too first; the
    note names the others)."""
    if layout is LIGHTNING and not has_path(keys, "state_dict") and has_path(keys, "model"):
        return Placement(layout, "model", layout.classes)
    if layout is TRANSFORMERS and not has_path(keys, "pytorch_model_fsdp_0"):
        return Placement(layout, "", layout.classes, shapes=False)  # its plain save
    if layout is PEFT:
        return Placement(layout, "", layout.classes, shapes=False)
    if layout is not STATEFUL:
        return Placement(layout, layout.model, layout.classes)
    found = _wrappers(keys, children(keys, ""))
    wrapper = found[0] if found else "app"
    note = None
    if not found:
        note = 'no top-level key holds "model": the stateful layout looked for "app.model"'
    elif len(found) > 1:
        note = (
            f"several keys hold a model ({', '.join(sorted(found))}); the stateful layout "
            f"took {wrapper}"
        )
    classes = {
        cls: tuple(f"{wrapper}.{name}" for name in names) + names for cls, names in _COMMON.items()
    }
    return Placement(layout, f"{wrapper}.model", classes, wrapper, note)
