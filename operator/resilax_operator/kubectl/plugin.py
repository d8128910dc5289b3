"""`kubectl resilax` (the `kubectl-resilax` executable) and `resilax job`: a JAXJob at a glance.

    kubectl resilax status NAME [-n NAMESPACE]    phase, generation, shape, step, saved step, goodput, last fault
    kubectl resilax goodput NAME [-n NAMESPACE]   where the job's wall time went (status.goodput)
    kubectl resilax timeline NAME [--png FILE]    its generations on a time axis (status.history): shapes,
                                                  faults, checkpoints; --png draws the picture (matplotlib)
    kubectl resilax save NAME [--timeout S]       ask a worker's sidecar for a save, wait for its commit
    kubectl resilax rotate-token NAME             a new sidecar token: delete its Secret, the operator writes a new one
    kubectl resilax suspend NAME [-n NAMESPACE]   spec.suspend=true: final save, then no workers
    kubectl resilax resume NAME [-n NAMESPACE]    spec.suspend=false: a new generation restores the newest step
    kubectl resilax rollback NAME --step N        save the current step, then a new generation restores N
    kubectl resilax web FILE [-n NS | -A]         write a static HTML page with every job's timeline
    kubectl resilax list [-n NAMESPACE | -A]      the jobs: phase, generation, shape, saved step, goodput
    kubectl resilax logs NAME [-f] [--process N]  the trainer log of process N (default 0); -f follows it
                                                  across generations until the job ends
    kubectl resilax version                       this plugin's version and the JAXJob API it speaks

The read commands (status, goodput, timeline, list, version) take `-o json|yaml` for programs
(kubectl/output.py).

Shell completion (kubectl 1.26+): kubectl asks the `kubectl_complete-resilax` executable, installed beside
`kubectl-resilax`, for the words that may follow (Cobra's `__complete` protocol: one per line, then
`:<directive>`): the commands, then the namespace's JAXJobs, or its namespaces after `-n`.

Everything comes from the JAXJob itself (its status, which the operator keeps) and its Events; suspend
and resume patch `spec.suspend` (a JSON merge patch), as Kueue does, rollback `spec.checkpoint.restore.step`
(kubectl/rollback.py); save goes through the API server's
pod proxy to the sidecar of the current generation's first worker, with the job's token read from its
Secret and sent in the sidecar's own header (never printed). The kubeconfig is kubectl's (`--kubeconfig`,
else `$KUBECONFIG`, else `~/.kube/config`; `--context`); the namespace is `-n`, else the context's, else
`default`. The RBAC each command needs: kubectl/client.py and docs/operations.md.

The screens are pure functions of the job and its events (`build_status_screen`, `build_goodput_screen`,
timeline.build_gantt, timeline_page.build_page; `plan_save_target`, `describe_save`), tested apart from
the API; kubectl/client.py makes the calls.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
import unicodedata
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .. import api
from ..ownership import owner_uid
from ..status import BREAKDOWN_KEYS
from ..status_fields import goodput as gp
from .client import JobAPI, PluginError
from .logs import run_logs
from .output import (
    OUTPUT_FORMATS,
    build_goodput_data,
    build_list_data,
    build_list_screen,
    build_status_data,
    build_timeline_data,
    build_version_data,
    render,
)
from .rollback import run_rollback
from .timeline import build_gantt, build_plot, parse_history, parse_time
from .timeline_page import build_page, build_page_data

#: Exit codes: 0 done, 1 the API refused or the job is missing, 2 usage.
EXIT_ERROR = 1

COMMANDS = ("status", "goodput", "timeline", "save", "rotate-token", "suspend", "resume", "rollback", "web",
            "list", "version", "logs")
#: The commands that only read, which take `-o json|yaml`; those that need no job name.
READ_COMMANDS = ("status", "goodput", "timeline", "list", "version")
NAMELESS_COMMANDS = ("list", "version")
#: Flags that take a value (`-n NS` or `--namespace=NS`).
VALUE_FLAGS = ("-n", "--namespace", "--kubeconfig", "--context", "--png", "--timeout", "-o", "--output",
               "--process", "--step")
#: Flags whose value is a file name.
FILE_FLAGS = ("--png",)
#: Cobra's ShellCompDirectiveNoFileComp: no file names when nothing matches; Default: the shell's files.
NO_FILE_COMPLETION = 4
FILE_COMPLETION = 0
#: How long `save` waits for the commit, and how often it asks.
SAVE_TIMEOUT_SECONDS = 300.0
SAVE_POLL_SECONDS = 1.0


# ---- pure: the screens ---------------------------------------------------------------------------


def escape_controls(text: str, keep_newlines: bool = False) -> str:
    """`text` with every control or format character (Unicode category C: ESC, CR, DEL, C1, bidi
    overrides) written as a Python escape, so a message from the cluster (an event, a transition, an
    error a sidecar sent) can move no cursor and recolour no terminal. `keep_newlines`: a screen's own
    line breaks stay."""
    def one(ch: str) -> str:
        if (keep_newlines and ch == "\n") or not unicodedata.category(ch).startswith("C"):
            return ch
        return ascii(ch)[1:-1]
    return "".join(map(one, text))


def _age(then: datetime | None, now: datetime) -> str:
    """`42s`, `7m3s`, `2h5m`, `3d4h` (kubectl's style); `-` when unknown."""
    if then is None:
        return "-"
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600}h"


def last_fault(status: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> str:
    """The transition in progress (or the in-place restart it became), else the newest Warning event,
    else `none`."""
    transition = status.get("transition")
    if isinstance(transition, Mapping) and transition.get("kind"):
        message = escape_controls(str(transition.get("message") or ""))
        return escape_controls(f"{transition['kind']} (in progress, generation {transition.get('generation')}): "
                               f"{message}".rstrip(": "))
    in_place = status.get("inPlace")
    if isinstance(in_place, Mapping) and in_place.get("kind"):  # a rollback's says no Warning event
        message = escape_controls(str(in_place.get("message") or ""))
        return escape_controls(f"{in_place['kind']} (in progress in place, generation {in_place.get('from')} -> "
                               f"{in_place.get('generation')}): {message}".rstrip(": "))
    warnings = [e for e in events if e.get("type") == "Warning"]
    if not warnings:
        return "none"
    newest = max(warnings, key=lambda e: parse_time(_event_time(e)) or datetime.min.replace(tzinfo=UTC))
    return escape_controls(f"{newest.get('reason')} at {_event_time(newest) or '?'}: "
                           f"{newest.get('message') or ''}".rstrip(": "))


def _event_time(event: Mapping[str, Any]) -> str | None:
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        value = event.get(key)
        if isinstance(value, str) and value:
            return value
    metadata = event.get("metadata") or {}
    created = metadata.get("creationTimestamp")
    return created if isinstance(created, str) else None


def build_status_screen(job: Mapping[str, Any], events: Sequence[Mapping[str, Any]], now: datetime) -> str:
    """One screen: phase, generation, shape, the step reached and the one saved, goodput, the last fault.
    The step reached is the one the operator last recorded (status.goodput's ledger, refreshed with every
    status change and at least every `goodputStatusSeconds` while the trainer steps)."""
    meta = job.get("metadata") or {}
    spec = job.get("spec") or {}
    status = job.get("status") or {}
    shape = status.get("shape") or {}
    checkpoint = status.get("checkpoint") or {}
    goodput = status.get("goodput") or {}
    current = (goodput.get("ledger") or {}).get("current") or {}
    phase = status.get("phase") or api.PHASE_PENDING
    if spec.get("suspend") and phase != api.PHASE_SUSPENDED:
        phase += " (suspend requested)"
    rows = [
        ("JAXJob", f"{meta.get('namespace')}/{meta.get('name')}"),
        ("Phase", phase),
        ("Generation", f"{status.get('generation', 0)} (started {_age(parse_time(status.get('generationStartTime')), now)} ago)"
         if status.get("generationStartTime") else str(status.get("generation", 0))),
        ("Shape", f"{shape.get('count')} x {shape.get('topology')} ({shape.get('hosts')} hosts)" if shape else "-"),
        ("Step", f"{current['lastStep']} (as of {_age(parse_time(goodput.get('asOf')), now)} ago)"
         if current.get("lastStep") is not None else "-"),
        ("Saved step", (f"{checkpoint.get('step')} ({checkpoint.get('tier') or 'persistent'}, "
                        f"{_age(parse_time(checkpoint.get('time')), now)} ago)") if checkpoint else "none"),
        ("Goodput", (f"{100 * float(goodput['ratio']):.1f}% of {float(goodput.get('wallSeconds') or 0):.0f} s"
                     if goodput.get("ratio") is not None else "-")),
        ("Restarts", str(status.get("restarts", 0))),
        ("Last fault", last_fault(status, events)),
    ]
    kept_out = [n for n in status.get("unhealthyNodes") or [] if isinstance(n, Mapping) and n.get("node")]
    if kept_out:  # failed the health check (spec.recovery.healthCheck): no new worker goes there
        rows.append(("Kept out", ", ".join(f"{n['node']} ({n.get('part')}, {n.get('failures', 1)}x)" for n in kept_out)))
    spares = status.get("spares")
    if isinstance(spares, Mapping):  # spec.recovery.spareSlices: placeholders holding slices for the job
        where = f" on {', '.join(spares.get('pools') or [])}" if spares.get("pools") else ""
        why = f" ({spares['message']})" if spares.get("message") else ""
        rows.append(("Spares", f"{spares.get('ready', 0)}/{spares.get('desired', 0)} ready{where}{why}, "
                               f"{spares.get('takenTotal', 0)} taken"))
    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    if conditions:
        rows.append(("Conditions", ", ".join(f"{c.get('type')} ({c.get('reason')})" for c in conditions)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in rows)


def build_goodput_screen(job: Mapping[str, Any]) -> str:
    """status.goodput as a table: each bucket's seconds and share of the wall time."""
    meta = job.get("metadata") or {}
    goodput = (job.get("status") or {}).get("goodput")
    name = f"{meta.get('namespace')}/{meta.get('name')}"
    if not isinstance(goodput, Mapping) or goodput.get("ratio") is None:
        return f"{name}: no goodput yet (the operator fills status.goodput once a generation was created)"
    wall = float(goodput.get("wallSeconds") or 0.0)
    breakdown = goodput.get("breakdown") or {}
    device = goodput.get("deviceRatio")
    weighted = f", {100 * float(device):.1f}% device-weighted" if isinstance(device, int | float) else ""
    lines = [f"{name}: goodput {100 * float(goodput['ratio']):.1f}% of {wall:.0f} s wall time{weighted} "
             f"(as of {goodput.get('asOf')}; {goodput.get('lostSteps', 0)} steps trained again)",
             f"{'BUCKET':<20} {'SECONDS':>10} {'SHARE':>7}"]
    for bucket in gp.BUCKETS:
        seconds = float(breakdown.get(BREAKDOWN_KEYS[bucket]) or 0.0)
        share = 100 * seconds / wall if wall else 0.0
        lines.append(f"{BREAKDOWN_KEYS[bucket]:<20} {seconds:>10.1f} {share:>6.1f}%")
    return "\n".join(lines)


def build_suspend_patch(suspend: bool) -> dict[str, Any]:
    """The JSON merge patch of suspend (True) or resume (False)."""
    return {"spec": {"suspend": suspend}}


def _sidecar_port(pod: Mapping[str, Any]) -> int | None:
    """The sidecar's port on a worker pod: its container's port named `sidecar`."""
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if container.get("name") != api.SIDECAR_CONTAINER:
            continue
        for port in container.get("ports") or []:
            if port.get("name") == "sidecar" and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


def plan_save_target(job: str, generation: int, pods: Sequence[Mapping[str, Any]], uid: str) -> tuple[str, int]:
    """The worker whose sidecar gets the save request (and the job's token): a running pod that this
    JAXJob (`uid`) controls by its owner reference, of the current generation by its label, with an IP
    and a sidecar port, process 0 first (one request is enough: the trainers agree on one step, docs/
    architecture.md "Save requests"). A pod that only carries the job's labels is anybody's (any
    tenant who may create pods in the namespace) and never gets the token. (pod name, sidecar port);
    PluginError naming why there is none."""
    candidates = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        port = _sidecar_port(pod)
        if (not uid or owner_uid(pod) != uid or str(labels.get(api.LABEL_GENERATION)) != str(generation)
                or meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP")
                or port is None):
            continue
        process = str(labels.get(api.LABEL_PROCESS, ""))
        candidates.append((0 if process == "0" else 1, str(meta.get("name")), port))
    if not candidates:
        raise PluginError(f"jaxjob {job}: no running worker of generation {generation} with a sidecar to ask "
                          f"({len(pods)} pods carry its labels; only a pod the job owns, uid {uid}, is asked); "
                          "try again once the job is Running")
    _, name, port = min(candidates)
    return name, port


def parse_save_id(job: str, answer: Mapping[str, Any]) -> str:
    """The id of the save request from the sidecar's answer to POST /v1/save, checked against the
    sidecar's own id format (api.SAVE_ID_PATTERN) before it goes into a proxy path; PluginError
    otherwise (a `../` there would send the next poll, with the user's credentials, anywhere)."""
    request_id = answer.get("id")
    if not isinstance(request_id, str) or not re.fullmatch(api.SAVE_ID_PATTERN, request_id):
        raise PluginError(f"jaxjob {job}: the sidecar answered the save with id {escape_controls(repr(request_id))[:200]}, "
                          f"not a save request id ({api.SAVE_ID_PATTERN}); not followed")
    return request_id


def describe_save(job: str, outcome: Mapping[str, Any], before: int | None) -> tuple[bool, str]:
    """What a save request's outcome (the sidecar's GET /v1/save/<id>) says: (finished, line to print).
    Raises PluginError for a failed save."""
    status = outcome.get("status")
    if status == "pending":
        return False, ""
    if status != "committed":
        raise PluginError(f"jaxjob {job}: the save failed: {outcome.get('error') or status}")
    step = outcome.get("step")
    was = "none" if before is None else str(before)
    persisted = "persisted" if outcome.get("persisted") else "in the local tier (the upload follows)"
    newer = "" if before is None or not isinstance(step, int) or step > before else " (no newer step to save)"
    return True, f"jaxjob {job}: step {step} committed, {persisted}; the newest saved step was {was}{newer}"


def plan_completion(words: Sequence[str]) -> tuple[str, str, dict[str, str]]:
    """What to complete for `kubectl resilax <words>` (the last word is the one being typed, maybe ""):
    ("command" | "job" | "namespace" | "file" | "none", the typed prefix, the flags given so far)."""
    *before, current = list(words) or [""]
    flags: dict[str, str] = {}
    positionals: list[str] = []
    i = 0
    while i < len(before):
        word = before[i]
        name, eq, value = word.partition("=")
        if name in VALUE_FLAGS and eq:
            flags[name] = value
        elif word in VALUE_FLAGS:
            if i + 1 == len(before):
                kind = "namespace" if word in ("-n", "--namespace") else "file" if word in FILE_FLAGS else "none"
                return kind, current, flags
            flags[word] = before[i + 1]
            i += 1
        elif not word.startswith("-"):
            positionals.append(word)
        i += 1
    if current.startswith("-"):
        return "none", current, flags
    if len(positionals) == 1 and positionals[0] == "web":
        return "file", current, flags
    kind = {0: "command", 1: "job"}.get(len(positionals), "none")
    if kind == "job" and positionals[0] in NAMELESS_COMMANDS:
        kind = "none"
    return kind, current, flags


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kubectl resilax", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("name", nargs="?", help="the JAXJob's name (web: the HTML file to write; list, version: none)")
    p.add_argument("-n", "--namespace", default=None, help="its namespace (default: the context's, else default)")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="web, list: the jobs of every namespace")
    p.add_argument("-o", "--output", choices=OUTPUT_FORMATS, default=None,
                   help=f"{', '.join(READ_COMMANDS)}: print json or yaml instead of the screen")
    p.add_argument("--png", type=Path, default=None, metavar="FILE",
                   help="timeline: also draw the picture into this PNG file (needs the 'plot' extra)")
    p.add_argument("--timeout", type=float, default=SAVE_TIMEOUT_SECONDS, metavar="SECONDS",
                   help=f"save: how long to wait for the commit (default {SAVE_TIMEOUT_SECONDS:.0f})")
    p.add_argument("-f", "--follow", action="store_true", help="logs: follow, across generations, until the job ends")
    p.add_argument("--process", type=int, default=0, metavar="N", help="logs: whose trainer (default 0)")
    p.add_argument("--step", type=int, default=None, metavar="N", help="rollback: the committed step to restore")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    args = p.parse_args(list(argv))
    if args.png is not None and args.command != "timeline":
        p.error("--png goes with timeline")
    if args.all_namespaces and args.command not in ("web", "list"):
        p.error("-A/--all-namespaces goes with web and list")
    if args.output is not None and args.command not in READ_COMMANDS:
        p.error(f"-o/--output goes with {', '.join(READ_COMMANDS)}")
    if (args.follow or args.process) and args.command != "logs":
        p.error("-f/--follow and --process go with logs")
    if (args.step is None) == (args.command == "rollback"):
        p.error("rollback needs --step N" if args.command == "rollback" else "--step goes with rollback")
    if args.command in NAMELESS_COMMANDS and args.name is not None:
        p.error(f"{args.command} takes no job name")
    if args.command not in NAMELESS_COMMANDS and args.name is None:
        p.error(f"{args.command} needs the JAXJob's name")
    return args


def run_save(kube: JobAPI, namespace: str, name: str, timeout: float) -> str:
    """Ask the current generation's first worker for a save and wait until its step is committed."""
    job = kube.get_job(namespace, name)
    status = job.get("status") or {}
    before = (status.get("checkpoint") or {}).get("step")
    generation = int(status.get("generation") or 0)
    uid = str((job.get("metadata") or {}).get("uid") or "")
    pod, port = plan_save_target(f"{namespace}/{name}", generation, kube.worker_pods(namespace, name, generation), uid)
    token = kube.sidecar_token(namespace, name)
    answer = kube.sidecar(namespace, pod, port, "POST", "/v1/save", {"reason": "manual"}, token=token)
    request_id = parse_save_id(f"{namespace}/{name}", answer)
    print(f"save requested from {pod} (request {request_id}); waiting for the commit", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    while True:
        done, line = describe_save(f"{namespace}/{name}", kube.sidecar(namespace, pod, port, "GET",
                                                                         f"/v1/save/{quote(request_id, safe='')}"),
                                   before)
        if done:
            return line
        if time.monotonic() > deadline:
            raise PluginError(f"jaxjob {namespace}/{name}: save request {request_id} not committed within "
                              f"{timeout:.0f} s (the trainer saves at its next step; see its logs)")
        time.sleep(SAVE_POLL_SECONDS)


def run_rotate_token(kube: JobAPI, namespace: str, name: str) -> str:
    """Rotate the job's sidecar token: delete its Secret (only the job's own); the operator writes a new
    random token within TOKEN_RECHECK_SECONDS (k8s.py), the kubelet refreshes the sidecars' mounted
    file, and the old token is refused from then on. The job keeps running (docs/sidecar.md, "Auth")."""
    job = kube.get_job(namespace, name)
    secret = kube.delete_token_secret(namespace, name, str((job.get("metadata") or {}).get("uid") or ""))
    return (f"jaxjob {namespace}/{name}: secret {secret} deleted; the operator writes a new token within "
            f"{api.TOKEN_RECHECK_SECONDS:.0f} s, the sidecars read it from their mounted Secret once the kubelet "
            "refreshes it (about a minute), and the old token is refused from then on")


def run_timeline(kube: JobAPI, namespace: str, name: str, png: Path | None, job: Mapping[str, Any]) -> str:
    now = datetime.now(UTC)
    generations = parse_history(job)
    lines = build_gantt(f"{namespace}/{name}", generations, now)
    if png is not None:
        from .timeline_plot import MissingPlotExtraError, render_png

        try:
            render_png(build_plot(f"JAXJob {namespace}/{name}: generations", generations, now), png)
        except MissingPlotExtraError as e:
            raise PluginError(str(e)) from e
        lines.append(f"picture: {png}")
    return "\n".join(lines)


def run_web(kube: JobAPI, namespace: str | None, path: Path) -> str:
    jobs = kube.list_jobs(namespace)
    path.write_text(build_page(build_page_data(jobs, datetime.now(UTC))))
    where = "every namespace" if namespace is None else f"namespace {namespace}"
    return f"wrote {path}: the timelines of {len(jobs)} JAXJobs of {where}"


def _print(screen: str) -> None:
    """Print a screen whose text came partly from the cluster: its own line breaks, nothing else raw."""
    print(escape_controls(screen, keep_newlines=True))


def run_read(kube: JobAPI, namespace: str, args: argparse.Namespace) -> str:
    """A read command's screen, or with `-o` its document."""
    if args.command == "list":
        jobs = kube.list_jobs(None if args.all_namespaces else namespace)
        if args.output:
            return render(build_list_data(jobs), args.output)
        return build_list_screen(jobs, args.all_namespaces)
    job = kube.get_job(namespace, args.name)
    if args.command == "goodput":
        return render(build_goodput_data(job), args.output) if args.output else build_goodput_screen(job)
    if args.command == "timeline":
        if args.output:
            return render(build_timeline_data(job), args.output)
        return run_timeline(kube, namespace, args.name, args.png, job)
    events = kube.job_events(namespace, args.name)
    if args.output:
        return render(build_status_data(job, last_fault(job.get("status") or {}, events)), args.output)
    return build_status_screen(job, events, datetime.now(UTC))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "version":  # needs no cluster
        data = build_version_data()
        print(render(data, args.output) if args.output else f"kubectl-resilax {data['clientVersion']} "
              f"(JAXJob {data['apiVersion']})")
        return 0
    try:
        kube = JobAPI(args.kubeconfig, args.context)
        namespace = args.namespace or kube.default_namespace
        if args.command in ("suspend", "resume"):
            suspend = args.command == "suspend"
            kube.patch_job(namespace, args.name, build_suspend_patch(suspend))
            print(f"jaxjob {namespace}/{args.name} {'suspended' if suspend else 'resumed'} (spec.suspend={str(suspend).lower()})")
        elif args.command == "save":
            _print(run_save(kube, namespace, args.name, args.timeout))
        elif args.command == "rotate-token":
            _print(run_rotate_token(kube, namespace, args.name))
        elif args.command == "rollback":
            _print(run_rollback(kube, namespace, args.name, args.step))
        elif args.command == "web":
            print(run_web(kube, None if args.all_namespaces else namespace, Path(args.name)))
        elif args.command == "logs":
            run_logs(kube, namespace, args.name, args.process, args.follow)
        elif args.output:
            print(run_read(kube, namespace, args))  # json.dumps / yaml.safe_dump escape control characters
        else:
            _print(run_read(kube, namespace, args))
        return 0
    except (PluginError, OSError) as e:
        print(escape_controls(f"kubectl resilax {args.command}: {e}"), file=sys.stderr)
        return EXIT_ERROR


def complete_main(argv: Sequence[str] | None = None) -> int:
    """`kubectl_complete-resilax WORDS...`: the completions, one per line, then `:4` (`:0` where a file
    name goes, so the shell offers its files). Names come from the API at best: an unreachable cluster
    completes nothing rather than failing the shell."""
    words = list(sys.argv[1:] if argv is None else argv)
    kind, prefix, flags = plan_completion(words)
    choices: list[str] = []
    if kind == "command":
        choices = list(COMMANDS)
    elif kind in ("job", "namespace"):
        with contextlib.suppress(Exception):  # completion must never break the shell
            kube = JobAPI(flags.get("--kubeconfig"), flags.get("--context"))
            if kind == "job":
                namespace = flags.get("-n") or flags.get("--namespace") or kube.default_namespace
                choices = kube.job_names(namespace)
            else:
                choices = kube.namespace_names()
    for choice in choices:
        if choice.startswith(prefix):
            print(choice)
    print(f":{FILE_COMPLETION if kind == 'file' else NO_FILE_COMPLETION}")
    return 0
