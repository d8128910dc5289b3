"""The training scripts a demo job (and bench/resilax_bench/goodput.py's jobs) can run."""

from __future__ import annotations

#: By name: their paths under the demo's files (resilax_local/demo_files). Both take --steps and
#: --step-seconds and print the same step and restore lines.
EXAMPLES = {"train": "examples/train.py", "transformer": "examples/transformer.py"}


def use_example(command: list[str], example: str) -> list[str]:
    """The job's command with EXAMPLES[example] in place of the example script it names."""
    if example not in EXAMPLES:
        raise ValueError(f"example: {example!r} is not one of {', '.join(sorted(EXAMPLES))}")
    scripts = set(EXAMPLES.values())
    return [EXAMPLES[example] if part in scripts else part for part in command]


def use_steps(command: list[str], steps: int | None) -> list[str]:
    """The job's command with `--steps steps` in place of the value it names (None: unchanged)."""
    if steps is None:
        return command
    if "--steps" not in command[:-1]:
        raise ValueError(f"the demo job's command {command} has no --steps to replace")
    at = command.index("--steps") + 1
    return [*command[:at], str(steps), *command[at + 1:]]
