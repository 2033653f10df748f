"""The command line as users and scripts meet it: exit codes, one-line errors, JSON, help.

Tests taking `deployment` run twice: embedded, and through `reg server` (remote mode), where
the same commands must print the same output and exit with the same codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cli_round_trip_with_json(deployment, cli, ckpts, tmp_path, catalog_url):
    res = cli(
        "push-ckpt",
        ckpts.ws2.step_dir(4),
        "--run",
        "run42",
        "--step",
        "4",
        "--metric",
        "val_loss=1.5",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    pushed = json.loads(res.stdout)
    assert pushed["ref"] == "run42@step4" and pushed["world_size"] == 2
    assert "inferred" in res.stderr
    listed = json.loads(cli("ls", "--json").stdout)
    assert [c["ref"] for c in listed] == ["run42@step4"]
    for key in (
        "ref",
        "project",
        "run",
        "step",
        "world_size",
        "state",
        "bytes",
        "files",
        "resumable",
        "missing_state",
        "pinned",
        "created_at",
        "upload_seconds",
    ):
        assert key in listed[0]
    assert all(re.fullmatch(r"[0-9a-f]{64}", f["sha256"]) for f in listed[0]["files"])
    shown = json.loads(cli("show", "run42@latest", "--json").stdout)
    assert shown["metrics"] == {"val_loss": 1.5}
    res = cli("pull", "run42@step4", tmp_path / "out")
    assert res.returncode == 0 and (tmp_path / "out" / ".metadata").exists()
    res = cli("verify", "run42@step4")
    assert res.returncode == 0 and "ok" in res.stdout
    human = cli("ls")
    assert "run42@step4" in human.stdout and human.returncode == 0
    empty = cli("ls", "llama-tiny")  # a model's name where a run's goes: the way to its releases
    assert empty.returncode == 0 and "`reg releases llama-tiny`" in empty.stderr


@pytest.mark.parametrize(
    ("args", "code", "pattern"),
    [
        (["show", "run42@stepX"], 2, "malformed ref"),
        (["show", "../x@step1"], 2, "invalid project name '..'"),
        (["show", "nope@step1"], 3, "run nope not found"),
        (["pull", "nope@latest", "/tmp/none-such"], 3, "not found"),
        (["push-ckpt", "/definitely/not/here", "--run", "r", "--step", "1"], 2, "does not exist"),
        (["push-ckpt", ".", "--run", "r", "--step", "1"], 2, "no .metadata"),
        (["push-ckpt", ".", "--run", "bad name", "--step", "1"], 2, "invalid run name"),
        (["push-ckpt", ".", "--run", "r", "--step", "1", "--metric", "x"], 2, "bad --metric"),
    ],
)
def test_errors_are_one_line_with_the_right_exit_code(deployment, cli, args, code, pattern):
    res = cli(*args)
    assert res.returncode == code, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: error: "), res.stderr
    assert re.search(pattern, lines[0])
    assert "Traceback" not in res.stderr


def test_corrupt_store_makes_verify_and_pull_exit_1(deployment, cli, ckpts, tmp_path):
    from tests import tamper

    assert cli("push-ckpt", ckpts.ws2.step_dir(2), "--run", "r", "--step", "2").returncode == 0
    with deployment.direct() as reg:
        tamper.flip_byte(reg.store, "ckpt/default/r/step-2/__1_0.distcp")
    res = cli("verify", "r@step2")
    assert res.returncode == 1
    assert "__1_0.distcp: sha256" in res.stdout and "damaged" in res.stderr
    res = cli("pull", "r@step2", tmp_path / "o")
    assert res.returncode == 1 and "corrupt" in res.stderr
    assert not (tmp_path / "o").exists()


def test_json_output_is_one_document_and_nothing_else(deployment, cli, ckpts):
    res = cli(
        "push-ckpt",
        ckpts.ws3.step_dir(3),
        "--run",
        "r",
        "--step",
        "3",
        "--world-size",
        "3",
        "--json",
    )
    json.loads(res.stdout)
    assert json.loads(cli("ls", "r", "--json").stdout)[0]["world_size"] == 3


def _bad_dir(kind: str, ckpts, tmp_path: Path) -> Path:
    import os
    import pickle

    d = ckpts.ws2.copy_step(4, tmp_path / kind)
    if kind == "no-metadata":
        (d / ".metadata").unlink()
    elif kind == "truncated":
        shard = d / "__0_0.distcp"
        os.truncate(shard, shard.stat().st_size - 10)
    elif kind == "missing-shard":
        (d / "__1_0.distcp").unlink()
    elif kind == "crafted":
        (d / ".metadata").write_bytes(pickle.dumps(print))
    elif kind == "symlink":
        (d / "link").symlink_to("/etc/passwd")
    elif kind == "negative-length":  # a crafted range: would move the promotion's spool back
        import dataclasses

        metadata = pickle.loads((d / ".metadata").read_bytes())  # the test's own file
        index, info = next(iter(metadata.storage_data.items()))
        metadata.storage_data[index] = dataclasses.replace(info, length=-5)
        (d / ".metadata").write_bytes(pickle.dumps(metadata))
    elif kind == "long-path":  # longer than the catalog's path column: refused before any byte
        deep = d.joinpath(*["d" * 200] * 6)
        deep.mkdir(parents=True)
        (deep / "notes.txt").write_text("x")
    return d


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        ("no-metadata", "has no .metadata"),
        ("truncated", "shard __0_0.distcp is truncated"),
        ("missing-shard", "shard __1_0.distcp named in .metadata is missing"),
        ("crafted", "references builtins.print, which a DCP checkpoint never does; refused"),
        ("symlink", "link is a symlink; refused"),
        ("long-path", "characters; refused"),
        ("negative-length", "storage length of rng.rank0.python is not a whole number in 0..2^63"),
    ],
)
def test_bad_checkpoint_directories_exit_2_with_one_line(
    deployment, cli, ckpts, tmp_path, kind, pattern
):
    res = cli("push-ckpt", _bad_dir(kind, ckpts, tmp_path), "--run", "r", "--step", "1")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: error: ") and pattern in lines[0]
    assert json.loads(cli("ls", "--json").stdout) == []


def test_promotion_refusals_exit_codes_and_one_line(
    deployment, cli, ckpts, bad_ckpts, tmp_path, monkeypatch
):
    monkeypatch.setenv("REG_POLICY", str(ROOT / "examples" / "cpu-policy.toml"))
    for name, trained in (("nan", bad_ckpts["nan"]), ("wo", bad_ckpts["weights_only"])):
        assert cli("push-ckpt", trained.step_dir(2), "--run", name, "--step", "2").returncode == 0
    assert cli("push-ckpt", ckpts.ws2.step_dir(4), "--run", "r", "--step", "4").returncode == 0
    cases = [
        (["promote", "nan@step2", "--model", "m"], 1, "model.blocks.0.up.bias"),
        (["promote", "wo@step2", "--model", "m"], 1, "not resumable"),
        (
            ["validate", "r@step4", "--device", "cpu", "--model-factory", "nope:f"],
            2,
            "cannot import nope",
        ),
        (["show", "m:v1"], 3, "model m not found"),
        (["show", "r@v1"], 3, "a version is written MODEL:vK (r:v1)"),  # the slip, named
        (["show", "r@nope"], 3, "a checkpoint is RUN@stepN or RUN@latest"),
        (["promote", "r@step4", "--model", "m", "--alias", "prod"], 0, ""),
        (["show", "m@staging"], 3, "alias m@staging not found"),
        (["yank", "m:v1", "--reason", "bad"], 0, ""),
        (["alias", "set", "m", "canary", "v1"], 5, "is yanked (bad)"),
    ]
    for args, code, pattern in cases:
        res = cli(*args)
        assert res.returncode == code, (args, res.stderr)
        if code:
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("reg: error: "), (args, res.stderr)
            assert pattern in lines[0], (args, lines[0])


def test_json_is_strict_even_for_non_finite_numbers():
    from cli.render import to_json

    doc = {"loss": float("nan"), "nested": [{"x": float("inf")}, 1.5], "ok": True}
    text = to_json(doc)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"loss": None, "nested": [{"x": None}, 1.5], "ok": True}


def test_a_failing_json_command_still_prints_one_json_document(deployment, cli):
    res = cli("show", "no-such-run@step1", "--json")
    assert res.returncode == 3, res.stderr
    error = json.loads(res.stdout)["error"]
    assert error["exit_code"] == 3 and "no-such-run" in error["message"]
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("user", ["bob\nadmin", " bob", "x" * 300])
def test_an_unusable_user_name_is_refused_before_anything_is_written(cli, ckpts, user):
    res = cli(
        "push-ckpt", ckpts.ws2.step_dir(2), "--run", "r", "--step", "2", env={"REG_USER": user}
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("reg: error: REG_USER is not a usable user name")
    assert len(res.stderr.strip().splitlines()) == 1
    assert json.loads(cli("ls", "--json").stdout) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["verify", "--json"], "Missing argument 'ref'. (`reg verify --help` shows the usage)"),
        (["ls", "--bogus"], "No such option: --bogus (`reg ls --help` shows the usage)"),
        (["nosuch"], "No such command 'nosuch'. (`reg --help` shows the usage)"),
    ],
)
def test_usage_errors_are_one_line_exit_2(deployment, cli, args, says):
    res = cli(*args)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"reg: error: {says}"]
    if "--json" in args:
        assert json.loads(res.stdout)["error"]["exit_code"] == 2
    else:
        assert res.stdout == ""


@pytest.mark.parametrize("mtbf", ["0s", "never", "-1h"])
def test_recovery_needs_a_positive_mtbf(cli, mtbf):
    res = cli("recovery", "r", "--mtbf", mtbf)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "mtbf" in res.stderr


def test_an_unusable_reg_home_is_one_line_naming_the_path(cli, tmp_path):
    (tmp_path / "a-file").write_text("x")
    res = cli("ls", "--json", env={"REG_HOME": str(tmp_path / "a-file" / "home")})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"reg: error: Not a directory: {tmp_path / 'a-file' / 'home'} (check the path and its "
        "permissions (REG_HOME, REG_STORE_URL, the destination))"
    ]
    assert json.loads(res.stdout)["error"]["exit_code"] == 2


def test_a_failed_pull_creates_no_directory(deployment, cli, tmp_path):
    dest = tmp_path / "new" / "deeper" / "out"
    assert cli("pull", "r@step999", dest).returncode == 3
    assert cli("pull", "bad@@ref", dest).returncode == 2
    assert not (tmp_path / "new").exists()


@pytest.mark.process
def test_a_json_error_to_a_reader_that_went_away_is_one_line(tmp_path: Path) -> None:
    """`reg ... --json | head -c 1`: the error document meets a closed pipe; stderr still says
    one line, with no traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "REG_HOME": str(tmp_path / "home")}
    reg = Path(sys.executable).parent / "reg"
    proc = subprocess.Popen(
        [str(reg), "show", "nope@step1", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before it writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) != 0
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
