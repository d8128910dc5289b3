"""The `resilax` console script: one entry point, each subcommand imported only when it runs.

Each subcommand is a `module:function` that takes the remaining arguments and returns an exit code, so
`resilax sidecar` never imports kopf and `resilax local` never imports JAX.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    # name: ("module:function", one-line help)
    "local": ("resilax_local.cli:main", "run and break a local Kubernetes cluster (up, down, nodes, faults)"),
    "operator": ("resilax_operator.main:main", "run the JAXJob operator"),
    "sidecar": ("resilax_sidecar.app:main", "run the checkpoint sidecar of a worker pod"),
    "demo": ("resilax_local.demo:main", "the end-to-end demo on the local cluster"),
}


def _usage() -> str:
    lines = ["usage: resilax <command> [args...] | --version | --help", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def _load(target: str) -> Callable[[Sequence[str]], int]:
    module_name, func_name = target.split(":")
    func: Callable[[Sequence[str]], int] = getattr(importlib.import_module(module_name), func_name)
    return func


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("resilax")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(_usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version", "version"):
        print(f"resilax {_version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"resilax: unknown command {name!r}; valid: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    return _load(SUBCOMMANDS[name][0])(rest)


if __name__ == "__main__":
    sys.exit(main())
