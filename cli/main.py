"""`reg`: the command line. Each command parses, calls one library method, renders the result.

Errors are one line on stderr with the exit code of DESIGN §7; `REG_DEBUG=1` shows tracebacks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import warnings
from typing import Any, TextIO

import typer

from cli import admin as admin_commands
from cli import checkpoints as checkpoint_commands
from cli import claims as claim_commands
from cli import keys as key_commands
from cli import mirror as mirror_commands
from cli import policy as policy_commands
from cli import releases as release_commands
from cli import server as server_commands
from cli import workflow as workflow_commands
from cli.help import GroupedHelp, readable
from registry.errors import RegistryError
from registry.text import inert, redact

app = typer.Typer(
    name="reg",
    help="Checkpoint and release-model registry for ML training.\n\n"
    "Docs: the docs/ folder of reg's source (`mkdocs serve` shows them as a site); every "
    "command and option: docs/reference/cli.md.",
    cls=GroupedHelp,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"reg {version('reg')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print reg's version and exit.",
    ),
) -> None:
    """Checkpoint and release-model registry for ML training."""


checkpoint_commands.register(app)
claim_commands.register(app)
release_commands.register(app)
admin_commands.register(app)
policy_commands.register(app)
mirror_commands.register(app)
server_commands.register(app)
key_commands.register(app)
workflow_commands.register(app)


def command() -> Any:
    """The click command tree `reg` runs, as its --help and docs/reference/cli.md show it."""
    return readable(typer.main.get_command(app))


def _warning(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]

    sys.stderr.write(f"reg: warning: {inert(str(message))}\n")


def main() -> None:
    """The `reg` console script. Exits without the interpreter's teardown: unloading the
    SQLAlchemy, pydantic and torch module graphs costs 0.1-0.15 s per command (measured), and
    every command has closed its catalog, store and threads by the time it returns."""
    code = run()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # a reader that went away (`reg ls | head`)
            stream.flush()
    os._exit(code)


class _InertStdout:
    """stdout for everything the commands print: control characters in names, reasons or
    documents are escaped (JSON output has none: json escapes them itself)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if not text.replace("\n", "").isprintable():
            text = "\n".join(inert(line) for line in text.split("\n"))
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run() -> int:
    """Run one command; its exit code (DESIGN §7)."""
    warnings.showwarning = _warning
    if not isinstance(sys.stdout, _InertStdout):
        sys.stdout = _InertStdout(sys.stdout)
    debug = os.environ.get("REG_DEBUG") == "1"

    try:
        code = command().main(standalone_mode=False, prog_name="reg")
    except typer.TyperException as exc:  # typer's usage errors (its vendored click)
        return _usage(exc)
    except typer.Abort:
        return _failed("interrupted", "interrupted", None, 130)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except RegistryError as exc:
        if debug:
            raise
        return _failed(f"error: {exc}", exc.message, exc.hint, exc.exit_code)
    except KeyboardInterrupt:
        return _failed("interrupted", "interrupted", None, 130)
    except OSError as exc:  # a path reg cannot use: REG_HOME read-only or full, a bad destination
        if debug:
            raise
        return _os_error(exc)
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        message = f"internal error: {type(exc).__name__}: {first}"
        return _failed(f"{message} (REG_DEBUG=1 shows the traceback)", message, None, 1)
    return code if isinstance(code, int) else 0


def _os_error(exc: OSError) -> int:
    """One line naming the path and what the system said; exit 1 when the disk or device
    failed, 2 when the path itself is unusable (read-only, missing, not a directory, denied)."""
    if exc.errno == errno.EPIPE:  # the reader of our output went away (`reg ls | head`)
        return 1
    failed = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO)
    where = f" {exc.filename}" if exc.filename else ""
    message = f"{exc.strerror or type(exc).__name__}:{where}"
    hint = (
        "free space there and retry"
        if failed
        else "check the path and its permissions (REG_HOME, REG_STORE_URL, the destination)"
    )
    return _failed(f"error: {message} ({hint})", message, hint, 1 if failed else 2)


def _usage(exc: typer.TyperException) -> int:
    """`reg` or `reg alias` alone print their help; any other usage error is one line."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        exc.show()  # type: ignore[attr-defined]
        return exc.exit_code
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "reg"
    message = " ".join(exc.format_message().split())
    hint = f"`{where} --help` shows the usage"
    return _failed(f"error: {message} ({hint})", message, hint, exc.exit_code)


def _failed(line: str, message: str, hint: str | None, code: int) -> int:
    """One line on stderr, inert and without credentials; with --json also the error document
    on stdout."""
    sys.stderr.write(f"reg: {inert(redact(line))}\n")
    if "--json" in sys.argv[1:]:
        from cli.render import error_json

        with contextlib.suppress(OSError):  # a reader that went away (`reg ... --json | head`)
            error_json(redact(message), redact(hint) if hint else None, code)
    return code


if __name__ == "__main__":
    main()
