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
