"""Consumers in one call: `reg fetch-release` keeps a verified folder per release.json
digest and prints its path; `--hf` lays the release out in the Hugging Face hub cache, where
stock `transformers` loads it offline by name, by alias and by revision.

Real parts: checkpoints from torchrun, promotions validated on CPU, signed with a real key, the
stock `model_signing` CLI, `reg` as a process, `reg server`, transformers. The registries are
built once per module (their own REG_HOME, passed explicitly: the autouse fixture gives each
test a clean environment of its own); each test fetches into a cache of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from registry import Registry, Settings
from registry.errors import Conflict, IntegrityError, UsageError
from tests.helpers import stock_verify
from tests.lifecycle.test_hf import STEPS, hf_trained  # noqa: F401 (the session's HF checkpoints)
from tests.serverproc import CPU_POLICY, RegServer, server_env

SIGNED = {"README.md", "model.safetensors", "model.sig", "provenance.intoto.json", "release.json"}


def _env(home: Path) -> dict[str, str]:
    return {
        "REG_HOME": str(home),
        "REG_USER": "tester",
        "REG_POLICY": str(CPU_POLICY),
        "REG_MLFLOW": "off",
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
    }


class Home:
    """A registry of its own (embedded), and the pinned public key of its signing key."""

    def __init__(self, home: Path) -> None:
        self.home, self.env = home, _env(home)
        self.pem = home.parent / "reg.pub"

    def open(self) -> Registry:
        return Registry(Settings.from_env(self.env))

    def cli(self, *args: object, **env: str) -> subprocess.CompletedProcess[str]:
        from tests.zygote import run_reg

        return run_reg(*map(str, args), env=dict(os.environ, **self.env, **env), timeout=300)


def _other_key(path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path.write_bytes(
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return path


@pytest.fixture(scope="module")
def signed(ckpts, tmp_path_factory: pytest.TempPathFactory) -> Home:
    """tiny:v1 (step 4, @prod) and tiny:v2 (step 2), gone:v1 (to be yanked): signed."""
    home = Home(tmp_path_factory.mktemp("signed") / "reg-home")
    with home.open() as reg:
        key = reg.create_signing_key()  # type: ignore[attr-defined]
        for step in (4, 2):
            metrics = ckpts.ws2.probe_metrics(step)
            reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step, metrics=metrics)
        reg.promote("r@step4", model="tiny", alias="prod")
        reg.promote("r@step2", model="tiny")
        reg.promote("r@step4", model="gone")
        home.pem.write_text(_public(reg, key.key_id))
    return home


def _public(reg: Registry, key_id: str) -> str:
    return next(k.public_pem for k in reg.signing_keys() if k.key_id == key_id)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): _sha(p)
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def _expected(reg: Registry, ref: str) -> dict[str, str]:
    shown = reg.show(ref)
    return {**{f["path"]: f["sha256"] for f in shown.files}, "release.json": shown.sha256}


def test_the_first_fetch_pulls_a_later_one_reuses_and_the_stock_verifier_passes(signed, tmp_path):
    cache = tmp_path / "cache"
    pem = signed.pem.read_text()
    with signed.open() as reg:
        first = reg.fetch_release("tiny@prod", cache_dir=cache, public_key=pem)
        shown = reg.show("tiny:v1")
        folder = Path(first.path)
        assert (first.cached, first.release, first.sha256) == (False, "tiny:v1", shown.sha256)
        assert first.signature_verified and first.hf_revision is None
        assert folder == cache / "releases" / "tiny" / shown.sha256
        assert _files(folder) == _expected(reg, "tiny:v1") and set(_files(folder)) == SIGNED
        record = json.loads((folder.parent / f"{shown.sha256}.json").read_text())
        assert {f["path"] for f in record["files"]} == SIGNED  # outside the folder
        inode = (folder / "model.safetensors").stat().st_ino
        again = reg.fetch_release("tiny:v1", cache_dir=cache, public_key=pem)
        plain = reg.fetch_release("tiny@prod", cache_dir=cache)
    assert again.cached and plain.cached and again.path == plain.path == first.path
    assert not plain.signature_verified
    assert (folder / "model.safetensors").stat().st_ino == inode  # nothing downloaded again
    ok = stock_verify(folder, signed.pem)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted(
        [shown.sha256, f"{shown.sha256}.json", ".lock"]
    )


def _same_size_edit(folder: Path) -> None:
    import time

    time.sleep(0.05)  # past the kernel's coarse timestamp tick: the write moves the ctime
    weights = folder / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as recorded


TAMPERING = {
    "same size, mtime restored": _same_size_edit,
    "another size": lambda f: (f / "README.md").write_text("# edited\n"),
    "an extra file": lambda f: (f / "extra.txt").write_text("not signed"),
    "an empty directory": lambda f: (f / "empty").mkdir(),
    "a deleted file": lambda f: (f / "provenance.intoto.json").unlink(),
    "a link for a file": lambda f: (
        (f / "README.md").unlink(),
        (f / "README.md").symlink_to(f / "release.json"),
    ),
    "a damaged record": lambda f: (f.parent / f"{f.name}.json").write_text("{"),
    "no record": lambda f: (f.parent / f"{f.name}.json").unlink(),
}


def test_a_tampered_cached_folder_is_pulled_again_with_the_right_bytes(signed, tmp_path):
    cache = tmp_path / "cache"
    with signed.open() as reg:
        folder = Path(reg.fetch_release("tiny:v1", cache_dir=cache).path)
        want = _expected(reg, "tiny:v1")
        for name, tamper in TAMPERING.items():
            tamper(folder)
            out = reg.fetch_release("tiny:v1", cache_dir=cache, public_key=signed.pem.read_text())
            assert not out.cached and Path(out.path) == folder, name
            assert _files(folder) == want, name
            assert reg.fetch_release("tiny:v1", cache_dir=cache).cached, name
    assert stock_verify(folder, signed.pem).returncode == 0
    left = sorted(p.name for p in folder.parent.iterdir())
    assert left == sorted([folder.name, f"{folder.name}.json", ".lock"]), left


def test_a_moved_alias_gives_a_new_folder_and_the_old_one_stays(signed, tmp_path):
    cache = tmp_path / "cache"
    with signed.open() as reg:
        reg.set_alias("tiny", "canary", "v1")
        one = reg.fetch_release("tiny@canary", cache_dir=cache)
        reg.set_alias("tiny", "canary", "v2")
        two = reg.fetch_release("tiny@canary", cache_dir=cache)
        assert (one.release, two.release) == ("tiny:v1", "tiny:v2")
        assert one.path != two.path and not two.cached and one.sha256 != two.sha256
        assert Path(two.path).name == two.sha256
        assert _files(Path(one.path)) == _expected(reg, "tiny:v1")
        assert _files(Path(two.path)) == _expected(reg, "tiny:v2")


def test_the_cli_prints_just_the_path_and_refuses_in_one_line(signed, tmp_path):
    cache = tmp_path / "cache"
    with signed.open() as reg:
        v2 = reg.show("tiny:v2").sha256
    ok = signed.cli("fetch-release", "tiny@prod", "--cache-dir", cache, "--public-key", signed.pem)
    assert ok.returncode == 0, ok.stderr
    path = Path(ok.stdout.strip())
    assert ok.stdout.count("\n") == 1 and path.parent == cache / "releases" / "tiny"
    assert stock_verify(path, signed.pem).returncode == 0
    by_env = signed.cli("fetch-release", "tiny@prod", "--json", REG_CACHE_DIR=str(cache))
    assert json.loads(by_env.stdout)["cached"] is True
    assert json.loads(by_env.stdout)["path"] == str(path)
    default = signed.cli("fetch-release", "tiny@prod")
    assert Path(default.stdout.strip()).parent == signed.home / "cache" / "releases" / "tiny"

    other = _other_key(tmp_path / "other.pub")
    models = cache / "releases" / "tiny"
    for when in ("first pull", "reuse"):
        wrong = signed.cli("fetch-release", "tiny:v2", "--cache-dir", cache, "--public-key", other)
        assert wrong.returncode == 1 and wrong.stdout == "", (when, wrong)
        assert wrong.stderr.count("\n") == 1 and "Traceback" not in wrong.stderr, wrong.stderr
        assert "not a valid signature by this key" in wrong.stderr, wrong.stderr
        if when == "first pull":  # nothing published, nothing left
            assert not any(p.name.startswith((v2, f".{v2}")) for p in models.iterdir())
            assert not any(".reg-" in p.name for p in models.iterdir())
            assert signed.cli("fetch-release", "tiny:v2", "--cache-dir", cache).returncode == 0
        else:  # the folder it was refused on stays as the release's own
            assert _files(models / v2) == {
                f["path"]: f["sha256"]
                for f in json.loads((models / f"{v2}.json").read_text())["files"]
            }

    for args, code, message in (
        (("tiny",), 2, "malformed ref"),
        (("tiny@@prod",), 2, "invalid"),
        (("r@step4",), 2, "names a checkpoint"),
        (("tiny:v9",), 3, "not found"),
        (("tiny@prod", "--cache-dir", ok.stdout.strip() + "/release.json"), 2, "is not usable"),
        (("tiny@prod", "--cache-dir", cache, "--hf"), 2, "give one of them"),
        (("tiny@prod", "--public-key", tmp_path / "none.pub"), 1, "not a PEM public key"),
    ):
        refused = signed.cli("fetch-release", *args)
        assert refused.returncode == code and message in refused.stderr, (args, refused)
        assert refused.stderr.count("\n") == 1 and refused.stdout == "", (args, refused)


def test_a_yanked_release_is_refused_even_when_cached(signed, tmp_path):
    cache = tmp_path / "cache"
    with signed.open() as reg:
        folder = Path(reg.fetch_release("gone:v1", cache_dir=cache).path)
        reg.yank("gone:v1", reason="test: leaked eval data")
        with pytest.raises(Conflict, match="was yanked: test: leaked eval data"):
            reg.fetch_release("gone:v1", cache_dir=cache)
        with pytest.raises(UsageError, match="two different caches"):
            reg.fetch_release("tiny:v1", cache_dir=cache, hf_cache=tmp_path / "hub")
    assert folder.is_dir()  # the cache keeps what it has; it only refuses to hand it over
    refused = signed.cli("fetch-release", "gone:v1", "--cache-dir", cache)
    assert refused.returncode == 5 and refused.stderr.count("\n") == 1, refused


def test_pull_release_counts_every_file_of_the_folder(signed, tmp_path):
    """The issue's "4 files verified for a folder of 5": the count is the folder's."""
    dest = tmp_path / "pulled"
    out = signed.cli(
        "pull-release", "tiny:v1", dest, "--verify-signature", "--public-key", signed.pem
    )
    assert out.returncode == 0, out.stderr
    assert set(_files(dest)) == SIGNED
    assert f"({len(SIGNED)} files verified, signature verified)" in out.stdout, out.stdout


def test_concurrent_fetches_of_one_digest_end_with_one_folder(signed, tmp_path):
    """Two processes fetch the same release at once: both print the same verified folder."""
    cache = tmp_path / "cache"
    env = dict(os.environ, **signed.env, REG_CACHE_DIR=str(cache))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "cli", "fetch-release", "tiny:v2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]
    folder = Path(outs[0][0].strip())
    with signed.open() as reg:
        assert _files(folder) == _expected(reg, "tiny:v2")
        assert reg.fetch_release("tiny:v2", cache_dir=cache).cached
    assert not any(".reg-" in p.name for p in folder.parent.iterdir())


def test_through_reg_server_the_same_cache(ckpts, tmp_path, monkeypatch):
    """Remote mode runs the same code: show and pull_release through the server."""
    server_home = tmp_path / "server-home"
    server = RegServer(
        server_env(server_home, f"sqlite:///{server_home / 'catalog.db'}"), server_home
    )
    server.init().start()  # init creates the signing key: every release through it is signed
    try:
        for key, value in server.client_env("admin").items():
            monkeypatch.setenv(key, value)
        cache = tmp_path / "cache"
        with Registry() as remote:
            remote.push_checkpoint(
                ckpts.ws2.step_dir(4), run="r", step=4, metrics=ckpts.ws2.probe_metrics(4)
            )
            remote.promote("r@step4", model="tiny", alias="prod")
            [pem] = [k.public_pem for k in remote.signing_keys() if k.state == "active"]
            first = remote.fetch_release("tiny@prod", cache_dir=cache, public_key=pem)
            again = remote.fetch_release("tiny@prod", cache_dir=cache, public_key=pem)
            want = _expected(remote, "tiny:v1")
        assert not first.cached and again.cached and first.path == again.path
        assert _files(Path(first.path)) == want and set(want) == SIGNED
        pinned = tmp_path / "reg.pub"
        pinned.write_text(pem)
        assert stock_verify(Path(first.path), pinned).returncode == 0
        other = _other_key(tmp_path / "o.pub").read_text()
        with Registry() as remote, pytest.raises(IntegrityError, match="not a valid signature"):
            remote.fetch_release("tiny@prod", cache_dir=cache, public_key=other)
    finally:
        server.stop()


# -- the Hugging Face hub cache ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_home(hf_trained, tmp_path_factory: pytest.TempPathFactory) -> Home:  # noqa: F811
    """llama:v1 (@prod): a tiny untied Llama, fp32, with its config.json; signed."""
    pytest.importorskip("transformers", reason="transformers is not installed (frameworks extra)")
    home = Home(tmp_path_factory.mktemp("hf") / "reg-home")
    trained = hf_trained / "llama_untied"
    with home.open() as reg:
        key = reg.create_signing_key()  # type: ignore[attr-defined]
        reg.push_checkpoint(trained / f"step-{STEPS}", run="llama", step=STEPS, world_size=2)
        reg.promote(
            f"llama@step{STEPS}", model="llama", alias="prod", extras=[trained / "config.json"]
        )
        home.pem.write_text(_public(reg, key.key_id))
    return home


def test_transformers_loads_the_release_from_the_hub_cache_offline(
    hf_home,
    hf_trained,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    import huggingface_hub.constants
    import torch
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoModelForCausalLM

    # As a consumer runs it offline. Without it transformers 5.24 with peft installed asks the
    # Hub for adapter_config.json even with local_files_only (its adapter lookup is not given
    # the flag) and waits out five retries: 20 s per load where the Hub is unreachable.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import
    hub = tmp_path / "hub"
    with hf_home.open() as reg:
        out = reg.fetch_release("llama@prod", hf_cache=hub, public_key=hf_home.pem.read_text())
        want = _expected(reg, "llama:v1")
    revision = out.sha256[:40]
    repo = hub / "models--llama"
    assert (out.cached, out.hf_revision, Path(out.path)) == (
        False,
        revision,
        repo / "snapshots" / revision,
    )
    for ref in ("main", "prod", "v1"):
        assert (repo / "refs" / ref).read_bytes() == revision.encode()
    snapshot = Path(out.path)
    for path, digest in want.items():
        link = snapshot / path
        assert os.readlink(link) == f"../../blobs/{digest}" and _sha(link) == digest
    assert sorted(p.name for p in (repo / "blobs").iterdir()) == sorted(set(want.values()))
    assert try_to_load_from_cache("llama", "config.json", cache_dir=hub) == str(
        snapshot / "config.json"
    )

    full = torch.load(hf_trained / "llama_untied" / f"step-{STEPS}.full.pt", weights_only=True)
    for revision_asked in (None, "prod", revision):
        kwargs = {} if revision_asked is None else {"revision": revision_asked}
        model = AutoModelForCausalLM.from_pretrained(
            "llama", local_files_only=True, cache_dir=hub, **kwargs
        )
        state = model.state_dict()
        assert sorted(state) == sorted(full), revision_asked
        for key, tensor in full.items():
            assert torch.equal(state[key], tensor), (revision_asked, key)

    # The stock verifier takes the snapshot with --allow_symlinks.
    tool = str(Path(sys.executable).with_name("model_signing"))
    verified = subprocess.run(
        [
            tool,
            "verify",
            "key",
            str(snapshot),
            "--signature",
            str(snapshot / "model.sig"),
            "--public_key",
            str(hf_home.pem),
            "--allow_symlinks",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verified.returncode == 0, verified.stderr + verified.stdout


def test_the_hub_cache_is_reused_repaired_and_refused_like_reg_s_own(hf_home, tmp_path):
    hub = tmp_path / "hub"
    pem = hf_home.pem.read_text()
    with hf_home.open() as reg:
        out = reg.fetch_release("llama:v1", hf_cache=hub)
        snapshot, repo = Path(out.path), hub / "models--llama"
        assert not (repo / "refs" / "prod").exists()  # fetched by version: main and v1 only
        assert reg.fetch_release("llama@prod", hf_cache=hub, public_key=pem).cached
        assert (repo / "refs" / "prod").read_text() == out.hf_revision
        blob = repo / "blobs" / reg.show("llama:v1").sha256
        blob.unlink()  # a missing blob, then a link pointing elsewhere: pulled again
        assert not reg.fetch_release("llama:v1", hf_cache=hub).cached
        (snapshot / "config.json").unlink()
        (snapshot / "config.json").symlink_to(blob)
        assert not reg.fetch_release("llama:v1", hf_cache=hub).cached
        assert reg.fetch_release("llama:v1", hf_cache=hub).cached
        want = _expected(reg, "llama:v1")
        with pytest.raises(IntegrityError, match="not a valid signature"):
            reg.fetch_release(
                "llama:v1", hf_cache=hub, public_key=_other_key(tmp_path / "o.pub").read_text()
            )
    assert {p: _sha(snapshot / p) for p in want} == want
    assert not any(".reg-" in p.name for p in [*repo.iterdir(), *(repo / "snapshots").iterdir()])
    cli = hf_home.cli("fetch-release", "llama@prod", "--hf", HF_HUB_CACHE=str(hub))
    assert cli.returncode == 0 and cli.stdout == f"{snapshot}\n", cli


@pytest.mark.parametrize(
    "name", ["tiny", "Llama-3.1_8B", "a", "x" * 96, "a--b", "ab-", "ab.", "a.git", "x" * 97]
)
def test_a_model_name_is_a_repo_id_exactly_when_huggingface_hub_says_so(name):
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from registry.api.consumers.hf_cache import check_repo_id

    try:
        validate_repo_id(name)
        valid = True
    except HFValidationError:
        valid = False
    if valid:
        assert check_repo_id(name) == name
    else:
        with pytest.raises(UsageError, match="not a Hugging Face repo id"):
            check_repo_id(name)


def test_the_default_hub_cache_is_huggingface_hub_s(tmp_path):
    from registry.api.consumers.hf_cache import default_hub_cache

    home = Path("~").expanduser()
    assert default_hub_cache({}) == home / ".cache" / "huggingface" / "hub"
    assert default_hub_cache({"HF_HOME": str(tmp_path)}) == tmp_path / "hub"
    assert default_hub_cache({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "huggingface" / "hub"
    given = {"HF_HUB_CACHE": str(tmp_path / "c"), "HF_HOME": "/elsewhere"}
    assert default_hub_cache(given) == tmp_path / "c"


def test_a_cache_rewritten_with_its_record_is_caught_under_a_pinned_key(signed, tmp_path):
    """Whoever can write the cache can rewrite the record with the file: the cheap check
    passes, so a fetch under a pinned key re-hashes every file and pulls again."""
    cache = tmp_path / "cache"
    pem = signed.pem.read_text()
    with signed.open() as reg:
        folder = Path(reg.fetch_release("tiny:v1", cache_dir=cache).path)
        want = _expected(reg, "tiny:v1")
        weights = folder / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
        record = folder.parent / f"{folder.name}.json"
        doc = json.loads(record.read_text())
        st = weights.stat()
        for f in doc["files"]:
            if f["path"] == "model.safetensors":
                f["mtime_ns"], f["ctime_ns"] = st.st_mtime_ns, st.st_ctime_ns
        record.write_text(json.dumps(doc))
        assert reg.fetch_release("tiny:v1", cache_dir=cache).cached  # the cheap check: fooled
        out = reg.fetch_release("tiny:v1", cache_dir=cache, public_key=pem)
        assert not out.cached and out.signature_verified
    assert _files(folder) == want


def test_an_alias_named_like_a_version_moves_no_version_ref(hf_home, tmp_path):
    """`refs/vK` names version K's revision, whatever an alias called vK points at (a
    releaser's alias `v9` on v1 would otherwise make `revision="v9"` load v1)."""
    hub = tmp_path / "hub"
    with hf_home.open() as reg:
        reg.set_alias("llama", "v9", "v1")
        reg.fetch_release("llama@v9", hf_cache=hub)
    refs = hub / "models--llama" / "refs"
    assert sorted(p.name for p in refs.iterdir()) == ["main", "v1"]
