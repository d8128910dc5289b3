"""The training scripts a demo job (and bench/resilax_bench/goodput.py's jobs) can run."""

from __future__ import annotations

from typing import Any

#: By name: their paths under the demo's files (resilax_local/demo/files). Both take --steps and
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


def steps_problem(steps: int | None, fault_step: int, dwell_steps: int) -> str | None:
    """Why `--steps steps` leaves the demo's story no room (None: it does not, or it is unset)."""
    if steps is None or steps > fault_step + dwell_steps:
        return None
    return (f"--steps {steps} leaves no room for the story: allowed: more than --fault-step + --dwell-steps "
            f"({fault_step} + {dwell_steps}), and enough past them for the grow-back")


def prepare_job(job: dict[str, Any], namespace: str, storage: str, working_dir: str, example: str,
                steps: int | None) -> dict[str, Any]:
    """The demo's JAXJob as its file has it, made to run here: in `namespace`, checkpoints in `storage`,
    each container started in `working_dir` (its command runs examples/...) with `example` and `steps`."""
    job["metadata"]["namespace"] = namespace
    job["spec"]["checkpoint"]["storage"] = storage
    for container in job["spec"]["template"]["spec"]["containers"]:
        container["workingDir"] = working_dir
        container["command"] = use_steps(use_example(container["command"], example), steps)
    return job
