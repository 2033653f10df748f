"""The documentation: the generated reference pages are current and name every command, option
and setting; every command has help and an example and sits in one section of `reg --help`;
every "DESIGN §N" the code cites is a section of docs/concepts/design.md; the README stays
short and its links land on pages that exist. (`mkdocs build --strict` runs in scripts/test.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.help import DEPRECATED, EXAMPLES, GROUPS, walk
from cli.main import command
from cli.reference import CLI_PAGE, CONFIG_PAGE, cli_reference
from registry.core.config import reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.process
def test_the_generated_pages_are_current():
    res = subprocess.run(
        [sys.executable, "-m", "cli.reference", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert CLI_PAGE.read_text() == cli_reference()
    assert reference() in CONFIG_PAGE.read_text()


def test_every_command_and_option_is_in_the_cli_reference():
    page = CLI_PAGE.read_text()
    for path, cmd in walk(command()):
        assert f"### reg {path}\n" in page, f"reg {path} is not in {CLI_PAGE.name}"
        section = page.split(f"### reg {path}\n", 1)[1].split("\n### ", 1)[0]
        for param in cmd.params:
            for opt in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())):
                if opt.startswith("-") and opt != "--help":
                    assert f"`{opt}" in section, f"reg {path} {opt} is not in its section"


def test_every_setting_is_in_the_configuration_reference():
    page = CONFIG_PAGE.read_text()
    settings = re.findall(r"^\| `([A-Z_]+)` \|", reference(), re.M)
    assert len(settings) >= 30 and {"REG_HOME", "REG_URL", "REG_OIDC_REQUIRE"} <= set(settings)
    for name in settings:
        assert f"| `{name}` |" in page, name


def test_every_command_has_help_an_example_and_a_section():
    root = command()
    grouped = [name for names in GROUPS.values() for name in names]
    assert len(grouped) == len(set(grouped)), "a command is in two sections"
    assert set(grouped) | set(DEPRECATED) == set(root.commands)
    for path, cmd in walk(root):
        assert cmd.help, f"reg {path} has no help text"
        leaf = not getattr(cmd, "commands", None)
        if leaf or cmd.invoke_without_command:
            assert path in EXAMPLES, f"reg {path} has no example"
            example = EXAMPLES[path]
            assert f"reg {path}" in example, f"the example of reg {path} runs something else"
            assert cmd.epilog and example in cmd.epilog
    assert set(EXAMPLES) <= {path for path, _ in walk(root)}, "an example of no command"


def test_help_is_grouped_and_readable(cli):
    res = cli("--help")
    assert res.returncode == 0
    out = res.stdout
    titles = [line[:-1] for line in out.splitlines() if re.fullmatch(r"[A-Z][a-z ]+:", line)]
    assert titles[-5:] == list(GROUPS)
    assert "recovery" not in out  # deprecated: runs, but is not advertised
    promote = cli("promote", "--help").stdout
    assert "Usage: reg promote [OPTIONS] REF" in promote
    assert "--extra FILE" in promote and "--model MODEL" in promote and "<" not in promote
    assert "Example:\n    reg promote run42@step9000" in promote
    keys = cli("keys", "--help").stdout  # a group's own commands: one section, not reg's
    assert "Commands:\n  create " in keys and "Checkpoints:" not in keys
    version = cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"reg \d+\.\d+\.\d+\S*\n", version.stdout)


def test_design_sections_cited_in_code_exist():
    design = (ROOT / "docs" / "concepts" / "design.md").read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", design, re.M)}
    assert sections == set(range(1, 11))
    cited: set[int] = set()
    for folder in ("registry", "cli", "policies", "examples", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            cited |= {int(n) for n in re.findall(r"DESIGN §(\d+)", path.read_text())}
    assert cited and cited <= sections, sorted(cited - sections)


def test_the_readme_is_short_and_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), link
    for task in ("push-ckpt", "require_device", "reg server"):
        assert task in readme


def _policy_keys(model: type, prefix: str = "") -> list[str]:
    """Every key a policy file can write, as `table.key` (nested models walked)."""
    from typing import get_args

    from pydantic import BaseModel

    keys = []
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        keys.append(prefix + name)
        for inner in (field.annotation, *get_args(field.annotation)):
            for kind in (inner, *get_args(inner)):
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    keys += _policy_keys(kind, f"{prefix}{name}.")
    return keys


def test_every_policy_key_is_in_the_policy_reference():
    from policies.loader import Policy

    page = (ROOT / "docs" / "reference" / "policy.md").read_text()
    keys = _policy_keys(Policy)
    assert {"retention.keep_last", "promotion.require_device", "webhooks.secret_file"} <= set(keys)

    def documented(key: str) -> bool:
        parent, _, last = key.rpartition(".")
        forms = (f"`{last}`", f"[{key}]", f"[[{key}]]", f"`{parent.rpartition('.')[2]}[].{last}`")
        return any(form in page for form in forms)

    missing = [key for key in keys if not documented(key)]
    assert not missing, f"policy keys not in docs/reference/policy.md: {missing}"
    # The shipped default, quoted whole, is the file itself.
    assert (ROOT / "policies" / "default.toml").read_text() in page


def test_every_result_shape_is_in_the_json_reference():
    from registry.api import results
    from registry.api.results.base import Result

    page = (ROOT / "docs" / "reference" / "json-and-exit-codes.md").read_text()
    shapes = [n for n, c in vars(results).items() if isinstance(c, type) and issubclass(c, Result)]
    assert len(shapes) > 30
    for name in shapes:
        if name != "Result":
            assert f"\n### {name}\n" in page, name
