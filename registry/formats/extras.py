"""What a release extra (`reg promote --extra FILE`) is, judged by its bytes, and by its name
where a loader goes by the name. A release is safetensors: nothing served beside its weights may
run code when a consumer loads the folder, unless the policy allows code on purpose.

    refused    a pickle: a name that loaders unpickle (.bin .pt .pth .pkl .pickle .ckpt
               .joblib), a protocol 2-5 pickle stream, a whole protocol 0/1 pickle, or a zip
               archive (the format torch.save writes: it holds a pickle)
               weights: a safetensors file under another name (the weights are the release's
               own shards)
               binary data that is none of the kinds below
               a *.json file that is not strict JSON (`parse_strict`)
    code       a name Python or a shell runs (.py .pyc .pyo .pyd .pyw .pyx .pyi .so .dylib .dll
               .sh .bash .ipynb), a `#!` script, an ELF, Mach-O or PE executable; a *.json file
               that names code: at any depth a key in CODE_KEYS (auto_map, custom_pipelines,
               custom_pipeline, trust_remote_code), or a member whose value is the name of a
               Python file (`x.py`, `dir/x.py`, `x.py:Name`). Refused unless the policy's
               `[release] allow_code_extras = true`; then recorded on the release.
    accepted   strict JSON that names no code (config.json, tokenizer.json, tokenizer_config.json,
               special_tokens_map.json, generation_config.json); UTF-8 text without NUL bytes
               (vocab.txt, merges.txt, README.md, LICENSE, chat templates .jinja, tiktoken
               files); a sentencepiece model (tokenizer.model: a protobuf, not a pickle)

Pure: a name and bytes in, a `Judged` out (or a UsageError for JSON that does not parse).
Nothing is unpickled or executed: pickles are recognised by `pickletools`, which only reads.
"""

from __future__ import annotations

import json
import pickletools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from registry.errors import UsageError
from registry.formats.hf_folder import (
    CONFIG,
    MAX_DOCUMENT,
    TOKENIZER_CONFIG,
    parse_config,
    parse_strict,
)

# Kinds a judgement ends in.
ACCEPTED = ("json", "text", "sentencepiece")
CODE = "code"
REFUSED = ("pickle", "weights", "binary")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
CODE_SUFFIXES = {
    ".py": "Python source",
    ".pyw": "Python source",
    ".pyi": "Python source",
    ".pyx": "Cython source",
    ".pyc": "compiled Python",
    ".pyo": "compiled Python",
    ".pyd": "a Python extension module",
    ".so": "a shared object",
    ".dylib": "a shared library",
    ".dll": "a shared library",
    ".sh": "a shell script",
    ".bash": "a shell script",
    ".ipynb": "a Jupyter notebook",
}
# Keys that make a loader import code shipped with the model (transformers' auto_map and
# custom_pipelines, diffusers' custom_pipeline) or ask it to.
CODE_KEYS = ("auto_map", "custom_pipelines", "custom_pipeline", "trust_remote_code")
_PYTHON_FILE = re.compile(r"(?:[\w-][\w.-]*/)*[\w-][\w.-]*\.py(?::\w[\w.]*)?")
_NATIVE = {
    b"\x7fELF": "an ELF executable or shared object",
    b"\xfe\xed\xfa\xce": "a Mach-O binary",
    b"\xfe\xed\xfa\xcf": "a Mach-O binary",
    b"\xce\xfa\xed\xfe": "a Mach-O binary",
    b"\xcf\xfa\xed\xfe": "a Mach-O binary",
    b"\xca\xfe\xba\xbe": "a Mach-O universal binary or Java class",
}
_ZIP = (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08")
# A JSON extra other than config.json larger than this is not parsed (a tokenizer.json of a
# 256k vocabulary is ~35 MiB).
MAX_JSON = 128 * 1024 * 1024
_HINT = "give the file save_pretrained wrote"


@dataclass(frozen=True, slots=True)
class Judged:
    kind: str  # one of ACCEPTED, CODE or REFUSED
    why: str  # what it is, for a message: "a protocol 4 pickle", "auto_map at auto_map"

    @property
    def accepted(self) -> bool:
        return self.kind in ACCEPTED


def judge(name: str, data: bytes, label: str | None = None) -> Judged:
    """What the extra `name` holding `data` is. A *.json file that is not strict JSON raises
    UsageError naming `label` (default `--extra NAME`)."""
    label = label or f"--extra {name}"
    lower = name.lower()
    suffix = lower[lower.rfind(".") :] if "." in lower else ""
    if suffix in PICKLE_SUFFIXES:
        return Judged("pickle", f"a {suffix} file, which loaders unpickle with torch.load")
    if suffix in CODE_SUFFIXES:
        return Judged(CODE, CODE_SUFFIXES[suffix])
    if data.startswith(_ZIP):
        return Judged("pickle", "a zip archive, the format torch.save writes around a pickle")
    if len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5:  # the PROTO opcode
        return Judged("pickle", f"a protocol {data[1]} pickle")
    if _one_pickle(data):
        return Judged("pickle", "a protocol 0 or 1 pickle")
    if _is_text(data):
        if data.startswith(b"#!"):
            return Judged(CODE, "a #! script")
        if suffix == ".json":
            return _judge_json(name, data, label)
        return Judged("text", "text")
    for magic, what in _NATIVE.items():
        if data.startswith(magic):
            return Judged(CODE, what)
    if data.startswith(b"MZ"):
        return Judged(CODE, "a Windows (PE) executable")
    if _is_safetensors(data):
        return Judged("weights", "a safetensors file: the release's weights are its own shards")
    if suffix == ".json":
        return _judge_json(name, data, label)  # not UTF-8: refused with the reason
    if _is_sentencepiece(data):
        return Judged("sentencepiece", "a sentencepiece model")
    return Judged("binary", "binary data that is not JSON, text or a sentencepiece model")


# -- JSON ---------------------------------------------------------------------------------------


def _judge_json(name: str, data: bytes, label: str) -> Judged:
    if name == CONFIG:
        doc: Any = parse_config(data, label)
    else:
        limit = MAX_DOCUMENT if name == TOKENIZER_CONFIG else MAX_JSON
        if len(data) > limit:
            raise UsageError(
                f"{label} is {len(data)} bytes, over {limit}: too large to check", _HINT
            )
        doc = parse_strict(data, label, _HINT)
    found = code_reference(doc)
    return Judged("json", "JSON") if found is None else Judged(CODE, found)


def code_reference(doc: Any) -> str | None:
    """The first place a parsed JSON document names code (see the module's rule), for a
    message ("its auto_map", "auto_map in a.b", "a.b names the Python file 'x.py'"); None when
    it names none."""
    for trail, key, value in _members(doc):
        if key in CODE_KEYS:
            return f"its {key}" if trail is None else f"{key} in {_shown(_path(trail))}"
        if _names_python_file(value):
            where = _path((trail, key))
            return f"{_shown(where)} names the Python file {_shown(value)!r}"
    return None


def _names_python_file(value: Any) -> bool:
    return (
        isinstance(value, str)
        and (value.endswith(".py") or ".py:" in value)  # most strings end here, cheaply
        and _PYTHON_FILE.fullmatch(value) is not None
    )


Trail = tuple[Any, str | int] | None  # (the parent's trail, this key or index): built lazily


def _members(doc: Any) -> Iterator[tuple[Trail, str, Any]]:
    """(trail of the object, key, value) of every object member at any depth, without
    recursion (a parsed document may be nested as deeply as the parser allowed)."""
    stack: list[tuple[Any, Trail]] = [(doc, None)]
    while stack:
        value, trail = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                yield trail, key, item
                if isinstance(item, (dict, list)):
                    stack.append((item, (trail, key)))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (dict, list)):
                    stack.append((item, (trail, i)))


def _path(trail: Trail) -> str:
    parts: list[str] = []
    while trail is not None:
        trail, step = trail
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return "".join(reversed(parts)).removeprefix(".")


def _shown(path: str) -> str:
    """A path fit for one line of a message."""
    text = path if path.isprintable() else json.dumps(path)
    return text if len(text) <= 120 else text[:117] + "..."


# -- bytes ----------------------------------------------------------------------------------------


def _is_text(data: bytes) -> bool:
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _Discard:
    def write(self, text: str) -> int:
        return len(text)


def _one_pickle(data: bytes) -> bool:
    """The whole of `data` is one pickle (protocols 0 and 1 have no PROTO opcode to know them
    by; protocol 0 is text): its opcodes parse up to a STOP that is the last byte, and their
    stack effects are consistent. Read by pickletools, never unpickled."""
    if not data.endswith(b"."):
        return False
    try:
        end = -1
        for opcode, _, pos in pickletools.genops(data):
            end = pos if opcode.name == "STOP" and pos is not None else -1
        if end != len(data) - 1:
            return False
        pickletools.dis(data, out=_Discard())  # type: ignore[arg-type]
    except Exception:  # not a pickle: an unknown opcode, a bad argument, an unbalanced stack
        return False
    return True


def _is_safetensors(data: bytes) -> bool:
    """An 8-byte little-endian header length, then that many bytes of a JSON object."""
    if len(data) < 10 or data[8:9] != b"{":
        return False
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        return False
    try:
        return isinstance(json.loads(data[8 : 8 + size]), dict)
    except (ValueError, RecursionError):
        return False


def _is_sentencepiece(data: bytes) -> bool:
    """A serialized sentencepiece ModelProto: top-level fields 1 (pieces, at least one) to 5,
    each length-delimited, covering the data exactly."""
    i, n, pieces = 0, len(data), 0
    while i < n:
        tag, i = _varint(data, i)
        if tag & 7 != 2 or not 1 <= tag >> 3 <= 5:
            return False
        length, i = _varint(data, i)
        if length < 0 or i + length > n:
            return False
        i += length
        pieces += tag >> 3 == 1
    return pieces > 0


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """A protobuf varint at `i` and the index after it; (-1, len) when it is malformed."""
    value, shift = 0, 0
    while i < len(data) and shift < 64:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
    return -1, len(data)
