"""Checkpoints torch writes that reg cannot read back are refused at push, before any byte is
stored: exit 2, one line saying what the directory is; and no command prints a traceback.

Each variant is a real ws=2 torchrun save of the tiny model with its full training state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import Trained, train
from tests.sharing import build_once


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trained]:
    return build_once(
        tmp_path_factory,
        "dcp_variants",
        lambda base: {
            writer: train(base / writer, nproc=2, steps=1, every=1, extra=("--writer", writer))
            for writer in ("safetensors", "zstd", "hf")
        },
    )


@pytest.mark.parametrize(
    ("writer", "says"),
    [
        (
            "safetensors",
            "is a safetensors file: the checkpoint was saved with "
            "serialization_format=SAFETENSORS, which torch cannot load back",
        ),
        ("zstd", "was saved with DCP storage transforms (stream.zstd/1), which reg does not read"),
        ("hf", "is a Hugging Face safetensors directory"),
    ],
)
def test_unreadable_variants_are_refused_at_push(cli, variants, writer, says):
    res = cli("push-ckpt", variants[writer].step_dir(1), "--run", "r", "--step", "1", "--json")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: error: "), res.stderr
    assert says in lines[0]
    assert "may not have finished" not in lines[0]
    error = json.loads(res.stdout)["error"]  # --json: the error is a JSON document too
    assert error["exit_code"] == 2 and says in error["message"]
    assert json.loads(cli("ls", "--json").stdout) == []
    assert not list(Path(os.environ["REG_HOME"]).glob("store/ckpt/**/*.distcp"))


def test_the_default_writer_still_pushes(cli, ckpts):
    res = cli("push-ckpt", ckpts.ws2.step_dir(2), "--run", "r", "--step", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["step"] == 2
