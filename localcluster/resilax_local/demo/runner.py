"""`resilax demo`: a JAXJob on the local cluster loses a node, recovers on one slice and grows back.

Steps (each shown as it happens):
  1. start the local cluster (default profile: 2 TPU slices of 2 hosts + cpu-0) in `<run-dir>/cluster`;
  2. apply the CRDs, create the operator's ServiceAccount, ClusterRole (charts/resilax/files/
     operator-rules.yaml) and binding, and start `resilax operator` as a process with that
     ServiceAccount's token, as the chart runs it (all namespaces, kopf peering);
  3. apply examples/jaxjob-demo.yaml (2 slices, elastic 1..2, growBack) with its checkpoints in
     `<run-dir>/ckpt`;
  4. once it trains, kill a node that hosts a worker; wait until it runs again on 1 slice;
  5. restore the node; wait until it runs on 2 slices again; wait until it Succeeded;
  6. write `timeline.txt` and `loss.png` (timeline.py builds both from what was recorded), stop the
     operator and the cluster (also on Ctrl-C and errors; `--keep` leaves the cluster up).
Exit code 0 when every step happened, 1 otherwise, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from resilax_operator import api

from ..controlplane.rbac import build_operator_rbac
from ..processes import stop_process_group
from .examples import EXAMPLES, prepare_job, steps_problem
from .outputs import render_plot, say, write_run_outputs
from .timeline import (
    Fault,
    JobSnapshot,
    LossRecord,
    TimelineEvent,
    build_generations,
    merge_loss_records,
    parse_event,
    parse_loss_lines,
    parse_snapshot,
)

log = logging.getLogger(__name__)

__all__ = ["Demo", "DemoError", "main", "render_plot", "say", "stop_process_group"]

# The files the demo needs ship inside the package (links to examples/ and charts/resilax/ in a checkout,
# copies in a wheel), so `resilax demo` runs from an installed wheel as from the repository.
FILES = Path(__file__).resolve().parent / "files"
JOB_FILE = FILES / "jaxjob-demo.yaml"
CRD_DIR = FILES / "crds"
RULES_FILE = FILES / "operator-rules.yaml"
OPERATOR_NAMESPACE = "resilax-system"
OPERATOR_NAME = "resilax-operator"
PEERING = "resilax"
JOB_NAMESPACE = "default"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# growBack waits for a generation to have run this long; the demo shortens the default 60 s
# (the chart's operator.env sets it the same way).
GROW_BACK_SETTLE_SECONDS = 30


class DemoError(RuntimeError):
    """A step of the demo did not happen in time, or something it needs is missing."""


class Demo:
    """One run of the demo in `run_dir`; `run()` drives it, `finish()` always runs afterwards."""

    def __init__(self, run_dir: Path, timeout: float, fault_step: int, keep: bool, dwell_steps: int = 30,
                 example: str = "train", steps: int | None = None) -> None:
        self.run_dir = run_dir
        self.example = example
        self.steps = steps
        self.dwell_steps = dwell_steps
        self.keep = keep
        self.fault_step = fault_step
        self.start = time.time()
        self.deadline = time.monotonic() + timeout
        self.cluster: Any = None
        self.client: Any = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.job_name = "demo"
        self.snapshots: list[JobSnapshot] = []
        self.faults: list[Fault] = []
        self.notes: list[TimelineEvent] = []
        self.events: dict[str, TimelineEvent] = {}
        self.records: list[LossRecord] = []
        self.outcome: dict[str, Any] = {"recovered_smaller": False, "grew_back": False, "succeeded": False}
        self._last_line: tuple[Any, ...] | None = None
        self._last_print = 0.0
        #: The job's last status.goodput seen (the operator's goodput account).
        self.goodput: dict[str, Any] | None = None

    # ---- the story ------------------------------------------------------------------------------
    def run(self) -> None:
        self.start_cluster()
        self.install_operator()
        self.apply_job()

        say(f"\n==> waiting for the job to run and train past step {self.fault_step}")
        first = self.wait_until(lambda s: s.phase == "Running" and self.last_step() >= self.fault_step,
                                "the job Running past step " + str(self.fault_step))
        node = self.pick_victim(first.generation)
        say(f"\n==> killing node {node} (hard loss: its Lease stops, its processes are SIGKILLed)")
        self.cluster.kill_node(node)
        self.faults.append(Fault(time.time(), "kill-node", node))

        say("==> waiting for the operator to recover the job on what is left (node Unknown after ~16 s, "
            "then nodeLossGraceSeconds)")
        shrunk = self.wait_until(
            lambda s: (s.phase == "Running" and (s.generation or 0) > (first.generation or 0)
                       and (s.count or 0) < (first.count or 0) and self.trained_by(s.generation)),
            "the job Running again on fewer slices")
        self.outcome["recovered_smaller"] = True
        gen = self.generation_summary(shrunk.generation)
        say(f"==> recovered: generation {shrunk.generation} on {describe(shrunk)}, restored step "
            f"{gen.restored_step if gen else '?'}, {self.devices_of(first.generation)} -> "
            f"{self.devices_of(shrunk.generation)} devices (state resharded)")

        restored = gen.restored_step if gen else 0
        say(f"\n==> letting it train {self.dwell_steps} steps on the smaller shape")
        self.wait_until(lambda s: self.last_step() >= restored + self.dwell_steps,
                        f"{self.dwell_steps} steps on the smaller shape")
        say(f"\n==> restoring node {node} (capacity returns; growBack after the generation ran "
            f"{GROW_BACK_SETTLE_SECONDS} s)")
        self.cluster.restore_node(node)
        self.faults.append(Fault(time.time(), "restore-node", node))
        grown = self.wait_until(
            lambda s: ((s.generation or 0) > (shrunk.generation or 0) and (s.count or 0) >= (first.count or 0)
                       and (self.trained_by(s.generation) or s.phase == "Succeeded")),
            "the job on 2 slices again")
        self.outcome["grew_back"] = True
        gen = self.generation_summary(grown.generation)
        say(f"==> grew back: generation {grown.generation} on {describe(grown)}, restored step "
            f"{gen.restored_step if gen else '?'}, {self.devices_of(grown.generation)} devices")

        say("\n==> waiting for the job to finish")
        end = self.wait_until(lambda s: s.phase in ("Succeeded", "Failed"), "the job Succeeded")
        if end.phase != "Succeeded":
            raise DemoError(f"the job ended {end.phase}: {end.message}")
        self.outcome["succeeded"] = True
        say("==> the job Succeeded")

    # ---- set-up -----------------------------------------------------------------------------------
    def start_cluster(self) -> None:
        from resilax_local import LocalCluster
        from resilax_local.binaries import ensure_binaries

        say("==> binaries (Kubernetes, etcd): found in the cache or built now (a cold build takes ~30 min)")
        ensure_binaries()
        say(f"==> starting the local cluster in {self.run_dir / 'cluster'} "
            "(2 TPU slices tpu-v5-lite-podslice 2x4 of 2 hosts each + cpu-0)")
        self.cluster = LocalCluster(self.run_dir / "cluster", profile="default")
        self.cluster.start(timeout=max(60.0, min(300.0, self.remaining())))
        self.client = self.cluster.client()
        self.note("setup", f"local cluster up ({len(self.cluster.nodes())} nodes)")
        for node in self.cluster.nodes():
            say(f"    node {node['name']:<16} {node.get('state', '')}")
        say(f"    export KUBECONFIG={self.cluster.kubeconfig}")

    def install_operator(self) -> None:
        from resilax_local.errors import KubeAPIError

        say(f"==> applying the CRDs from {CRD_DIR}")
        names = []
        for path in sorted(CRD_DIR.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    self.create(CRD_PATH, doc)
                    names.append(doc["metadata"]["name"])
        self.poll_until(lambda: all(self.crd_established(n) for n in names), "the CRDs Established", 60)
        say(f"    {', '.join(names)} Established")

        say(f"==> operator RBAC: ServiceAccount {OPERATOR_NAMESPACE}/{OPERATOR_NAME}, ClusterRole from "
            f"{RULES_FILE.name}")
        rules = yaml.safe_load(RULES_FILE.read_text())
        self.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                           "metadata": {"name": OPERATOR_NAMESPACE}})
        account, role, binding = build_operator_rbac(OPERATOR_NAMESPACE, OPERATOR_NAME, OPERATOR_NAME, rules)
        self.create(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts", account)
        self.create("/apis/rbac.authorization.k8s.io/v1/clusterroles", role)
        self.create("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)
        try:
            self.create("/apis/kopf.dev/v1/clusterkopfpeerings",
                        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": PEERING}})
        except KubeAPIError as e:  # the peering CRD is optional for the demo
            log.warning("could not create the kopf peering object: %s", e)
        kubeconfig = self.cluster.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_NAME,
                                                             path=self.run_dir / "operator-kubeconfig")
        log_path = self.run_dir / "operator.log"
        resilax = shutil.which("resilax") or str(Path(sys.executable).with_name("resilax"))
        argv = [resilax, "operator", "--all-namespaces", f"--peering={PEERING}", f"--kubeconfig={kubeconfig}"]
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_ID": "resilax-demo-operator",
               "RESILAX_OPERATOR_GROW_BACK_SETTLE_SECONDS": str(GROW_BACK_SETTLE_SECONDS),
               "PYTHONUNBUFFERED": "1"}
        say(f"==> starting the operator with the ServiceAccount's token: {' '.join(argv[1:4])} "
            f"(log: {log_path})")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            self.operator = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             env=env, cwd=self.run_dir, start_new_session=True)
        time.sleep(3)
        self.check_operator()
        self.note("setup", f"operator started (pid {self.operator.pid}, ServiceAccount {OPERATOR_NAME})")

    def apply_job(self) -> None:
        ckpt = self.run_dir / "ckpt"
        ckpt.mkdir(parents=True, exist_ok=True)
        job = prepare_job(yaml.safe_load(JOB_FILE.read_text()), JOB_NAMESPACE, str(ckpt), str(FILES), self.example,
                          self.steps)
        self.job_name = job["metadata"]["name"]
        (self.run_dir / "jaxjob.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
        say(f"\n==> applying {JOB_FILE.name} as {JOB_NAMESPACE}/{self.job_name} "
            f"(checkpoints in {ckpt})")
        self.create(self.job_path(collection=True), job)
        self.note("setup", f"JAXJob {JOB_NAMESPACE}/{self.job_name} applied")

    def note(self, kind: str, text: str) -> None:
        self.notes.append(TimelineEvent(time.time(), kind, text))

    # ---- observing ---------------------------------------------------------------------------------
    def job_path(self, collection: bool = False) -> str:
        base = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{JOB_NAMESPACE}/{api.PLURAL}"
        return base if collection else f"{base}/{self.job_name}"

    def observe(self) -> JobSnapshot:
        """One poll: the job, its events, the loss lines; prints a progress line when something changed."""
        self.check_operator()
        body = self.client.get(self.job_path())
        snap = parse_snapshot(time.time(), body)
        self.goodput = (body.get("status") or {}).get("goodput") or self.goodput
        prev = self.snapshots[-1] if self.snapshots else None
        if prev is None or _key(prev) != _key(snap):
            self.snapshots.append(snap)
        self.read_events()
        self.read_losses()
        self.print_progress(snap)
        return snap

    def read_losses(self) -> None:
        pods = self.cluster.run_dir / "pods" / JOB_NAMESPACE
        found: list[LossRecord] = []
        for path in pods.glob(f"{self.job_name}-g*/logs/{api.TRAINER_CONTAINER}/*.log"):
            with contextlib.suppress(OSError):
                found += parse_loss_lines(path.read_text(errors="replace"))
        self.records = merge_loss_records(found)

    def read_events(self) -> None:
        from resilax_local.errors import KubeAPIError

        try:
            items = self.client.get(f"/api/v1/namespaces/{JOB_NAMESPACE}/events",
                                    fieldSelector=f"involvedObject.name={self.job_name}").get("items", [])
        except KubeAPIError:
            return
        for item in items:
            uid = item.get("metadata", {}).get("uid", "")
            event = parse_event(item)
            if event is not None and uid:
                self.events[uid] = event

    def print_progress(self, s: JobSnapshot) -> None:
        key = _key(s)
        now = time.monotonic()
        if key == self._last_line and now - self._last_print < 15:
            return
        if self._last_line is None:
            say(f"    {'TIME':>7}  {'PHASE':<11} {'TOPOLOGY':<8} {'COUNT':>5} {'GEN':>3} {'CKPT-STEP':>9} "
                f"{'RESTARTS':>8}  {'TRAINED':>7} {'DEVICES':>7}")
        self._last_line, self._last_print = key, now
        last = self.records[-1] if self.records else None
        say(f"    {time.time() - self.start:>6.0f}s  {s.phase:<11} {s.topology or '-':<8} "
            f"{_dash(s.count):>5} {_dash(s.generation):>3} {_dash(s.checkpoint_step):>9} {s.restarts:>8}  "
            f"{_dash(last.step if last else None):>7} {_dash(last.devices if last else None):>7}")

    def last_step(self) -> int:
        return max((r.step for r in self.records), default=0)

    def trained_by(self, generation: int | None) -> bool:
        return any(r.generation == generation for r in self.records)

    def devices_of(self, generation: int | None) -> str:
        devices = {r.devices for r in self.records if r.generation == generation}
        return "/".join(str(d) for d in sorted(devices)) or "?"

    def generation_summary(self, generation: int | None) -> Any:
        return next((g for g in build_generations(self.records) if g.generation == generation), None)

    def pick_victim(self, generation: int | None) -> str:
        """The node of the last worker (highest slice and host) of `generation`."""
        selector = f"{api.LABEL_JOB}={self.job_name},{api.LABEL_GENERATION}={generation}"
        pods = self.client.get(f"/api/v1/namespaces/{JOB_NAMESPACE}/pods", labelSelector=selector)["items"]
        nodes = sorted((p["metadata"]["name"], p["spec"].get("nodeName")) for p in pods if p["spec"].get("nodeName"))
        if not nodes:
            raise DemoError(f"no worker pod of generation {generation} is bound to a node")
        return str(nodes[-1][1])

    # ---- waiting -------------------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def wait_until(self, done: Callable[[JobSnapshot], bool], what: str) -> JobSnapshot:
        while True:
            snap = self.observe()
            if done(snap):
                return snap
            if self.remaining() <= 0:
                raise DemoError(f"timed out waiting for {what}; the job is {snap.phase} "
                                f"({snap.message or 'no message'}), generation {snap.generation}, "
                                f"shape {describe(snap)}")
            if snap.phase == "Failed" and "Succeeded" not in what:
                raise DemoError(f"the job Failed while waiting for {what}: {snap.message}")
            time.sleep(1.0)

    def poll_until(self, done: Callable[[], bool], what: str, seconds: float) -> None:
        deadline = time.monotonic() + min(seconds, max(self.remaining(), 1.0))
        while not done():
            if time.monotonic() > deadline:
                raise DemoError(f"timed out waiting for {what}")
            time.sleep(0.5)

    def crd_established(self, name: str) -> bool:
        crd = self.client.get(f"{CRD_PATH}/{name}")
        return any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])

    def create(self, path: str, body: dict[str, Any]) -> None:
        from resilax_local.errors import KubeAPIError

        try:
            self.client.create(path, body)
        except KubeAPIError as e:
            if e.status != 409:
                raise

    def check_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is not None:
            tail = _tail(self.run_dir / "operator.log", 30)
            raise DemoError(f"the operator exited with code {self.operator.returncode}; its log ends:\n{tail}")

    # ---- the end -------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Write what was recorded, then stop the operator and (unless --keep) the cluster."""
        if self.cluster is not None and self.client is not None:
            with contextlib.suppress(Exception):
                self.observe_quietly()
        with contextlib.suppress(Exception):
            self.write_outputs()
        if self.operator is not None:
            say(f"==> stopping the operator (pid {self.operator.pid})")
            stop_process_group(self.operator)
        if self.cluster is not None:
            if self.keep:
                say(f"==> leaving the cluster up (--keep): export KUBECONFIG={self.cluster.kubeconfig}\n"
                    f"    the operator is stopped; run it again with: resilax operator --all-namespaces "
                    f"--peering={PEERING} --kubeconfig={self.run_dir / 'operator-kubeconfig'}\n"
                    f"    stop the cluster with: resilax local down --dir {self.cluster.run_dir}")
            else:
                say("==> stopping the local cluster")
                self.cluster.stop()

    def observe_quietly(self) -> None:
        body = self.client.get(self.job_path())
        snap = parse_snapshot(time.time(), body)
        self.goodput = (body.get("status") or {}).get("goodput") or self.goodput
        if not self.snapshots or _key(self.snapshots[-1]) != _key(snap):
            self.snapshots.append(snap)
        self.read_events()
        self.read_losses()

    def write_outputs(self) -> None:
        lines = write_run_outputs(self.run_dir, self.job_name, self.start, self.snapshots, self.faults, self.records,
                                  self.events, self.notes, self.goodput, self.outcome)
        say("")
        for line in lines:
            say(line)


def describe(s: JobSnapshot) -> str:
    return f"{_dash(s.count)} x {s.topology or '-'}"


def _key(s: JobSnapshot) -> tuple[Any, ...]:
    return (s.phase, s.generation, s.topology, s.count, s.checkpoint_step, s.restarts, s.transition)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resilax demo", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="folder for the cluster, logs, checkpoints, timeline.txt and loss.png "
                             "(default: ~/.cache/resilax/demo/run-<time>)")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="give up after this many seconds (default 1200)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster (and its job) up at the end")
    parser.add_argument("--fault-step", type=int, default=25, help="kill the node once the job trained this step")
    parser.add_argument("--dwell-steps", type=int, default=30,
                        help="steps to train on the smaller shape before the node comes back")
    parser.add_argument("--steps", type=int, default=None, help="steps the job trains (default: the job "
                        "file's 300); leave room for the story after --fault-step and --dwell-steps")
    parser.add_argument("--example", choices=sorted(EXAMPLES), default="train",
                        help="the job's training script: train (examples/train.py, a small MLP) or transformer "
                             "(examples/transformer.py, its cpu-tiny preset)")
    return parser


#: The file that marks a folder as a demo run's own (only such a folder is ever cleared).
RUN_DIR_MARKER = ".resilax-demo-run"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = steps_problem(args.steps, args.fault_step, args.dwell_steps)
    if problem is not None:
        print(f"resilax demo: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="    %(message)s")
    from resilax_local.launch import isolation_problem

    if args.run_dir is None:
        from resilax_local.binaries import cache_dir

        args.run_dir = cache_dir() / "demo" / time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = args.run_dir.resolve()
    if run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / RUN_DIR_MARKER).is_file():
        print(f"resilax demo: --run-dir {run_dir} is not empty and was not made by a demo run; the demo "
              "never deletes a folder it did not create: name a new or empty folder", file=sys.stderr)
        return 2
    problem = isolation_problem()  # the demo's cluster runs pods as `local up` does: ask before starting
    if problem is not None:
        print(f"resilax demo: {problem}", file=sys.stderr)
        return 1
    if run_dir.exists() and any(run_dir.iterdir()):
        shutil.rmtree(run_dir)  # a previous demo run's folder (it carries the marker)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_DIR_MARKER).write_text("a resilax demo run folder; `resilax demo` may clear it\n")
    say(f"==> resilax demo: run folder {run_dir}")
    demo = Demo(run_dir, timeout=args.timeout, fault_step=args.fault_step, keep=args.keep,
                dwell_steps=args.dwell_steps, example=args.example, steps=args.steps)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C interrupts the demo even when started from a shell that ignores SIGINT in background jobs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    try:
        demo.run()
    except KeyboardInterrupt:
        say("\n==> interrupted: cleaning up")
        code = 130
    except Exception as e:  # every failure still cleans up and says where the logs are
        say(f"\n==> demo failed: {e}")
        (run_dir / "demo-error.txt").write_text(traceback.format_exc())
        code = 1
    finally:
        # A second Ctrl-C must not leave processes behind: ignore it while cleaning up.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            demo.finish()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)
    ok = all(demo.outcome.get(k) for k in ("recovered_smaller", "grew_back", "succeeded", "continuous", "png"))
    say("\n==> outcome: " + ", ".join(f"{k} {'yes' if demo.outcome.get(k) else 'NO'}"
                                       for k in ("recovered_smaller", "grew_back", "succeeded", "continuous")))
    say(f"==> logs and results in {run_dir}:")
    for name, what in (("timeline.txt", "the timeline above"),
                       ("loss.png", "loss against step per generation" if demo.outcome.get("png") else "(not written)"),
                       ("operator.log", "the operator"), ("cluster/logs/", "control plane and node agent"),
                       ("cluster/pods/", "every pod's logs: <namespace>/<pod>-<uid>/logs/<container>/<n>.log"),
                       ("ckpt/", "the checkpoints"), ("demo-error.txt", "why the demo failed"), ("result.json", "the outcome, machine-readable")):
        if name != "demo-error.txt" or (run_dir / name).exists():
            say(f"    {name:<14} {what}")
    if code == 0 and not ok:
        code = 1
    return code
