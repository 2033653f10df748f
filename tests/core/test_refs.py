import pytest

from registry.core.refs import CheckpointRef, ReleaseRef, parse_checkpoint_ref, parse_ref
from registry.errors import MalformedRef


@pytest.mark.parametrize(
    ("text", "expected", "printed"),
    [
        ("run42@step9000", CheckpointRef("default", "run42", 9000), "run42@step9000"),
        ("run42@latest", CheckpointRef("default", "run42", None), "run42@latest"),
        ("team-a/run42@step0", CheckpointRef("team-a", "run42", 0), "team-a/run42@step0"),
        ("default/r@step1", CheckpointRef("default", "r", 1), "r@step1"),
        ("llama-tiny:v3", ReleaseRef("llama-tiny", version=3), "llama-tiny:v3"),
        ("llama-tiny@prod", ReleaseRef("llama-tiny", alias="prod"), "llama-tiny@prod"),
        ("m.v2_x@canary-1", ReleaseRef("m.v2_x", alias="canary-1"), "m.v2_x@canary-1"),
    ],
)
def test_refs_parse_by_shape_and_print_back(text, expected, printed):
    ref = parse_ref(text)
    assert ref == expected
    assert str(ref) == printed


@pytest.mark.parametrize(
    "text",
    [
        "",
        "run42",
        "run42@stepX",
        "run42@step-1",
        "run42@step01",
        "../x@step1",
        "a/../b@step1",
        "a/b/c@step1",
        "x..y@step1",
        "-run@step1",
        "run@",
        "@step1",
        "m:v0",
        "m:3",
        "m:vx",
        "m@step",
        "m@stepup",
        "a/m@prod",
        "m@.hidden",
        "run 1@step1",
        "r@step1\n",
        "m@../x",
        "x" * 129 + "@step1",
    ],
)
def test_malformed_refs_are_refused_with_exit_2(text):
    with pytest.raises(MalformedRef) as info:
        parse_ref(text)
    assert info.value.exit_code == 2


def test_default_project_applies_only_without_one():
    assert parse_checkpoint_ref("r@step1", project="p").project == "p"
    assert parse_checkpoint_ref("q/r@step1", project="p").project == "q"


def test_release_ref_is_not_a_checkpoint_ref():
    with pytest.raises(MalformedRef, match="names a release") as info:
        parse_checkpoint_ref("model@prod")
    assert "`reg pull-release model@prod DIR`" in str(info.value)  # the way out, named
