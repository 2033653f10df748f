"""DeepSpeed ZeRO checkpoints read without DeepSpeed and without unpickling them
(registry/formats/deepspeed_root.py), from files laid out exactly as DeepSpeed 0.19.8's
`save_checkpoint` writes them (torch.save of the same dicts; DeepSpeed's own LossScaler and
ZeroStageEnum become whatever object the pickle names: reg never builds them). DeepSpeed's own
save, resume and zero_to_fp32 are in tests/formats/test_frameworks.py (`deepspeed`,
`deepspeed-zero3`); here: the arithmetic on shapes that split mid-row over ranks and groups, and
what a careless or hostile checkpoint gets."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from registry import Registry
from registry.errors import IntegrityError, InvalidCheckpoint
from registry.formats import deepspeed_root, deepspeed_zero
from tests import tamper
from tests.lifecycle import test_integrity
from tests.server import test_presigned

store_kind = test_integrity.store_kind  # memory, local, and S3 over HTTP
on_s3 = test_presigned.reg_on_s3
KEY = "ckpt/default/ds/step-3/"
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
# Two groups; shapes whose elements split mid-row over the ranks' partitions.
GROUPS = [
    OrderedDict(embed=(7, 3), empty=(0, 3), bias=(3,)),  # a parameter with no element too
    OrderedDict([("head.weight", (5, 4)), ("head.bias", (5,))]),
]


BUFFERS = {"norm.running_mean": torch.arange(4.0)}  # a buffer: in the model states, kept


def weights() -> dict[str, torch.Tensor]:
    """The parameters, as the fp32 partitions hold them."""
    g = torch.Generator().manual_seed(7)
    return {
        name: torch.randn(shape, generator=g) for group in GROUPS for name, shape in group.items()
    }


def released() -> dict[str, torch.Tensor]:
    """What zero_to_fp32 rebuilds: the buffers and the parameters."""
    return {**BUFFERS, **weights()}


def _states(stage: int, ranks: int, rank: int, **facts: Any) -> dict[str, Any]:
    full = weights()
    module = {k: (v.clone() if stage < 3 else torch.empty(0)) for k, v in full.items()}
    states = {
        "module": {**module, **{k: v.clone() for k, v in BUFFERS.items()}},
        "buffer_names": list(BUFFERS),
        "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in g.items()) for g in GROUPS],
        "frozen_param_shapes": {},
        "shared_params": {},
        "frozen_param_fragments": {},
        "lr_scheduler": {"base_lrs": [0.003], "last_epoch": 3, "_step_count": 4},
        "data_sampler": None,
        "global_steps": 3,
        "global_samples": 48,
        "dp_world_size": ranks,
        "mp_world_size": 1,
        "ds_version": "0.19.8",
    }
    return {**states, **facts}


def _zero2_partitions(ranks: int) -> list[list[torch.Tensor]]:
    """rank -> group -> its partition: the group's parameters back to back, padded to a
    multiple of 2 x ranks, split in equal parts."""
    full = weights()
    out: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for group in GROUPS:
        flat = torch.cat([full[n].reshape(-1) for n in group])
        size = 2 * ranks * math.ceil(flat.numel() / (2 * ranks))
        flat = torch.cat([flat, torch.zeros(size - flat.numel())])
        for r, part in enumerate(flat.chunk(ranks)):
            out[r].append(part.clone())
    return out


def _zero3_partitions(ranks: int) -> list[list[torch.Tensor]]:
    """rank -> group -> its flat group: slice r of each parameter (ceil(numel / ranks)
    elements, the last padded), one after another."""
    full = weights()
    out: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for group in GROUPS:
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
        for name in group:
            flat = full[name].reshape(-1)
            part = math.ceil(flat.numel() / ranks)
            flat = torch.cat([flat, torch.zeros(part * ranks - flat.numel())])
            for r in range(ranks):
                per_rank[r].append(flat[r * part : (r + 1) * part])
        for r in range(ranks):
            out[r].append(torch.cat(per_rank[r]).clone())
    return out


def zero_dir(root: Path, stage: int = 2, ranks: int = 2, **facts: Any) -> Path:
    """A global_step3/ as DeepSpeed's save_checkpoint writes it for ZeRO-`stage`."""
    root.mkdir(parents=True)
    parts = _zero2_partitions(ranks) if stage < 3 else _zero3_partitions(ranks)
    for r in range(ranks):
        state = {
            g: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.full_like(p, 0.5 + r),
                "exp_avg_sq": torch.full_like(p, 0.25),
            }
            for g, p in enumerate(parts[r])
        }
        inner = {"state": state, "param_groups": [{"lr": 0.003, "params": [0]}]}
        if stage < 3:
            opt = {
                "loss_scaler": {"cur_scale": 1.0},
                "single_partition_of_fp32_groups": parts[r],
                "base_optimizer_state": inner,
                "partition_count": [ranks] * len(GROUPS),
                "param_alignment_paddings": [[0] * len(g) for g in GROUPS],
                "zero_stage": 2,
            }
        else:
            opt = {
                "zero_stage": 3,
                "partition_count": ranks,
                "optimizer_state_dict": inner,
                "fp32_flat_groups": parts[r],
            }
        torch.save({"optimizer_state_dict": opt, "ds_version": "0.19.8"}, root / OPTIM.format(r))
        if stage == 3:
            name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            torch.save(_states(stage, ranks, r, **facts), root / name)
    if stage < 3:
        torch.save(_states(stage, ranks, 0, **facts), root / "mp_rank_00_model_states.pt")
    return root


def read_as_root(root: Path) -> Any:
    parts = {}
    for name in sorted(os.listdir(root)):
        if deepspeed_root.is_root_name(name):
            data = (root / name).read_bytes()
            parts[name], _ = deepspeed_root.read_root(
                lambda at, n, d=data: d[at : at + n], len(data), name
            )
    return deepspeed_zero.build(parts)


# -- the arithmetic ------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_boxes_tile_a_flat_range_in_order_each_contiguous(
    shape: tuple[int, ...], cut: tuple[float, float]
) -> None:
    numel = math.prod(shape)
    start, stop = sorted(int(c * numel) for c in cut)
    index = torch.arange(numel).reshape(shape) if numel else None
    covered = []
    for offsets, sizes, first in deepspeed_zero.boxes(shape, start, stop):
        assert len(offsets) == len(sizes) == len(shape)
        assert index is not None
        box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        flat = box.reshape(-1).tolist()
        assert flat == list(range(first, first + len(flat)))  # contiguous, where it says
        covered += flat
    assert covered == list(range(start, stop))
    if shape:
        assert len(deepspeed_zero.boxes(shape, start, stop)) <= max(1, 2 * len(shape) - 1)


@pytest.mark.parametrize(("stage", "ranks"), [(2, 2), (2, 3), (3, 2), (3, 3)])
def test_each_parameter_is_found_where_zero_to_fp32_finds_it(
    tmp_path: Path, stage: int, ranks: int
) -> None:
    built = read_as_root(zero_dir(tmp_path / "global_step3", stage, ranks))
    assert (built.stage, built.world_size, built.step) == (stage, ranks, 3)
    files = {p.name: p.read_bytes() for p in (tmp_path / "global_step3").iterdir()}
    for name, want in weights().items():
        dtype, shape, pieces = built.tensors[f"module.{name}"]
        assert (dtype, shape) == ("float32", tuple(want.shape))
        got = torch.empty(want.numel())
        for p in pieces:
            raw = files[p.file][p.at : p.at + 4 * p.count]
            got[p.start : p.start + p.count] = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        assert torch.equal(got.reshape(want.shape), want), name
    assert set(built.tensors) >= {f"module.{name}" for name in BUFFERS}
    exp_avg = built.tensors["optimizer.state.0.exp_avg"]
    assert exp_avg[0] == "float32" and len(exp_avg[2]) == ranks
    assert built.tensors["optimizer.state.1.step"][1] == ()


# -- end to end ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_push_validate_promote_pull_as_the_files_record(
    tmp_path: Path, cli: Any, cpu_policy: Path, stage: int
) -> None:
    root = zero_dir(tmp_path / "global_step3", stage, 3)
    pushed = cli("push-ckpt", root, "--run", "ds", "--json")  # step, world size recorded
    assert pushed.returncode == 0, pushed.stderr
    out = json.loads(pushed.stdout)
    assert (out["step"], out["world_size"], out["layout"], out["resumable"]) == (
        3, 3, "deepspeed", True
    )  # fmt: skip
    shown = json.loads(cli("show", "ds@step3", "--json").stdout)
    assert shown["model_path"] == "module"
    validated = cli("validate", "ds@step3", "--json")
    assert validated.returncode == 0 and json.loads(validated.stdout)["passed"], validated.stderr
    assert cli("promote", "ds@step3", "--model", "tiny").returncode == 0
    assert cli("pull-release", "tiny:v1", tmp_path / "release").returncode == 0
    from safetensors.torch import load_file

    got = load_file(tmp_path / "release" / "model.safetensors")
    want = released()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert cli("pull", "ds@step3", tmp_path / "pulled").returncode == 0
    for f in root.iterdir():
        assert (tmp_path / "pulled" / f.name).read_bytes() == f.read_bytes()


def _truncate(root: Path) -> None:
    path = root / OPTIM.format(1)
    path.write_bytes(path.read_bytes()[:-100])


def _drop_rank(root: Path) -> None:
    (root / OPTIM.format(1)).unlink()


def _model_parallel(root: Path) -> None:
    (root / "zero_pp_rank_0_mp_rank_01_optim_states.pt").write_bytes(
        (root / OPTIM.format(0)).read_bytes()
    )


def _bigger_shapes(root: Path) -> None:
    state = torch.load(root / "mp_rank_00_model_states.pt", weights_only=False)
    state["param_shapes"][0]["embed"] = torch.Size([70, 3])
    torch.save(state, root / "mp_rank_00_model_states.pt")


def _strided(root: Path) -> None:
    state = torch.load(root / OPTIM.format(0), weights_only=False)
    part = state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    wide = torch.zeros(part.numel() * 2)
    wide[::2] = part
    state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] = wide[::2]
    torch.save(state, root / OPTIM.format(0))


def _frozen(root: Path) -> None:
    state = torch.load(root / "mp_rank_00_model_states.pt", weights_only=False)
    state["frozen_param_shapes"] = {"frozen.weight": torch.Size([2])}
    torch.save(state, root / "mp_rank_00_model_states.pt")


def _optimizer_state(root: Path, rank: int, change: Any) -> None:
    path = root / OPTIM.format(rank)
    state = torch.load(path, weights_only=False)
    change(state["optimizer_state_dict"])
    torch.save(state, path)


def _half_partition(root: Path) -> None:
    def change(opt: dict[str, Any]) -> None:
        groups = opt["single_partition_of_fp32_groups"]
        groups[0] = groups[0].half()

    _optimizer_state(root, 1, change)


def _both_stages(root: Path) -> None:
    def change(opt: dict[str, Any]) -> None:
        opt["fp32_flat_groups"] = opt["single_partition_of_fp32_groups"]

    _optimizer_state(root, 0, change)


def _partition_count(root: Path) -> None:
    _optimizer_state(root, 0, lambda opt: opt.update(partition_count=[4, 4]))


def _paddings_tuple(root: Path) -> None:
    _optimizer_state(root, 0, lambda opt: opt.update(param_alignment_paddings=([1, 0, 0], [0, 0])))


def _a_rank_twice(root: Path) -> None:
    data = (root / OPTIM.format(0)).read_bytes()
    (root / ("bf16_" + OPTIM.format(0))).write_bytes(data)


def _shape_of_text(root: Path) -> None:
    state = torch.load(root / "mp_rank_00_model_states.pt", weights_only=False)
    state["param_shapes"][0]["embed"] = ("x", 3)
    torch.save(state, root / "mp_rank_00_model_states.pt")


def _rezip(path: Path, change: Any) -> None:
    """The archive written again record by record (stored, in order), `change(name, data)`
    giving each record's new (name, data)."""
    import zipfile

    with zipfile.ZipFile(path) as old:
        records = [(i.filename, old.read(i)) for i in old.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as new:
        for name, data in records:
            new.writestr(*change(name, data))


def _big_endian(root: Path) -> None:
    _rezip(root / OPTIM.format(0), lambda n, d: (n, b"big" if n.endswith("/byteorder") else d))


def _a_name_twice_in_two_cases(root: Path) -> None:
    """A second record whose name differs from the storage record's only in case: torch's zip
    reader finds either for the pickle's key."""
    import zipfile

    with zipfile.ZipFile(root / OPTIM.format(0), "a", zipfile.ZIP_STORED) as z:
        name = next(n for n in z.namelist() if n.endswith("/data/0"))
        z.writestr(name.replace("/data/", "/DATA/"), bytes(4))


def _no_pickle_first(root: Path) -> None:
    (root / OPTIM.format(0)).write_bytes(b"PK\x03\x04" + os.urandom(300))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "is not a torch.save archive reg can read"),
        (_drop_rank, "records dp_world_size 2 and mp_world_size 1, with 1 optimizer states"),
        (_model_parallel, "a tensor- or pipeline-parallel DeepSpeed save"),
        (_bigger_shapes, "group 0's partitions hold 24 elements; 'embed' needs 210"),
        (_strided, "is not contiguous"),
        (_frozen, "records frozen_param_shapes: reg does not rebuild"),
        (_no_pickle_first, "is not a torch.save archive reg can read"),
        (_half_partition, "single_partition_of_fp32_groups[0] is float16, not float32"),
        (_both_stages, "holds both ZeRO-2 and ZeRO-3 fp32 partitions"),
        (_partition_count, "records partition_count 4, with 2 optimizer states files"),
        (_paddings_tuple, "param_alignment_paddings do not match param_shapes"),
        (_a_rank_twice, "are both rank 0's optim states"),
        (_shape_of_text, "param_shapes has an entry that is not a name and a shape"),
        (_big_endian, "it was saved big-endian"),
        (_a_name_twice_in_two_cases, "mp_rank_00_optim_states/ or twice"),
    ],
)
def test_a_damaged_or_partial_save_is_refused_in_one_line_and_nothing_is_committed(
    tmp_path: Path, cli: Any, damage: Any, message: str
) -> None:
    root = zero_dir(tmp_path / "global_step3")
    damage(root)
    got = cli("push-ckpt", root, "--run", "ds", "--step", "3", "--world-size", "2")
    assert got.returncode == 2, got.stderr
    assert message in got.stderr and "Traceback" not in got.stderr
    assert len(got.stderr.strip().splitlines()) <= 2
    assert "ds" not in cli("ls", "--json").stdout


class _Boom:
    """A pickle that would run a command if anything unpickled it."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.target}",))


def test_nothing_in_the_pickles_runs(tmp_path: Path, cli: Any, cpu_policy: Path) -> None:
    """DeepSpeed's pickles name its own classes; reg reads them as inert stand-ins. One naming
    os.system pushes, validates and promotes, and the command never runs."""
    root = zero_dir(tmp_path / "global_step3")
    target = tmp_path / "pwned"
    for path in (root / "mp_rank_00_model_states.pt", root / OPTIM.format(0)):
        state = torch.load(path, weights_only=False)
        state["ds_version"] = _Boom(target)
        torch.save(state, path)
    assert cli("push-ckpt", root, "--run", "ds").returncode == 0
    assert cli("validate", "ds@step3").returncode == 0
    assert cli("promote", "ds@step3", "--model", "tiny").returncode == 0
    assert not target.exists()


def test_a_file_changed_in_the_store_fails_validation_and_promotes_nothing(
    store_kind: str, cpu_policy: Path, tmp_path: Path
) -> None:
    from registry.errors import ValidationFailed

    root = zero_dir(tmp_path / "global_step3")
    with Registry() as reg:
        reg.push_checkpoint(root, run="ds", step=3)
        tamper.flip_byte(reg.store, KEY + OPTIM.format(1), None)
        report = reg.validate("ds@step3")
        integrity = next(c for c in report["checks"] if c["name"] == "integrity")
        assert report["passed"] is False and OPTIM.format(1) in integrity["detail"]
        with pytest.raises((IntegrityError, ValidationFailed)):
            reg.promote("ds@step3", model="tiny")
        assert reg.releases() == []


def _through_server(cli: Any, server: Any, root: Path, tmp_path: Path) -> None:
    alice = server.client_env("alice")
    pushed = cli("push-ckpt", root, "--project", "team-a", "--run", "ds", "--json", env=alice)
    assert pushed.returncode == 0, pushed.stderr
    out = json.loads(pushed.stdout)
    assert (out["step"], out["world_size"], out["layout"]) == (3, 2, "deepspeed")
    ref = "team-a/ds@step3"
    validated = cli("validate", ref, "--device", "cpu", "--json", env=server.client_env("val"))
    assert validated.returncode == 0 and json.loads(validated.stdout)["passed"], validated.stderr
    promoted = cli("promote", ref, "--model", "tiny-llama", "--json", env=server.client_env("rel"))
    assert promoted.returncode == 0, promoted.stderr
    assert cli("pull-release", "tiny-llama:v1", tmp_path / "rel", env=alice).returncode == 0
    from safetensors.torch import load_file

    got, want = load_file(tmp_path / "rel" / "model.safetensors"), released()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_zero_save_goes_through_reg_server(cli: Any, reg_server: Any, tmp_path: Path) -> None:
    _through_server(cli, reg_server, zero_dir(tmp_path / "global_step3", 3), tmp_path)


def test_a_zero_save_goes_straight_to_s3(cli: Any, on_s3: Any, tmp_path: Path) -> None:
    """The presigned push: the server proves each file's ranges from the object S3 holds (one
    pass through sha256) before it reads a tensor's place from them."""
    _through_server(cli, on_s3, zero_dir(tmp_path / "global_step3"), tmp_path)


def test_a_crafted_ranges_blob_is_refused() -> None:
    with pytest.raises(InvalidCheckpoint, match="not the ranges reg read"):
        deepspeed_zero.build({OPTIM.format(0): b"not ranges"})


def test_a_stray_deepspeed_file_beside_dcp_shards_is_neither_a_root_nor_the_layout(
    tmp_path: Path, cli: Any, ckpts: Any
) -> None:
    """DCP metadata decides: a file with DeepSpeed's name beside it (even a garbage one) is a
    file beside the shards, read by its ranges (never whole) and unread, and the checkpoint
    keeps its own layout."""
    import shutil

    root = shutil.copytree(ckpts.ws2.step_dir(2), tmp_path / "step-2")
    (root / "mp_rank_00_model_states.pt").write_bytes(os.urandom(4096))
    got = cli("push-ckpt", root, "--run", "r", "--step", "2", "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["layout"] == "dcp"
    assert json.loads(got.stdout)["resumable"] is True
    validated = cli("validate", "r@step2", "--json")
    assert validated.returncode == 0 and json.loads(validated.stdout)["passed"], validated.stderr


@settings(max_examples=200, deadline=None)
@given(reads=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 120)), max_size=12))
def test_ranges_merge_what_was_read_and_answer_only_inside_it(
    reads: list[tuple[int, int]],
) -> None:
    data = bytes(range(256)) * 2
    ranges = deepspeed_root.Ranges(len(data), [])
    read = bytearray(len(data))
    for at, n in reads:
        n = min(n, len(data) - at)
        ranges.add(at, data[at : at + n])
        read[at : at + n] = b"\x01" * n
    spans = ranges.spans
    assert all(a + len(d) < b for (a, d), (b, _) in itertools.pairwise(spans))
    for at, chunk in spans:
        assert chunk == data[at : at + len(chunk)]
    for at in range(len(data)):
        for n in (1, 7):
            inside = at + n <= len(data) and all(read[at : at + n])
            same = [a for a, d in spans if a <= at and at + n <= a + len(d)]
            if same:
                assert ranges.read(at, n) == data[at : at + n]
            else:  # whatever was read back to back is one span
                assert not inside and not ranges.covers(at, n)


def test_a_large_states_file_is_read_in_a_few_small_ranges(tmp_path: Path) -> None:
    """What a push, validation or a server reads of a big optimizer states file before its one
    pass: its two ends, its central directory, data.pkl and the local header of each record a
    tensor comes from; never the tensors' bytes."""
    root = zero_dir(tmp_path / "global_step3")
    path = root / OPTIM.format(0)
    state = torch.load(path, weights_only=False)
    big = torch.zeros(4 * 1024 * 1024)  # 16 MiB of exp_avg
    state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"] = big
    torch.save(state, path)
    data = path.read_bytes()
    asked: list[int] = []

    def read(at: int, n: int) -> bytes:
        asked.append(n)
        return data[at : at + n]

    blob, spans = deepspeed_root.read_root(read, len(data), path.name)
    assert sum(asked) < 256 * 1024 and len(asked) <= 12, asked
    assert sum(len(d) for _, d in spans) <= sum(asked) and len(blob) < 256 * 1024


class _Storage:
    """Pickled by reference: what torch.save's persistent id names."""

    def __init__(self, kind: Any, key: str, numel: int) -> None:
        self.kind, self.key, self.numel = kind, key, numel


class _Tensor:
    def __init__(self, storage: _Storage, size: tuple[int, ...]) -> None:
        self.storage, self.size = storage, size

    def __reduce__(self) -> Any:
        from torch._utils import _rebuild_tensor_v2

        stride = (1,) * len(self.size)
        return (_rebuild_tensor_v2, (self.storage, 0, self.size, stride, False, OrderedDict()))


def _pickled(value: Any) -> bytes:
    import io
    import pickle

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _Storage):
                return ("storage", obj.kind, obj.key, "cpu", obj.numel)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(value)
    return buf.getvalue()


def test_a_storage_record_named_as_two_dtypes_is_refused() -> None:
    """torch.load makes a record's storage at its first mention and hands it to every later
    one: a pickle that names record 0 as float32, then as float16 for the tensor reg would use,
    would have reg read other values than torch. Refused; one name, one way, reads."""
    from registry.formats.torch_pickle_bounds import StoredTensor, read_tensors

    first = _Tensor(_Storage(torch.FloatStorage, "0", 2), (2,))
    again = _Tensor(_Storage(torch.HalfStorage, "0", 4), (4,))
    with pytest.raises(Exception, match="named twice, in two ways"):
        read_tensors(_pickled({"a": first, "b": again}))
    same = read_tensors(
        _pickled({"a": first, "b": _Tensor(_Storage(torch.FloatStorage, "0", 2), (1,))})
    )
    assert isinstance(same["b"], StoredTensor) and same["b"].dtype == "float32"


def test_the_library_takes_the_step_and_world_size_the_files_record(
    deployment: Any, tmp_path: Path
) -> None:
    """`Registry.push_checkpoint` without a step, embedded and through `reg server` (whose
    client reads the step from the files before sending a byte): DeepSpeed's `global_steps`
    and its ranks; a step given that disagrees is refused; a save directory rather than the
    checkpoint in it is named as such, not asked for a step."""
    from registry.errors import UsageError

    root = zero_dir(tmp_path / "saved" / "global_step3")
    with Registry() as reg:
        out = reg.push_checkpoint(root, run="ds")
        assert (out.step, out.world_size, out.layout) == (3, 2, "deepspeed")
        assert [(c["step"], c["state"]) for c in reg.list_checkpoints("ds")] == [(3, "committed")]
        with pytest.raises(UsageError, match="--step 4 disagrees with .*global_steps"):
            reg.push_checkpoint(root, run="ds", step=4)
        (root.parent / "latest").write_text("global_step3")
        with pytest.raises(InvalidCheckpoint, match="DeepSpeed save directory"):
            reg.push_checkpoint(root.parent, run="ds")
