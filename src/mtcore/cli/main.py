"""The ``mtcore`` command: ``mtcore COMMAND [options]``.

Every command is a module of ``mtcore.cli`` named in ``COMMANDS`` that defines
``HELP`` (one line for ``mtcore --help``), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status). Adding a command is adding a module and
its name here (a hyphen in a name is an underscore in the module's: ``new-plugin``
is ``new_plugin``). The modules are imported to build the parser, so their top level
stays light; heavy imports go inside ``run``.

Exit status: 0 success, 1 the command failed (the message says why),
2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings

from mtcore import __version__

COMMANDS = (
    "plugins",
    "doctor",
    "train",
    "data",
    "plan",
    "sweep",
    "trace",
    "generate",
    "convert",
    "new-plugin",
)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

ENVIRONMENT_HELP = """\
environment:
  MTCORE_BACKEND=NAME                 backend to use when code does not name one
  MTCORE_PLUGINS=a,b                  load only these plugins (entry point or distribution names)
  MTCORE_DISABLE_PLUGIN_AUTOLOAD=1    load no plugin unless MTCORE_PLUGINS names it
  MTCORE_KERNELS=reference            run the reference implementation of every kernel op
  MTCORE_SHM_COLLECTIVES=0            keep tp/dp/ep groups and pipeline transfers of CPU ranks on gloo
"""


class _OneLineErrors(argparse.ArgumentParser):
    """A usage error is one line, ``mtcore COMMAND: error: ...`` and where the usage is,
    like every other bad input (argparse's own prints the usage first); exit 2. Its
    subcommands' parsers are of this class too (argparse makes them of the parent's)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="mtcore",
        description="mtcore: hardware-neutral LLM training with accelerator plugins.",
        epilog=ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mtcore {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMANDS:
        module = importlib.import_module(f"mtcore.cli.{name.replace('-', '_')}")
        sub = commands.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            epilog=ENVIRONMENT_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `mtcore doctor | head`: the reader left; silence the flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def console() -> int:
    """The `mtcore` program (its console script): ``main`` with warnings as one line each."""
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
    with one_line_warnings(command):
        return main()


@contextlib.contextmanager
def one_line_warnings(command: str):
    """While a command runs, a Python warning is one line, ``mtcore COMMAND: warning: ...``,
    printed once however often it is raised (not the file, line and source of where it was
    raised: that is for the developer, not the user). Restored afterwards."""
    seen: set[str] = set()
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text not in seen:
            seen.add(text)
            prefix = f"mtcore {command}" if command in COMMANDS else "mtcore"
            print(f"{prefix}: warning: {text}", file=file or sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(console())
