"""Release extras judged by their content (registry/formats/extras.py): pickles and unknown
binary data are refused before a release exists, code is refused unless the policy allows it on
purpose (then recorded on the release and shown by `reg show`); the tokenizer files, configs and
text a Hugging Face folder needs are accepted. Embedded and through `reg server`."""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from registry.errors import UsageError
from registry.formats.extras import CODE, judge
from tests.serverproc import CPU_POLICY

MODELING = b"import torch\n\nclass TinyModel(torch.nn.Module):\n    pass\n"
AUTO_MAP = {"model_type": "tiny", "auto_map": {"AutoModel": "modeling_tiny.TinyModel"}}


def _torch_save(**kw: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf, **kw)
    return buf.getvalue()


def _safetensors() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"w": torch.ones(2)})


def _sentencepiece() -> bytes:
    """A real serialized sentencepiece ModelProto (transformers ships its protobuf schema)."""
    pytest.importorskip("google.protobuf")
    from transformers.utils import sentencepiece_model_pb2_new as pb

    model = pb.ModelProto()
    for i, piece in enumerate(["<unk>", "<s>", "</s>", *(f"\u2581w{i}" for i in range(200))]):
        added = model.pieces.add()
        added.piece, added.score = piece, -0.5 * i
    model.trainer_spec.model_type = 1
    model.normalizer_spec.name = "nmt_nfkc"
    return bytes(model.SerializeToString())


def _shared_object() -> bytes:
    import math

    return Path(math.__file__).read_bytes()  # an extension module of this Python


def _hf_files(dest: Path) -> dict[str, bytes]:
    """What transformers itself writes for a tokenizer and a generation config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 64)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(dest)
    GenerationConfig(max_new_tokens=8).save_pretrained(dest)
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.is_file()}


ACCEPTED_TEXT = {
    "vocab.txt": b"[PAD]\n[UNK]\nhello\n",
    "merges.txt": b"#version: 0.2\n\xc4\xa0 t\n",
    "README.md": b"# tiny\n\nRun `python generate.py`. A model card.\n",
    "LICENSE": b"Apache License 2.0\n",
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "qwen.tiktoken": b"IQ== 0\nIg== 1\n",
}


def test_what_each_extra_is_judged_to_be(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    accepted = {**_hf_files(tmp_path / "hf"), **ACCEPTED_TEXT, "tokenizer.model": _sentencepiece()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(accepted)
    for name, data in accepted.items():
        assert judge(name, data).accepted, (name, judge(name, data))
    legacy = _torch_save(_use_new_zipfile_serialization=False)
    refused = {
        # by name: loaders unpickle these whatever they hold
        "pytorch_model.bin": (b'{"not": "a pickle"}', "pickle", ".bin file"),
        "training_args.pt": (b"text", "pickle", ".pt file"),
        "optimizer.pth": (b"", "pickle", ".pth file"),
        "x.ckpt": (b"", "pickle", ".ckpt file"),
        "x.pkl": (b"", "pickle", ".pkl file"),
        # by content, whatever the name
        "tokenizer.model": (_torch_save(), "pickle", "zip archive"),
        "vocab.txt": (legacy, "pickle", "protocol 2 pickle"),
        "merges.txt": (pickle.dumps({"a": [1]}, protocol=0), "pickle", "protocol 0 or 1"),
        "spiece.model": (pickle.dumps({"a": [1]}, protocol=1), "pickle", "protocol 0 or 1"),
        "added_tokens.json": (pickle.dumps([1], protocol=5), "pickle", "protocol 5 pickle"),
        "adapter.model": (_safetensors(), "weights", "safetensors file"),
        "blob.dat": (bytes(range(256)) * 8, "binary", "not JSON, text or a sentencepiece"),
        # code
        "modeling_tiny.py": (MODELING, CODE, "Python source"),
        "tokenization_tiny.pyc": (b"\x00", CODE, "compiled Python"),
        "kernels.so": (b"", CODE, "shared object"),
        "kernels.dat": (_shared_object(), CODE, "ELF"),
        "setup": (b"#!/bin/sh\nrm -rf /\n", CODE, "#! script"),
        "config.json": (json.dumps(AUTO_MAP).encode(), CODE, "its auto_map"),
        "tokenizer_config.json": (
            json.dumps(
                {"tokenizer_class": "X", "auto_map": {"AutoTokenizer": ["t.T", None]}}
            ).encode(),
            CODE,
            "its auto_map",
        ),
        "generation_config.json": (b'{"a": [{"b": {"auto_map": {}}}]}', CODE, "auto_map in a[0].b"),
        "preprocessor_config.json": (b'{"trust_remote_code": true}', CODE, "trust_remote_code"),
        "pipeline.json": (b'{"custom_pipelines": {}}', CODE, "custom_pipelines"),
        "model_index.json": (
            b'{"pipe": {"impl": "pipes/my_pipe.py:Pipe"}}',
            CODE,
            "pipe.impl names the Python file 'pipes/my_pipe.py:Pipe'",
        ),
    }
    for name, (data, kind, why) in refused.items():
        got = judge(name, data)
        assert got.kind == kind and why in got.why, (name, got)
    # A vocabulary's tokens are keys and list items, never a member's value: ".py" in them is
    # not a reference to code.
    vocab = {"model": {"vocab": {"setup.py": 1}, "merges": ["setup .py", "main.py"]}}
    assert judge("tokenizer.json", json.dumps(vocab).encode()).kind == "json"
    # JSON that does not parse strictly is refused with the reason, one line.
    for data, reason in (
        (b'{"a": 1, "a": 2}', "'a' appears twice"),
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b"\xef\xbb\xbf{}", "byte order mark"),
        (b"\xff\xfe{", "is not UTF-8"),
        (b'{"a": ', "is not valid JSON"),
    ):
        with pytest.raises(UsageError, match="^--extra special_tokens_map.json") as raised:
            judge("special_tokens_map.json", data)
        assert reason in str(raised.value) and "\n" not in str(raised.value)


def _push(cli: Any, ckpts: Any) -> None:
    res = cli("push-ckpt", ckpts.ws2.step_dir(4), "--run", "r", "--step", "4")
    assert res.returncode == 0, res.stderr


def _one_line(res: Any) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: "), res.stderr
    assert "Traceback" not in res.stderr
    return str(lines[0])


def test_pickles_and_code_are_refused_before_a_release_exists(
    deployment: Any, cpu_policy: Path, cli: Any, ckpts: Any, tmp_path: Path
) -> None:
    _push(cli, ckpts)
    config = tmp_path / "ok" / "config.json"
    config.parent.mkdir()
    config.write_text('{"model_type": "tiny"}')
    cases = {
        "pytorch_model.bin": (_torch_save(), "is a pickle (a .bin file", "no policy allows"),
        "tokenizer.model": (_torch_save(), "is a pickle (a zip archive", "no policy allows"),
        "adapter.model": (_safetensors(), "is a safetensors file", "leave it out"),
        "blob.dat": (bytes(range(256)), "is binary data", "tokenizer files"),
        "modeling_tiny.py": (MODELING, "is code (Python source)", "allow_code_extras = true"),
        "config.json": (json.dumps(AUTO_MAP).encode(), "is code (its auto_map)", "allow_code"),
    }
    for i, (name, (data, said, hint)) in enumerate(cases.items()):
        extra = tmp_path / str(i) / name
        extra.parent.mkdir()
        extra.write_bytes(data)
        others = [] if name == "config.json" else ["--extra", config]
        res = cli("promote", "r@step4", "--model", "tiny", *others, "--extra", extra, "--json")
        assert res.returncode == 2, (name, res.stderr)
        line = _one_line(res)
        assert f"--extra {name} {said}" in line and hint in line, line
        assert str(tmp_path) not in line  # the file's name, not a path (the server's own)
        assert json.loads(res.stdout)["error"]["exit_code"] == 2
    assert json.loads(cli("releases", "--json").stdout) == []
    if deployment.remote:  # nothing the server was sent stays in its uploads
        assert not list((deployment.server.home / "uploads").glob("promote-*"))


def test_code_allowed_by_policy_is_released_recorded_and_shown(
    deployment: Any, cpu_policy: Path, cli: Any, ckpts: Any, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    _push(cli, ckpts)
    policy = tmp_path / "policy.toml"
    allow = (
        '[release]\nallow_code_extras = true\n[[access.grants]]\nprincipals = ["admin", "tester"]'
    )
    policy.write_text(f'{CPU_POLICY.read_text()}\n{allow}\nrole = "admin"\n')
    applied = cli("policy", "apply", policy)
    assert applied.returncode == 0, applied.stderr
    files = tmp_path / "files"
    files.mkdir()
    given = {
        **_hf_files(tmp_path / "hf"),
        **ACCEPTED_TEXT,
        "tokenizer.model": _sentencepiece(),
        "config.json": json.dumps(AUTO_MAP).encode(),
        "modeling_tiny.py": MODELING,
    }
    for name, data in given.items():
        (files / name).write_bytes(data)
    extras = [a for name in sorted(given) for a in ("--extra", files / name)]
    res = cli("promote", "r@step4", "--model", "tiny", *extras, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    code = ["config.json", "modeling_tiny.py"]
    assert out["code_extras"] == code and set(given) <= {f["path"] for f in out["files"]}
    shown = json.loads(cli("show", "tiny:v1", "--json").stdout)
    assert shown["code_extras"] == code
    human = cli("show", "tiny:v1")
    assert re.search(r"^  code extras +config\.json, modeling_tiny\.py$", human.stdout, re.M)
    again = json.loads(cli("promote", "r@step4", "--model", "tiny", *extras, "--json").stdout)
    assert again["existing"] and again["release"] == "tiny:v1" and again["code_extras"] == code

    # Recorded in the catalog's options and in release.json (a format an older reg refuses).
    from sqlmodel import select

    from registry.catalog.models import Release

    with deployment.direct() as reg, reg.catalog.session() as s:
        (row,) = s.exec(select(Release)).all()
        assert row.options["code_extras"] == code
    pulled = tmp_path / "pulled"
    assert cli("pull-release", "tiny:v1", pulled).returncode == 0
    for name, data in given.items():
        assert (pulled / name).read_bytes() == data, name
    document = json.loads((pulled / "release.json").read_text())
    assert document["format"] == "reg.release/4" and document["code_extras"] == code
    offline = {"REG_URL": "", "REG_TOKEN": "", "REG_CATALOG_URL": "sqlite:////nonexistent/x.db"}
    verified = cli("verify", "--dir", pulled, "--sha256", out["sha256"], env=offline)
    assert verified.returncode == 0, verified.stderr

    # A release without code says so (an empty list), and keeps the older format.
    plain = cli("promote", "r@step4", "--model", "tiny", "--extra", files / "vocab.txt", "--json")
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["code_extras"] == []
    shutil.rmtree(pulled)
    assert cli("pull-release", "tiny:v2", pulled).returncode == 0
    assert json.loads((pulled / "release.json").read_text())["format"] == "reg.release/2"


def test_release_json_records_code_extras_in_a_format_of_its_own() -> None:
    from dataclasses import replace

    from registry.core.refs import CheckpointRef
    from registry.errors import InvalidDocument
    from registry.formats.documents import (
        FileRecord,
        HfConfigRecord,
        ReleaseDocument,
        SourceRecord,
        ValidationRecord,
    )

    sha = "a" * 64
    plain = ReleaseDocument(
        model="tiny",
        version=1,
        files=tuple(FileRecord(n, 1, sha) for n in ("config.json", "m.py", "model.safetensors")),
        source=SourceRecord(CheckpointRef("default", "r", 4), sha, 2),
        validation=ValidationRecord(7, True, "cpu", "x86_64", "2.13.0", 1.5),
        dtype=None,
        tied={},
        created_at="2026-12-01T10:00:00Z",
        created_by="bob",
    )
    hf = HfConfigRecord("config.json", sha, {"dtype": {"from": None, "to": "bfloat16"}})
    for doc in (
        replace(plain, code_extras=("config.json", "m.py")),
        replace(plain, code_extras=("m.py",), hf_config=hf),
    ):
        data = json.loads(doc.to_bytes())
        assert data["format"] == "reg.release/4" and data["code_extras"] == list(doc.code_extras)
        assert ReleaseDocument.from_bytes(doc.to_bytes(), "d") == doc
    assert json.loads(plain.to_bytes())["format"] == "reg.release/2"  # none: as before
    assert json.loads(replace(plain, hf_config=hf).to_bytes())["format"] == "reg.release/3"
    good = json.loads(replace(plain, code_extras=("m.py",)).to_bytes())
    for edit, message in (
        (dict(code_extras=["x.py"]), "names 'x.py', which is not one of the files"),
        (dict(code_extras=["m.py", "config.json"]), "not a sorted list of distinct names"),
        (dict(code_extras=[]), "not a sorted list of distinct names"),
        (dict(code_extras="m.py"), "code_extras is not a list of strings"),
        (dict(format="reg.release/3"), "code_extras is not a known key"),
    ):
        with pytest.raises(InvalidDocument, match="^d: ") as info:
            ReleaseDocument.from_bytes(json.dumps({**good, **edit}).encode(), "d")
        assert message in str(info.value)
    # A /3 document still needs its hf_config; only /4 may have it null.
    with pytest.raises(InvalidDocument, match="hf_config is not an object"):
        bad = {k: v for k, v in good.items() if k != "code_extras"}
        ReleaseDocument.from_bytes(json.dumps({**bad, "format": "reg.release/3"}).encode(), "d")
