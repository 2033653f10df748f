"""`reg`: the command line. Each command parses, calls one library method, renders the result.

Errors are one line on stderr with the exit code of DESIGN §7; `REG_DEBUG=1` shows tracebacks.
"""

from __future__ import annotations

import os
import sys
import warnings

import typer

from cli import admin as admin_commands
from cli import checkpoints as checkpoint_commands
from cli import mirror as mirror_commands
from cli import policy as policy_commands
from cli import releases as release_commands

app = typer.Typer(
    name="reg",
    help="Checkpoint and release-model registry for ML training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
checkpoint_commands.register(app)
release_commands.register(app)
admin_commands.register(app)
policy_commands.register(app)
mirror_commands.register(app)


def _warning(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
    sys.stderr.write(f"reg: warning: {message}\n")


def main() -> None:
    warnings.showwarning = _warning
    debug = os.environ.get("REG_DEBUG") == "1"
    from registry.errors import RegistryError

    try:
        app()
    except RegistryError as exc:
        if debug:
            raise
        sys.stderr.write(f"reg: error: {exc}\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("reg: interrupted\n")
        sys.exit(130)
    except Exception as exc:
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        sys.stderr.write(
            f"reg: internal error: {type(exc).__name__}: {first} "
            "(REG_DEBUG=1 shows the traceback)\n"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
