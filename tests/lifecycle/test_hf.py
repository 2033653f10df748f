"""Releases that stock Hugging Face transformers loads as they are.

One `torchrun` (2 gloo processes, FSDP2 `fully_shard`) per session trains config-built tiny
`LlamaForCausalLM` and `GPT2LMHeadModel`, tied and untied (examples/train_hf.py), and writes
each one's DCP checkpoint through `torch.distributed.checkpoint`, its full state_dict and its
config.json. Each is pushed, promoted (bf16, sharded, with and without the model factory) with
its config.json as an extra, pulled, and loaded with `AutoModelForCausalLM.from_pretrained`:
the state dict and the logits on a fixed input must equal the trained weights' bit for bit.
Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from registry.formats.hf_folder import completeness, rewrite_config
from tests import helpers
from tests.sharing import build_once

STEPS = 2
MODELS = ("llama_tied", "llama_untied", "gpt2_tied", "gpt2_untied")
CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


@pytest.fixture(scope="session")
def hf_trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model's step-2 checkpoint, full weights and config.json, from one torchrun."""
    pytest.importorskip("transformers", reason="transformers is not installed (frameworks extra)")
    models = [a for m in MODELS for a in ("--model", m)]

    def build(base: Path) -> Path:
        out = base / "out"
        helpers.torchrun(
            "examples.train_hf",
            2,
            ["--out", str(out), "--steps", str(STEPS), *models],
            clean=out,
            env_extra={"CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"},
        )
        return out

    return build_once(tmp_path_factory, "hf_trained", build)


@dataclass(frozen=True)
class Case:
    model: str
    dtype: str | None
    factory: bool
    max_shard_size: str
    tokenizer: bool = False  # a real tokenizer.json + tokenizer_config.json as extras


CASES = {
    "llama-tied-bf16-sharded-factory": Case("llama_tied", "bf16", True, "20KB", tokenizer=True),
    "llama-untied-fp32": Case("llama_untied", None, False, "5GB"),
    "gpt2-tied-sharded-factory": Case("gpt2_tied", None, True, "20KB"),
    "gpt2-untied-bf16-sharded": Case("gpt2_untied", "bf16", False, "8KB"),
}


def _tokenizer(dest: Path) -> list[Path]:
    """A tiny word-level tokenizer written by transformers itself (tokenizer.json and
    tokenizer_config.json), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(dest)
    return [dest / "tokenizer.json", dest / "tokenizer_config.json"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_loads_the_release_bit_exact(
    name: str, hf_trained: Path, cpu_policy: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from examples.hf_models import CONFIGS, tokens
    from registry import Registry

    case = CASES[name]
    family = case.model.split("_")[0]
    trained = hf_trained / case.model
    config = trained / "config.json"
    extras = [config, *(_tokenizer(tmp_path / "tok") if case.tokenizer else [])]
    with Registry() as reg:
        reg.push_checkpoint(trained / f"step-{STEPS}", run=case.model, step=STEPS, world_size=2)
        out = reg.promote(
            f"{case.model}@step{STEPS}",
            model=family,
            dtype=case.dtype,
            max_shard_size=case.max_shard_size,
            extras=extras,
            model_factory=f"examples.hf_models:{case.model}" if case.factory else None,
        )
        shown = reg.show(out["release"])
        release = reg.pull_release(out["release"], tmp_path / "release")["dest"]
    release_dir = Path(release)

    # The layout HF expects: one file, or shards with an index.
    names = {f["path"] for f in out["files"]}
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if case.max_shard_size != "5GB":
        assert len(shards) >= 2 and "model.safetensors.index.json" in names, names
    else:
        assert shards == ["model.safetensors"]

    # config.json: dtype rewritten to the release's, architectures from the factory's class.
    given = json.loads(config.read_text())
    got = json.loads((release_dir / "config.json").read_text())
    assert list(got)[: len(given)] == list(given)  # every key kept, in its order
    assert {k: v for k, v in got.items() if k in given} == given
    rewritten = {}
    if case.dtype:
        rewritten["dtype"] = {"from": None, "to": "bfloat16"}
    if case.factory:
        rewritten["architectures"] = {"from": None, "to": [CLASSES[family]]}
    assert {k: v for k, v in got.items() if k not in given} == {
        k: c["to"] for k, c in rewritten.items()
    }
    expected_hf_config = (
        {
            "path": "config.json",
            "original_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
            "rewritten": rewritten,
        }
        if rewritten
        else None
    )
    assert out["hf_config"] == shown["hf_config"] == expected_hf_config
    recorded = next(f for f in out["files"] if f["path"] == "config.json")
    stored = (release_dir / "config.json").read_bytes()
    assert recorded["sha256"] == hashlib.sha256(stored).hexdigest()
    document = json.loads((release_dir / "release.json").read_text())
    assert document["format"] == ("reg.release/3" if rewritten else "reg.release/2")
    assert document.get("hf_config") == expected_hf_config
    assert out["hf"] == shown["hf"] and out["hf"]["complete"] is True, out["hf"]

    # generation_config.json, as save_pretrained writes it, where the class is a generative
    # head (the factory's class names it; a config without `architectures` says nothing)
    made = release_dir / "generation_config.json"
    assert made.exists() == bool(got.get("architectures")), got.get("architectures")
    if made.exists():
        from transformers import GenerationConfig

        generation = GenerationConfig.from_pretrained(release_dir)
        assert generation.eos_token_id == got.get("eos_token_id")
        assert generation.bos_token_id == got.get("bos_token_id")
        assert "generation_config.json" in {f["path"] for f in out["files"]}

    # Loaded by stock transformers, equal to the trained weights bit for bit.
    dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    full = torch.load(trained / f"step-{STEPS}.full.pt", weights_only=True)
    want = {k: v.to(dtype) for k, v in full.items()}
    loaded = AutoModelForCausalLM.from_pretrained(release_dir).eval()
    assert type(loaded).__name__ == CLASSES[family]
    state = loaded.state_dict()
    assert sorted(state) == sorted(want)
    for key, tensor in want.items():
        assert state[key].dtype == dtype and torch.equal(state[key], tensor), key
    head, embed = loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight
    assert (head is embed) == case.model.endswith("_tied")
    if case.factory and case.model.endswith("_tied"):
        assert out["tied"]  # written once, as HF does
    # The trained weights in a model transformers builds at that dtype (buffers such as the
    # rotary frequencies stay float32, as from_pretrained keeps them)
    reference = AutoModelForCausalLM.from_config(CONFIGS[case.model](), dtype=dtype).eval()
    reference.load_state_dict(want)
    probe = tokens(seed=99)
    with torch.no_grad():
        assert torch.equal(loaded(probe).logits, reference(probe).logits)
    if case.tokenizer:
        from transformers import AutoTokenizer

        assert AutoTokenizer.from_pretrained(release_dir)("w1 w2")["input_ids"] == [1, 2]


def test_an_incomplete_folder_warns_and_show_says_what_is_missing(
    hf_trained: Path, cpu_policy: Path, cli: Any, tmp_path: Path
) -> None:
    trained = hf_trained / "gpt2_untied"
    tokenizer_config = tmp_path / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    bad = tmp_path / "bad" / "config.json"
    bad.parent.mkdir()
    bad.write_text("[1, 2]")
    pushed = cli("push-ckpt", trained / f"step-{STEPS}", "--run", "g", "--step", str(STEPS))
    assert pushed.returncode == 0, pushed.stderr

    refused = cli("promote", f"g@step{STEPS}", "--model", "gpt2", "--extra", bad, "--dtype", "bf16")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.count("\n") == 1 and "is JSON but not an object" in refused.stderr
    assert json.loads(cli("releases", "--json").stdout) == []

    promoted = cli(
        "promote", f"g@step{STEPS}", "--model", "gpt2", "--extra", trained / "config.json",
        "--extra", tokenizer_config, "--json",
    )  # fmt: skip
    assert promoted.returncode == 0, promoted.stderr
    warnings = [line for line in promoted.stderr.splitlines() if "Hugging Face" in line]
    assert warnings == [
        "reg: gpt2:v1: not a complete Hugging Face model folder: missing vocab.json, merges.txt"
    ]
    shown = json.loads(cli("show", "gpt2:v1", "--json").stdout)
    assert shown["hf"] == {
        "complete": False,
        "missing": ["vocab.json", "merges.txt"],
        "notes": [],
    }
    assert shown["hf_config"] is None  # no --dtype, no factory: config.json as given


# -- the pure parts --------------------------------------------------------------------------


def test_rewrite_keeps_order_and_bytes_when_nothing_changes() -> None:
    given = b'{"torch_dtype": "float32", "model_type": "llama", "architectures": ["X"]}'
    same = rewrite_config(given, dtype=None, architecture=None)
    assert same.data == given and same.changes == {}
    out = rewrite_config(given, dtype="fp16", architecture="LlamaForCausalLM")
    assert list(json.loads(out.data)) == ["torch_dtype", "model_type", "architectures"]
    assert out.changes == {
        "torch_dtype": {"from": "float32", "to": "float16"},
        "architectures": {"from": ["X"], "to": ["LlamaForCausalLM"]},
    }
    both = rewrite_config(b'{"dtype": "float32", "torch_dtype": "float32"}', dtype="bf16",
                          architecture=None)  # fmt: skip
    assert json.loads(both.data) == {"dtype": "bfloat16", "torch_dtype": "bfloat16"}
    already = b'{"dtype": "bfloat16"}'
    assert rewrite_config(already, dtype="bf16", architecture=None).data == already


@pytest.mark.parametrize(
    ("files", "tokenizer_config", "missing", "note"),
    [
        ({"tokenizer.json"}, {"tokenizer_class": "LlamaTokenizerFast"}, [], None),
        (set(), {"tokenizer_class": "LlamaTokenizer"}, ["tokenizer.model"], None),
        ({"tokenizer.model"}, {"tokenizer_class": "LlamaTokenizer"}, [], None),
        ({"vocab.json"}, {"tokenizer_class": "GPT2Tokenizer"}, ["merges.txt"], None),
        (set(), {"tokenizer_class": "T5Tokenizer"}, ["spiece.model"], None),
        (set(), {"tokenizer_class": "BertTokenizerFast"}, ["vocab.txt"], None),
        (set(), {"tokenizer_class": "PreTrainedTokenizerFast"}, ["tokenizer.json"], None),
        (set(), {}, ["tokenizer.json"], None),
        (set(), {"tokenizer_class": "MyTokenizer"}, [], "unknown tokenizer class MyTokenizer"),
    ],
)
def test_completeness_follows_the_tokenizer_class(
    files: set[str], tokenizer_config: dict[str, str], missing: list[str], note: str | None
) -> None:
    names = {"model.safetensors", "config.json", "tokenizer_config.json", *files}
    found = completeness(names, b'{"model_type": "llama"}', json.dumps(tokenizer_config).encode())
    assert found.missing == missing
    assert found.complete == (not missing and note is None)
    assert (note is None) == (not found.notes) and all(note in n for n in found.notes if note)


def test_completeness_without_config_or_with_a_broken_one() -> None:
    assert completeness({"model.safetensors"}, None, None).missing == ["config.json"]
    broken = completeness({"model.safetensors", "config.json"}, b"{nope", None)
    assert not broken.complete and "config.json is not valid JSON" in broken.notes[0]
    plain = completeness({"model.safetensors", "config.json"}, b'{"model_type": "gpt2"}', None)
    assert plain.complete and plain.notes == [
        "no tokenizer_config.json: weights and config only (no tokenizer)"
    ]


# -- review fixes: architectures of a subclass, strict config.json, unreadable release.json ----


def test_architectures_names_the_transformers_class_never_a_users_subclass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (frameworks extra)")
    from registry.lifecycle.promotion.hf import factory_architecture

    (tmp_path / "user_models_arch.py").write_text(
        "import torch\n"
        "from transformers import LlamaForCausalLM, PreTrainedModel\n"
        "from examples.hf_models import llama_config\n"
        "class MyLlama(LlamaForCausalLM):\n"
        "    pass\n"
        "class Deeper(MyLlama):\n"
        "    pass\n"
        "class Mine(PreTrainedModel):\n"
        "    config_class = type(llama_config(True))\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        self.proj = torch.nn.Linear(2, 2)\n"
        "def my_llama():\n"
        "    return MyLlama(llama_config(True))\n"
        "def deeper():\n"
        "    return Deeper(llama_config(False))\n"
        "def mine():\n"
        "    return Mine(llama_config(True))\n"
        "def plain():\n"
        "    return torch.nn.Linear(2, 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert factory_architecture("examples.hf_models:llama_tied") == "LlamaForCausalLM"
    assert factory_architecture("user_models_arch:my_llama") == "LlamaForCausalLM"
    assert factory_architecture("user_models_arch:deeper") == "LlamaForCausalLM"
    assert factory_architecture("user_models_arch:mine") is None  # no class transformers has
    assert factory_architecture("user_models_arch:plain") is None


BAD_CONFIGS = {
    "lone surrogate": (b'{"x":"\\ud800","dtype":"float32"}', "x holds a lone surrogate escape"),
    "lone surrogate key": (b'{"\\udc00":1}', "a key in the object holds a lone surrogate"),
    "nested surrogate": (b'{"a":{"b":[1,"\\ud800"]}}', "a.b[1] holds a lone surrogate"),
    "bom": (b'\xef\xbb\xbf{"dtype":"float32"}', "starts with a UTF-8 byte order mark"),
    "utf-16": ('{"dtype":"float32"}'.encode("utf-16"), "is not UTF-8"),
    "latin-1": ('{"name":"caf\xe9"}'.encode("latin-1"), "is not UTF-8"),
    "duplicate key": (b'{"dtype":"float32","dtype":"bfloat16"}', "'dtype' appears twice"),
    "nested duplicate": (b'{"a":{"k":1,"k":2}}', "'k' appears twice"),
    "NaN": (b'{"x":NaN}', "NaN is not a JSON number"),
    "Infinity": (b'{"x":-Infinity}', "-Infinity is not a JSON number"),
    "overflow": (b'{"x":1e400}', "1e400 is not a finite number"),
    "array": (b"[1, 2]", "is JSON but not an object"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_a_crafted_config_is_refused_in_one_line(name: str) -> None:
    from registry.errors import UsageError

    data, message = BAD_CONFIGS[name]
    for dtype in (None, "bf16"):
        with pytest.raises(UsageError, match="^--extra config.json") as raised:
            rewrite_config(data, dtype=dtype, architecture=None, label="--extra config.json")
        assert message in raised.value.message and "\n" not in str(raised.value)
        assert raised.value.exit_code == 2


def test_a_crafted_config_refuses_promote_before_anything_is_written(
    ckpts: Any, cpu_policy: Path, cli: Any, tmp_path: Path
) -> None:
    from registry.formats.hf_folder import MAX_DOCUMENT

    assert cli("push-ckpt", ckpts.ws2.step_dir(4), "--run", "r", "--step", "4").returncode == 0
    cases = {**BAD_CONFIGS, "too large": (b"", f"over {MAX_DOCUMENT}: not a config")}
    for i, (name, (data, message)) in enumerate(sorted(cases.items())):
        config = tmp_path / str(i) / "config.json"
        config.parent.mkdir()
        config.write_bytes(data)
        if name == "too large":
            with open(config, "r+b") as f:  # sparse, and refused before it is read
                f.truncate(MAX_DOCUMENT + 1)
        res = cli("promote", "r@step4", "--model", "tiny", "--extra", config, "--dtype", "bf16")
        assert res.returncode == 2, (name, res.stderr)
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, (name, res.stderr)
        assert message in res.stderr, (name, res.stderr)
    assert json.loads(cli("releases", "--json").stdout) == []
    documented = helpers.docs_text()
    for said in ("duplicate key", "byte order mark", "lone surrogate", "larger than 16 MiB"):
        assert said in documented, said


def test_an_unreadable_release_document_is_a_note_not_a_failed_show(
    ckpts: Any, cpu_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from registry import Registry
    from registry.errors import InvalidDocument
    from registry.formats.documents import ReleaseDocument

    def newer(cls: type, data: bytes, where: str) -> ReleaseDocument:
        raise InvalidDocument(f"{where}: format is 'reg.release/9'; this reg reads reg.release/3")

    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="tiny")
        monkeypatch.setattr(ReleaseDocument, "from_bytes", classmethod(newer))
        shown = reg.show("tiny:v1")
    assert shown["hf_config"] is None and shown["hf"]["complete"] is False
    assert any("release.json: format is 'reg.release/9'" in n for n in shown["hf"]["notes"])


def test_generation_config_only_for_a_generative_head() -> None:
    """Made as GenerationConfig.from_model_config makes it, for a class that generates only."""
    from registry.formats.hf_folder import generation_config

    def made(doc: dict) -> dict | None:
        out = generation_config(json.dumps(doc).encode())
        return None if out is None else json.loads(out)

    llama = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": [2, 3]}
    assert made({**llama, "pad_token_id": None, "transformers_version": "4.57.0"}) == {
        "_from_model_config": True,
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "transformers_version": "4.57.0",
    }
    assert made({"architectures": ["BertForSequenceClassification"], "eos_token_id": 2}) is None
    assert made({"model_type": "gpt2", "eos_token_id": 0}) is None  # no class named
    assert made({"architectures": "GPT2LMHeadModel"}) is None  # not a list: not a config's
    # token ids only in the text config (a LLaVA-like config): taken from there
    llava = {"architectures": ["LlavaForConditionalGeneration"], "text_config": {"eos_token_id": 2}}
    assert made(llava) == {"_from_model_config": True, "eos_token_id": 2}
    # a config with its own generation settings (a BART-like one) gets none: transformers'
    # fallback reads them all; defaults written out (old configs) are no settings
    bart = {"architectures": ["BartForConditionalGeneration"], "eos_token_id": 2, "num_beams": 4}
    assert made(bart) is None
    assert made({**bart, "num_beams": 1, "max_length": 20})["eos_token_id"] == 2
