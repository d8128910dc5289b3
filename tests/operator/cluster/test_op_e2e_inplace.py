"""In-place restart of the survivors end to end (issue 26): real JAX workers (examples/train.py) under
the supervisor `resilax run`, the real sidecars and the operator on the local cluster.

Job: 2 slices of tpu-v5-lite-podslice 2x4 (2 hosts each) = 4 processes x 2 fake CPU devices,
`recovery.inPlace: Auto`, a checkpoint every 4 steps, 0.5 s per step; a spare host in slice 1's node pool,
so a hard loss of one host keeps the shape (the shrink-and-grow-back flow has no spare, and elastic
bounds). A sampler (every 0.5 s, in a thread) reads every worker pod's sidecar `/v1/state`
(`trainer_process`) and the process table (the trainers' RESILAX_GENERATION) and records any moment at
which trainers of two generations are alive at once."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from op_cluster import (
    Jobs,
    OperatorProcess,
    committed_steps,
    event_time,
    goodput_metrics,
    job_manifest,
    recovery_breakdown,
    steps_lost_observed,
    unique_name,
)
from resilax_local.cluster import LocalCluster
from resilax_local.node.profiles import build_tpu_slice
from resilax_local.testing import wait_for

EVERY = 4
SIDECAR_PORT = 8490  # OperatorSettings.sidecar_port
RESULTS = Path(os.environ.get("RESILAX_E2E_RESULTS", "/tmp/resilax-e2e-recovery.jsonl"))


class Sampler(threading.Thread):
    """Every 0.5 s: the generations whose trainers are alive (sidecars' `trainer_process` not `exited`,
    and `train.py` processes of the job in the process table); any sample with two is a violation."""

    def __init__(self, jobs: Jobs, name: str) -> None:
        super().__init__(daemon=True)
        self.jobs, self.name = jobs, name
        self.stop = threading.Event()
        self.samples = 0
        self.violations: list[dict[str, Any]] = []

    def run(self) -> None:
        while not self.stop.wait(0.5):
            with contextlib.suppress(Exception):
                self.sample()

    def sample(self) -> None:
        alive: dict[str, set[int]] = {}
        for pod in self.jobs.pods(self.name):
            ip = (pod.get("status") or {}).get("podIP")
            if not ip or pod["metadata"].get("deletionTimestamp"):
                continue
            try:
                with urllib.request.urlopen(f"http://{ip}:{SIDECAR_PORT}/v1/state", timeout=1) as r:
                    tp = json.loads(r.read()).get("trainer_process") or {}
            except OSError:
                continue
            if tp and tp.get("state") != "exited":
                alive.setdefault(f"sidecar:{pod['metadata']['name']}", set()).add(int(tp["generation"]))
        for pid, generation in trainer_processes(self.name):
            alive.setdefault(f"pid:{pid}", set()).add(generation)
        generations = set().union(*alive.values()) if alive else set()
        self.samples += 1
        if len(generations) > 1:
            self.violations.append({"time": time.time(), "alive": {k: sorted(v) for k, v in alive.items()}})


def trainer_processes(job: str) -> list[tuple[int, int]]:
    """(pid, RESILAX_GENERATION) of every live `train.py` process of `job` on this machine."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            # train.py itself, not its supervisor (`resilax run -- python train.py`: argv[0] or, under
            # a python launcher, argv[1] is the `resilax` console script)
            if not any(a.endswith(b"train.py") for a in argv) or any(Path(a.decode()).name == "resilax"
                                                                      for a in argv[:2]):
                continue
            stat = Path(f"/proc/{entry}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().decode(
                errors="replace").split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("RESILAX_JOB_NAME") == job and env.get("RESILAX_GENERATION", "").isdigit():
            out.append((int(entry), int(env["RESILAX_GENERATION"])))
    return out


def losses(jobs: Jobs, name: str) -> dict[int, dict[int, dict[str, Any]]]:
    """generation → step → record of process 0's loss lines, read by generation from every trainer log
    of the job's pods (op_cluster.Jobs.losses), whichever pod process 0 ran in."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for text in jobs.trainer_logs(name):
        for line in text.splitlines():
            if line.startswith("{") and '"loss"' in line:
                with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError, ValueError):
                    record = json.loads(line)
                    out.setdefault(int(record["generation"]), {})[int(record["step"])] = record
    return out


def add_spare(cluster: LocalCluster, pool: str, name: str) -> str:
    spec = replace(build_tpu_slice(pool, "tpu-v5-lite-podslice", "2x4")[0], name=name)
    spec = replace(spec, labels={**spec.labels, "kubernetes.io/hostname": name})
    if not any(n["name"] == name for n in cluster.nodes()):
        cluster.add_nodes([spec])
    cluster.wait_nodes_ready([name], timeout=120)
    return name


def pod_ids(jobs: Jobs, name: str) -> dict[str, tuple[str, str]]:
    return {p["metadata"]["name"]: (p["metadata"]["uid"], p["spec"].get("nodeName", ""))
            for p in jobs.pods(name) if not p["metadata"].get("deletionTimestamp")}


def start(jobs: Jobs, name: str, storage: Path, elastic: dict[str, Any] | None = None) -> None:
    manifest = job_manifest(name, storage, count=2, every_steps=EVERY, steps=5000, step_seconds=0.5, elastic=elastic,
                            recovery={"inPlace": "Auto", "inPlaceStopTimeoutSeconds": 60}, final_save_timeout=20)
    jobs.create(manifest)
    jobs.wait_status(name, lambda s: s.get("phase") == "Running" and s.get("generation") == 1, 600,
                     "generation 1 Running")
    wait_for(lambda: max(losses(jobs, name).get(1, {}), default=0) >= 10 and committed_steps(storage), timeout=600,
             interval=1, message=f"{name}: generation 1 past step 10 with a checkpoint")
    supervised = [p["metadata"]["annotations"].get("resilax.dev/supervised") for p in jobs.pods(name)]
    assert supervised == ["1"] * 4, supervised


def finish(jobs: Jobs, name: str, pod0: str, generation: int) -> dict[str, Any]:
    status = jobs.wait_status(
        name, lambda s: s.get("generation") == generation and s.get("phase") == "Running" and not s.get("inPlace")
        and (s.get("shape") or {}).get("count") == 2, 600, f"generation {generation} Running in place")
    wait_for(lambda: losses(jobs, name).get(generation), timeout=600, interval=1,
             message=f"{name}: a training step of generation {generation}")
    return status


def assert_compilation_cache_hit(jobs: Jobs, name: str, pod: str, generation: int) -> tuple[int, int]:
    """Process 0's trainer of `generation` (a kept pod) was served by the persistent compilation cache
    the generation before filled (spec.compilationCache's default; process 0 writes the entries:
    docs/architecture.md "Compilation cache"): its sidecar's metric and its log line say so.
    Returns (hits, compilations) as the log says them."""
    ip = next(p["status"]["podIP"] for p in jobs.pods(name) if p["metadata"]["name"] == pod)
    said = re.compile(rf"trainer of generation {generation} reached step \d+: the compilation cache served "
                      rf"(\d+) of its (\d+) compilations")
    found = wait_for(lambda: said.search(jobs.cluster.logs(jobs.namespace, pod, "resilax-sidecar")), timeout=60,
                     interval=1, message=f"{pod}: the sidecar's compilation-cache line for generation {generation}")
    hits, compilations = int(found.group(1)), int(found.group(2))
    with urllib.request.urlopen(f"http://{ip}:{SIDECAR_PORT}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    series = re.search(rf'^resilax_trainer_compilation_cache_hits_total\{{generation="{generation}"\}} (\S+)$',
                       metrics, re.M)
    assert series is not None, metrics[-3000:]
    assert hits > 0 and float(series.group(1)) >= hits, (found.group(0), series.group(0))
    return hits, compilations


def print_timeline(jobs: Jobs, name: str, operator: OperatorProcess, fault: float) -> None:
    """The job's events and the operator's in-place lines, in seconds after the fault."""
    for e in jobs.events(name):
        if event_time(e) >= int(fault):
            print(f"  +{event_time(e) - fault:6.1f}s event {e.get('reason')}: {str(e.get('message'))[:160]}")
    for line in operator.logs().splitlines():
        if any(w in line for w in ("/v1/trainer", "kept ", "created", "deleting")):
            print(f"  operator: {line[:200]}")


def assert_redone_steps_match(records: dict[int, dict[int, dict[str, Any]]], old: int, new: int) -> int:
    both = sorted(set(records[old]) & set(records[new]))
    for step in both:
        assert records[new][step]["loss"] == pytest.approx(records[old][step]["loss"], rel=1e-4), step
    return len(both)


@pytest.fixture
def spare(cluster: LocalCluster) -> Any:
    name = add_spare(cluster, "tpu-slice-1", f"tpu-slice-1-spare-{os.getpid() % 1000}")
    yield name
    with contextlib.suppress(Exception):
        cluster.remove_node(name)


def test_hard_loss_keeps_the_survivors_pods_and_restarts_their_trainers(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, spare: str, tmp_path: Path) -> None:
    name, storage = unique_name("inplace"), tmp_path / "ckpt"
    start(jobs, name, storage)
    pod0 = f"{name}-g1-s0-h0"
    sampler = Sampler(jobs, name)
    sampler.start()
    before = pod_ids(jobs, name)
    lost = f"{name}-g1-s1-h1"
    victim = before[lost][1]
    fault = time.time()
    cluster.kill_node(victim)
    try:
        status = finish(jobs, name, pod0, 2)
    finally:
        sampler.stop.set()
        sampler.join(timeout=10)
    after = pod_ids(jobs, name)
    survivors = {n: v for n, v in before.items() if n != lost}
    assert {n: after.get(n) for n in survivors} == survivors  # same UIDs, same nodes
    new = sorted(set(after) - set(before))
    assert new == [f"{name}-g2-s1-h1"] and after[new[0]][1] != victim, after
    assert status["workerPods"] == [f"{name}-g1-s0-h0", f"{name}-g1-s0-h1", f"{name}-g1-s1-h0", new[0]], status
    assert status["inPlaceRestarts"] == 1 and status["restarts"] == 1, status
    records = losses(jobs, name)
    restored = min(records[2]) - 1
    assert restored in committed_steps(storage)
    redone = assert_redone_steps_match(records, 1, 2)
    assert all(r["devices"] == 8 for r in records[2].values())
    assert sampler.samples >= 10 and not sampler.violations, sampler.violations[:3]
    reasons = jobs.event_reasons(name, "NodeLost", "RestartingInPlace")
    assert "RestartingInPlace" in reasons and "GenerationCreated" not in reasons[reasons.index("NodeLost"):], reasons
    detected = next(event_time(e) for e in jobs.events(name) if e.get("reason") == "NodeLost")
    first_step = min(r["time"] for r in records[2].values())
    figures = {"detection": round(detected - fault, 1), "restart": round(first_step - detected, 1),
               "total": round(first_step - fault, 1)}
    print_timeline(jobs, name, operator, fault)
    print(f"\nin-place recovery of {name}: {figures}; {len(records[1])} steps of generation 1, restored {restored}, "
          f"{redone} redone steps match; {sampler.samples} samples, no two generations alive")
    r = jobs.restores(name, 2).get(0)  # process 0's restore line of generation 2, wherever it ran
    if r is not None:
        print(f"  process 0 restore of generation 2: began +{r['began'] - fault:.1f}s, done +{r['time'] - fault:.1f}s")
    cache = storage / "_jax_cache"  # spec.compilationCache's default for folder storage
    hits, compilations = assert_compilation_cache_hit(jobs, name, pod0, 2)
    print(f"compilation cache: {len(list(cache.iterdir())) if cache.exists() else 0} entries in {cache}; process 0 "
          f"of generation 2 was served {hits} of its {compilations} compilations")
    with RESULTS.open("a") as f:
        f.write(json.dumps({"test": "hard_node_loss_in_place", "time": time.time(), **figures,
                            "lost": max(records[1]) - restored, "restored": restored}) + "\n")


def test_operator_killed_mid_inplace_restart_resumes_from_status(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, spare: str, tmp_path: Path) -> None:
    name, storage = unique_name("inplace-op"), tmp_path / "ckpt"
    start(jobs, name, storage)
    pod0 = f"{name}-g1-s0-h0"
    sampler = Sampler(jobs, name)
    sampler.start()
    before = pod_ids(jobs, name)
    lost = f"{name}-g1-s1-h1"
    fault = time.time()
    cluster.kill_node(before[lost][1])
    try:
        seen = jobs.wait_status(name, lambda s: bool(s.get("inPlace")), 300, "an in-place restart under way")
        operator.kill(signal.SIGKILL)  # mid-restart: the status is all the next operator has
        time.sleep(3)
        operator.start()
        status = finish(jobs, name, pod0, 2)
    finally:
        sampler.stop.set()
        sampler.join(timeout=10)
    print_timeline(jobs, name, operator, fault)
    print(f"\noperator killed in phase {seen['inPlace']['phase']}; restart finished: {status.get('workerPods')}")
    after = pod_ids(jobs, name)
    assert {n: after.get(n) for n in before if n != lost} == {n: v for n, v in before.items() if n != lost}
    assert sorted(set(after) - set(before)) == [f"{name}-g2-s1-h1"], after
    assert status["inPlaceRestarts"] == 1 and status["generation"] == 2, status
    records = losses(jobs, name)
    assert_redone_steps_match(records, 1, 2)
    assert sampler.samples >= 10 and not sampler.violations, sampler.violations[:3]


@dataclasses.dataclass
class ShrinkGrowRun:
    """What the hard-loss shrink and grow-back flow saw, at the moment each thing is asserted on:
    test_a_shrink_and_its_grow_back_keep_the_surviving_slices_pods (here) and
    test_op_e2e_history.py::test_hard_node_loss_shrinks_then_grows_back_and_the_history_tells_it assert
    on the same run, each its own asserts."""

    name: str
    storage: Path
    supervised: list[str | None]
    before: dict[str, tuple[str, str]]
    count_at_start: int
    committed_before: int
    fault: float
    shrunk: dict[str, Any]
    gen1: dict[int, dict[str, Any]]
    gen2: dict[int, dict[str, Any]]
    loss_reasons: list[str]
    observed: tuple[int, float]
    goodput: dict[str, Any]
    goodput_first_step: float
    goodput_metrics: dict[str, float]
    grown: dict[str, Any]
    gen2_final: dict[int, dict[str, Any]]
    gen3: dict[int, dict[str, Any]]
    grow_reasons: list[str]
    metrics: str
    steps_lost_after: tuple[int, float]
    final_saves: list[str]
    checkpoint: dict[str, Any]
    history: list[dict[str, Any]]
    final_status: dict[str, Any]
    after: dict[str, tuple[str, str]]
    records: dict[int, dict[int, dict[str, Any]]]
    inplace_reasons: list[str]
    samples: int
    violations: list[dict[str, Any]]


def run_shrink_and_grow_back(operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster,
                             tmp_path: Path) -> ShrinkGrowRun:
    """2 slices, elastic 1..2 with growBack, in place (the default Auto, with a 60 s stop timeout), no
    spare: slice 1's host 1 is killed, the job shrinks to slice 0 in place (generation 2); the node
    comes back and the grow-back's final save restarts slice 0's kept trainers with slice 1's new pods
    (generation 3). A sampler records any moment with trainers of two generations alive."""
    from test_op_e2e_faults import ELASTIC, record_result, start_training, wait_generation

    name, storage = unique_name("shrink"), tmp_path / "ckpt"
    start_training(jobs, name, storage, elastic=ELASTIC, final_save_timeout=20,
                   recovery={"inPlace": "Auto", "inPlaceStopTimeoutSeconds": 60})
    supervised = [p["metadata"]["annotations"].get("resilax.dev/supervised") for p in jobs.pods(name)]
    pod0 = f"{name}-g1-s0-h0"
    sampler = Sampler(jobs, name)
    sampler.start()
    before = pod_ids(jobs, name)
    count_at_start = jobs.status(name)["shape"]["count"]
    victim = before[f"{name}-g1-s1-h1"][1]
    fault = time.time()
    committed_before = max(committed_steps(storage))
    try:
        cluster.kill_node(victim)
        shrunk = jobs.wait_status(name, lambda s: s.get("generation") == 2 and s.get("phase") == "Running"
                                  and not s.get("inPlace"), 600, "generation 2 Running in place on one slice")
        wait_generation(jobs, name, 2, count=1)  # and a step of generation 2
        gen1, gen2 = jobs.losses(name, 1), jobs.losses(name, 2)
        restored = min(gen2) - 1
        breakdown = recovery_breakdown(jobs, name, 2, fault, ("NodeLost", "NodeNotReady", "PodLost", "WorkerFailed"))
        record_result("hard_node_loss", breakdown, lost=max(gen1) - restored, restored=restored)
        loss_reasons = jobs.event_reasons(name, "NodeLost")
        observed = wait_for(lambda: steps_lost_observed(operator) if steps_lost_observed(operator)[0] >= 1 else None,
                            timeout=120, interval=1, message="resilax_operator_steps_lost observed for the recovery")

        def after_restore() -> dict[str, Any] | None:
            g = jobs.status(name).get("goodput") or {}
            current = (g.get("ledger") or {}).get("current") or {}
            return g if current.get("generation") == 2 and current.get("firstStep") is not None else None

        goodput = wait_for(after_restore, timeout=120, interval=1, message="status.goodput with generation 2's first step")
        goodput_first_step = min(r["time"] for r in jobs.losses(name, 2).values())
        metrics = wait_for(lambda: goodput_metrics(operator, name) or None, timeout=60, interval=1,
                           message="resilax_operator_goodput_* of the job")

        # The node comes back: growBack resizes up to 2 slices through a final save (0 steps lost).
        cluster.restore_node(victim)
        grown = finish(jobs, name, pod0, 3)
        wait_generation(jobs, name, 3, count=2)
    finally:
        cluster.restore_node(victim)
        sampler.stop.set()
        sampler.join(timeout=10)
    print_timeline(jobs, name, operator, fault)
    gen2_final, gen3 = jobs.losses(name, 2), jobs.losses(name, 3)
    grow_reasons = jobs.event_reasons(name, "GrowBack")
    metrics_text = operator.metrics()
    steps_lost_after = wait_for(
        lambda: steps_lost_observed(operator) if steps_lost_observed(operator)[0] >= 2 else None,
        timeout=120, interval=1, message="resilax_operator_steps_lost observed for the grow-back")
    final_saves = [e["message"] for e in jobs.events(name) if e["reason"] == "FinalSaveDone"]
    checkpoint = jobs.status(name)["checkpoint"]

    def told() -> list[dict[str, Any]] | None:
        h = jobs.status(name).get("history") or []
        return h if len(h) == 3 and "restoredStep" in h[2] and "firstStep" in h[2] else None

    history = wait_for(told, timeout=120, interval=1, message="status.history with generation 3's restore")
    return ShrinkGrowRun(
        name=name, storage=storage, supervised=supervised, before=before, count_at_start=count_at_start,
        committed_before=committed_before, fault=fault, shrunk=shrunk, gen1=gen1, gen2=gen2,
        loss_reasons=loss_reasons, observed=observed, goodput=goodput, goodput_first_step=goodput_first_step,
        goodput_metrics=metrics, grown=grown, gen2_final=gen2_final, gen3=gen3, grow_reasons=grow_reasons,
        metrics=metrics_text, steps_lost_after=steps_lost_after, final_saves=final_saves, checkpoint=checkpoint,
        history=history, final_status=jobs.status(name), after=pod_ids(jobs, name), records=losses(jobs, name),
        inplace_reasons=jobs.event_reasons(name, "GrowBack", "FinalSaveDone", "RestartingInPlace"),
        samples=sampler.samples, violations=sampler.violations)


def shrink_and_grow_back(shared_runs: dict[str, Any], request: pytest.FixtureRequest) -> ShrinkGrowRun:
    """The shrink and grow-back flow, run once a session (CI time: two tests assert on it): the first
    test that needs it runs it under its own operator, namespace and tmp_path; a failed run fails the
    other test too, naming the first."""
    key = "shrink-and-grow-back"
    if key not in shared_runs:
        try:
            shared_runs[key] = run_shrink_and_grow_back(request.getfixturevalue("operator"), request.getfixturevalue("jobs"),
                                                        request.getfixturevalue("cluster"), request.getfixturevalue("tmp_path"))
        except Exception as e:
            shared_runs[key] = f"the shared shrink and grow-back run failed in {request.node.nodeid}: {e!r}"
            raise
    run = shared_runs[key]
    if isinstance(run, str):
        pytest.fail(run, pytrace=False)
    return run


@pytest.mark.cluster
def test_a_shrink_and_its_grow_back_keep_the_surviving_slices_pods(shared_runs: dict[str, Any],
                                                                   request: pytest.FixtureRequest) -> None:
    """No spare: a hard loss in slice 1 shrinks the job to slice 0 in place; when the node returns, the
    grow-back's final save stops slice 0's trainers, which are kept again: only slice 1's pods are new,
    and generation 3 starts from the final save (no step lost). The flow is shared with the history
    test (`shrink_and_grow_back`)."""
    run = shrink_and_grow_back(shared_runs, request)
    name, before, shrunk, status = run.name, run.before, run.shrunk, run.grown
    assert run.supervised == ["1"] * 4, run.supervised
    assert run.count_at_start == 2, run.count_at_start  # both slices at the start
    slice0 = {n: v for n, v in before.items() if "-g1-s0-" in n}
    assert shrunk["shape"]["count"] == 1 and shrunk["workerPods"] == sorted(slice0), shrunk
    assert run.records.get(2), "a step of generation 2"
    after = run.after
    assert {n: after.get(n) for n in slice0} == slice0  # the same pods on the same nodes, all along
    assert status["workerPods"] == [*sorted(slice0), f"{name}-g3-s1-h0", f"{name}-g3-s1-h1"], status
    assert status["inPlaceRestarts"] == 2 and status["restarts"] == 2, status
    records = run.records
    assert min(records[3]) - 1 == max(records[2])  # the grow-back's final save: nothing trained twice
    assert all(r["devices"] == 8 for r in records[3].values())
    assert run.samples >= 10 and not run.violations, run.violations[:3]
    reasons = run.inplace_reasons
    grow = reasons.index("GrowBack")
    assert "FinalSaveDone" in reasons[grow:] and "RestartingInPlace" in reasons[grow:], reasons
    assert "GenerationCreated" not in reasons[grow:], reasons
