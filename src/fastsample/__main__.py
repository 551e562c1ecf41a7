"""Command line: ``python -m fastsample COMMAND`` (also the ``fastsample`` script).

Commands:

* ``bench``: fastsample against ``torch.multinomial``, side by side (:mod:`fastsample.tools.bench`).
* ``selfcheck``: exactness, bad rows, batch invariance and (on CUDA) graph capture on this
  device (:mod:`fastsample.tools.selfcheck`).

A command is a module with ``add_arguments(parser)`` and ``run(args) -> int``; to add one,
add it to :func:`_commands`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from types import ModuleType


def _commands() -> list[tuple[str, str, ModuleType]]:
    """``(name, one-line help, module)`` for each subcommand, in help order."""
    from .tools import bench, selfcheck

    return [
        ("bench", "time fastsample against torch.multinomial and one read pass", bench),
        ("selfcheck", "check exactness and graph safety of fastsample on this device", selfcheck),
    ]


def build_parser() -> argparse.ArgumentParser:
    """The ``fastsample`` parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="python -m fastsample",
        description="fastsample: exact, sync-free token sampling for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text, module in _commands():
        doc = getattr(module, "DESCRIPTION", None) or module.__doc__ or help_text
        command = sub.add_parser(
            name,
            help=help_text,
            description=doc.strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen command."""
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
