"""The goodput benchmark's variants and victims (pure): which JAXJob each variant runs, whether this
checkout's operator can run the spare-slice variant, and which worker's host each fault of the seeded
schedule hits. bench/resilax_bench/goodput.py runs them.

Variants (one run measures the chosen ones in turn, on the same cluster and schedule):

* ``restart``: restart from the persistent checkpoint, as a JobSet-style restart has it: no local tier,
  no final saves, no elastic shapes, every pod replaced (`recovery.inPlace: Never`); every fault
  restarts all workers at the full shape once the capacity is there.
* ``resilax``: Resilax with shrink: the demo's job (elastic 1..2 with growBack, final saves), a
  node-local tier (`checkpoint.local: {}`) and in-place restarts of the survivors (`inPlace: Auto`).
* ``resilax-spare``: the same with one spare slice (`recovery.spareSlices: 1`); the harness adds a third
  slice's nodes (`SPARE_POOL`) for this variant only, so the others cannot use them.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any, Final

import yaml
from resilax_local.demo.examples import use_example
from resilax_local.demo.runner import FILES, JOB_FILE, JOB_NAMESPACE

from .goodput_model import GoodputInputError

RESTART: Final = "restart"
RESILAX: Final = "resilax"
RESILAX_SPARE: Final = "resilax-spare"
VARIANTS: Final = (RESTART, RESILAX, RESILAX_SPARE)
#: The spare variant's extra node pool: one more slice of the demo's shape (tpu-v5-lite-podslice 2x4).
SPARE_POOL: Final = "tpu-slice-2"
#: Worker processes of the demo's job at its declared shape (2 slices x 2 hosts): the victims' range.
PROCESSES: Final = 4
STEPS: Final = 1_000_000  # more than any run trains: the harness ends the job
#: Devices of the demo's job at its declared shape: 4 processes x 2 fake CPU devices (its XLA_FLAGS).
FULL_DEVICES: Final = PROCESSES * 2
CRD_FILE: Final = Path(__file__).resolve().parents[2] / "charts" / "resilax" / "crds" / "jaxjobs.resilax.dev.yaml"


def build_variant_job(variant: str, name: str, storage: str, step_seconds: float, example: str = "train",
                      example_args: tuple[str, ...] = (), compute_bound: bool = False) -> dict[str, Any]:
    """The demo's JAXJob as `variant` runs it (see the module doc), training `example` (resilax_local.demo.runner.
    EXAMPLES: examples/train.py by default, or examples/transformer.py) with `example_args` appended.
    With `compute_bound`, examples/train.py's step sleeps `step_seconds` x FULL_DEVICES / its devices
    (`--full-devices`): a step at half the devices takes twice as long, as a compute-bound step's would."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    job = copy.deepcopy(yaml.safe_load(JOB_FILE.read_text()))
    job["metadata"] = {"name": name, "namespace": JOB_NAMESPACE}
    spec = job["spec"]
    spec["checkpoint"]["storage"] = storage
    spec["recovery"]["maxRestarts"] = 1000  # the schedule, not the restart budget, is under test
    if compute_bound and example != "train":
        raise ValueError(f"compute_bound simulates examples/train.py's step; example {example!r} computes its own")
    scaled = ("--full-devices", str(FULL_DEVICES)) if compute_bound else ()
    for container in spec["template"]["spec"]["containers"]:
        container["workingDir"] = str(FILES)  # the demo's files: examples/train.py
        container["command"] = use_example(["python", "examples/train.py", "--steps", str(STEPS), "--step-seconds",
                                            str(step_seconds), *scaled, *example_args], example)
    if variant == RESTART:
        spec["checkpoint"]["finalSave"] = {**spec["checkpoint"].get("finalSave", {}),
                                           "onPreemption": False, "onResize": False}
        spec["recovery"]["inPlace"] = "Never"  # every pod replaced, as a JobSet-style restart does
        spec.pop("elastic", None)
        return job
    spec["checkpoint"]["local"] = {}
    spec["recovery"]["inPlace"] = "Auto"  # survivors of a hard loss or a shrink restart in place
    if variant == RESILAX_SPARE:
        spec["recovery"]["spareSlices"] = 1
    return job


def spare_problem(variants: tuple[str, ...], crd_text: str | None = None) -> str | None:
    """Why the chosen variants cannot run with this checkout's operator (None: they can): the spare
    variant needs `spec.recovery.spareSlices` in the JAXJob CRD (issue 39's spare slices)."""
    if RESILAX_SPARE not in variants:
        return None
    text = CRD_FILE.read_text() if crd_text is None else crd_text
    for doc in yaml.safe_load_all(text):
        for version in (doc or {}).get("spec", {}).get("versions", []):
            recovery = (version.get("schema", {}).get("openAPIV3Schema", {}).get("properties", {})
                        .get("spec", {}).get("properties", {}).get("recovery", {}).get("properties", {}))
            if "spareSlices" in recovery:
                return None
    return (f"--variants {RESILAX_SPARE}: this checkout's operator has no spec.recovery.spareSlices (the JAXJob "
            f"CRD in {CRD_FILE} lacks it: issue 39's spare slices are not on this branch); run "
            f"--variants {RESTART},{RESILAX} or a checkout with the spare slices")


def plan_victims(seed: int, faults: int, processes: int = PROCESSES) -> tuple[int, ...]:
    """The worker process whose host each of `faults` faults hits, from `seed` (its own random stream:
    the schedule's times stay those of `goodput_model.build_schedule`): process 0's host (the JAX
    coordinator's, and the one that logs the steps) at one seeded position, the others drawn from the
    rest. The harness maps a process to its pod by status.workerPods."""
    if faults < 0 or processes < 1:
        raise GoodputInputError(f"faults must be >= 0 and processes >= 1, got faults={faults!r}, "
                                f"processes={processes!r}")
    if faults == 0:
        return ()
    rng = random.Random(f"victims-{seed}")
    out = [rng.randrange(1, processes) if processes > 1 else 0 for _ in range(faults)]
    out[rng.randrange(faults)] = 0
    return tuple(out)
