"""`kubectl resilax` (the `kubectl-resilax` executable) and `resilax job`: a JAXJob at a glance.

    kubectl resilax status NAME [-n NAMESPACE]    phase, generation, shape, step, saved step, goodput, last fault
    kubectl resilax goodput NAME [-n NAMESPACE]   where the job's wall time went (status.goodput)
    kubectl resilax suspend NAME [-n NAMESPACE]   spec.suspend=true: final save, then no workers
    kubectl resilax resume NAME [-n NAMESPACE]    spec.suspend=false: a new generation restores the newest step

Shell completion (kubectl 1.26+): kubectl asks the `kubectl_complete-resilax` executable, installed beside
`kubectl-resilax`, for the words that may follow (Cobra's `__complete` protocol: one per line, then
`:<directive>`): the commands, then the namespace's JAXJobs, or its namespaces after `-n`.

Everything comes from the JAXJob itself (its status, which the operator keeps) and its Events; suspend
and resume patch `spec.suspend` (a JSON merge patch), as Kueue does. The kubeconfig is kubectl's
(`--kubeconfig`, else `$KUBECONFIG`, else `~/.kube/config`; `--context`); the namespace is `-n`, else the
context's, else `default`. Needs `get` on jaxjobs and `list` on events, and `patch` on jaxjobs for
suspend/resume.

The screens are pure functions of the job and its events (`build_status_screen`, `build_goodput_screen`),
tested apart from the API.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from . import api
from . import goodput as gp
from .status import BREAKDOWN_KEYS

#: Exit codes: 0 done, 1 the API refused or the job is missing, 2 usage.
EXIT_ERROR = 1

COMMANDS = ("status", "goodput", "suspend", "resume")
#: Flags that take a value (`-n NS` or `--namespace=NS`).
VALUE_FLAGS = ("-n", "--namespace", "--kubeconfig", "--context")
#: Cobra's ShellCompDirectiveNoFileComp: no file names when nothing matches.
NO_FILE_COMPLETION = 4


class PluginError(Exception):
    """An answer the user must see (the job is missing, the API refused): printed, exit 1."""


# ---- pure: the screens ---------------------------------------------------------------------------


def _parse_time(raw: Any) -> datetime | None:
    if not isinstance(raw, str) or not raw:
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None


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
    """The transition in progress, else the newest Warning event, else `none`."""
    transition = status.get("transition")
    if isinstance(transition, Mapping) and transition.get("kind"):
        message = transition.get("message") or ""
        return f"{transition['kind']} (in progress, generation {transition.get('generation')}): {message}".rstrip(": ")
    warnings = [e for e in events if e.get("type") == "Warning"]
    if not warnings:
        return "none"
    newest = max(warnings, key=lambda e: _parse_time(_event_time(e)) or datetime.min.replace(tzinfo=UTC))
    return f"{newest.get('reason')} at {_event_time(newest) or '?'}: {newest.get('message') or ''}".rstrip(": ")


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
        ("Generation", f"{status.get('generation', 0)} (started {_age(_parse_time(status.get('generationStartTime')), now)} ago)"
         if status.get("generationStartTime") else str(status.get("generation", 0))),
        ("Shape", f"{shape.get('count')} x {shape.get('topology')} ({shape.get('hosts')} hosts)" if shape else "-"),
        ("Step", f"{current['lastStep']} (as of {_age(_parse_time(goodput.get('asOf')), now)} ago)"
         if current.get("lastStep") is not None else "-"),
        ("Saved step", (f"{checkpoint.get('step')} ({checkpoint.get('tier') or 'persistent'}, "
                        f"{_age(_parse_time(checkpoint.get('time')), now)} ago)") if checkpoint else "none"),
        ("Goodput", (f"{100 * float(goodput['ratio']):.1f}% of {float(goodput.get('wallSeconds') or 0):.0f} s"
                     if goodput.get("ratio") is not None else "-")),
        ("Restarts", str(status.get("restarts", 0))),
        ("Last fault", last_fault(status, events)),
    ]
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
    lines = [f"{name}: goodput {100 * float(goodput['ratio']):.1f}% of {wall:.0f} s wall time "
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


def plan_completion(words: Sequence[str]) -> tuple[str, str, dict[str, str]]:
    """What to complete for `kubectl resilax <words>` (the last word is the one being typed, maybe ""):
    ("command" | "job" | "namespace" | "none", the typed prefix, the flags given so far)."""
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
                return ("namespace" if word in ("-n", "--namespace") else "none", current, flags)
            flags[word] = before[i + 1]
            i += 1
        elif not word.startswith("-"):
            positionals.append(word)
        i += 1
    if current.startswith("-"):
        return "none", current, flags
    kind = {0: "command", 1: "job"}.get(len(positionals), "none")
    return kind, current, flags


# ---- I/O: the API ---------------------------------------------------------------------------------


class JobAPI:
    """The few calls the plugin makes, through the kubernetes client and kubectl's kubeconfig."""

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        try:
            import kubernetes
        except ImportError as e:
            raise PluginError("needs the kubernetes client: pip install 'resilax[operator]'") from e

        self._kubernetes = kubernetes
        self.client = kubernetes.config.new_client_from_config(config_file=kubeconfig, context=context)
        contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = next((c for c in contexts if c["name"] == context), active) if context else active
        self.default_namespace = str(((chosen or {}).get("context") or {}).get("namespace") or "default")

    def _call(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except self._kubernetes.client.ApiException as e:
            message = e.reason
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                message = json.loads(e.body or "").get("message") or message
            raise PluginError(f"{what}: {e.status} {message}") from e

    def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        objects = self._kubernetes.client.CustomObjectsApi(self.client)
        job: dict[str, Any] = self._call(f"jaxjob {namespace}/{name}", objects.get_namespaced_custom_object,
                                         api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        return job

    def job_events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        core = self._kubernetes.client.CoreV1Api(self.client)
        selector = f"involvedObject.kind={api.KIND},involvedObject.name={name}"
        answer = self._call(f"events of {namespace}/{name}", core.list_namespaced_event, namespace,
                            field_selector=selector, _preload_content=False)
        items: list[dict[str, Any]] = json.loads(answer.data).get("items") or []
        return items

    def job_names(self, namespace: str) -> list[str]:
        objects = self._kubernetes.client.CustomObjectsApi(self.client)
        listed = self._call(f"jaxjobs of {namespace}", objects.list_namespaced_custom_object,
                            api.GROUP, api.VERSION, namespace, api.PLURAL)
        return sorted(item["metadata"]["name"] for item in listed.get("items") or [])

    def namespace_names(self) -> list[str]:
        core = self._kubernetes.client.CoreV1Api(self.client)
        listed = self._call("namespaces", core.list_namespace)
        return sorted(item.metadata.name for item in listed.items)

    def patch_job(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        objects = self._kubernetes.client.CustomObjectsApi(self.client)
        job: dict[str, Any] = self._call(f"patching jaxjob {namespace}/{name}",
                                         objects.patch_namespaced_custom_object,
                                         api.GROUP, api.VERSION, namespace, api.PLURAL, name, patch)
        return job


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kubectl resilax", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("name", help="the JAXJob's name")
    p.add_argument("-n", "--namespace", default=None, help="its namespace (default: the context's, else default)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        kube = JobAPI(args.kubeconfig, args.context)
        namespace = args.namespace or kube.default_namespace
        if args.command in ("suspend", "resume"):
            suspend = args.command == "suspend"
            kube.patch_job(namespace, args.name, build_suspend_patch(suspend))
            print(f"jaxjob {namespace}/{args.name} {'suspended' if suspend else 'resumed'} (spec.suspend={str(suspend).lower()})")
            return 0
        job = kube.get_job(namespace, args.name)
        if args.command == "goodput":
            print(build_goodput_screen(job))
        else:
            print(build_status_screen(job, kube.job_events(namespace, args.name), datetime.now(UTC)))
        return 0
    except PluginError as e:
        print(f"kubectl resilax {args.command}: {e}", file=sys.stderr)
        return EXIT_ERROR


def complete_main(argv: Sequence[str] | None = None) -> int:
    """`kubectl_complete-resilax WORDS...`: the completions, one per line, then `:4`. Names come from the
    API at best: an unreachable cluster completes nothing rather than failing the shell."""
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
    print(f":{NO_FILE_COMPLETION}")
    return 0
