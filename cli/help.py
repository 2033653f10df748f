"""How `reg --help` reads: commands in groups, one example per command, and metavars that say
what a value is (`--model NAME`, `--extra FILE`) instead of typer's `<str>` and `<list[Path]>`.

`readable(command)` dresses the click command tree typer builds; `cli.main` runs that tree and
`cli.reference` documents it, so the help a user reads and the reference page are one text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

from typer.core import TyperArgument, TyperGroup, TyperOption

# The sections of `reg --help`, in order; every command is in exactly one
# (tests/project/test_docs.py).
GROUPS: dict[str, tuple[str, ...]] = {
    "Checkpoints": (
        "push-ckpt",
        "claim-ckpt",
        "commit-ckpt",
        "ls",
        "show",
        "pull",
        "verify",
        "pin",
        "unpin",
        "run",
        "advise",
    ),
    "Releases": (
        "validate",
        "promote",
        "releases",
        "pull-release",
        "fetch-release",
        "alias",
        "requests",
        "approve",
        "reject",
        "deprecate",
        "yank",
        "sign-release",
        "keys",
    ),
    "Policy and access": ("policy", "token", "login", "whoami", "audit", "webhook"),
    "Operations": ("gc", "fsck", "catalog", "storage", "mlflow", "ui"),
    "Server": ("server",),
}
DEPRECATED = ("recovery",)  # still runs; left out of --help

# One example per command, by its path under `reg` (tests/project/test_docs.py: every command
# has one).
EXAMPLES: dict[str, str] = {
    "push-ckpt": "reg push-ckpt ./ckpt/step9000 --run run42 --step 9000",
    "claim-ckpt": "reg claim-ckpt --run run42 --step 9000 --lease 2h",
    "commit-ckpt": "reg commit-ckpt --claim TOKEN",
    "ls": "reg ls run42 --project team-a",
    "show": "reg show run42@step9000",
    "pull": "reg pull run42@latest ./resume",
    "verify": "reg verify run42@step9000",
    "pin": 'reg pin run42@step9000 --reason "paper baseline"',
    "unpin": "reg unpin run42@step9000",
    "run": "reg run finish run42 --status failed",
    "alias": "reg alias set llama-tiny prod v3",
    "keys": "reg keys ls",
    "policy": "reg policy show",
    "token": "reg token create alice --expires 90d",
    "webhook": "reg webhook ls",
    "catalog": "reg catalog migrate",
    "storage": "REG_STORE_URL=s3://ckpts/reg reg storage init",
    "mlflow": "reg mlflow sync",
    "run finish": "reg run finish run42 --status failed",
    "run restart": "reg run restart run42 --planned",
    "advise": "reg advise run42 --gpus 64 --plot waste.svg",
    "recovery": "reg recovery run42",
    "validate": "reg validate run42@step9000 --device cpu",
    "promote": "reg promote run42@step9000 --model llama-tiny --alias prod --dtype bf16",
    "releases": "reg releases llama-tiny",
    "pull-release": "reg pull-release llama-tiny@prod ./model",
    "fetch-release": 'python -c "from transformers import AutoModel; '
    "AutoModel.from_pretrained('$(reg fetch-release llama-tiny@prod)')\"",
    "alias set": "reg alias set llama-tiny prod v3",
    "requests": "reg requests llama-tiny --state open",
    "approve": "reg approve 7 --version v3",
    "reject": 'reg reject 7 --reason "eval regressed"',
    "deprecate": 'reg deprecate llama-tiny:v2 --reason "superseded by v3"',
    "yank": 'reg yank llama-tiny:v2 --reason "trained on leaked data"',
    "sign-release": "reg sign-release llama-tiny:v1",
    "keys create": "reg keys create",
    "keys rotate": "reg keys rotate",
    "keys ls": "reg keys ls",
    "keys public": "reg keys public > reg-signing.pem",
    "keys retire": 'reg keys retire 3f2a9c1d --reason "rotated"',
    "keys revoke": 'reg keys revoke 3f2a9c1d --reason "private key leaked"',
    "policy show": "reg policy show",
    "policy check": "reg policy check policy.toml",
    "policy apply": "reg policy apply policy.toml",
    "policy export": "reg policy export --format s3 --bucket ckpts/reg",
    "token create": "reg token create alice --expires 90d",
    "token ls": "reg token ls",
    "token revoke": "reg token revoke 12",
    "login": "reg login https://reg.example.com --token-stdin < token.txt",
    "whoami": "reg whoami",
    "audit": "reg audit --since 24h --action promote",
    "audit verify": "reg audit verify --max-unsealed-age 1m",
    "audit seal": "reg audit seal",
    "webhook ls": "reg webhook ls",
    "webhook test": "reg webhook test chat-ops",
    "webhook deliveries": "reg webhook deliveries --status given-up",
    "webhook deliver": "reg webhook deliver --budget 60",
    "gc": "reg gc --dry-run",
    "fsck": "reg fsck",
    "catalog rebuild": "REG_CATALOG_URL=sqlite:////tmp/new.db reg catalog rebuild --dry-run",
    "catalog migrate": "reg catalog migrate --grant reg_runtime",
    "catalog grants": "reg catalog grants reg_runtime --dry-run",
    "catalog sign": "reg catalog sign --dry-run",
    "catalog backfill-journal": "reg catalog backfill-journal --dry-run",
    "storage init": "REG_STORE_URL=s3://ckpts/reg reg storage init",
    "mlflow sync": "reg mlflow sync --every 1m",
    "ui": "reg ui --port 5000",
    "server": "reg server --host 0.0.0.0 --port 8470 --workers 4 --gc-every 1h",
    "server init": "reg server init --admin alice",
}

# Metavars by parameter name where the name alone says too little; else the name in capitals.
_METAVARS: dict[str, str] = {
    "ref": "REF",
    "dest": "DIR",
    "directory": "DIR",
    "path": "FILE",
    "request": "ID",
    "token_id": "ID",
    "key_id": "KEY_ID",
    "metric": "NAME=VALUE",
    "model_factory": "MODULE:FUNCTION",
    "max_shard_size": "SIZE",
    "memory_budget": "SIZE",
    "strip_prefix": "PREFIX",
    "convert": "CONVERTER",
    "base": "RELEASE",
    "claim": "TOKEN",
    "lease": "DURATION",
    "expires": "DURATION",
    "every": "INTERVAL",
    "gc_every": "INTERVAL",
    "mtbf": "DURATION",
    "since": "WHEN",
    "actor": "PRINCIPAL",
    "admin": "PRINCIPAL",
    "grant": "ROLE",
    "reason": "TEXT",
    "sha256": "HEX",
    "bucket": "BUCKET[/PREFIX]",
    "allowed_hosts": "HOSTS",
    "budget": "SECONDS",
    "graceful_timeout": "SECONDS",
    "gpus": "N",
    "limit": "N",
    "sample": "N",
    "workers": "N",
    "skip": "EVENT_ID",
    "node_loss_share": "SHARE",
    "max_unsealed_age": "DURATION",
    "max_anchor_age": "DURATION",
    "plot": "FILE",
    "cache_dir": "DIR",
    "hf_cache": "DIR",
    "dir": "DIR",
    "ssl_certfile": "FILE",
    "ssl_keyfile": "FILE",
}


def metavar_for(param: Any) -> str:
    """What a value of `param` is, as help shows it: `NAME`, `FILE`, `DIR`, `N`."""
    name = param.name or "value"
    if name in _METAVARS:
        return _METAVARS[name]
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    if annotation is Path:
        return "FILE"
    if annotation is int and param.param_type_name == "option":
        return "N"
    return name.upper()


class _ReadableArgument(TyperArgument):
    """An argument shown as `REF` (not `{ref}` and `ref <str>`)."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        return self.display_name_raw if self.required else f"[{self.display_name_raw}]"


class _ReadableOption(TyperOption):
    """An option shown as `--extra FILE` (not `--extra <list[Path]>`)."""


def readable(command: Any, path: tuple[str, ...] = ()) -> Any:
    """Give every parameter of `command` and its subcommands a metavar, mark repeatable options
    so, and put each command's example after its help. Returns `command` (changed in place)."""
    for param in command.params:
        if param.metavar is None and not getattr(param, "is_flag", False):
            param.metavar = metavar_for(param)
        if isinstance(param, TyperArgument) and not isinstance(param, _ReadableArgument):
            param.__class__ = _ReadableArgument  # same state, the two display methods above
        elif isinstance(param, TyperOption) and not isinstance(param, _ReadableOption):
            param.__class__ = _ReadableOption
            if param.multiple and "repeat" not in (param.help or ""):
                param.help = f"{param.help or ''} Repeatable.".strip()
    if isinstance(command, TyperGroup) and not isinstance(command, GroupedHelp):
        command.__class__ = GroupedHelp  # whole first sentences in its list of commands
    if isinstance(command, TyperGroup) and command.invoke_without_command:
        command.subcommand_metavar = "[COMMAND [ARGS]...]"  # runs on its own too
    key = " ".join(path)
    if key in EXAMPLES and command.epilog is None:
        command.epilog = f"\b\nExample:\n  {EXAMPLES[key]}"  # \b: click keeps the line as is
    for name, sub in getattr(command, "commands", {}).items():
        readable(sub, (*path, name))
    if not path and isinstance(command, TyperGroup):
        for name in DEPRECATED:
            if name in command.commands:
                command.commands[name].hidden = True
    return command


def walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Every command under `command` as ("alias set", click command), groups before theirs."""
    for name, sub in getattr(command, "commands", {}).items():
        yield " ".join((*path, name)), sub
        yield from walk(sub, (*path, name))


class GroupedHelp(TyperGroup):
    """`reg --help` with its commands in the sections of GROUPS; a group under it (`reg keys`)
    lists its own commands in one section."""

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        shown = {
            name: cmd
            for name in self.list_commands(ctx)
            if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden
        }
        if not shown:
            return
        groups = GROUPS.items() if ctx.parent is None else ()  # `keys ls` is not `reg ls`
        sections = [(title, [n for n in names if n in shown]) for title, names in groups]
        grouped = {n for _, names in sections for n in names}
        rest = [n for n in shown if n not in grouped]
        sections.append(("Other" if grouped else "Commands", rest))
        for title, names in sections:
            if names:
                with formatter.section(title):
                    formatter.write_dl([(n, summary(shown[n])) for n in names])


def summary(command: Any) -> str:
    """A command's first sentence, whole (`write_dl` wraps it), for the list of commands."""
    text = " ".join((command.short_help or command.help or "").split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]
