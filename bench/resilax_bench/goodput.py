"""Goodput under a seeded failure schedule: ``python -m resilax_bench.goodput [--minutes 20] [--seed 1]``.

One local cluster (resilax_local, the demo's profile: 2 TPU slices tpu-v5-lite-podslice 2x4 of 2 hosts
each + cpu-0) and one operator (started as `resilax demo` starts it: the chart's RBAC, a ServiceAccount
token). For each variant in turn (goodput_variants.py: ``restart`` from the persistent checkpoint,
``resilax`` with shrink, ``resilax-spare`` with one spare slice, whose third slice of nodes the harness
adds for it alone), on the same cluster and with the same schedule (`goodput_model.build_schedule(seed)`:
a hard node loss every ~`--kill-every` s, the second one a preemption notice instead, each node back
`--restore-after` s later). The victim of each fault is the host of a worker process drawn from the seed
(`goodput_variants.plan_victims`: process 0's host is one of them), found by the job's status.workerPods.

The job trains examples/train.py (real JAX processes, 2 CPU devices each) for `--minutes`; the harness
applies the faults at their times, polls the job, its pods and Events every ~second, then deletes the job
and restores every node. From process 0's step lines, the restore lines, the pods' times and the job's
status it computes goodput and its breakdown (`goodput_model.compute_goodput`), and writes the JSON
(`--json`, default bench/results/goodput-<time>.json; it records the commit and the victims) and the
markdown table (printed; `--markdown FILE`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml
from resilax_local.demo.examples import EXAMPLES
from resilax_local.demo.runner import JOB_NAMESPACE, Demo, DemoError, say, stop_process_group
from resilax_local.demo.timeline import Fault, LossRecord, parse_timestamp
from resilax_operator import api

from .goodput_model import (
    BUCKETS,
    KILL,
    RESTORE,
    GenerationMarks,
    Goodput,
    PlannedFault,
    build_schedule,
    compute_goodput,
    find_reaction,
    pod_marks,
    recoveries,
)
from .goodput_variants import (
    RESILAX_SPARE,
    SPARE_POOL,
    VARIANTS,
    build_variant_job,
    plan_victims,
    spare_problem,
)

__all__ = ("GoodputRun", "build_variant_job", "main", "recompute", "render_table", "summarize")

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


class GoodputRun(Demo):
    """The demo's cluster, operator and observation (resilax_local.demo.runner.Demo), driven by a schedule."""

    def __init__(self, run_dir: Path, timeout: float, example: str = "train",
                 example_args: tuple[str, ...] = (), compute_bound: bool = False) -> None:
        super().__init__(run_dir, timeout=timeout, fault_step=0, keep=False, example=example)
        self.example_args = example_args
        self.compute_bound = compute_bound
        self.pods_seen: dict[int, dict[str, Any]] = {}  # generation -> {"created", "running"}
        self.down: set[str] = set()
        #: The worker process whose host each fault hits (by fault index; goodput_variants.plan_victims).
        self.victim_processes: tuple[int, ...] = ()

    def reset(self, name: str) -> None:
        self.job_name = name
        self.snapshots, self.faults, self.notes, self.events, self.records = [], [], [], {}, []
        self.pods_seen = {}
        self._last_line = None

    def observe_pods(self) -> None:
        selector = f"{api.LABEL_JOB}={self.job_name}"
        pods = self.client.get(f"/api/v1/namespaces/{JOB_NAMESPACE}/pods", labelSelector=selector)["items"]
        now = time.time()
        by_gen: dict[int, list[dict[str, Any]]] = {}
        for p in pods:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                by_gen.setdefault(int(p["metadata"]["labels"][api.LABEL_GENERATION]), []).append(p)
        for gen, ps in by_gen.items():
            seen = self.pods_seen.setdefault(gen, {"created": None, "running": None, "pods": 0})
            created = [parse_timestamp(p["metadata"].get("creationTimestamp")) for p in ps]
            if created and all(c is not None for c in created):
                first = min(c for c in created if c is not None)
                seen["created"] = min(seen["created"] or first, first)
            seen["pods"] = max(seen["pods"], len(ps))
            if seen["running"] is None and ps and all((p.get("status") or {}).get("phase") == "Running" for p in ps):
                started = [parse_timestamp(_started_at(p)) for p in ps]
                seen["running"] = max(s for s in started if s is not None) if all(started) else now

    def restore_lines(self) -> dict[int, tuple[float | None, float]]:
        """generation -> (began, ended) of process 0's restore (its restore line)."""
        out: dict[int, tuple[float | None, float]] = {}
        pods = self.cluster.run_dir / "pods" / JOB_NAMESPACE
        for path in pods.glob(f"{self.job_name}-g*/logs/{api.TRAINER_CONTAINER}/*.log"):
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    if not line.startswith("{") or '"restored"' not in line:
                        continue
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        raw = json.loads(line)
                        if int(raw.get("process", 0)) == 0 and "time" in raw:
                            gen = int(raw["generation"])
                            began = float(raw["began"]) if raw.get("began") is not None else None
                            if gen not in out or float(raw["time"]) < out[gen][1]:
                                out[gen] = (began, float(raw["time"]))
        return out

    def marks(self, start: float) -> dict[int, GenerationMarks]:
        """Per generation seen (pods or steps): its pods' times, its restore, and the operator's reaction
        that replaced the generation before it."""
        restored = self.restore_lines()
        out = {}
        gens = sorted({r.generation for r in self.records} | set(self.pods_seen))
        events = list(self.events.values())
        times = {g: pod_marks(g, self.pods_seen.get(g, {}).get("created"), self.pods_seen.get(g, {}).get("running"),
                              events) for g in gens}
        for n, gen in enumerate(gens):
            created, running = times[gen]
            detected = None
            if n:
                prev = gens[n - 1]
                detected = find_reaction(prev, [r.time for r in self.records if r.generation == prev],
                                         times[prev][1] or times[prev][0], created or running, self.snapshots, events)
            began, ended = restored.get(gen, (None, None))
            out[gen] = GenerationMarks(detected=detected, pods_created=created, pods_running=running, restored=ended,
                                       restore_began=began)
        return out

    def apply_fault(self, planned: PlannedFault, victims: dict[int, str]) -> None:
        if planned.kind == RESTORE:
            node = victims.pop(planned.victim, None)
            if node is not None:
                self.cluster.restore_node(node)
                self.down.discard(node)
                self.faults.append(Fault(time.time(), RESTORE, node))
                say(f"    {self.elapsed():6.0f}s  restore-node {node}")
            return
        gen = self.snapshots[-1].generation if self.snapshots else None
        process = self.victim_processes[planned.victim] if planned.victim < len(self.victim_processes) else None
        try:
            node = self.pick_victim(gen) if process is None else self.node_of_process(process)
        except DemoError as e:
            self.note("fault", f"{planned.kind} skipped: {e}")
            say(f"    {self.elapsed():6.0f}s  {planned.kind} skipped: {e}")
            return
        if planned.kind == KILL:
            self.cluster.kill_node(node)
        else:
            self.cluster.preempt_node(node, delay_seconds=30.0)
        self.down.add(node)
        victims[planned.victim] = node
        self.faults.append(Fault(time.time(), planned.kind, node))
        say(f"    {self.elapsed():6.0f}s  {planned.kind} {node} (generation {gen}, process {process})")

    def node_of_process(self, process: int) -> str:
        """The node of worker `process` of the current generation (status.workerPods: by process id; a
        shrunk generation's `process mod its size`)."""
        pods = list((self.client.get(self.job_path()).get("status") or {}).get("workerPods") or [])
        if not pods:
            raise DemoError("the job's status names no worker pods yet")
        name = pods[process % len(pods)]
        pod = self.client.get(f"/api/v1/namespaces/{JOB_NAMESPACE}/pods/{name}")
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            raise DemoError(f"worker pod {name} (process {process % len(pods)}) is bound to no node")
        return str(node)

    def elapsed(self) -> float:
        return time.time() - self.variant_start

    def run_variant(self, variant: str, schedule: tuple[PlannedFault, ...], duration: float,
                    step_seconds: float) -> dict[str, Any]:
        name = f"goodput-{variant}"
        self.reset(name)
        ckpt = self.run_dir / "ckpt" / variant
        shutil.rmtree(ckpt, ignore_errors=True)  # a reused --run-dir: the job starts at step 0, not an old run's
        ckpt.mkdir(parents=True)
        job = build_variant_job(variant, name, str(ckpt), step_seconds, self.example, self.example_args,
                                compute_bound=self.compute_bound)
        if variant == RESILAX_SPARE:  # one more slice of nodes, for this variant's spare alone
            spare = self.cluster.add_tpu_slice(SPARE_POOL)
            self.cluster.wait_nodes_ready(spare, timeout=180)
            say(f"    spare slice nodes {', '.join(spare)}")
        (self.run_dir / f"{name}.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
        say(f"\n==> variant {variant}: JAXJob {JOB_NAMESPACE}/{name} for {duration:.0f} s, "
            f"{sum(f.kind != RESTORE for f in schedule)} faults")
        self.client.create(self.job_path(collection=True), job)
        self.variant_start = start = time.time()
        load = [os.getloadavg()[0]]  # the machine's own load shapes a CPU run's start-ups: recorded with it
        pending = list(schedule)
        victims: dict[int, str] = {}
        while time.time() < start + duration:
            with contextlib.suppress(Exception):  # one failed poll (an API hiccup) is not the end
                self.observe()
                self.observe_pods()
            while pending and time.time() >= start + pending[0].at:
                self.apply_fault(pending.pop(0), victims)
            if time.time() >= start + 60 * len(load):
                load.append(os.getloadavg()[0])
            time.sleep(1.0)
        end = time.time()
        with contextlib.suppress(Exception):
            self.observe_quietly()
            self.observe_pods()
        marks = self.marks(start)
        result = compute_goodput(self.records, self.faults, start, end, marks)
        self.save_variant(variant, start, end, marks)
        self.teardown_variant()
        return {**summarize(variant, result, self.faults, start, marks, self.records),
                "load_1min": {"median": round(sorted(load)[len(load) // 2], 2), "max": round(max(load), 2),
                              "samples": len(load)}}

    def save_variant(self, variant: str, start: float, end: float, marks: dict[int, GenerationMarks]) -> None:
        out = self.run_dir / variant
        out.mkdir(parents=True, exist_ok=True)
        for fname, items in (("losses", self.records), ("faults", self.faults), ("snapshots", self.snapshots),
                             ("events", sorted(self.events.values(), key=lambda e: e.time))):
            (out / f"{fname}.jsonl").write_text("".join(json.dumps(asdict(i)) + "\n" for i in items))
        (out / "marks.json").write_text(json.dumps({"start": start, "end": end,
                                                    "marks": {g: asdict(m) for g, m in marks.items()}}, indent=1))

    def teardown_variant(self) -> None:
        say(f"==> deleting {self.job_name}, restoring nodes {sorted(self.down) or '-'}")
        for node in sorted(self.down):
            with contextlib.suppress(Exception):
                self.cluster.restore_node(node)
        self.down.clear()
        with contextlib.suppress(Exception):
            self.client.delete(self.job_path())
        selector = f"{api.LABEL_JOB}={self.job_name}"

        def gone() -> bool:
            return not self.client.get(f"/api/v1/namespaces/{JOB_NAMESPACE}/pods", labelSelector=selector)["items"]

        self.poll_until(gone, f"the pods of {self.job_name} gone", 180)
        for node in [n["name"] for n in self.cluster.nodes() if n["name"].startswith(f"{SPARE_POOL}-")]:
            self.cluster.remove_node(node)  # the spare variant's extra slice: no other variant may use it
        names = [n["name"] for n in self.cluster.nodes()]
        self.cluster.wait_nodes_ready(names, timeout=180)


def _started_at(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        if c.get("name") == api.TRAINER_CONTAINER:
            return ((c.get("state") or {}).get("running") or {}).get("startedAt")
    return None


def summarize(variant: str, g: Goodput, faults: list[Fault], start: float,
              marks: dict[int, GenerationMarks], records: Sequence[LossRecord] = ()) -> dict[str, Any]:
    return {
        "variant": variant, "device_weighted_goodput": round(g.device_weighted_goodput, 4),
        "goodput": round(g.goodput, 4), "wall_seconds": round(g.wall_seconds, 1),
        "buckets_seconds": {k: round(v, 1) for k, v in g.buckets.items()},
        "final_step": g.final_step, "steps_trained": g.steps_trained, "steps_lost": g.steps_lost,
        "generations": g.generations,
        "faults": [{"at": round(f.time - start, 1), "kind": f.kind, "node": f.node} for f in faults],
        "recoveries": [asdict(r) for r in recoveries(records, faults, start)],
        "marks": {g_: {k: (round(v - start, 1) if v is not None else None) for k, v in asdict(m).items()}
                  for g_, m in marks.items()},
    }


def _recovery_cell(r: dict[str, Any]) -> str:
    if r["seconds"] is None:
        return f"@{r['at']:.0f}s: none"
    return f"@{r['at']:.0f}s: {r['seconds']:.1f} s at {r['devices']}/{r['full']} devices"


def render_table(result: dict[str, Any]) -> str:
    rows = result["variants"]
    head = "| | " + " | ".join(r["variant"] for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    # Device-weighted first (issue 39): a second at half the devices counts half. Runs recorded before
    # it was computed have only the plain figure ("–").
    row("**device-weighted goodput**", [f"**{100 * r['device_weighted_goodput']:.1f}%**"
                                        if r.get("device_weighted_goodput") is not None else "–" for r in rows])
    row("goodput (plain)", [f"{100 * r['goodput']:.1f}%" for r in rows])
    row("wall time", [f"{r['wall_seconds']:.0f} s" for r in rows])
    for bucket in BUCKETS:
        row(bucket.replace("_", " "), [f"{r['buckets_seconds'][bucket]:.1f} s" for r in rows])
    row("final step", [str(r["final_step"]) for r in rows])
    row("steps lost (trained again)", [str(r["steps_lost"]) for r in rows])
    row("generations", [str(r["generations"]) for r in rows])
    row("hard fault → next generation's first step", [", ".join(_recovery_cell(x) for x in r.get("recoveries", []))
                                                       or "–" for r in rows])
    row("machine load (1-min average: median, max)", [f"{r['load_1min']['median']:.1f}, {r['load_1min']['max']:.1f}"
                                                        if r.get("load_1min") else "–" for r in rows])
    row("faults applied", [", ".join(f"{f['kind']}@{f['at']:.0f}s" for f in r["faults"]) or "-" for r in rows])
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resilax_bench.goodput", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="training time per variant (default 20)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kill-every", type=float, default=300.0, help="seconds between faults, ± jitter (default 300)")
    p.add_argument("--restore-after", type=float, default=90.0, help="seconds until a lost node returns (default 90)")
    p.add_argument("--jitter", type=float, default=0.2, help="fraction of --kill-every (default 0.2)")
    p.add_argument("--step-seconds", type=float, default=0.3, help="the example's --step-seconds (default 0.3)")
    p.add_argument("--example", choices=sorted(EXAMPLES), default="train",
                   help="the job's training script: train (examples/train.py, default) or transformer "
                        "(examples/transformer.py: a step's work is split over the devices)")
    p.add_argument("--step-model", choices=("compute-bound", "fixed"), default=None,
                   help="examples/train.py's step: compute-bound (default for train: the sleep scales with full / "
                        "current devices, so half the devices make a step take twice as long) or fixed (the same "
                        "sleep at any size, as runs before issue 39); the transformer example computes its own")
    p.add_argument("--example-args", default="",
                   help="more flags for the example, one string (e.g. \"--preset cpu-small\")")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, run in this order (default {','.join(VARIANTS)}; resilax-spare needs "
                        "the operator's spec.recovery.spareSlices)")
    p.add_argument("--run-dir", type=Path, default=None, help="default: a temporary folder, removed afterwards")
    p.add_argument("--json", type=Path, default=None, help="default: bench/results/goodput-<time>.json")
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--recompute", type=Path, nargs="+", default=None, metavar="RUN_DIR/VARIANT",
                   help="no run: compute the breakdown of saved variants (a --run-dir's resilax/, restart/) "
                        "again with this checkout's accounting, the operator's reactions found again")
    args = p.parse_args(argv)
    args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    args.example_args = tuple(shlex.split(args.example_args))
    if args.step_model is None:
        args.step_model = "compute-bound" if args.example == "train" else "fixed"
    if args.step_model == "compute-bound" and args.example != "train":
        p.error(f"--step-model compute-bound: not allowed with --example {args.example} (it computes its own step); "
                "use --step-model fixed")
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants: {bad or args.variants!r} not allowed; choose from {', '.join(VARIANTS)}")
    return args


def recompute(folder: Path) -> dict[str, Any]:
    """The summary of a variant saved by `GoodputRun.save_variant`, computed again (reactions included)."""
    from resilax_local.demo.timeline import JobSnapshot, TimelineEvent

    saved = json.loads((folder / "marks.json").read_text())

    def rows(name: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines() if line.strip()]

    records = [LossRecord(**r) for r in rows("losses")]
    faults = [Fault(**f) for f in rows("faults")]
    snapshots = [JobSnapshot(**s) for s in rows("snapshots")]
    events = [TimelineEvent(**e) for e in rows("events")]
    fields = set(GenerationMarks.__dataclass_fields__)
    marks = {int(g): GenerationMarks(**{k: v for k, v in m.items() if k in fields}) for g, m in saved["marks"].items()}
    for g, m in marks.items():  # runs saved before pod_marks knew in-place restarts
        created, running = pod_marks(g, m.pods_created, m.pods_running, events)
        marks[g] = replace(m, pods_created=created, pods_running=running)
    gens = sorted(marks)
    for n, gen in enumerate(gens[1:], 1):
        prev = gens[n - 1]
        marks[gen] = replace(marks[gen], detected=find_reaction(
            prev, [r.time for r in records if r.generation == prev], marks[prev].pods_running or marks[prev].pods_created,
            marks[gen].pods_created or marks[gen].pods_running, snapshots, events))
    result = compute_goodput(records, faults, saved["start"], saved["end"], marks)
    return summarize(folder.name, result, faults, saved["start"], marks, records)


def commit_of_checkout() -> str:
    """The checkout's commit (with "-dirty" when it has changes), "unknown" without git."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "unknown"
    return (head + ("-dirty" if dirty else "")) if head else "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recompute:
        again: dict[str, Any] = {"benchmark": "goodput", "recomputed": [str(f) for f in args.recompute],
                                 "variants": [recompute(f) for f in args.recompute]}
        say(render_table(again))
        if args.json:
            args.json.write_text(json.dumps(again, indent=1) + "\n")
        return 0
    no_spares = spare_problem(args.variants)  # before anything starts
    if no_spares is not None:
        print(f"resilax_bench.goodput: {no_spares}", file=sys.stderr)
        return 2
    from resilax_local.launch import isolation_problem

    problem = isolation_problem()  # the cluster runs pods as `resilax local up` does: ask before starting
    if problem is not None:
        print(f"resilax_bench.goodput: {problem}", file=sys.stderr)
        return 1
    duration = args.minutes * 60
    schedule = build_schedule(args.seed, duration, args.kill_every, args.restore_after, args.jitter)
    victims = plan_victims(args.seed, sum(f.kind != RESTORE for f in schedule))
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="resilax-goodput-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%SZ")
    result: dict[str, Any] = {
        "benchmark": "goodput", "started": stamp, "seed": args.seed, "minutes": args.minutes,
        "kill_every": args.kill_every, "restore_after": args.restore_after, "jitter": args.jitter,
        "step_seconds": args.step_seconds, "step_model": args.step_model, "example": args.example, "example_args": list(args.example_args),
        "commit": commit_of_checkout(), "schedule": [asdict(f) for f in schedule], "victim_processes": list(victims),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join(["python -m resilax_bench.goodput", *(sys.argv[1:] if argv is None else argv)]),
        "variants": [],
    }
    run = GoodputRun(run_dir, timeout=duration * len(args.variants) + 1800, example=args.example,
                     example_args=args.example_args, compute_bound=args.step_model == "compute-bound")
    run.victim_processes = victims
    code = 0
    try:
        run.start_cluster()
        run.install_operator()
        for variant in args.variants:
            result["variants"].append(run.run_variant(variant, schedule, duration, args.step_seconds))
    except (Exception, KeyboardInterrupt) as e:
        say(f"==> goodput run failed: {e!r} (logs in {run_dir})")
        result["error"] = repr(e)
        code = 1
    finally:
        if run.operator is not None:
            stop_process_group(run.operator)
        if run.cluster is not None:
            run.cluster.stop()
    out = args.json or RESULTS / f"goodput-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if result["variants"]:
        table = render_table(result)
        say("\n" + table)
        if args.markdown:
            args.markdown.write_text(table + "\n")
    say(f"==> result: {out}; run folder: {run_dir}")
    if args.run_dir is None and code == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
