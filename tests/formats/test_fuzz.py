"""Property-based fuzzing of every parser that takes outside input: refs, MANIFEST.json and
release.json, policy documents, and mutated real `.metadata` files. Any input ends in success or
a `RegistryError` (one line, an exit code), never another exception, and within a deadline.

The suite runs a bounded number of examples (`REG_FUZZ_EXAMPLES`, default 150 per property);
`python -m bench.fuzz` runs many more.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from registry.errors import RegistryError

EXAMPLES = int(os.environ.get("REG_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=5),
    database=None,
    derandomize=os.environ.get("REG_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _ends_well(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Success, or a RegistryError with a one-line message."""
    try:
        return fn(*args, **kwargs)
    except RegistryError as exc:
        assert "\n" not in str(exc), str(exc)
        return None


# -- refs ---------------------------------------------------------------------------------------

REF_ALPHABET = st.sampled_from(list("abcXYZ019._-/@:vstep latest\x00\n\u202e%"))


@FUZZ
@given(st.one_of(st.text(), st.text(REF_ALPHABET, max_size=60)))
def test_any_ref_text_parses_or_is_a_malformed_ref(text):
    from registry.core.refs import parse_ref

    _ends_well(parse_ref, text)


# -- documents ----------------------------------------------------------------------------------


def _manifest_bytes() -> bytes:
    from registry.formats.documents import FileRecord, Manifest, ResumeRecord, TensorSummary

    return Manifest(
        project="p",
        run="r",
        step=4,
        world_size=2,
        world_size_inferred=False,
        files=(
            FileRecord(".metadata", 10, "ab" * 32),
            FileRecord("__0_0.distcp", 20, "cd" * 32, 0),
        ),
        tensors=TensorSummary(3, 120, 1),
        resume=ResumeRecord({"model": ["model"]}, [], True, [], "dcp", ("model.w",), ()),
        metrics={"loss": 1.5},
        pushed_by="alice",
        created_at="2026-11-30T10:00:00Z",
    ).to_bytes()


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


def _mutate(doc: object, path: list[int], value: object) -> object:
    """Replace one node of the document (chosen by `path`) with `value`."""
    if not path or not isinstance(doc, dict | list) or not doc:
        return value
    if isinstance(doc, dict):
        key = sorted(doc)[path[0] % len(doc)]
        return {**doc, key: _mutate(doc[key], path[1:], value)}
    i = path[0] % len(doc)
    return [*doc[:i], _mutate(doc[i], path[1:], value), *doc[i + 1 :]]


@FUZZ
@given(st.lists(st.integers(min_value=0, max_value=50), max_size=5), JSON_VALUES)
def test_a_mutated_manifest_is_read_or_refused(path, value):
    from registry.formats.documents import Manifest

    doc = _mutate(json.loads(_manifest_bytes()), path, value)
    data = json.dumps(doc, allow_nan=True).encode()
    manifest = _ends_well(Manifest.from_bytes, data, "m")
    if manifest is not None:  # whatever is accepted round-trips
        assert Manifest.from_bytes(manifest.to_bytes(), "m") == manifest


@FUZZ
@given(st.binary(max_size=2000))
def test_any_bytes_as_a_document_are_read_or_refused(data):
    from registry.formats.documents import Manifest, ReleaseDocument

    _ends_well(Manifest.from_bytes, data, "m")
    _ends_well(ReleaseDocument.from_bytes, data, "r")


# -- policies -----------------------------------------------------------------------------------

POLICY_KEYS = st.sampled_from(
    [
        "[retention]\nttl",
        "[retention]\nkeep_last",
        "[retention]\nmax_bytes",
        "[retention]\norphan_grace",
        "[retention]\nkeep_best",
        "[promotion]\nprobe_rtol",
        "[promotion]\nrequire_device",
        "[release]\nlock_days",
        "[resume]\nrequired",
        "[[access.grants]]\nprincipals",
        "[[access.grants]]\nrole",
    ]
)
TOML_VALUES = st.sampled_from(
    [
        "-1",
        "0",
        "1",
        "1e400",
        "inf",
        "-inf",
        "nan",
        '"7d"',
        '"-7d"',
        '"never"',
        '"0GB"',
        '"5TB"',
        '"x"',
        "[]",
        '["admin"]',
        "{}",
        "true",
        "99999999999999999999",
        '"\\u0000"',
    ]
)


@FUZZ
@given(st.lists(st.tuples(POLICY_KEYS, TOML_VALUES), max_size=4), st.text(max_size=40))
def test_any_policy_document_loads_or_is_a_policy_error(pairs, noise):
    from policies.loader import parse_policy

    text = "\n".join(f"{k} = {v}" for k, v in pairs)
    _ends_well(parse_policy, text, "p.toml")
    _ends_well(parse_policy, noise, "p.toml")


# -- .metadata ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_metadata(ckpts) -> Path:  # type: ignore[no-untyped-def]
    return Path(ckpts.ws2.step_dir(2), ".metadata")  # a path: a failing example prints short


@functools.cache
def _bytes_of(path: Path) -> bytes:
    return path.read_bytes()


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
        min_size=1,
        max_size=8,
    ),
    st.integers(min_value=0),
    st.booleans(),
)
def test_a_mutated_real_metadata_parses_or_is_refused(real_metadata, flips, cut, light):
    from registry.formats.dcp import inventory
    from registry.formats.dcp_metadata import load_metadata

    data = bytearray(_bytes_of(real_metadata))
    for where, byte in flips:
        data[where % len(data)] = byte
    if cut % 4 == 0:
        data = data[: cut % len(data)]

    def parse() -> None:
        inventory(load_metadata(bytes(data), light=light))

    _ends_well(parse)
