"""The files trainers write beside their shards, read without trusting them, and the resume
classes what is in them provides (registry/formats/sidecars.py, policies/resume.py)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from policies.loader import ResumePolicy
from policies.resume import classify
from registry.formats import sidecars
from tests.helpers import saved

LIGHTNING_KEYS = sorted(
    [
        "state_dict.model.embed.weight",
        "optimizer_0.state.model.embed.weight.exp_avg",
        "optimizer_0.state.model.embed.weight.step",
        "optimizer_0.param_groups.0.lr",
    ]
)
ACCELERATE_KEYS = sorted(
    [
        "pytorch_model_fsdp_0.model.embed.weight",
        "optimizer_0.optimizer.state.embed.weight.exp_avg",
        "optimizer_0.optimizer.param_groups.0.lr",
    ]
)


def lightning_meta(**extra: object) -> dict[str, object]:
    """What Lightning 2.6's ModelParallelStrategy writes to meta.pt
    (tests/formats/test_frameworks.py has the real one)."""
    return {
        "epoch": 0,
        "global_step": 3,
        "pytorch-lightning_version": "2.6.6",
        "loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"ready": 3}}}},
        "callbacks": {},
        "lr_schedulers": [{"step_size": 2, "gamma": 0.5, "last_epoch": 3}],
        **extra,
    }


def entries_of(files: dict[str, bytes]) -> list[str]:
    return sidecars.entries(files, {p: len(d) for p, d in files.items()}, files.__getitem__)


def test_lightning_meta_pt_is_read_into_its_classes() -> None:
    entries = entries_of({"meta.pt": saved(lightning_meta())})
    assert {"meta.pt", "meta.pt:", "meta.pt:global_step", "meta.pt:lr_schedulers"} <= set(entries)
    assert "meta.pt:callbacks" not in entries  # an empty value is no state
    assert not any(e.startswith("meta.pt:lr_schedulers.") for e in entries)  # lists are one value
    v = classify(LIGHTNING_KEYS, entries, ResumePolicy(), "lightning")
    assert v.resumable, v.missing
    assert v.classes["train_state"] == ["meta.pt:global_step", "meta.pt:loops.fit_loop"]
    assert v.classes["lr_scheduler"] == ["meta.pt:lr_schedulers"]
    assert "dataloader" not in v.classes and "present but unread" not in " ".join(v.warnings)


def test_a_meta_pt_without_a_step_leaves_train_state_missing() -> None:
    meta = lightning_meta()
    del meta["global_step"], meta["loops"]
    v = classify(LIGHTNING_KEYS, entries_of({"meta.pt": saved(meta)}), ResumePolicy())
    assert v.layout == "lightning" and v.missing == ["train_state"]


def test_a_meta_pt_weights_only_refuses_is_present_but_unread() -> None:
    """save_hyperparameters() with an argparse.Namespace: torch.load(weights_only=True) refuses
    it, and reg counts nothing from the file rather than guess."""
    meta = lightning_meta(hyper_parameters=argparse.Namespace(lr=0.1))
    entries = entries_of({"meta.pt": saved(meta)})
    assert entries == [
        "meta.pt",
        "meta.pt!torch.load(weights_only=True) refuses argparse.Namespace",
    ]
    v = classify(LIGHTNING_KEYS, entries, ResumePolicy())
    assert v.missing == ["train_state"]
    assert any(
        w.startswith("meta.pt is present but unread (torch.load(weights_only=True) refuses")
        for w in v.warnings
    )


def test_a_library_that_widens_torchs_allowlist_widens_nothing_reg_reads() -> None:
    """Imported, megatron.core, torchtitan and peft add argparse.Namespace (and more) to the
    process-wide list of globals torch's weights_only loader allows: reg's loads allow exactly
    their own list all the same, and leave the process's as they found it."""
    import torch.serialization as serialization

    before = serialization.get_safe_globals()
    serialization.add_safe_globals([argparse.Namespace])  # what `import megatron.core` does
    try:
        widened = sorted(map(repr, serialization.get_safe_globals()))
        meta = lightning_meta(hyper_parameters=argparse.Namespace(lr=0.1))
        assert entries_of({"meta.pt": saved(meta)}) == [
            "meta.pt",
            "meta.pt!torch.load(weights_only=True) refuses argparse.Namespace",
        ]
        assert sorted(map(repr, serialization.get_safe_globals())) == widened
    finally:
        serialization.clear_safe_globals()
        serialization.add_safe_globals(before)


def test_a_crafted_sidecar_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            import os

            return os.system, (f"touch {marker}",)

    buf = io.BytesIO()
    torch.save({"global_step": Evil()}, buf)
    entries = entries_of({"meta.pt": buf.getvalue(), "scheduler.bin": b"\x80\x04junk"})
    assert not marker.exists()
    assert any(e.startswith("meta.pt!torch.load(weights_only=True) refuses") for e in entries)
    assert "meta.pt!torch.load(weights_only=True) refuses posix.system" in entries
    assert "scheduler.bin!it is not a torch.save archive" in entries


def test_accelerate_rng_files_load_with_exactly_the_numpy_globals() -> None:
    state = np.random.RandomState(0).get_state()  # what accelerate's random_states_N.pkl holds
    good = saved({"step": 0, "random_state": state, "torch_manual_seed": torch.zeros(4)})
    other = saved({"random_state": np.float64(1.0)})  # a numpy scalar: not on the list
    entries = entries_of({"random_states_0.pkl": good, "random_states_1.pkl": other})
    assert "random_states_0.pkl:random_state" in entries
    # refused before torch sees it: only numpy's arrays, checked to be plain numbers
    assert any(
        e.startswith("random_states_1.pkl!its pickle holds a numpy array that is not plain")
        and "numpy._core.multiarray.scalar called" in e
        for e in entries
    )
    # The allowlist is only for the RNG files: a scheduler.bin with numpy arrays is refused.
    assert any(e.startswith("scheduler.bin!") for e in entries_of({"scheduler.bin": good}))


def test_accelerate_sidecars_make_it_resumable() -> None:
    files = {
        "scheduler.bin": saved({"last_epoch": 6, "base_lrs": [0.01]}),
        "custom_checkpoint_0.pkl": saved({"step": 3}),
        "random_states_0.pkl": saved(
            {"step": 0, "random_state": np.random.RandomState(0).get_state()}
        ),
    }
    entries = entries_of(files)
    v = classify(ACCELERATE_KEYS, entries, ResumePolicy())
    assert v.layout == "accelerate" and v.resumable
    assert v.model_path == "pytorch_model_fsdp_0.model"
    assert v.classes["optimizer"] == ["optimizer_0.optimizer"]
    assert v.classes["lr_scheduler"] == ["scheduler.bin"]
    assert v.classes["train_state"] == ["custom_checkpoint_0.pkl"]  # not random_states' step
    assert v.classes["rng"] == ["random_states_0.pkl:random_state"]
    assert v.model_names(["pytorch_model_fsdp_0.model.embed.weight"]) == {
        "embed.weight": "pytorch_model_fsdp_0.model.embed.weight"
    }


def test_a_large_sidecar_is_not_read() -> None:
    def never(path: str) -> bytes:
        raise AssertionError(f"read {path}")

    got = sidecars.entries(["meta.pt"], {"meta.pt": sidecars.MAX_BYTES + 1}, never)
    assert got == ["meta.pt", "meta.pt!it is over 64 MiB"]


def test_files_reg_does_not_read_are_listed_only() -> None:
    def never(path: str) -> bytes:
        raise AssertionError(f"read {path}")

    assert sidecars.entries(["notes.txt", "a/b.bin"], {}, never) == ["a/b.bin", "notes.txt"]


def test_content_paths_are_bounded() -> None:
    wide = {f"k{i}": i + 1 for i in range(10_000)}
    assert len(sidecars.content_paths(wide)) == sidecars.MAX_ENTRIES
    deep: dict[str, object] = {"x": 1}
    for _ in range(50):
        deep = {"d": deep}
    assert sidecars.content_paths(deep) == ["d", "d.d", "d.d.d", "d.d.d.d"]
    odd = {"a.b": 1, "c:d": 1, "e!f": 1, "": 1, 7: 1, "ok": 1}
    assert sidecars.content_paths(odd) == ["ok"]  # a key that would confuse a path is left out


def test_a_key_set_recorded_before_sidecars_were_read_keeps_its_verdict() -> None:
    """Key sets are never rewritten: a meta.pt recorded before reg read it keeps the classes
    the layout assumed then, and says so."""
    v = classify(LIGHTNING_KEYS, ["meta.pt"], ResumePolicy())
    assert v.resumable and v.classes["train_state"] == ["meta.pt"]
    assert v.classes["lr_scheduler"] == ["meta.pt"] and v.classes["dataloader"] == ["meta.pt"]
    assert (
        "meta.pt was recorded before reg read it: it is assumed to hold train_state, "
        "lr_scheduler, dataloader, as it was then"
    ) in v.warnings


@pytest.mark.parametrize("prefix", ["", "model.", "model"])
def test_strip_prefix_values(prefix: str) -> None:
    from policies.resume import check_strip_prefix, names_path

    got = check_strip_prefix(prefix)
    assert got == ("model." if prefix else "")
    assert names_path("state_dict", got) == ("state_dict.model" if prefix else "state_dict")
    assert names_path("", got) == ("model" if prefix else "")


@pytest.mark.parametrize("bad", ["..", ".model", "a..b", "x" * 2000])
def test_bad_strip_prefixes_are_usage_errors(bad: str) -> None:
    from policies.resume import check_strip_prefix
    from registry.errors import UsageError

    with pytest.raises(UsageError, match="--strip-prefix"):
        check_strip_prefix(bad)


def test_a_release_name_cannot_be_empty() -> None:
    from registry.errors import InvalidCheckpoint

    keys = sorted(["model.", "model.w", "optimizer.state.w.m", "optimizer.param_groups.0.lr"])
    v = classify(keys, [], ResumePolicy(), "dcp")
    with pytest.raises(InvalidCheckpoint, match="has no name once 'model.' is stripped"):
        v.model_names(keys)
    with pytest.raises(InvalidCheckpoint, match="has no name once 'model.w.' is stripped"):
        classify(["model.w.", "model.w.x"], [], ResumePolicy(), "dcp").model_names(
            ["model.w.", "model.w.x"], "w."
        )


def test_sidecar_reading_refuses_what_would_be_slow_or_huge() -> None:
    """torch.load never sees a compressed record (a deflated 3 MB file inflates to gigabytes)
    or a global named with thousands of characters (torch's refusal message is searched by a
    quadratic regex); the reason recorded is bounded."""
    import zipfile

    plain = saved({"global_step": 1, "t": torch.zeros(1024)})
    packed = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(plain)) as src,
        zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for record in src.infolist():
            dst.writestr(record.filename, src.read(record))
    got = entries_of({"meta.pt": packed.getvalue()})
    assert got[1].startswith("meta.pt!its record") and got[1].endswith(
        "is compressed (torch.save never is)"
    )

    long_name = "m" * 20_000
    pickle_bytes = b"\x80\x02c" + long_name.encode() + b"\nC\n)\x81."
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle_bytes)
    got = entries_of({"meta.pt": archive.getvalue()})
    assert got[1] == "meta.pt!it names a global of 20002 characters"
    assert all(len(e) < 300 for e in got)
    assert entries_of({"meta.pt": b"not a zip"})[1] == "meta.pt!it is not a torch.save archive"


def test_a_dict_shared_by_many_parents_is_not_walked_whole_each_time() -> None:
    looked_at = 0

    class Counting(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def]
            nonlocal looked_at
            for item in super().items():
                looked_at += 1
                yield item

    shared = Counting({f"k{i}": None for i in range(200_000)})
    value = {f"t{j}": shared for j in range(510)}
    assert sidecars.content_paths(value) == sorted(f"t{j}" for j in range(510))
    assert looked_at <= 510 * sidecars.MAX_ENTRIES  # 512 keys of it per parent, not 200,000
