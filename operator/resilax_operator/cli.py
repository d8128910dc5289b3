"""The `resilax` console script: one entry point, each subcommand imported only when it runs.

Each subcommand is a `module:function` that takes the remaining arguments and returns an exit code, so
`resilax sidecar` never imports kopf, `resilax local` never imports JAX, and `resilax run` (the
trainer's supervisor) imports only `resilax_ckpt.trainer.supervisor`, standard library only. Each also names the extra
of pyproject.toml that carries its dependencies: a subcommand whose dependencies this install lacks
(a bare `pip install resilax`, or `resilax[train]` asked for `resilax operator`) says which extra to
install and exits with `MISSING_EXTRA_EXIT`, instead of an import traceback. It checks the extra's
distributions in the installed metadata before importing anything (some subcommands import their
dependencies late, inside `main`), and an import that still fails is reported the same way.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    # name: ("module:function", one-line help, the extra that carries its dependencies)
    "local": ("resilax_local.cli:main", "run and break a local Kubernetes cluster (up, down, nodes, faults)",
              "local"),
    "operator": ("resilax_operator.main:main", "run the JAXJob operator", "operator"),
    "sidecar": ("resilax_sidecar.app:main", "run the checkpoint sidecar of a worker pod", "sidecar"),
    "node-sweep": ("resilax_sidecar.node_sweep:main",
                   "remove the node folders of deleted JAXJobs (checkpoint.local.scope: Node)", "sidecar"),
    "demo": ("resilax_local.demo.runner:main", "the end-to-end demo on the local cluster", "local"),
    # "": the standard library is enough (a trainer image with resilax[train], or no extra at all)
    "run": ("resilax_ckpt.trainer.supervisor:main", "run a trainer under the in-place restart supervisor", ""),
    "health-check": ("resilax_ckpt.trainer.health_check:main",
                     "check this host's devices, a matmul and a collective before a trainer starts", "train"),
    "job": ("resilax_operator.kubectl.plugin:main",
            "a JAXJob at a glance: status, goodput, timeline, save, suspend, resume, web (also `kubectl resilax`)",
            "operator"),
}

MISSING_EXTRA_EXIT = 3
"""The exit code of a subcommand whose extra is not installed (2 is a usage or configuration error)."""


def _usage() -> str:
    lines = ["usage: resilax <command> [args...] | --version | --help", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_, _) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def missing_extra_message(command: str, extra: str, missing: Sequence[str]) -> str:
    """What `resilax <command>` says when its extra's dependencies are not all installed (pure)."""
    what = ", ".join(repr(m) for m in missing) if missing else "some of its Python packages"
    return (f"resilax {command}: this install lacks {what}, which the {extra!r} extra brings; "
            f"install it with: pip install 'resilax[{extra}]'")


_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?[^;]*(?:;(.*))?$")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def plan_extra_distributions(requires: Sequence[str], extra: str) -> list[str]:
    """The distributions `resilax[extra]` installs, from the `Requires-Dist` lines of resilax's metadata
    (`kopf>=1.38; extra == "operator"`), following `resilax[a,b]` to its own extras (pure)."""
    wanted: list[str] = []
    seen_extras: set[str] = set()
    pending = [extra]
    while pending:
        current = pending.pop()
        if current in seen_extras:
            continue
        seen_extras.add(current)
        for line in requires:
            match = _REQUIREMENT.match(line)
            if match is None:
                continue
            name, extras, marker = match.groups()
            marked = _EXTRA_MARKER.search(marker or "")
            if marked is None or marked.group(1) != current:
                continue
            if name.lower() == "resilax":
                pending += [e.strip() for e in (extras or "").split(",") if e.strip()]
            elif name not in wanted:
                wanted.append(name)
    return wanted


def missing_distributions(extra: str) -> list[str]:
    """The distributions of `resilax[extra]` this environment lacks ([] when resilax's own metadata is
    not there, e.g. a checkout on PYTHONPATH: then only the imports can tell)."""
    try:
        requires = metadata.requires("resilax") or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for name in plan_extra_distributions(requires, extra):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _load(name: str) -> Callable[[Sequence[str]], int] | None:
    """The subcommand's function, or None (after saying which extra to install) when its extra's
    distributions are not installed or its imports fail for want of one."""
    target, _, extra = SUBCOMMANDS[name]
    missing = missing_distributions(extra)
    if missing:
        print(missing_extra_message(name, extra, missing), file=sys.stderr)
        return None
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0].startswith("resilax"):
            raise  # our own module missing is a broken install or a bug, not an extra to add
        print(missing_extra_message(name, extra, [e.name] if e.name else []), file=sys.stderr)
        return None
    func: Callable[[Sequence[str]], int] = getattr(module, func_name)
    return func


def _version() -> str:
    try:
        return metadata.version("resilax")
    except metadata.PackageNotFoundError:
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
    func = _load(name)
    return MISSING_EXTRA_EXIT if func is None else func(rest)


if __name__ == "__main__":
    sys.exit(main())
