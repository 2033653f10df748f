"""What trainers' own files say, read without trusting them: the step and world size a
checkpoint records (registry/formats/recorded.py), the one-line refusals that name a stack
push-ckpt cannot take and what would work (registry/formats/foreign.py), and the transformers
Trainer's sidecars as resume classes (policies/layouts.py TRANSFORMERS)."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from policies.loader import ResumePolicy
from policies.resume import classify
from registry.errors import InvalidCheckpoint, UsageError
from registry.formats import sidecars
from registry.formats.foreign import refuse_foreign
from registry.formats.recorded import (
    Recorded,
    recorded,
    recorded_in,
    resolve_step,
    resolve_world_size,
)
from tests.helpers import saved

TRAINER_KEYS = sorted(
    [
        "pytorch_model_fsdp_0.model.model.embed_tokens.weight",
        "optimizer_0.optimizer.state.model.embed_tokens.weight.exp_avg",
        "optimizer_0.optimizer.param_groups.0.lr",
    ]
)


def trainer_rng_state() -> dict[str, Any]:
    """What transformers 5's Trainer._save_rng_state writes on CPU."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }


def trainer_files(world: int = 2, step: int = 3) -> dict[str, bytes]:
    files = {
        "trainer_state.json": json.dumps({"global_step": step, "log_history": []}).encode(),
        "scheduler.pt": saved({"last_epoch": step, "base_lrs": [0.001], "_step_count": 4}),
    }
    for rank in range(world):
        files[f"rng_state_{rank}.pth"] = saved(trainer_rng_state())
    return files


def entries_of(files: dict[str, bytes]) -> list[str]:
    return sidecars.entries(files, {p: len(d) for p, d in files.items()}, files.__getitem__)


# -- the Trainer's sidecars ----------------------------------------------------------------


def test_a_trainer_sharded_save_is_the_transformers_layout_and_resumable() -> None:
    verdict = classify(TRAINER_KEYS, entries_of(trainer_files()), ResumePolicy())
    assert verdict.layout == "transformers"
    assert verdict.resumable and not verdict.missing
    assert verdict.classes["train_state"] == ["trainer_state.json:global_step"]
    assert verdict.classes["dataloader"] == ["trainer_state.json:global_step"]
    assert verdict.classes["lr_scheduler"] == ["scheduler.pt"]
    assert verdict.classes["rng"] == ["rng_state_0.pth", "rng_state_1.pth"]


def test_trainer_files_that_do_not_read_provide_nothing() -> None:
    """A trainer_state.json that is not JSON and a scheduler.pt naming a global torch's
    restricted loader refuses: present but unread, so the checkpoint is not resumable."""
    files = trainer_files()
    files["trainer_state.json"] = b"{not json"
    files["scheduler.pt"] = saved({"lr_lambdas": [argparse_namespace()]})
    entries = entries_of(files)
    assert "trainer_state.json!it is not a JSON document" in entries
    assert any(e.startswith("scheduler.pt!torch.load(weights_only=True) refuses") for e in entries)
    verdict = classify(TRAINER_KEYS, entries, ResumePolicy())
    assert not verdict.resumable
    assert {"lr_scheduler", "train_state", "dataloader"} <= set(verdict.missing)


def argparse_namespace() -> object:
    import argparse

    return argparse.Namespace(lr=1.0)


def test_a_deeply_nested_trainer_state_is_unread_not_a_crash() -> None:
    files = {"trainer_state.json": b"[" * 100_000 + b"]" * 100_000}
    assert entries_of(files)[1].startswith("trainer_state.json!")


# -- the step and world size a checkpoint records ------------------------------------------


def test_the_trainer_records_its_step_and_world_size() -> None:
    files = trainer_files(world=2, step=3)
    found = recorded("checkpoint-3", {p: len(d) for p, d in files.items()}, files.__getitem__)
    assert (found.step, found.world_size) == (3, 2)
    assert found.step_source == "trainer_state.json:global_step"
    assert resolve_step(None, found) == 3 and resolve_step(3, found) == 3
    assert resolve_world_size(None, found) == 2


@pytest.mark.parametrize(
    ("given", "message"),
    [(4, "--step 4 disagrees with trainer_state.json:global_step, which says 3")],
)
def test_a_given_step_that_disagrees_is_refused(given: int, message: str) -> None:
    files = trainer_files(step=3)
    found = recorded("x", {p: len(d) for p, d in files.items()}, files.__getitem__)
    with pytest.raises(UsageError, match=message):
        resolve_step(given, found)
    with pytest.raises(UsageError, match="--world-size 4 disagrees with rng_state_0..1.pth"):
        resolve_world_size(4, found)


@pytest.mark.parametrize(
    "state",
    [b'{"global_step": -1}', b'{"global_step": true}', b'{"global_step": 1.5}', b"[3]",
     b'{"global_step": 1000000000000000000}', b"\xff"],
)  # fmt: skip
def test_a_step_that_is_no_whole_step_is_not_taken(state: bytes) -> None:
    found = recorded("x", {"trainer_state.json": len(state)}, lambda _: state)
    assert found.step is None
    with pytest.raises(UsageError, match="--step is required"):
        resolve_step(None, found)


def test_rank_files_with_a_gap_record_no_world_size() -> None:
    files = {"trainer_state.json": 2, "rng_state_0.pth": 1, "rng_state_2.pth": 1}
    assert recorded("x", files, lambda _: b"{}").world_size is None
    # another trainer's rng files (no trainer_state.json) are not read as a world size
    assert recorded("x", {"rng_state_0.pth": 1}, lambda _: b"").world_size is None


def test_megatron_records_its_iteration_in_the_directory_name_and_needs_a_world_size() -> None:
    files = {"metadata.json": 1, "common.pt": 1, ".metadata": 1}
    found = recorded("iter_0000042", files, lambda _: b"")
    assert (found.step, found.step_source) == (42, "the directory name iter_0000042")
    with pytest.raises(UsageError, match="--world-size is required: Megatron records no world"):
        resolve_world_size(None, found)
    assert resolve_world_size(4, found) == 4
    assert recorded("iter_0000042", {".metadata": 1}, lambda _: b"") == Recorded()


def test_recorded_in_reads_a_local_directory(tmp_path: Path) -> None:
    for name, data in trainer_files(world=1).items():
        (tmp_path / name).write_bytes(data)
    assert (recorded_in(tmp_path).step, recorded_in(tmp_path).world_size) == (3, 1)
    assert recorded_in(tmp_path / "absent") == Recorded()


# -- refusals that name the stack ----------------------------------------------------------


def layout(root: Path, files: list[str]) -> Path:
    for name in files:
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
    return root


@pytest.mark.parametrize(
    ("files", "what", "hint"),
    [
        (
            ["pytorch_model.bin", "optimizer.pt", "scheduler.pt", "rng_state_0.pth",
             "trainer_state.json", "training_args.bin"],
            "transformers Trainer checkpoint with a pickled model (pytorch_model.bin)",
            "save_safetensors=True",
        ),
        (
            ["pytorch_model_fsdp.bin", "optimizer.pt", "trainer_state.json"],
            "transformers Trainer checkpoint with FSDP's FULL_STATE_DICT",
            '"state_dict_type": "SHARDED_STATE_DICT"',
        ),
        (
            ["adapter_model.bin", "adapter_config.json", "README.md"],
            "is a PEFT adapter without adapter_model.safetensors",
            "safe_serialization=True",
        ),
        (
            ["mp_rank_00_model_states.pt", "zero_to_fp32.py"],
            "holds DeepSpeed model states but no *_optim_states.pt",
            "push the whole global_stepN/ directory",
        ),
        (
            ["model.safetensors", "config.json"],
            "is a Hugging Face safetensors directory (model.safetensors, ...)",
            "reg promote",
        ),
    ],
)  # fmt: skip
def test_a_foreign_directory_is_named_with_what_would_work(
    tmp_path: Path, cli: Any, files: list[str], what: str, hint: str
) -> None:
    root = layout(tmp_path / "ckpt", files)
    with pytest.raises(InvalidCheckpoint) as caught:
        refuse_foreign(root, has_metadata=False)
    assert what in caught.value.message and hint in (caught.value.hint or "")
    got = cli("push-ckpt", root, "--run", "r", "--step", "3")
    assert got.returncode == 2 and what in got.stderr and "Traceback" not in got.stderr


def test_deepspeeds_save_dir_names_its_latest_step(tmp_path: Path, cli: Any) -> None:
    root = layout(tmp_path / "ds", ["global_step3/mp_rank_00_model_states.pt", "zero_to_fp32.py"])
    (root / "latest").write_text("global_step3")
    got = cli("push-ckpt", root, "--run", "r")
    assert got.returncode == 2, got.stderr
    assert "is a DeepSpeed save directory, not one checkpoint: its latest is global_step3/" in (
        got.stderr
    )
    assert f"reg push-ckpt {root / 'global_step3'} --run RUN" in got.stderr
    (root / "latest").write_text("../../etc")  # a pointer is a plain sibling, never a path
    with pytest.raises(InvalidCheckpoint, match="whose `latest` names no checkpoint in it"):
        refuse_foreign(root, has_metadata=False)


def test_a_megatron_save_dir_points_at_its_latest_iteration(tmp_path: Path, cli: Any) -> None:
    root = layout(tmp_path / "save", ["iter_0000003/.metadata", "iter_0000003/common.pt"])
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")
    got = cli("push-ckpt", root, "--run", "r", "--step", "3")
    assert got.returncode == 2, got.stderr
    assert "is a Megatron-LM save directory, not one checkpoint: its latest is" in got.stderr
    assert f"reg push-ckpt {root / 'iter_0000003'}" in got.stderr


@pytest.mark.parametrize(
    "tracker", ["../../etc", "/etc/passwd", "iter_0000003/../x", "7", "x" * 300, "\x00"]
)
def test_a_tracker_naming_anything_but_a_sibling_directory_names_nothing(
    tmp_path: Path, tracker: str
) -> None:
    """The tracker picks the message only: a path, a missing directory or junk there never
    makes reg look outside the directory."""
    root = layout(tmp_path / "save", ["iter_0000003/.metadata"])
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    with pytest.raises(InvalidCheckpoint, match="names no checkpoint directory in it"):
        refuse_foreign(root, has_metadata=True)


def test_a_dcp_checkpoint_is_never_refused_as_foreign(ckpts: Any) -> None:
    refuse_foreign(ckpts.ws2.step_dir(2), has_metadata=True)  # nothing raised


def test_rng_states_load_in_many_threads_at_once() -> None:
    """torch's safe_globals is one process-wide list: validation loads Megatron's rng_state
    items on several threads, and one thread leaving it must not refuse another's load."""
    from concurrent.futures import ThreadPoolExecutor

    from registry.formats.dcp_load import load_object

    data = saved([{"np_rng_state": np.random.get_state(), "random_rng_state": random.getstate()}])

    def load(_: int) -> bool:
        return isinstance(load_object(data, "rng_state/shard_0.0_1.1"), list)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(load, range(400)))


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_tracker_that_is_no_regular_file_is_never_followed(tmp_path: Path, kind: str) -> None:
    """A tracker that is a link (to a file naming a real directory) or a FIFO (whose open would
    block): not read, so nothing is named, and nothing hangs."""
    import os

    root = layout(tmp_path / "save", ["iter_0000003/.metadata"])
    tracker = root / "latest_checkpointed_iteration.txt"
    if kind == "symlink":
        (tmp_path / "real.txt").write_text("3")
        tracker.symlink_to(tmp_path / "real.txt")
    else:
        os.mkfifo(tracker)
    with pytest.raises(InvalidCheckpoint, match="names no checkpoint directory in it"):
        refuse_foreign(root, has_metadata=True)


# -- numpy arrays in pickles: plain numbers of exactly their bytes, or refused ------------


def _archive(pickled: bytes) -> bytes:
    """A torch.save archive whose pickle is `pickled` (the test's own crafted stream)."""
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def _array(dtype: bytes, shape: int, data: bytes, dtype_state: bytes = b"") -> bytes:
    """{"x": an ndarray built as numpy pickles one}, with the given dtype code, shape, data
    (a pickled value) and, optionally, a BUILD state for the dtype."""
    build_dtype = (b"(K\x03X\x01\x00\x00\x00<" + dtype_state + b"tb") if dtype_state else b""
    return (
        b"\x80\x02}X\x01\x00\x00\x00x"
        b"cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85U\x01b\x87R"
        b"(K\x01J" + shape.to_bytes(4, "little") + b"\x85"
        b"cnumpy\ndtype\nX" + len(dtype).to_bytes(4, "little") + dtype + b"\x89\x88\x87R"
        + build_dtype + b"\x89" + data + b"tbs."
    )  # fmt: skip


CRAFTED_ARRAYS = {
    # an object array whose data is a list shorter than its shape: numpy reads heap pointers
    "object": (_array(b"O8", 10, b"](K\x07K\x07K\x07e"), "dtype 'O8'"),
    # plain numbers, too few bytes for the shape
    "short": (_array(b"u4", 10, b"C\x04abcd"), "4 bytes for shape (10,)"),
    # a dtype given fields by its state
    "fields": (
        _array(b"u4", 1, b"C\x04abcd", dtype_state=b"N(X\x01\x00\x00\x00a\x85}"),
        "a dtype with fields",
    ),
}


@pytest.mark.process
@pytest.mark.parametrize("case", sorted(CRAFTED_ARRAYS))
def test_a_numpy_array_that_is_not_plain_numbers_is_refused_before_numpy_sees_it(
    case: str, tmp_path: Path
) -> None:
    """numpy's __setstate__ trusts its state: these crash the process (or worse) once torch
    hands them to numpy with numpy's globals allowed. Each is refused by name, in a process
    of its own so that a regression fails here instead of killing the test worker."""
    import subprocess
    import sys

    pickled, why = CRAFTED_ARRAYS[case]
    path = tmp_path / "rng_state_0.pth"
    path.write_bytes(_archive(pickled))
    script = (
        "import sys\n"
        "from registry.errors import UnsafeMetadata\n"
        "from registry.formats import sidecars\n"
        "from registry.formats.dcp_load import load_object\n"
        "data = open(sys.argv[1], 'rb').read()\n"
        "print(sidecars.entries(['rng_state_0.pth'], {'rng_state_0.pth': len(data)},"
        " lambda _: data)[1])\n"
        "try:\n"
        "    load_object(data, 'rng_state/shard_0.0_1.1')\n"
        "except UnsafeMetadata as exc:\n"
        "    print(exc.message)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    entry, refused = done.stdout.splitlines()
    assert entry.startswith("rng_state_0.pth!its pickle holds a numpy array that is not plain")
    assert why in entry and why in refused
    assert refused.startswith("rng_state/shard_0.0_1.1 holds a numpy array")


def test_numpy_rng_states_still_load() -> None:
    from registry.formats.dcp_load import load_object

    state = np.random.get_state()
    loaded = load_object(saved({"np": state}), "rng")
    assert np.array_equal(loaded["np"][1], state[1])


def test_megatrons_step_is_common_pts_iteration_which_the_name_must_agree_with() -> None:
    """A copy of iter_0000100 renamed iter_0000200 would otherwise record the wrong step."""
    import argparse

    common = saved(
        {"iteration": 100, "args": argparse.Namespace(lr=1.0), "checkpoint_version": 3.0}
    )
    files = {"metadata.json": 2, "common.pt": len(common), ".metadata": 1}

    def read(path: str) -> bytes:
        return common if path == "common.pt" else b"{}"

    found = recorded("iter_0000100", files, read)
    assert (found.step, found.step_source) == (100, "common.pt:iteration")
    assert recorded("renamed", files, read).step == 100
    with pytest.raises(UsageError, match="iter_0000200 disagrees with common.pt:iteration"):
        recorded("iter_0000200", files, read)


def test_a_megatron_save_dir_without_its_tracker_is_named_too(tmp_path: Path) -> None:
    root = layout(tmp_path / "save", ["iter_0000003/.metadata", "iter_0000006/.metadata"])
    with pytest.raises(InvalidCheckpoint) as caught:
        refuse_foreign(root, has_metadata=True)
    assert "Megatron-LM save directory (iter_0000003, iter_0000006)" in caught.value.message
    assert str(root / "iter_0000006") in (caught.value.hint or "")


def test_a_claimed_part_needs_its_step(tmp_path: Path, cli: Any) -> None:
    got = cli("push-ckpt", tmp_path, "--run", "r", "--claim", "abc")
    assert got.returncode == 2 and "--claim needs --step" in got.stderr


def test_a_recorded_world_size_below_the_shard_files_names_its_source(
    ckpts: Any, tmp_path: Path, cli: Any
) -> None:
    """One rng_state file beside shards of two ranks: the message says where 1 came from."""
    d = ckpts.ws2.copy_step(2, tmp_path / "ck")
    for name, data in trainer_files(world=1, step=2).items():
        (d / name).write_bytes(data)
    got = cli("push-ckpt", d, "--run", "r")
    assert got.returncode == 2, got.stderr
    assert "the world size 1 (rng_state_0.pth) is smaller than the 2 ranks" in got.stderr
