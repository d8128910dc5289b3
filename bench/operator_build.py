"""What building one generation's worker pods costs the operator (issue 25, item 6): time and peak
memory of `build_pods` for a job shape, in a fresh process. The operator builds every pod of a
generation in memory before creating them, so these figures size `RESILAX_OPERATOR_MAX_HOSTS_PER_JOB`
against the operator's memory limit.

    python bench/operator_build.py cpu 2x4 --chips-per-host 1 --count 1024     # 8,192 CPU pods
    python bench/operator_build.py tpu-v5p-slice 16x20x28 --count 1             # the largest TPU slice

Prints one JSON line: pods, seconds, ms per pod, peak RSS growth (MiB), KiB per pod, validation ms,
and what the watch cache holds per pod (each pod's JSON, and that JSON parsed on its own, as a watch
event delivers it: the API's answer adds status and defaults on top).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import tracemalloc

from resilax_operator.builders import GenerationPlan, JobRef, build_pods
from resilax_operator.settings import OperatorSettings
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("accelerator")
    parser.add_argument("topology")
    parser.add_argument("--count", type=int, default=1, help="slices")
    parser.add_argument("--chips-per-host", type=int, default=None)
    args = parser.parse_args()
    slices = {"accelerator": args.accelerator, "topology": args.topology, "count": args.count}
    if args.chips_per_host is not None:
        slices["chipsPerHost"] = args.chips_per_host
    raw = {"slices": slices, "checkpoint": {"storage": "gs://bucket/run", "local": {"scope": "Pod"}},
           "template": {"spec": {"containers": [{"name": "trainer", "image": "example/train:1",
                                                 "command": ["python", "train.py"]}]}}}
    settings = OperatorSettings(sidecar_image="resilax:bench", max_hosts_per_job=10**8)
    started = time.perf_counter()
    spec = validate_spec(raw, settings=settings)
    validated = time.perf_counter() - started
    plan = GenerationPlan(1, Shape(args.topology, args.count), ("pool",) * args.count)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    pods = build_pods(JobRef("job", "ns", "uid"), spec, plan, settings, coordinator_ip="10.0.0.1")
    seconds = time.perf_counter() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB → MiB
    texts = [json.dumps(p) for p in pods]
    del pods
    tracemalloc.start()
    cached = [json.loads(t) for t in texts]
    parsed = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(json.dumps({"shape": f"{args.count}x[{args.accelerator} {args.topology}]", "pods": len(cached),
                      "seconds": round(seconds, 2), "ms_per_pod": round(1000 * seconds / len(cached), 2),
                      "peak_rss_growth_mib": round(grown), "kib_per_pod": round(1024 * grown / len(cached), 1),
                      "validate_ms": round(1000 * validated, 1),
                      "cached_json_kib_per_pod": round(sum(map(len, texts)) / len(texts) / 1024, 1),
                      "cached_parsed_kib_per_pod": round(parsed / len(cached) / 1024, 1),
                      "cached_parsed_mib": round(parsed / 2**20)}))


if __name__ == "__main__":
    main()
