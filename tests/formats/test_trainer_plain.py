"""The transformers Trainer's plain save (no FSDP): `model.safetensors` beside `optimizer.pt`,
`scheduler.pt`, `rng_state_R.pth` and `trainer_state.json` (registry/formats/
safetensors_root.py). Its model file's header is a root of the checkpoint, checked before
anything is built from it; the tensors are read as raw bytes; the header is proven against the
catalog's digest wherever a stored copy is read; the release carries the checkpoint's own
config.json. The Trainer's own save and resume of this layout are in
tests/formats/test_frameworks.py (`trainer-plain`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from registry.errors import IntegrityError, InvalidCheckpoint
from registry.formats import safetensors_root
from registry.formats.dcp import inventory
from registry.formats.foreign import refuse_foreign
from registry.lifecycle.validation.streamed import RawStream
from tests import tamper
from tests.formats.test_trainer_files import trainer_files
from tests.helpers import saved
from tests.lifecycle import test_integrity
from tests.server import test_presigned

KEY = "ckpt/default/hf/step-3/"
# reg server on a real S3 server (tests/server/test_presigned.py), as the fixture `on_s3`
on_s3 = test_presigned.reg_on_s3
store_kind = test_integrity.store_kind  # memory, local, and S3 over HTTP


def safetensors_bytes(tensors: dict[str, torch.Tensor], header: Any = None) -> bytes:
    """A safetensors file as the format says (the `header` given as is, when given)."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data, at = b"", 0
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        doc[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + len(raw)],
        }
        data += raw
        at += len(raw)
    text = (json.dumps(doc) if header is None else header).encode()
    return struct.pack("<Q", len(text)) + text + data


def model_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


def plain_trainer_dir(root: Path, model: bytes | None = None) -> Path:
    """checkpoint-3/ as the Trainer writes it without FSDP on 2 ranks."""
    root.mkdir(parents=True)
    tensors = model_tensors()
    params = [torch.nn.Parameter(t.detach().clone().float()) for t in tensors.values()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
    optimizer.step()
    files = {
        **trainer_files(world=2, step=3),
        "model.safetensors": model if model is not None else safetensors_bytes(tensors),
        "optimizer.pt": saved(optimizer.state_dict()),
        "config.json": json.dumps({"model_type": "llama", "vocab_size": 16}).encode(),
        "training_args.bin": b"not read",
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


# -- the header, checked ------------------------------------------------------------------------


def test_a_header_gives_each_tensor_its_own_byte_range() -> None:
    tensors = model_tensors()
    data = safetensors_bytes(tensors)
    entries = safetensors_root.parse(data, len(data), "model.safetensors")
    assert [(e.name, e.dtype, e.shape) for e in entries] == [
        ("model.embed_tokens.weight", "float32", (16, 8)),
        ("model.norm.weight", "bfloat16", (8,)),
        ("lm_head.weight", "float32", (16, 8)),
    ]
    for e in entries:
        got = torch.frombuffer(
            bytearray(data[e.offset : e.offset + e.length]), dtype=getattr(torch, e.dtype)
        )
        assert torch.equal(got.view(e.shape), tensors[e.name])
    inv = inventory(safetensors_root.metadata({"model.safetensors": data}, light=True))
    assert all(
        c.raw and c.file == "model.safetensors" for t in inv.tensors.values() for c in t.chunks
    )


def _entry(dtype: str = "F32", shape: Any = (2,), offsets: Any = (0, 8)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("[1, 2]", "its header is not a JSON object"),
        ('{"a": 1, "a": 2}', "appears twice"),
        ("{not json", "not valid JSON"),
        (json.dumps({"a": _entry(dtype="F128")}), "has dtype 'F128'"),
        (json.dumps({"a": _entry(shape=[3])}), "does not fill bytes 0..8"),
        (json.dumps({"a": _entry(shape=[-2])}), "are not numbers"),
        (json.dumps({"a": _entry(shape=[True, 2])}), "are not numbers"),
        (json.dumps({"a": _entry(offsets=[8, 16])}), "of a 8-byte data section"),
        (json.dumps({"a": _entry(), "b": _entry(offsets=[4, 8], shape=[1])}), "overlap"),
        (json.dumps({"a": _entry(offsets=[0, 8, 9])}), "are not numbers"),
        (json.dumps({"__metadata__": {"k": 1}}), "__metadata__ is not text to text"),
        (json.dumps({"a": "x"}), "is not a tensor entry"),
        (json.dumps({"a": _entry(shape=[1], offsets=[4, 8])}), "leaves a gap before it"),
        (json.dumps({"a": _entry(shape=[1], offsets=[0, 4])}), "its tensors end at byte"),
        (json.dumps({"a": _entry(shape=[0, 2**62, 2**62], offsets=[0, 0])}), "is too large"),
    ],
)  # fmt: skip
def test_a_header_that_is_not_sound_is_refused_in_one_line(header: str, message: str) -> None:
    data = struct.pack("<Q", len(header)) + header.encode() + bytes(8)
    with pytest.raises(InvalidCheckpoint) as caught:
        safetensors_root.parse(data, len(data), "model.safetensors")
    assert message in caught.value.message and "\n" not in caught.value.message


@pytest.mark.parametrize("length", [0, 1, 10**12, 2**64 - 1])
def test_a_header_length_that_cannot_be_is_refused_before_anything_is_read(length: int) -> None:
    with pytest.raises(InvalidCheckpoint, match="its safetensors header says"):
        safetensors_root.header_length(struct.pack("<Q", length), 1000, "model.safetensors")
    with pytest.raises(InvalidCheckpoint, match="not safetensors"):
        safetensors_root.header_length(b"\x01\x02", None, "model.safetensors")


def test_one_name_in_two_model_files_is_refused() -> None:
    one = safetensors_bytes({"w": torch.zeros(2)})
    with pytest.raises(InvalidCheckpoint, match="w is in both a.safetensors and b.safetensors"):
        safetensors_root.metadata({"a.safetensors": one, "b.safetensors": one}, light=True)


def test_raw_bytes_stream_in_whole_elements_however_they_are_split() -> None:
    values = torch.arange(10, dtype=torch.float32)
    data = values.numpy().tobytes()
    stream, pieces, at = RawStream("float32", "w"), [], 0
    for size in (3, 1, 7, 2, 13, 14):
        pieces += [bytes(p) for p in stream.feed(memoryview(data[at : at + size]))]
        at += size
    stream.finish()
    assert all(len(p) % 4 == 0 for p in pieces)
    assert b"".join(pieces) == data
    cut = RawStream("float32", "w")
    cut.feed(memoryview(data[:6]))
    with pytest.raises(IntegrityError, match="ends inside an element"):
        cut.finish()


# -- push, validate, promote --------------------------------------------------------------------


def test_a_plain_trainer_folder_is_taken_and_a_save_pretrained_folder_still_named(
    tmp_path: Path,
) -> None:
    assert refuse_foreign(plain_trainer_dir(tmp_path / "ckpt"), has_metadata=False) is True
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(safetensors_bytes({"w": torch.zeros(2)}))
    with pytest.raises(InvalidCheckpoint, match="is a Hugging Face safetensors directory"):
        refuse_foreign(hf, has_metadata=False)


def test_push_records_step_world_size_and_every_resume_class(
    tmp_path: Path, cli: Any, cpu_policy: Path
) -> None:
    root = plain_trainer_dir(tmp_path / "checkpoint-3")
    pushed = cli("push-ckpt", root, "--run", "hf", "--json")
    assert pushed.returncode == 0, pushed.stderr
    out = json.loads(pushed.stdout)
    assert (out["step"], out["world_size"], out["layout"]) == (3, 2, "transformers")
    assert out["model_path"] == "" and out["resumable"] is True, out
    assert out["resume_state"]["optimizer"] == ["optimizer.pt:state"]
    assert out["resume_state"]["model"] == ["lm_head", "model"]

    validated = cli("validate", "hf@step3", "--json")
    assert validated.returncode == 0, validated.stderr
    assert json.loads(validated.stdout)["passed"] is True

    promoted = cli("promote", "hf@step3", "--model", "llama", "--json")
    assert promoted.returncode == 0, promoted.stderr
    release = json.loads(promoted.stdout)
    assert sorted(f["path"] for f in release["files"]) == ["config.json", "model.safetensors"]
    assert cli("pull-release", "llama:v1", tmp_path / "release").returncode == 0
    assert (tmp_path / "release" / "config.json").read_bytes() == (
        root / "config.json"
    ).read_bytes()
    from safetensors.torch import load_file

    got = load_file(tmp_path / "release" / "model.safetensors")
    want = model_tensors()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)

    # an --extra of that name is the release's config instead
    mine = tmp_path / "config.json"
    mine.write_text(json.dumps({"model_type": "llama", "vocab_size": 16, "mine": True}))
    again = cli("promote", "hf@step3", "--model", "llama", "--extra", mine, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["version"] == 2


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[: len(data) - 5], "the file is truncated"),
        (lambda data: struct.pack("<Q", 10**9) + data[8:], "its safetensors header says"),
        (lambda data: data[:8] + b"[" + data[9:], "model.safetensors"),
    ],
)
def test_a_damaged_model_file_is_refused_at_push_and_nothing_is_committed(
    tmp_path: Path, cli: Any, damage: Any, message: str
) -> None:
    good = safetensors_bytes(model_tensors())
    root = plain_trainer_dir(tmp_path / "checkpoint-3", model=damage(good))
    got = cli("push-ckpt", root, "--run", "hf")
    assert got.returncode == 2, got.stderr
    assert message in got.stderr and "Traceback" not in got.stderr
    assert len(got.stderr.strip().splitlines()) <= 2
    assert "hf" not in cli("ls", "--json").stdout


def test_a_config_json_that_is_no_config_is_named_at_promotion(
    tmp_path: Path, cli: Any, cpu_policy: Path
) -> None:
    root = plain_trainer_dir(tmp_path / "checkpoint-3")
    (root / "config.json").write_bytes(b"\x80\x04pickle")
    assert cli("push-ckpt", root, "--run", "hf").returncode == 0
    got = cli("promote", "hf@step3", "--model", "llama")
    assert got.returncode == 2 and "config.json of the checkpoint is" in got.stderr
    assert "--extra config.json" in got.stderr and "Traceback" not in got.stderr


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_model_file_changed_in_the_store_fails_validation_and_promotes_nothing(
    store_kind: str, cpu_policy: Path, tmp_path: Path, where: str
) -> None:
    """The header is proven against the catalog's digest before a tensor is placed by it; a
    flipped data byte fails the restore's one pass."""
    from registry.errors import ValidationFailed

    root = plain_trainer_dir(tmp_path / "checkpoint-3")
    with Registry() as reg:
        reg.push_checkpoint(root, run="hf", step=3, world_size=2)
        tamper.flip_byte(reg.store, KEY + "model.safetensors", 20 if where == "header" else None)
        report = reg.validate("hf@step3")
        assert report["passed"] is False
        integrity = next(c for c in report["checks"] if c["name"] == "integrity")
        assert integrity["passed"] is False and "model.safetensors" in integrity["detail"]
        with pytest.raises((IntegrityError, ValidationFailed)):
            reg.promote("hf@step3", model="llama")
        assert reg.releases() == []  # no model was even created


# -- an optimizer.pt too large to read whole ----------------------------------------------------


def adamw_state() -> bytes:
    params = [torch.nn.Parameter(torch.ones(64, 64)) for _ in range(3)]
    optimizer = torch.optim.AdamW(params)
    sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
    optimizer.step()
    return saved(optimizer.state_dict())


def ends_of(data: bytes) -> Any:
    return lambda _path, head, tail: (data[:head], data[len(data) - min(tail, len(data) - head) :])


def test_a_large_optimizer_file_is_read_for_its_structure_by_its_two_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over MAX_BYTES (a real model's optimizer.pt is gigabytes) the archive's data.pkl is
    found through its central directory and read for its structure, tensors opaque; without a
    reader of its ends it stays present but unread."""
    from registry.formats import sidecars

    data = adamw_state()
    monkeypatch.setattr(sidecars, "MAX_BYTES", 1024)
    monkeypatch.setattr(sidecars, "ENDS_HEAD", 4096)
    monkeypatch.setattr(sidecars, "ENDS_TAIL", 2048)
    sizes = {"optimizer.pt": len(data)}
    got = sidecars.entries(["optimizer.pt"], sizes, lambda _: b"", ends_of(data))
    assert {"optimizer.pt:", "optimizer.pt:state", "optimizer.pt:param_groups"} <= set(got)
    unread = sidecars.entries(["optimizer.pt"], sizes, lambda _: b"")
    assert unread == ["optimizer.pt", "optimizer.pt!it is over 0 MiB"]


def _zip(records: list[tuple[str, bytes]], method: int) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as z:
        for name, body in records:
            z.writestr(name, body)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x80\x04not a zip at all" * 200, "read by its ends"),
        (_zip([("a/version", b"3"), ("a/data.pkl", b"\x80\x02}q\x00."), ("a/x", b"")], 0),
         "the first record is not ROOT/data.pkl at byte 0"),
        (_zip([("a/data.pkl", b"\x80\x02}q\x00." * 300), ("a/version", b"3"), ("a/x", b"")], 8),
         "not a stored record"),
        (_zip([("a/data.pkl", b"\x80\x02}q\x00."), ("b/version", b"3"), ("a/x", b"")], 0),
         "outside a/"),
        (_zip([("a/data.pkl", b"\x80\x02" + b"(" * 3000), ("a/version", b"3"), ("a/x", b"")], 0),
         "its pickle does not read"),
    ],
)  # fmt: skip
def test_a_large_archive_that_torch_save_did_not_write_is_present_but_unread(
    monkeypatch: pytest.MonkeyPatch, data: bytes, why: str
) -> None:
    from registry.formats import sidecars

    monkeypatch.setattr(sidecars, "MAX_BYTES", 16)
    got = sidecars.entries(
        ["optimizer.pt"], {"optimizer.pt": len(data)}, lambda _: b"", ends_of(data)
    )
    assert got[0] == "optimizer.pt" and len(got) == 2 and got[1].startswith("optimizer.pt!")
    assert why in got[1], got


def test_a_large_optimizer_file_counts_at_push_and_at_validation_and_is_proven(
    monkeypatch: pytest.MonkeyPatch, cpu_policy: Path, tmp_path: Path
) -> None:
    from registry.formats import sidecars

    monkeypatch.setattr(sidecars, "MAX_BYTES", 1024)
    root = plain_trainer_dir(tmp_path / "checkpoint-3")
    with Registry() as reg:
        pushed = reg.push_checkpoint(root, run="hf", step=3, world_size=2)
        assert pushed["resume_state"]["optimizer"] == ["optimizer.pt:state"]
        report = reg.validate("hf@step3")
        assert report["passed"] is True and report["resume_state"]["optimizer"] == [
            "optimizer.pt:state"
        ]
        tamper.flip_byte(reg.store, KEY + "optimizer.pt", 40)
        report = reg.validate("hf@step3")
        assert report["passed"] is False
        assert (
            "optimizer.pt"
            in next(c for c in report["checks"] if c["name"] == "integrity")["detail"]
        )


# -- through reg server -------------------------------------------------------------------------


def _through_server(cli: Any, server: Any, root: Path, tmp_path: Path) -> None:
    """Push as alice (no --step or --world-size: the files record them), validate as the
    validator, promote as the releaser, pull both back: every byte through the server's
    paths."""
    alice = server.client_env("alice")
    pushed = cli("push-ckpt", root, "--project", "team-a", "--run", "hf", "--json", env=alice)
    assert pushed.returncode == 0, pushed.stderr
    out = json.loads(pushed.stdout)
    assert (out["step"], out["world_size"], out["layout"], out["resumable"]) == (
        3, 2, "transformers", True
    )  # fmt: skip
    ref = "team-a/hf@step3"
    validated = cli("validate", ref, "--device", "cpu", "--json", env=server.client_env("val"))
    assert validated.returncode == 0, validated.stderr
    assert json.loads(validated.stdout)["passed"] is True
    promoted = cli("promote", ref, "--model", "tiny-llama", "--json", env=server.client_env("rel"))
    assert promoted.returncode == 0, promoted.stderr
    files = sorted(f["path"] for f in json.loads(promoted.stdout)["files"])
    assert {"config.json", "model.safetensors"} <= set(files)  # beside what signing adds
    assert cli("pull", ref, tmp_path / "pulled", env=alice).returncode == 0
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        assert (tmp_path / "pulled" / name).read_bytes() == (root / name).read_bytes()


def test_a_plain_trainer_save_goes_through_reg_server(
    cli: Any, reg_server: Any, tmp_path: Path
) -> None:
    _through_server(cli, reg_server, plain_trainer_dir(tmp_path / "checkpoint-3"), tmp_path)


def test_a_plain_trainer_save_goes_straight_to_s3(cli: Any, on_s3: Any, tmp_path: Path) -> None:
    """The presigned push: the server proves the model file's header from the object S3 holds
    (one pass through sha256) before it reads a tensor's place from it."""
    _through_server(cli, on_s3, plain_trainer_dir(tmp_path / "checkpoint-3"), tmp_path)


def test_a_tensor_with_no_elements_validates_and_is_released(
    tmp_path: Path, cli: Any, cpu_policy: Path
) -> None:
    tensors = {**model_tensors(), "model.empty": torch.zeros(0, 8)}
    root = plain_trainer_dir(tmp_path / "checkpoint-3", model=safetensors_bytes(tensors))
    assert cli("push-ckpt", root, "--run", "hf").returncode == 0
    validated = cli("validate", "hf@step3", "--json")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert cli("promote", "hf@step3", "--model", "llama").returncode == 0
    assert cli("pull-release", "llama:v1", tmp_path / "release").returncode == 0
    from safetensors.torch import load_file

    got = load_file(tmp_path / "release" / "model.safetensors")
    assert got["model.empty"].shape == (0, 8) and sorted(got) == sorted(tensors)


def test_a_dcp_checkpoint_with_stray_adapter_files_is_neither_peft_nor_an_adapter(
    tmp_path: Path, cli: Any, cpu_policy: Path, ckpts: Any
) -> None:
    """adapter_config.json or adapter_model.safetensors beside DCP shards are files of the
    checkpoint, nothing more: the layout is the shards', the promotion converts nothing and
    carries no config from the checkpoint."""
    import shutil

    root = Path(shutil.copytree(ckpts.ws2.step_dir(2), tmp_path / "dcp"))
    (root / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (root / "adapter_model.safetensors").write_bytes(safetensors_bytes({"w": torch.zeros(2)}))
    (root / "config.json").write_text("lr: 0.1  # a training config, not a model's")
    pushed = cli("push-ckpt", root, "--run", "r", "--step", "2", "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["layout"] == "dcp"
    promoted = cli("promote", "r@step2", "--model", "tiny", "--json")
    assert promoted.returncode == 0, promoted.stderr
    out = json.loads(promoted.stdout)
    assert "convert" not in out or out["convert"] is None
    assert [f["path"] for f in out["files"]] == ["model.safetensors"]


def test_the_layout_option_names_every_layout() -> None:
    from cli.common import LAYOUT_OPTION
    from policies.layouts import LAYOUTS

    assert all(name in str(LAYOUT_OPTION.help) for name in LAYOUTS)


def test_optimizer_shaped_names_in_the_model_file_are_no_optimizer(
    tmp_path: Path, cli: Any
) -> None:
    """A model file whose tensors are named like an optimizer's state is the model: without
    optimizer.pt the checkpoint is not resumable."""
    tensors = {"state.0.exp_avg": torch.zeros(2), "param_groups.0.lr": torch.zeros(1)}
    root = plain_trainer_dir(tmp_path / "checkpoint-3", model=safetensors_bytes(tensors))
    (root / "optimizer.pt").unlink()
    pushed = cli("push-ckpt", root, "--run", "hf", "--json")
    assert pushed.returncode == 0, pushed.stderr
    out = json.loads(pushed.stdout)
    assert out["resumable"] is False and out["missing_state"] == ["optimizer"]
    assert out["resume_state"]["model"] == ["param_groups", "state"]


# -- each big file read once ----------------------------------------------------------------


class Counted:
    """Bytes read from the store per key (`stream` and `read_range`), over LocalStore."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, lie: dict[str, bytes] | None = None):
        from registry.storage.local import LocalStore

        self.read: dict[str, int] = {}
        stream, ranged = LocalStore._stream, LocalStore._read_range

        def counted_stream(store: Any, key: str, version: Any) -> Any:
            for piece in stream(store, key, version):
                self.read[key] = self.read.get(key, 0) + len(piece)
                yield piece

        def counted_range(store: Any, key: str, offset: int, length: int, version: Any) -> Any:
            self.read[key] = self.read.get(key, 0) + length
            data = ranged(store, key, offset, length, version)
            for suffix, fake in (lie or {}).items():  # a store that answers ranges otherwise
                if key.endswith(suffix) and offset < len(fake):
                    data = bytearray(fake[offset : offset + length])
            return data

        monkeypatch.setattr(LocalStore, "_stream", counted_stream)
        monkeypatch.setattr(LocalStore, "_read_range", counted_range)

    def of(self, path: str) -> int:
        return sum(n for key, n in self.read.items() if key.endswith("/" + path))


def test_validation_and_promotion_read_each_big_file_once(
    monkeypatch: pytest.MonkeyPatch, cpu_policy: Path, tmp_path: Path
) -> None:
    """A model file's header and a large optimizer.pt's two ends are read by range and proved
    in the one pass over each file: about one read of each, not two."""
    from registry.formats import sidecars

    monkeypatch.setattr(sidecars, "MAX_BYTES", 1024)  # optimizer.pt read by its ends
    monkeypatch.setattr(sidecars, "ENDS_HEAD", 2048)  # as a real one: ends << the file
    monkeypatch.setattr(sidecars, "ENDS_TAIL", 2048)
    root = plain_trainer_dir(tmp_path / "checkpoint-3")
    sizes = {name: (root / name).stat().st_size for name in ("model.safetensors", "optimizer.pt")}
    with Registry() as reg:
        reg.push_checkpoint(root, run="hf", step=3, world_size=2)
        counted = Counted(monkeypatch)
        assert reg.validate("hf@step3")["passed"] is True
        for name, size in sizes.items():
            assert size <= counted.of(name) < 1.2 * size + 4096, (name, counted.read)
        counted.read.clear()
        reg.promote("hf@step3", model="llama")
        size = sizes["model.safetensors"]
        assert size <= counted.of("model.safetensors") < 1.2 * size + 4096, counted.read


def test_a_header_that_changes_between_two_reads_fails_validation(
    monkeypatch: pytest.MonkeyPatch, cpu_policy: Path, tmp_path: Path
) -> None:
    """A store that answers the header's range with other (well-formed) bytes than the pass
    hashes: what was parsed is not what was proved, and validation fails."""
    root = plain_trainer_dir(tmp_path / "checkpoint-3")
    real = (root / "model.safetensors").read_bytes()
    fake = real.replace(b'"format": "pt"', b'"format": "px"')
    assert fake != real and len(fake) == len(real)
    with Registry() as reg:
        reg.push_checkpoint(root, run="hf", step=3, world_size=2)
        Counted(monkeypatch, lie={"/model.safetensors": fake})
        report = reg.validate("hf@step3")
        integrity = next(c for c in report["checks"] if c["name"] == "integrity")
        assert report["passed"] is False and "changed while it was validated" in integrity["detail"]
        from registry.errors import ValidationFailed

        with pytest.raises((IntegrityError, ValidationFailed), match="changed"):
            reg.promote("hf@step3", model="llama")


def test_a_release_name_safetensors_reserves_is_refused_before_any_work(
    tmp_path: Path, cli: Any, cpu_policy: Path
) -> None:
    tensors = {"x.w": torch.ones(2), "x.__metadata__": torch.zeros(2)}
    root = plain_trainer_dir(tmp_path / "checkpoint-3", model=safetensors_bytes(tensors))
    assert cli("push-ckpt", root, "--run", "hf").returncode == 0
    got = cli("promote", "hf@step3", "--model", "llama", "--strip-prefix", "x.")
    assert got.returncode == 2, got.stderr
    assert "would name x.__metadata__ __metadata__" in got.stderr and "Traceback" not in got.stderr


def test_a_sharded_model_and_its_index_push_and_release_as_one_model(
    tmp_path: Path, cli: Any, cpu_policy: Path
) -> None:
    """save_pretrained of a model over max_shard_size (every large model) writes
    model-0000K-of-0000N.safetensors and an index: each shard is a root, the index a file
    beside them, and the release holds every tensor once."""
    tensors = model_tensors()
    names = sorted(tensors)
    root = plain_trainer_dir(tmp_path / "checkpoint-3")
    (root / "model.safetensors").unlink()
    shards = {
        "model-00001-of-00002.safetensors": {n: tensors[n] for n in names[:2]},
        "model-00002-of-00002.safetensors": {n: tensors[n] for n in names[2:]},
    }
    weight_map = {n: f for f, part in shards.items() for n in part}
    for name, part in shards.items():
        (root / name).write_bytes(safetensors_bytes(part))
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    pushed = cli("push-ckpt", root, "--run", "hf", "--json")
    assert pushed.returncode == 0, pushed.stderr
    out = json.loads(pushed.stdout)
    assert out["resumable"] is True and out["resume_state"]["model"] == ["lm_head", "model"]
    assert cli("validate", "hf@step3").returncode == 0
    assert cli("promote", "hf@step3", "--model", "llama").returncode == 0
    assert cli("pull-release", "llama:v1", tmp_path / "release").returncode == 0
    from safetensors.torch import load_file

    got = load_file(tmp_path / "release" / "model.safetensors")
    assert sorted(got) == names and all(torch.equal(got[n], tensors[n]) for n in names)
