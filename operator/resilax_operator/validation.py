"""Validate a JAXJob at the boundary: every problem at once, each with its field path.

The CRD schema and its CEL rules reject what they can at admission; this module repeats those checks
(an operator may meet objects written before a schema change) and adds what a schema cannot express
(topology tables, machine types, the pod template's contents: Kubernetes' PodTemplateSpec schema in
pods/podtemplate.py). With the operator's settings it also applies the operator's policies (the restricted Pod
Security profile unless host access is allowed: pods/podsecurity.py).
Modelled on jobset's webhook `allErrs`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from . import api, topology
from .errors import InvalidSpecError, SpecProblem, UnknownTopologyError
from .pods.podsecurity import check_pod_security
from .pods.podtemplate import check_template_schema
from .settings import OperatorSettings
from .spec import (
    HANG_DETECTION_OFF,
    IN_PLACE_MODES,
    KEEP_BEST_MODES,
    LOCAL_MEDIA,
    LOCAL_SCOPE_POD,
    LOCAL_SCOPES,
    MAX_HANG_TIMEOUT_SECONDS,
    MAX_HEALTH_CHECK_TIMEOUT_SECONDS,
    MIN_HANG_TIMEOUT_SECONDS,
    PROVISIONING_MODES,
    RULE_ACTIONS,
    JobSpec,
    parse_spec,
)

STORAGE_SCHEMES: Final = ("gs://", "pvc://", "/")
#: Longest JAXJob name: pod names are `<job>-g<generation>-s<slice>-h<host>` and must stay DNS labels.
MAX_JOB_NAME: Final = 40
_DNS_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Job names must also make DNS-1035 Service names (`<job>-g<generation>`): a letter first.
_JOB_NAME: Final = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_GCS: Final = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/.*)?$")
_PVC: Final = re.compile(r"^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?$")


def validate_spec(raw: Mapping[str, Any], *, name: str | None = None,
                  settings: OperatorSettings | None = None) -> JobSpec:
    """Parse and check `spec` (and the job's name when given; with `settings`, the operator's policies
    too). Raises InvalidSpecError with all problems."""
    problems: list[SpecProblem] = []
    if name is not None:
        problems += validate_name(name)
    spec = parse_spec(raw, problems)
    problems += check_spec(spec, already_found=problems)
    if settings is not None:
        problems += check_template_ports(spec.template, settings)
        if not any(p.path.startswith(("spec.slices", "spec.elastic")) for p in problems):
            problems += check_job_size(spec, settings.max_hosts_per_job)
    if settings is not None and not settings.allow_host_access:
        found = {p.path for p in problems}  # a malformed field's own problem wins
        problems += [p for p in check_pod_security(spec.template) if p.path not in found]
    if problems:
        raise InvalidSpecError(problems)
    return spec


def check_job_size(spec: JobSpec, max_hosts: int) -> list[SpecProblem]:
    """The most worker pods the spec may ask for (its largest allowed topology at its largest count)
    against the operator's `max_hosts_per_job`."""
    high = spec.count_bounds[1]
    sizes = []
    for t in spec.allowed_topologies:
        try:
            sizes.append((topology.plan_geometry(spec.slices.accelerator, t, chips_per_host=spec.slices.chips_per_host,
                                                 machine_type=spec.slices.machine_type).hosts, t))
        except UnknownTopologyError:
            continue  # reported by check_spec
    if not sizes:
        return []
    hosts, t = max(sizes)
    if hosts * high <= max_hosts:
        return []
    setting = f"at most {max_hosts:,} per job (operator setting RESILAX_OPERATOR_MAX_HOSTS_PER_JOB)"
    if hosts > max_hosts:
        return [SpecProblem("spec.slices.topology", f"one slice of {t} is {hosts:,} hosts (worker pods); this operator "
                                                    f"allows {setting}")]
    path = "spec.elastic.maxCount" if spec.elastic is not None else "spec.slices.count"
    return [SpecProblem(path, f"{high:,} slices of {t} ({hosts:,} hosts each) make {hosts * high:,} worker pods; "
                              f"this operator allows {setting}: {max_hosts // hosts:,} such slices at most")]


def check_template_ports(template: Mapping[str, Any], settings: OperatorSettings) -> list[SpecProblem]:
    """A template's container port that would collide, in the pod's one network namespace, with the
    sidecar the operator adds (its port, on any container) or with JAX's coordination service (its
    port, on a container other than the trainer, which runs it)."""
    pod = template.get("spec")
    out: list[SpecProblem] = []
    if not isinstance(pod, Mapping):
        return out
    containers = pod.get("containers")
    names = [c.get("name") if isinstance(c, Mapping) else None for c in containers] \
        if isinstance(containers, list) else []
    trainer_i = names.index(api.TRAINER_CONTAINER) if api.TRAINER_CONTAINER in names else 0
    for key in ("initContainers", "containers"):
        items = pod.get(key)
        for i, c in enumerate(items if isinstance(items, list) else []):
            if not isinstance(c, Mapping) or not isinstance(c.get("ports"), list):
                continue
            trainer = key == "containers" and i == trainer_i
            for j, port in enumerate(c["ports"]):
                number = port.get("containerPort") if isinstance(port, Mapping) else None
                if number == settings.sidecar_port:
                    out.append(SpecProblem(f"spec.template.spec.{key}[{i}].ports[{j}].containerPort",
                                           f"{number} is the Resilax sidecar's port in every worker pod "
                                           "(operator setting RESILAX_OPERATOR_SIDECAR_PORT); use another"))
                elif number == settings.coordinator_port and not trainer:
                    out.append(SpecProblem(f"spec.template.spec.{key}[{i}].ports[{j}].containerPort",
                                           f"{number} is JAX's coordination service's port, which the trainer "
                                           "binds (operator setting RESILAX_OPERATOR_COORDINATOR_PORT); use another"))
    return out


def validate_name(name: str) -> list[SpecProblem]:
    if len(name) > MAX_JOB_NAME or not _JOB_NAME.match(name):
        return [SpecProblem("metadata.name", f"{name!r} must be at most {MAX_JOB_NAME} characters: lower-case "
                            "letters, digits and '-', starting with a letter (worker Services are named after it)")]
    return []


def check_spec(spec: JobSpec, *, already_found: Sequence[SpecProblem] = ()) -> list[SpecProblem]:
    """Semantic checks of a parsed spec. Skips fields whose parsing already failed (`already_found`)."""
    found = {p.path for p in already_found}
    out: list[SpecProblem] = []
    out += _check_slices(spec, found)
    out += _check_elastic(spec, found)
    out += _check_checkpoint(spec, found)
    out += _check_capacity(spec, found)
    out += _check_recovery(spec, found)
    out += _check_compilation_cache(spec, found)
    out += _check_template(spec.template, found)
    return out


def _check_slices(spec: JobSpec, found: set[str]) -> list[SpecProblem]:
    s = spec.slices
    out: list[SpecProblem] = []
    if "spec.slices.accelerator" in found or "spec.slices.topology" in found:
        return out
    if not topology.is_known_accelerator(s.accelerator):
        return [SpecProblem("spec.slices.accelerator",
                            f"unknown accelerator {s.accelerator!r}; valid: "
                            f"{', '.join(topology.TPU_ACCELERATORS)}, nvidia-<type>, cpu")]
    if not topology.is_valid_topology(s.accelerator, s.topology):
        out.append(_bad_topology("spec.slices.topology", s.accelerator, s.topology))
        return out
    if s.machine_type is not None and topology.accelerator_family(s.accelerator) in ("gpu", "cpu"):
        out.append(SpecProblem("spec.slices.machineType", f"applies to TPU accelerators only, not {s.accelerator}"))
        return out
    try:
        topology.plan_geometry(s.accelerator, s.topology, chips_per_host=s.chips_per_host,
                               machine_type=s.machine_type)
    except UnknownTopologyError as e:
        path = "spec.slices.machineType" if "machine type" in str(e) else "spec.slices.chipsPerHost"
        out.append(SpecProblem(path, str(e)))
    return out


def _bad_topology(path: str, accelerator: str, value: str) -> SpecProblem:
    return SpecProblem(path, f"{value!r} is not a valid {accelerator} topology; valid: "
                             f"{topology.describe_valid_topologies(accelerator)}")


def _check_elastic(spec: JobSpec, found: set[str]) -> list[SpecProblem]:
    e = spec.elastic
    if e is None:
        return []
    out: list[SpecProblem] = []
    if e.min_count > e.max_count:
        out.append(SpecProblem("spec.elastic.minCount", f"{e.min_count} is greater than maxCount {e.max_count}"))
    elif not e.min_count <= spec.slices.count <= e.max_count:
        out.append(SpecProblem("spec.slices.count", f"{spec.slices.count} is outside the elastic bounds "
                               f"[{e.min_count}, {e.max_count}]"))
    s = spec.slices
    if topology.is_known_accelerator(s.accelerator) and topology.is_valid_topology(s.accelerator, s.topology):
        path = "spec.elastic.topologies"
        for t in e.topologies[1:]:
            if not topology.is_valid_topology(s.accelerator, t):
                out.append(_bad_topology(path, s.accelerator, t))
                continue
            try:
                topology.plan_geometry(s.accelerator, t, chips_per_host=s.chips_per_host,
                                       machine_type=s.machine_type)
            except UnknownTopologyError as err:
                out.append(SpecProblem(path, str(err)))
    return out


def _check_checkpoint(spec: JobSpec, found: set[str]) -> list[SpecProblem]:
    c = spec.checkpoint
    out: list[SpecProblem] = []
    if "spec.checkpoint.storage" not in found and "spec.checkpoint" not in found:
        if not c.storage.startswith(STORAGE_SCHEMES):
            out.append(SpecProblem("spec.checkpoint.storage", f"{c.storage!r} must be gs://bucket/prefix, "
                                   "pvc://claim/sub/path or an absolute path"))
        elif c.storage.startswith("gs://") and not _GCS.match(c.storage):
            out.append(SpecProblem("spec.checkpoint.storage", f"{c.storage!r} is not a valid gs://bucket/prefix"))
        elif c.storage.startswith("pvc://") and not _PVC.match(c.storage):
            out.append(SpecProblem("spec.checkpoint.storage", f"{c.storage!r}: pvc://<claim-name>[/sub/path] "
                                   "needs a DNS-subdomain claim name"))
    if c.local is not None and c.local.medium not in LOCAL_MEDIA:
        out.append(SpecProblem("spec.checkpoint.local.medium",
                               f"{c.local.medium!r} is not a local tier medium; valid: '' (node disk), Memory"))
    if c.local is not None and c.local.scope not in LOCAL_SCOPES:
        out.append(SpecProblem("spec.checkpoint.local.scope",
                               f"{c.local.scope!r} is not a local tier scope; valid: Node (a folder on the node, "
                               "kept across generations), Pod (an emptyDir, lost with the pod)"))
    elif c.local is not None and c.local.size_limit is not None and c.local.scope != LOCAL_SCOPE_POD:
        out.append(SpecProblem("spec.checkpoint.local.sizeLimit",
                               f"{c.local.size_limit!r} with scope {c.local.scope}: sizeLimit applies to "
                               "scope: Pod only (an emptyDir); a scope: Node folder on the node has no size limit"))
    return out + _check_keep(spec, found)


def _check_keep(spec: JobSpec, found: set[str]) -> list[SpecProblem]:
    """`spec.checkpoint.keep.best` needs `metric` and `mode`; `metric` and `mode` need `best`."""
    k, p = spec.checkpoint.keep, "spec.checkpoint.keep"
    out: list[SpecProblem] = []
    if k.best is None:
        out += [SpecProblem(f"{p}.{key}", f"{value!r} needs {p}.best (how many of the best steps to keep)")
                for key, value in (("metric", k.metric), ("mode", k.mode))
                if value is not None and f"{p}.{key}" not in found]
        return out
    if f"{p}.metric" not in found and not k.metric:
        out.append(SpecProblem(f"{p}.metric", f"is required with {p}.best: the name of a metric the training "
                               "script passes to save(..., metrics={...}), e.g. loss"))
    if f"{p}.mode" not in found and k.mode not in KEEP_BEST_MODES:
        found_text = "is required" if k.mode is None else f"{k.mode!r} is not a mode"
        out.append(SpecProblem(f"{p}.mode", f"{found_text} with {p}.best; valid: max (keep the highest values, "
                               "e.g. accuracy), min (keep the lowest, e.g. loss)"))
    return out


def _check_capacity(spec: JobSpec, found: set[str]) -> list[SpecProblem]:
    c = spec.capacity
    if "spec.capacity.provisioning" in found:
        return []
    if c.provisioning not in PROVISIONING_MODES:
        return [SpecProblem("spec.capacity.provisioning",
                            f"{c.provisioning!r} is not a provisioning mode; valid: Ready (plan only over Ready nodes "
                            "with free devices), Autoscaled (create the workers at the declared shape even where "
                            "no node exists yet: a cluster autoscaler, node auto-provisioning or flex-start adds "
                            "nodes for pending pods)")]
    if c.shrink_after_seconds is not None and not c.autoscaled:
        return [SpecProblem("spec.capacity.shrinkAfterSeconds",
                            f"{c.shrink_after_seconds} with provisioning {c.provisioning}: shrinkAfterSeconds applies "
                            "to provisioning: Autoscaled only (with Ready the job never waits for nodes that do not "
                            "exist)")]
    return []


#: Exit codes of the worker protocol (api.py): their rows in worker_exit.py decide, no rule may.
RESERVED_EXIT_CODES: Final = (0, api.EXIT_CODE_STOPPED, api.EXIT_CODE_PEER_LOST, api.EXIT_CODE_STORAGE_IN_USE)
MAX_FAILURE_RULES: Final = 32


def _check_recovery(spec: JobSpec, found: set[str]) -> list[SpecProblem]:
    r = spec.recovery
    out: list[SpecProblem] = []
    if "spec.recovery.inPlace" not in found and r.in_place not in IN_PLACE_MODES:
        out.append(SpecProblem("spec.recovery.inPlace",
                               f"{r.in_place!r} is not an in-place mode; valid: Auto (keep the surviving pods after a "
                               "worker failure, node loss or shrink and restart only their trainer), Never (replace "
                               "every pod)"))
    if len(r.failure_rules) > MAX_FAILURE_RULES:
        out.append(SpecProblem("spec.recovery.failureRules",
                               f"{len(r.failure_rules)} rules; at most {MAX_FAILURE_RULES} are allowed"))
    for i, rule in enumerate(r.failure_rules):
        p = f"spec.recovery.failureRules[{i}]"
        if f"{p}.action" not in found and rule.action not in RULE_ACTIONS:
            out.append(SpecProblem(f"{p}.action", f"{rule.action!r} is not a rule action; valid: Restart (a counted "
                                   "worker failure), RestartWithoutCounting (a new generation, never counted), "
                                   "FailJob (the job fails at once)"))
        if not rule.exit_codes and not rule.pod_reasons and not {f"{p}.exitCodes", f"{p}.podReasons"} & found:
            out.append(SpecProblem(p, "matches nothing: set exitCodes, podReasons or both"))
        for j, code in enumerate(rule.exit_codes):
            if code in RESERVED_EXIT_CODES or not 1 <= code <= 255:
                out.append(SpecProblem(f"{p}.exitCodes[{j}]", f"{code} is not allowed; allowed: 1..255 except "
                                       "75, 76 and 78 (the worker protocol's codes: stopped for rescheduling, a "
                                       "peer lost, storage in use)"))
        if rule.container_name is not None and not rule.exit_codes:
            out.append(SpecProblem(f"{p}.containerName", f"{rule.container_name!r} without exitCodes: containerName "
                                   "says whose exit code exitCodes reads; set exitCodes too"))
        elif rule.container_name is not None and not _DNS_LABEL.match(rule.container_name):
            out.append(SpecProblem(f"{p}.containerName", f"{rule.container_name!r} must be a DNS label (a "
                                   "container name of the template, or resilax-sidecar)"))
    hang = r.hang_timeout_seconds
    if "spec.recovery.hangTimeoutSeconds" not in found and hang is not None and hang != HANG_DETECTION_OFF \
            and not MIN_HANG_TIMEOUT_SECONDS <= hang <= MAX_HANG_TIMEOUT_SECONDS:
        out.append(SpecProblem("spec.recovery.hangTimeoutSeconds",
                               f"{hang} is not allowed; allowed: {MIN_HANG_TIMEOUT_SECONDS}-{MAX_HANG_TIMEOUT_SECONDS} "
                               "seconds, 0 (no hang detection), or unset (automatic from the trainer's step times)"))
    check_timeout = r.health_check.timeout_seconds
    if "spec.recovery.healthCheck.timeoutSeconds" not in found and check_timeout > MAX_HEALTH_CHECK_TIMEOUT_SECONDS:
        out.append(SpecProblem("spec.recovery.healthCheck.timeoutSeconds",
                               f"{check_timeout} is not allowed; allowed: 1-{MAX_HEALTH_CHECK_TIMEOUT_SECONDS} seconds"))
    return out + _check_spares(spec, found)


#: The most spare slices a job may hold (`spec.recovery.spareSlices`; the CRD says the same).
MAX_SPARE_SLICES: Final = 8


def _check_spares(spec: JobSpec, found: set[str]) -> list[SpecProblem]:
    spares, path = spec.recovery.spare_slices, "spec.recovery.spareSlices"
    if path in found or spares == 0:
        return []
    if spares > MAX_SPARE_SLICES:
        return [SpecProblem(path, f"{spares} is not allowed; allowed: 0-{MAX_SPARE_SLICES} spare slices")]
    if topology.accelerator_family(spec.slices.accelerator) == "cpu":
        return [SpecProblem(path, f"{spares} spare slice(s) of accelerator 'cpu' hold nothing (a placeholder "
                            "holds a slice's TPUs or GPUs); allowed with cpu: 0")]
    return []


def _check_compilation_cache(spec: JobSpec, found: set[str]) -> list[SpecProblem]:
    path = spec.compilation_cache.path
    if "spec.compilationCache.path" in found or not path or path.startswith(("/", "gs://")):
        return []
    return [SpecProblem("spec.compilationCache.path",
                        f"{path!r} is not allowed; allowed: an absolute path (a folder every worker can reach) or "
                        "gs://bucket/prefix")]


def _check_template(template: Mapping[str, Any], found: set[str]) -> list[SpecProblem]:
    if "spec.template" in found:
        return []
    p = "spec.template.spec"
    pod = template.get("spec")
    if not isinstance(pod, Mapping):
        return [SpecProblem(p, "is required (a pod spec with at least one container)")]
    out: list[SpecProblem] = []
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers:
        out.append(SpecProblem(f"{p}.containers", "must list at least one container"))
        containers = []
    names: set[str] = set()
    for key in ("containers", "initContainers"):
        items = pod.get(key) or []
        if not isinstance(items, list):
            out.append(SpecProblem(f"{p}.{key}", "must be a list"))
            continue
        for i, c in enumerate(items):
            cp = f"{p}.{key}[{i}]"
            if not isinstance(c, Mapping):
                out.append(SpecProblem(cp, "must be an object"))
                continue
            name = c.get("name")
            if not isinstance(name, str) or not _DNS_LABEL.match(name):
                out.append(SpecProblem(f"{cp}.name", f"{name!r} must be a DNS label"))
            elif name in api.RESERVED_CONTAINER_NAMES:
                out.append(SpecProblem(f"{cp}.name", f"{name!r} is reserved for the operator's sidecar"))
            elif name in names:
                out.append(SpecProblem(f"{cp}.name", f"duplicate container name {name!r}"))
            else:
                names.add(name)
            if key == "containers" and not (isinstance(c.get("image"), str) and c.get("image")):
                out.append(SpecProblem(f"{cp}.image", "is required"))
    for i, v in enumerate(pod.get("volumes") or []):
        if isinstance(v, Mapping) and v.get("name") in api.RESERVED_VOLUME_NAMES:
            out.append(SpecProblem(f"{p}.volumes[{i}].name", f"{v.get('name')!r} is reserved for the operator"))
    if pod.get("nodeName"):
        out.append(SpecProblem(f"{p}.nodeName", f"{pod.get('nodeName')!r}: the operator places the workers (one per "
                               "node, each slice on its node pool); leave it unset, use nodeSelector or affinity"))
    if pod.get("ephemeralContainers"):
        out.append(SpecProblem(f"{p}.ephemeralContainers", "cannot be set when a pod is created (the API server "
                               "refuses them); `kubectl debug` adds them to a running worker"))
    restart = pod.get("restartPolicy")
    if restart not in (None, "Never"):
        out.append(SpecProblem(f"{p}.restartPolicy", f"{restart!r}: workers run with Never (the operator "
                               "restarts whole generations); leave it unset"))
    # Kubernetes' own schema: what the builder reads is typed there (a problem found above, with its
    # more specific message, wins for the same field).
    seen = {problem.path for problem in out}
    return out + [problem for problem in check_template_schema(template) if problem.path not in seen]
