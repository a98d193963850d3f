"""The ``kvfleet`` command.

Each sub-command lives in its own module exposing ``register(subparsers) -> None``; the module adds one
parser whose ``func`` default is a callable ``(argparse.Namespace) -> int``. Built-in sub-commands are
listed in ``BUILTIN_COMMANDS``; sub-commands shipped outside the runtime (the operator, the dev cluster)
register through the ``kvfleet.commands`` entry-point group, so this module never imports them.

Exit codes: 0 success, 1 runtime failure, 2 bad input (argparse's convention).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, cast

#: (module, attribute) of each built-in sub-command's ``register`` function. Modules that do not exist
#: yet are skipped, so the command grows with the runtime.
BUILTIN_COMMANDS: tuple[str, ...] = (
    "kvfleet_runtime.kv.plan_cli",
    "kvfleet_runtime.kv.simulate_cli",
    "kvfleet_runtime.gateway.cli",
    "kvfleet_runtime.gateway.epp_cli",
    "kvfleet_runtime.gateway.usage_cli",
    "kvfleet_runtime.engine.cli",
)

Register = Callable[[Any], None]


def _registrars() -> list[Register]:
    found: list[Register] = []
    for module_name in BUILTIN_COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        found.append(cast(Register, module.register))
    for ep in entry_points(group="kvfleet.commands"):
        found.append(cast(Register, ep.load()))
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet",
        description="Multi-tenant LLM serving on vLLM + LMCache with per-tenant KV-cache governance.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in _registrars():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args))


if __name__ == "__main__":
    sys.exit(main())
