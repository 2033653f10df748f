"""What makes a folder a Hugging Face model folder, decided from file names and two small JSON
documents: the release's copy of `config.json` (its `dtype`, `torch_dtype` and `architectures`
rewritten to what the release holds) and whether a release is complete (config.json, and the
tokenizer files its `tokenizer_config.json` implies).

Pure: bytes and names in, results out. transformers is never imported here (it is slow to
import and not a dependency of reg): the tokenizer classes reg knows are a table, taken from
each class's `vocab_files_names` in transformers 5.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from registry.errors import UsageError

CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"  # a `tokenizers` (fast) tokenizer: all it needs
# A config.json or tokenizer_config.json larger than this is refused as an extra and not read
# from a release (transformers' are a few KiB; a tokenizer's vocabulary lives elsewhere).
MAX_DOCUMENT = 16 * 1024 * 1024

# --dtype -> the name transformers writes in config.json (`dtype`; `torch_dtype` before 4.56)
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_KEYS = ("dtype", "torch_dtype")

# Tokenizer class (without a `Fast` suffix) -> the files its slow form needs when there is no
# tokenizer.json (every one of these also loads from tokenizer.json alone).
_BPE = ("vocab.json", "merges.txt")
_SENTENCEPIECE = ("tokenizer.model",)
_WORDPIECE = ("vocab.txt",)
TOKENIZER_FILES: dict[str, tuple[str, ...]] = {
    "GPT2Tokenizer": _BPE,
    "Qwen2Tokenizer": _BPE,
    "RobertaTokenizer": _BPE,
    "BartTokenizer": _BPE,
    "GPTNeoXTokenizer": _BPE,
    "CodeGenTokenizer": _BPE,
    "LlamaTokenizer": _SENTENCEPIECE,
    "CodeLlamaTokenizer": _SENTENCEPIECE,
    "GemmaTokenizer": _SENTENCEPIECE,
    "MistralTokenizer": _SENTENCEPIECE,
    "T5Tokenizer": ("spiece.model",),
    "XLMRobertaTokenizer": ("sentencepiece.bpe.model",),
    "BertTokenizer": _WORDPIECE,
    "DistilBertTokenizer": _WORDPIECE,
    # Only a tokenizer.json: the generic fast tokenizer (transformers 5's TokenizersBackend).
    "PreTrainedTokenizer": (),
    "TokenizersBackend": (),
}


# -- config.json ----------------------------------------------------------------------------


def parse_object(data: bytes, label: str) -> dict[str, Any]:
    """A JSON object (key order kept), else a UsageError naming `label`."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise UsageError(
            f"{label} is not valid JSON ({_first_line(exc)})",
            "give the config.json that save_pretrained wrote",
        ) from None
    if not isinstance(doc, dict):
        raise UsageError(
            f"{label} is JSON but not an object (a {type(doc).__name__})",
            "give the config.json that save_pretrained wrote",
        )
    return doc


def parse_config(data: bytes, label: str) -> dict[str, Any]:
    """A config.json a release will hold, read strictly (UsageError, one line, for anything
    else): at most MAX_DOCUMENT bytes, a JSON object read by `parse_strict`."""
    hint = "give the config.json that save_pretrained wrote"
    if len(data) > MAX_DOCUMENT:
        raise UsageError(f"{label} is {len(data)} bytes, over {MAX_DOCUMENT}: not a config", hint)
    doc = parse_strict(data, label, hint)
    if not isinstance(doc, dict):
        raise UsageError(f"{label} is JSON but not an object (a {type(doc).__name__})", hint)
    return doc


def parse_strict(data: bytes, label: str, hint: str) -> Any:
    """A JSON document read strictly (UsageError, one line, for anything else): UTF-8 without
    a BOM, no duplicate keys, non-finite numbers (NaN, Infinity) or lone surrogate escapes.
    Each of those reads differently, or not at all, in other JSON readers (and a config.json's
    release copy is rewritten with ensure_ascii=False, which cannot encode a lone surrogate)."""
    if data.startswith(b"\xef\xbb\xbf"):
        raise UsageError(f"{label} starts with a UTF-8 byte order mark", "save it without one")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{label} is not UTF-8 (byte {exc.start})", hint) from None
    try:
        doc = json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite
        )
    except _Refused as exc:
        raise UsageError(f"{label}: {exc}", hint) from None
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{label} is not valid JSON ({_first_line(exc)})", hint) from None
    if (bad := _lone_surrogate(doc)) is not None:
        raise UsageError(f"{label}: {bad} holds a lone surrogate escape, not text", hint)
    return doc


class _Refused(ValueError):
    """A config.json that parses but must not be accepted (the message says why)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number (finite numbers only)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a float too large is infinity
        raise _Refused(f"{text} is not a finite number")
    return value


def _lone_surrogate(value: Any, where: str = "") -> str | None:
    """The path of the first string (a key or a value) that cannot be encoded as UTF-8, or
    None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "a string"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if _lone_surrogate(key) is not None:
                return f"a key in {where or 'the object'}"
            name = key if key.isprintable() else json.dumps(key)  # one line, whatever it holds
            if (found := _lone_surrogate(item, f"{where}.{name}" if where else name)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := _lone_surrogate(item, f"{where}[{i}]")) is not None:
                return found
    return None


@dataclass(frozen=True, slots=True)
class ConfigRewrite:
    """The release's config.json: its bytes and what was changed (key -> {from, to})."""

    data: bytes
    original_sha256: str
    changes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"path": CONFIG, "original_sha256": self.original_sha256, "rewritten": self.changes}


def rewrite_config(
    data: bytes, *, dtype: str | None, architecture: str | None, label: str = CONFIG
) -> ConfigRewrite:
    """config.json as the release holds it: with `dtype` (a --dtype), `dtype` and `torch_dtype`
    name the release's dtype (whichever are there; `dtype` when neither is); with
    `architecture`, `architectures` is `[architecture]`. Every other key and the key order are
    kept; unchanged values leave the bytes exactly as given. The config is read strictly
    (`parse_config`)."""
    doc = parse_config(data, label)
    wanted: dict[str, Any] = {}
    if dtype is not None:
        name = DTYPE_NAMES[dtype]
        present = [k for k in DTYPE_KEYS if k in doc]
        wanted.update({k: name for k in present or ["dtype"]})
    if architecture is not None:
        wanted["architectures"] = [architecture]
    changes = {
        k: {"from": doc.get(k), "to": v} for k, v in wanted.items() if k not in doc or doc[k] != v
    }
    digest = hashlib.sha256(data).hexdigest()
    if not changes:
        return ConfigRewrite(data, digest)
    for key, change in changes.items():
        doc[key] = change["to"]  # an existing key keeps its place; a new one goes last
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    return ConfigRewrite(text.encode(), digest, changes)


GENERATION_CONFIG = "generation_config.json"
# The heads transformers' `can_generate()` is true for, by their class names' endings
GENERATIVE_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForSeq2SeqLM")
# Where generation starts and stops: what GenerationConfig.from_model_config takes from
# config.json, or else from its decoder's (text) config
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
SUB_CONFIGS = ("decoder", "generator", "text_config")  # from_model_config's order
# The generation settings older configs carry, with GenerationConfig's defaults: a config that
# sets one otherwise gets no generated file (transformers' own fallback, which reads them all,
# then decides at load time; reg does not guess at what it would make of them)
LEGACY_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "early_stopping": False,
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "temperature": 1.0,
    "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
    "length_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None, "num_return_sequences": 1, "output_scores": False,
    "return_dict_in_generate": False, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "remove_invalid_values": False, "exponential_decay_length_penalty": None,
    "suppress_tokens": None, "begin_suppress_tokens": None,
}  # fmt: skip


def generation_config(config: bytes) -> bytes | None:
    """The generation_config.json transformers' `save_pretrained` writes beside a model that
    generates (its class, `architectures`, names a generative head), made from the release's
    config.json as `GenerationConfig.from_model_config` makes it: the token ids generation
    starts and stops at (from the decoder's config where the top level has none), marked
    `_from_model_config`. Serving stacks (vLLM, TGI) read their defaults from it. None for a
    config that names no generative head, or that sets other generation settings."""
    doc = parse_config(config, CONFIG)
    architectures = doc.get("architectures")
    if not isinstance(architectures, list) or not any(
        isinstance(a, str) and a.endswith(GENERATIVE_HEADS) for a in architectures
    ):
        return None
    sub: dict[str, Any] = next(
        (doc[k] for k in SUB_CONFIGS if isinstance(doc.get(k), dict) and doc[k]), {}
    )
    for where in (doc, sub):
        if any(k in where and where[k] != v for k, v in LEGACY_DEFAULTS.items()):
            return None
    out: dict[str, Any] = {"_from_model_config": True}
    for key in GENERATION_KEYS:
        value = doc.get(key) if doc.get(key) is not None else sub.get(key)
        if value is not None:
            out[key] = value
    if isinstance(doc.get("transformers_version"), str):
        out["transformers_version"] = doc["transformers_version"]
    return (json.dumps(out, indent=2, sort_keys=True) + "\n").encode()


# -- completeness ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completeness:
    complete: bool
    missing: list[str]
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"complete": self.complete, "missing": self.missing, "notes": self.notes}

    def warning(self) -> str | None:
        """One line for a user, or None when the folder is complete."""
        if self.complete:
            return None
        parts = []
        if self.missing:
            parts.append(f"missing {', '.join(self.missing)}")
        parts.extend(self.notes)
        return "not a complete Hugging Face model folder: " + "; ".join(parts)


def completeness(
    files: Collection[str], config: bytes | None, tokenizer_config: bytes | None
) -> Completeness:
    """Whether `files` (a folder's names) with these config.json and tokenizer_config.json
    contents (None: absent) make a complete Hugging Face model folder."""
    names = set(files)
    missing: list[str] = []
    notes: list[str] = []
    unsure = False
    if not any(n.endswith(".safetensors") for n in names):
        missing.append("model.safetensors")
    if CONFIG not in names or config is None:
        missing.append(CONFIG)
    else:
        doc = _object_or_note(config, CONFIG, notes)
        if doc is None:
            unsure = True
        elif not isinstance(doc.get("model_type"), str):
            notes.append("config.json has no model_type: AutoConfig cannot tell the model")
            unsure = True
    if TOKENIZER_CONFIG in names and tokenizer_config is not None:
        needed, note = tokenizer_files(tokenizer_config, names)
        missing.extend(n for n in needed if n not in missing)
        if note:
            notes.append(note)
            unsure = True
    elif CONFIG in names:
        notes.append("no tokenizer_config.json: weights and config only (no tokenizer)")
    else:
        notes.append("no tokenizer_config.json either (no tokenizer)")
    return Completeness(not missing and not unsure, missing, notes)


def tokenizer_files(tokenizer_config: bytes, names: Collection[str]) -> tuple[list[str], str]:
    """The tokenizer files missing from `names` that tokenizer_config.json implies, and a note
    when that cannot be decided."""
    notes: list[str] = []
    doc = _object_or_note(tokenizer_config, TOKENIZER_CONFIG, notes)
    if doc is None:
        return [], notes[0]
    if TOKENIZER_JSON in names:  # every tokenizers-backed class loads from it alone
        return [], ""
    cls = doc.get("tokenizer_class")
    if not isinstance(cls, str) or not cls:
        return [TOKENIZER_JSON], ""
    needed = TOKENIZER_FILES.get(cls.removesuffix("Fast"))
    if needed is None:
        return [], f"unknown tokenizer class {cls}: cannot say which files it needs"
    if not needed:
        return [TOKENIZER_JSON], ""
    return [n for n in needed if n not in names], ""


def _object_or_note(data: bytes, label: str, notes: list[str]) -> dict[str, Any] | None:
    try:
        return parse_object(data, label)
    except UsageError as exc:
        notes.append(exc.message)
        return None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
