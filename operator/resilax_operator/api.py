"""The JAXJob API's names, written down once: group, version, Kubernetes keys, phases, conditions.

Condition types and reasons are CamelCase; every reason is paired with its message (a format string
whose fields are filled by `Reason.format`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

GROUP: Final = "resilax.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "JAXJob"
PLURAL: Final = "jaxjobs"
SINGULAR: Final = "jaxjob"
SHORT_NAME: Final = "jj"
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
#: Path of the CRD's single source file, relative to the repository root (the chart ships it).
CRD_FILE: Final = "charts/resilax/crds/jaxjobs.resilax.dev.yaml"

# --- labels and annotations on what the operator creates (resilax.dev/<kebab-name>) ---
LABEL_JOB: Final = "resilax.dev/job"
LABEL_GENERATION: Final = "resilax.dev/generation"
LABEL_SLICE: Final = "resilax.dev/slice"
LABEL_HOST: Final = "resilax.dev/host"
LABEL_PROCESS: Final = "resilax.dev/process"
LABEL_NODE_POOL: Final = "resilax.dev/node-pool"
LABEL_ROLE: Final = "resilax.dev/role"
ROLE_WORKER: Final = "worker"
#: A grow-back probe pod (policies/grow_back_probe.py): a placeholder of a missing slice, never a worker.
ROLE_PROBE: Final = "probe"
#: On a probe pod: the probe set (`g<generation>r<round>`) and the probe slice it holds a place for.
LABEL_PROBE_SET: Final = "resilax.dev/probe-set"
LABEL_PROBE_SLICE: Final = "resilax.dev/probe-slice"
#: A spare slice's placeholder pod (spec.recovery.spareSlices, policies/spares.py): holds a slice's
#: nodes for the job, never a worker; `resilax.dev/spare-slice` is the spare slot it belongs to.
ROLE_SPARE: Final = "spare"
LABEL_SPARE_SLICE: Final = "resilax.dev/spare-slice"
ANNOTATION_SHAPE: Final = "resilax.dev/shape"
ANNOTATION_RESTORE_STEP: Final = "resilax.dev/restore-step"
#: On a worker pod: "1" when its trainer runs under `resilax run` (the supervisor), so an in-place restart
#: may replace the trainer process and keep the pod (spec.recovery.inPlace: Auto).
ANNOTATION_SUPERVISED: Final = "resilax.dev/supervised"
#: The sidecar's doorbell for a supervised trainer: 200 while its current incarnation runs, else 503.
TRAINER_READY_PATH: Final = "/v1/trainer/ready"
#: The supervisor that runs a supervised trainer as its child (`resilax run -- <command> <args>`).
SUPERVISOR_COMMAND: Final = ("resilax", "run", "--")
#: On a worker pod, set by the I/O side after it posted a final save request to that pod's sidecar:
#: `<operator request id>=<sidecar request id>`, so that a repeated RequestFinalSave posts nothing.
ANNOTATION_SAVE_REQUEST: Final = "resilax.dev/save-request"
#: Checkpoint freshness, on the JAXJob and its current workers (policies/freshness.py), written once per
#: newly committed step: when the operator first saw it committed (RFC 3339), its step, its tier
#: (`persistent` or `local`), and the trainer's step then minus that step.
ANNOTATION_LAST_CHECKPOINT_TIME: Final = "resilax.dev/last-checkpoint-time"
ANNOTATION_LAST_CHECKPOINT_STEP: Final = "resilax.dev/last-checkpoint-step"
ANNOTATION_LAST_CHECKPOINT_TIER: Final = "resilax.dev/last-checkpoint-tier"
ANNOTATION_STEPS_AT_RISK: Final = "resilax.dev/steps-at-risk"
FRESHNESS_ANNOTATIONS: Final = (ANNOTATION_LAST_CHECKPOINT_TIME, ANNOTATION_LAST_CHECKPOINT_STEP,
                                ANNOTATION_LAST_CHECKPOINT_TIER, ANNOTATION_STEPS_AT_RISK)

# --- GKE node keys ---
NODE_POOL_LABEL: Final = "cloud.google.com/gke-nodepool"
TPU_ACCELERATOR_LABEL: Final = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL: Final = "cloud.google.com/gke-tpu-topology"
GPU_ACCELERATOR_LABEL: Final = "cloud.google.com/gke-accelerator"
TPU_RESOURCE: Final = "google.com/tpu"
GPU_RESOURCE: Final = "nvidia.com/gpu"
TPU_TAINT_KEY: Final = "google.com/tpu"
GPU_TAINT_KEY: Final = "nvidia.com/gpu"
#: GKE's disruption signals on a node. "Now": the taint GKE puts on a node about to be reclaimed, the
#: taint set when a host maintenance window opens, and the label set while host maintenance runs.
IMPENDING_TERMINATION_TAINT: Final = "cloud.google.com/impending-node-termination"
MAINTENANCE_WINDOW_STARTED_TAINT: Final = "cloud.google.com/maintenance-window-started"
ACTIVE_MAINTENANCE_LABEL: Final = "cloud.google.com/active-node-maintenance"
#: Values of ACTIVE_MAINTENANCE_LABEL that mean the maintenance runs now.
ACTIVE_MAINTENANCE_VALUES: Final = frozenset({"ONGOING", "true"})
#: "Later": the time of an upcoming host maintenance, in Unix epoch seconds (GKE sets it days ahead).
SCHEDULED_MAINTENANCE_LABEL: Final = "cloud.google.com/scheduled-maintenance-time"
UNREACHABLE_TAINT: Final = "node.kubernetes.io/unreachable"
NOT_READY_TAINT: Final = "node.kubernetes.io/not-ready"
HOSTNAME_LABEL: Final = "kubernetes.io/hostname"

# --- Kueue (plain Pod integration: the workers of one generation are one pod group, admitted as a gang) ---
#: On the JAXJob (or its template): the LocalQueue; passed to every worker pod.
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
#: On each worker pod: the generation's pod group (`<job>-g<generation>`), the Workload's name.
KUEUE_POD_GROUP_LABEL: Final = "kueue.x-k8s.io/pod-group-name"
#: On each worker pod: how many pods the group has; Kueue creates the Workload once it sees them all.
KUEUE_POD_GROUP_COUNT_ANNOTATION: Final = "kueue.x-k8s.io/pod-group-total-count"
#: On each worker pod, "false": the group is never retried with replacement pods (the operator's next
#: generation is a new group), so Kueue finishes its Workload and frees its quota once every pod ended.
KUEUE_RETRIABLE_ANNOTATION: Final = "kueue.x-k8s.io/retriable-in-group"
#: The pod condition Kueue sets (True, reason WorkloadEvicted, ...) on each pod of a group it stops
#: (preempted, evicted) before deleting the pod (pkg/controller/jobs/pod: ConditionTypeTerminationTarget).
KUEUE_STOP_CONDITION: Final = "TerminationTarget"

# --- containers, ports, volumes ---
TRAINER_CONTAINER: Final = "trainer"  # the default name; the first container of the template is the trainer
SIDECAR_CONTAINER: Final = "resilax-sidecar"
#: Init container that hands a scope Node local tier folder to the worker's user (chown, chmod 0700).
LOCAL_INIT_CONTAINER: Final = "resilax-local-init"
#: Init container of a new worker pod that runs `resilax health-check` (spec.recovery.healthCheck); its
#: JSON result is its termination message (policies/health_check.py reads it from the watch cache).
HEALTH_CHECK_CONTAINER: Final = "resilax-health-check"
CONTROL_VOLUME: Final = "resilax-control"
LOCAL_VOLUME: Final = "resilax-local"
TOKEN_VOLUME: Final = "resilax-token"
CONTROL_DIR: Final = "/var/run/resilax/control"
LOCAL_DIR: Final = "/var/run/resilax/local"
TOKEN_DIR: Final = "/var/run/resilax/token"
TOKEN_KEY: Final = "token"
#: How often the operator reads a running job's token Secret again: a deleted Secret is noticed (and the
#: token rotated) within this long, or at once when the next generation starts (docs/sidecar.md,
#: "Auth"). Each job reads at its own phase of the period (`k8s.token_recheck_due`), so a fleet's reads
#: spread out: one GET per job every 10 minutes stays far inside the operator's budget of one API
#: request per job per minute (docs/benchmarks.md, "The operator at fleet scale"), also in a burst.
TOKEN_RECHECK_SECONDS: Final = 600.0
#: The sidecar's own header for its token, accepted beside `Authorization: Bearer`: the API server's pod
#: proxy removes `Authorization` once it has authenticated the caller (`kubectl resilax save` uses it).
#: The sidecar keeps the same name (resilax_sidecar.api_base.TOKEN_HEADER; a test holds them equal).
SIDECAR_TOKEN_HEADER: Final = "X-Resilax-Token"
#: What a sidecar's save request id looks like (resilax_sidecar.control.valid_request_id; a test holds
#: them equal): `kubectl resilax save` refuses any other id before it goes into a proxy path.
SAVE_ID_PATTERN: Final = r"^[A-Za-z0-9_-]{1,80}$"
RESERVED_CONTAINER_NAMES: Final = frozenset({SIDECAR_CONTAINER, LOCAL_INIT_CONTAINER, HEALTH_CHECK_CONTAINER})
RESERVED_VOLUME_NAMES: Final = frozenset({CONTROL_VOLUME, LOCAL_VOLUME, TOKEN_VOLUME})

#: The trainer's exit code for "stopped for rescheduling" (resilax_ckpt.EXIT_CODE_STOPPED).
EXIT_CODE_STOPPED: Final = 75
#: The trainer's exit code for "a peer process of my generation is gone" (resilax_ckpt.EXIT_CODE_PEER_LOST):
#: not its own failure; the cause is elsewhere (a node down, a peer that failed).
EXIT_CODE_PEER_LOST: Final = 76
#: 128 + SIGABRT: how JAX's coordination service ends every surviving process of a generation once one
#: task is gone ("Terminating process because the JAX distributed service detected fatal errors"; it can
#: come before the Python error that exits 76), and how a trainer's own C++ assertion ends. A witness that
#: a peer may be gone, never proof: worker_exit.wait_for_abort_cause.
EXIT_CODE_ABORTED: Final = 134
#: The exit codes that make a worker a witness of a peer's loss: its nodes' Leases are read
#: (observed/snapshot.nodes_needing_lease) and a node they prove down is a NodeLoss at once (node_loss.py).
PEER_LOSS_WITNESS_CODES: Final = frozenset({EXIT_CODE_PEER_LOST, EXIT_CODE_ABORTED})
#: The trainer's exit code for "a live JAXJob of another uid holds the checkpoint storage"
#: (resilax_ckpt.EXIT_CODE_STORAGE_IN_USE): the job fails with StorageInUse instead of fencing it out.
EXIT_CODE_STORAGE_IN_USE: Final = 78
#: `resilax health-check`'s exit code for a host that failed its check (resilax_ckpt.trainer.health_check.EXIT_UNHEALTHY).
EXIT_CODE_UNHEALTHY: Final = 79

# --- phases ---
PHASE_PENDING: Final = "Pending"
PHASE_RUNNING: Final = "Running"
PHASE_SAVING: Final = "Saving"
PHASE_RECOVERING: Final = "Recovering"
PHASE_RESIZING: Final = "Resizing"
PHASE_SUSPENDED: Final = "Suspended"
PHASE_SUCCEEDED: Final = "Succeeded"
PHASE_FAILED: Final = "Failed"
PHASES: Final = (PHASE_PENDING, PHASE_RUNNING, PHASE_SAVING, PHASE_RECOVERING, PHASE_RESIZING,
                 PHASE_SUSPENDED, PHASE_SUCCEEDED, PHASE_FAILED)
TERMINAL_PHASES: Final = frozenset({PHASE_SUCCEEDED, PHASE_FAILED})

# --- condition types ---
COND_READY: Final = "Ready"
COND_SAVING: Final = "Saving"
COND_DEGRADED: Final = "Degraded"
COND_INVALID_SPEC: Final = "InvalidSpec"
#: True when the workers restored an older step because newer committed ones could not be read.
COND_CHECKPOINT_FALLBACK: Final = "CheckpointFallback"
#: True while a node hosting a worker has a host maintenance scheduled (the job moves before it).
COND_MAINTENANCE: Final = "MaintenanceScheduled"
#: True while spec.suspend holds and no worker is left (JobSet's condition of the same name).
COND_SUSPENDED: Final = "Suspended"
#: True while an object the job needs (a worker pod, its Service, its token Secret) has a name another
#: owner's object holds (never adopted).
COND_NAME_CONFLICT: Final = "NameConflict"
#: A worker's own step time is >= 1.5x the generation's median (policies/straggler.py); absent when none is.
COND_STRAGGLER: Final = "Straggler"
#: True once the job Succeeded (Kubernetes Job's and JobSet's condition: `kubectl wait --for=condition=Completed`).
COND_COMPLETED: Final = "Completed"
#: True once the job Failed; reason and message are the Ready condition's (why it failed).
COND_FAILED: Final = "Failed"
#: True while the job keeps nodes out of its generations because they failed the health check
#: (status.unhealthyNodes, policies/health_check.py); absent when none is.
COND_UNHEALTHY_NODES: Final = "UnhealthyNodes"
CONDITION_TYPES: Final = (COND_READY, COND_SAVING, COND_DEGRADED, COND_INVALID_SPEC, COND_CHECKPOINT_FALLBACK,
                          COND_MAINTENANCE, COND_SUSPENDED, COND_NAME_CONFLICT, COND_STRAGGLER, COND_COMPLETED,
                          COND_FAILED, COND_UNHEALTHY_NODES)


@dataclass(frozen=True)
class Reason:
    """A CamelCase condition/event reason and its message template (`str.format` fields)."""

    name: str
    message: str

    def format(self, **fields: Any) -> str:
        return self.message.format(**fields)


# Reasons, each with its message. Fields in braces are filled by the caller.
GENERATION_CREATED = Reason("GenerationCreated", "generation {generation}: {count} x {topology} ({hosts} hosts), restoring {restore}")
WORKERS_STARTING = Reason("WorkersStarting", "generation {generation}: {running} of {hosts} workers running")
WORKERS_RUNNING = Reason("WorkersRunning", "generation {generation}: all {hosts} workers running")
COMPLETED = Reason("Completed", "all workers of generation {generation} exited 0")
INSUFFICIENT_CAPACITY = Reason("InsufficientCapacity", "no shape fits the healthy capacity: {detail}")
PREEMPTION_NOTICE = Reason("PreemptionNotice", "node {node} hosting generation {generation} has a preemption notice ({notice})")
MAINTENANCE_SCHEDULED = Reason("MaintenanceScheduled",
                               "node {node} hosting generation {generation} has host maintenance at {time}; the job "
                               "saves and moves from {move_at} (lead {lead}s)")
NO_MAINTENANCE = Reason("NoMaintenance", "no node hosting a worker has host maintenance scheduled")
NODE_LOST = Reason("NodeLost", "node {node} hosting generation {generation} has not been Ready for {seconds}s (grace {grace}s)")
NODE_LOSS_GUARD = Reason("NodeLossGuard",
                         "{down} of {total} nodes are NotReady/Unknown at once (guard: at least {percent}% and "
                         "{min_nodes} nodes), {node} hosting generation {generation} among them: more likely a "
                         "control-plane or network blip than that many node losses; waiting for them instead of "
                         "tearing down (no pod is force-deleted)")
NODE_NOT_READY = Reason("NodeNotReady", "node {node} hosting generation {generation} is not Ready; waiting up to {grace}s")
UNSCHEDULABLE = Reason("Unschedulable", "worker {pod} of generation {generation} was not scheduled within {seconds}s; replanning")
POD_LOST = Reason("PodLost", "worker pod {pod} of generation {generation} disappeared or was deleted")
WORKER_FAILED = Reason("WorkerFailed", "worker {pod} of generation {generation} failed: {detail}")
PEER_LOST = Reason("PeerLost", "worker {pod} of generation {generation} stopped because a peer process of its "
                   "generation is gone (exit 76); waiting up to {seconds}s for the cause (a node down, a failed peer)")
ABORT_CAUSE_WAIT = Reason("WorkerAborted", "worker {pod} of generation {generation} was aborted (exit 134, as JAX's "
                          "coordination service ends every process once one is gone); waiting up to {seconds}s for "
                          "the Leases of nodes {nodes} to show whether one is down (then NodeLoss) or alive (then "
                          "the worker's own failure)")
WORKER_UNREACHABLE = Reason(
    "WorkerUnreachable", "worker {pod} of generation {generation} is unreachable: its trainer has not been ready for "
    "{seconds}s and its sidecar does not answer ({count} of {hosts} workers so); whether the trainer exited is "
    "unknown: replacing it as a pod-level loss, not counted as a failure")
WORKER_STOPPED = Reason("WorkerStopped", "worker {pod} of generation {generation} stopped for rescheduling (exit {code})")
CONTAINER_WAITING = Reason("ContainerWaiting", "worker {pod} of generation {generation}: container {container} is "
                           "waiting: {reason}{message}; fix: {fix}")
CONTAINER_WAITING_TIMEOUT = Reason("ContainerWaitingTimeout", "a container waited longer than {seconds}s: {detail}")
POD_LOSS_BACKOFF = Reason("PodLossBackoff", "pod-level loss {losses} in a row (failing after {max_losses}); the next "
                          "generation starts at {until}")
POD_LOSSES_EXCEEDED = Reason("PodLossesExceeded", "{losses} pod-level losses in a row, none after a generation that "
                             "ran {reset}s (operator setting max_pod_losses={max_losses}); last: {detail}")
BACKOFF = Reason("Backoff", "restart {failures} of {max_restarts} after a worker failure; waiting until {until}")
STORAGE_IN_USE = Reason("StorageInUse", "spec.checkpoint.storage {storage} is in use by {holders}, live on the same "
                        "storage; worker {pod} refused to take it over (exit 78), which would stop that job's "
                        "commits; give this job a storage of its own, or set spec.checkpoint.takeOver: true")
FAILED_BY_RULE = Reason("FailedByRule", "worker {pod} of generation {generation} failed ({detail}) and "
                        "spec.recovery.failureRules[{index}] says FailJob")
NOT_COUNTED_BY_RULE = Reason("WorkerFailedNotCounted", "worker {pod} of generation {generation} failed ({detail}); "
                             "spec.recovery.failureRules[{index}] says RestartWithoutCounting: not counted "
                             "against maxRestarts")
SPEC_FIXED = Reason("SpecFixed", "the spec that failed the job was fixed; the job starts")
TTL_EXPIRED = Reason("TTLExpired", "finished {seconds}s ago (spec.ttlSecondsAfterFinished={ttl}): deleting the JAXJob")
MAX_RESTARTS_EXCEEDED = Reason("MaxRestartsExceeded", "worker failures exceeded recovery.maxRestarts={max_restarts}; last: {detail}")
SPEC_RESIZED = Reason("SpecResized", "spec changed: resizing from {old} to {new}")
GROW_BACK = Reason("GrowBack", "capacity returned: growing from {old} to {new}")
FINAL_SAVE_DONE = Reason("FinalSaveDone", "final save of generation {generation} finished: {detail}")
FINAL_SAVE_TIMEOUT = Reason("FinalSaveTimeout", "final save of generation {generation} did not finish within {seconds}s; stopping it anyway")
SHRUNK = Reason("Shrunk", "running {current}, below the spec's {wanted}")
AT_FULL_SHAPE = Reason("AtFullShape", "running at the largest allowed shape {current}")
POD_CREATION_REFUSED = Reason("PodCreationRefused", "generation {generation}: the API server refused pod {pod}: {detail}{fix}")
#: The fix named in POD_CREATION_REFUSED's message when the job's pods mount a hostPath local tier.
HOSTPATH_FIX: Final = (" -- checkpoint.local.scope: Node mounts a hostPath folder, which the Pod Security levels "
                       "baseline and restricted refuse (restricted also refuses its init container running as "
                       "root): set "
                       "checkpoint.local.scope: Pod (an emptyDir, no restart from the local tier), or run the job "
                       "in a namespace labelled pod-security.kubernetes.io/enforce=privileged")
STEPS_SKIPPED = Reason("CheckpointStepsSkipped",
                       "generation {generation} restored step {step}: newer committed steps could not be read and "
                       "were marked bad (kept in storage): {skipped}")
WAITING_FOR_CAPACITY = Reason(
    "WaitingForCapacity",
    "generation {generation}: {waiting} of {hosts} workers wait for nodes that do not exist yet "
    "(capacity.provisioning: Autoscaled; their pending pods are what a cluster autoscaler, node auto-provisioning "
    "or flex-start adds nodes for): {missing}; {then}")
WAITING_FOR_ADMISSION = Reason(
    "WaitingForAdmission",
    "generation {generation}: {waiting} of {hosts} workers are held by scheduling gates ({gates}): waiting for "
    "the queue (Kueue) to admit the pod group {group}")
CAPACITY_TIMEOUT = Reason(
    "CapacityTimeout",
    "generation {generation}: {waiting} workers found no node within capacity.shrinkAfterSeconds={seconds}; "
    "shrinking from {old} to {new}, which the Ready nodes fit")
QUEUE_EVICTED = Reason("QueueEvicted", "the queue (Kueue) stopped generation {generation}, pod group {group} "
                       "({detail}): not a failure; the workers save on SIGTERM and the next generation queues again")
SUSPENDING = Reason("Suspending", "spec.suspend is true: saving and stopping generation {generation}")
SUSPENDED = Reason("Suspended", "spec.suspend is true: no workers; false again starts a generation that restores "
                   "the newest committed step (the last the operator saw: {step})")
RESTARTING_IN_PLACE = Reason(
    "RestartingInPlace", "generation {generation}: restarting in place after {cause}: keeping {kept} of {hosts} "
    "pods ({pods}), their trainers restarted; {replaced} pods new")
TRAINER_HUNG = Reason(
    "TrainerHung", "worker {pod} (process {process}, node {node}) of generation {generation} hung: {why}; last step "
    "{step} at {step_time}, phase {phase}; no progress for {seconds}s (timeout {timeout}s, {basis}); restarting the "
    "generation, not counted as a failure")
STRAGGLER_SUSPECTED = Reason(
    "StragglerSuspected", "worker {pod} of generation {generation} takes {seconds}s of its own per step, {ratio}x the "
    "median {median}s of the {hosts} hosts; StragglerDetected if that lasts {minutes} min")
STRAGGLER_DETECTED = Reason(
    "StragglerDetected", "worker {pod} (process {process}, node {node}) of generation {generation} is a straggler: "
    "{seconds}s of its own per step, {ratio}x the median {median}s of the {hosts} hosts, for {minutes} min")
IN_PLACE_UNAVAILABLE = Reason("InPlaceUnavailable", "generation {generation}: every pod replaced, not in place: {why}")
IN_PLACE_STOP_TIMEOUT = Reason("InPlaceStopTimeout", "generation {generation}: the old trainer of {pods} was not "
                               "proven gone within {seconds}s (recovery.inPlaceStopTimeoutSeconds); replacing those pods")
#: A generation Recovering (or Resizing) for minutes: what it waits for (policies/recovery_wait.py).
RECOVERY_WAITING = Reason("RecoveryWaiting", "generation {generation} has been {phase} for {waited}: waiting for {what}")
#: A Ready node held down by a witnessed Lease not yet expired in full would change the plan: wait, do not shrink.
LEASE_LAGGING = Reason("WaitingForLease", "generation {generation}: node(s) {nodes} still Ready but held down by a "
                       "witnessed Lease; planning waits until {until} (the Lease's full duration) before running "
                       "without them")
RESUMED = Reason("Resumed", "spec.suspend is false: generation {generation} restores {restore}")
ROLLBACK_ASKED = Reason("RollbackAsked", "spec.checkpoint.restore.step is now {step}: generation {generation} saves "
                        "its current step, then generation {next} restores step {step}; the newer steps are "
                        "kept on their own branch (superseded, never deleted)")
ROLLBACK_REFUSED = Reason("RollbackRefused", "spec.checkpoint.restore.step: {step} is not a committed step of this job: "
                          "the newest visible committed step is {newest}; a rollback names a step at or below it "
                          "(`kubectl resilax timeline` lists them); the job runs on")
SPEC_VALID = Reason("SpecValid", "the spec is valid")
SPEC_INVALID = Reason("SpecInvalid", "{problems}")
#: An invalid edit of a job that has run: it keeps running under status.lastValidSpec until fixed.
SPEC_INVALID_KEPT = Reason("LastValidSpecKept", "{problems} -- the job runs on under its last valid spec "
                           "(metadata.generation {generation}) until the spec is fixed")
NAME_CONFLICT = Reason("NameConflict", "generation {generation}: {kind} {name} exists and is not this job's "
                       "({owner}); the job does not adopt it and waits (delete or rename it)")
NO_NAME_CONFLICT = Reason("NoNameConflict", "every worker of generation {generation} is this job's own and runs")
NOT_SAVING = Reason("NotSaving", "no final save in progress")
SAVING = Reason("FinalSaveInProgress", "final save ({reason}) of generation {generation} in progress until {deadline}")
HEALTH_CHECK_FAILED = Reason("HealthCheckFailed",
                             "node {node} failed the health check of generation {generation} (worker {pod}, {part}: "
                             "{detail}); it is kept out of this and later generations ({failures} failure(s) so far)")
HEALTH_CHECK_SLICE_FAILED = Reason("HealthCheckSliceFailed",
                                   "worker {pod} of generation {generation} failed the health check's {part} part "
                                   "({detail}); no host is blamed for a part that needs the others: the generation "
                                   "starts again")
NODES_KEPT_OUT = Reason("NodesKeptOut", "kept out of new generations after a failed health check: {nodes}")
SPARE_TAKEN = Reason("SpareTaken", "generation {generation} takes the spare slice(s) on node pool(s) {pools} at "
                    "full size; their placeholder pods are deleted and replaced where capacity allows")
SPARE_JOB_SUSPENDED = Reason("SpareJobSuspended", "generation {generation} waits for capacity: suspending JAXJob {job} "
                             "(annotated resilax.dev/spare-for: {name}) after its final save, to take its nodes")
SPARE_JOB_RESUMED = Reason("SpareJobResumed", "JAXJob {job}, suspended to serve as this job's spare, is resumed "
                           "({why}); it waits for capacity of its own")
