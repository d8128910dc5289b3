"""The nodes a decision sees (pure): `ObservedNode` (readiness, taints, notices, the Lease, the
devices others hold) and the parsers from a Node, its Lease and GKE's maintenance label."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from .. import api
from .. import status as st
from .devices import DEVICE_RESOURCES

#: The kubelet's Ready=False message during a graceful node shutdown.
SHUTTING_DOWN_MESSAGE: Final = "node is shutting down"
#: With a witness (a peer exited 76), the fraction of leaseDurationSeconds after its last renewal from
#: which a Ready node's Lease proves its kubelet dead: 0.5, two missed renewals (the kubelet renews every
#: 0.25 of the duration). docs/architecture.md, "Faster hard-loss detection (item 6)".
WITNESSED_LEASE_FRACTION: Final = 0.5
#: leaseDurationSeconds when a Lease names none (the kubelet's default).
DEFAULT_LEASE_SECONDS: Final = 40


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class ObservedNode:
    """A node, as the planner and the failure detection need it."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    taints: tuple[Taint, ...] = ()
    #: Status of the node's Ready condition: "True", "False" or "Unknown".
    ready: str = "True"
    #: lastTransitionTime of the Ready condition.
    ready_since: datetime | None = None
    unschedulable: bool = False
    #: Allocatable extended resources (google.com/tpu, nvidia.com/gpu) as integers.
    allocatable: Mapping[str, int] = field(default_factory=dict, hash=False)
    #: Requests of those resources by pods that are NOT this job's (not terminated).
    in_use_by_others: Mapping[str, int] = field(default_factory=dict, hash=False)
    #: Until when the node's Lease (kube-node-lease) says its kubelet is alive: renewTime +
    #: leaseDurationSeconds. Read only for a NotReady (Ready=False) node hosting a worker; None: unknown.
    lease_live_until: datetime | None = None
    #: The Lease's leaseDurationSeconds (its renewTime is lease_live_until less this).
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    #: The Ready condition's message (the kubelet's reason for NotReady).
    ready_message: str = ""
    #: Why this job keeps the node out of its generations (it failed the health check:
    #: policies/health_check.py marks it from status.unhealthyNodes); "" for none.
    kept_out: str = ""
    #: A placeholder of the job's own spare slice holds it (policies/spares.py `mark_spare_nodes`): free
    #: for the job's next generation, which takes such pools last (a restart keeps off its spares).
    spare: bool = False

    @property
    def pool(self) -> str | None:
        return self.labels.get(api.NODE_POOL_LABEL)

    def notice(self, now: datetime, lead: timedelta = timedelta(0)) -> str | None:
        """The disruption notice that tells the job to save and move off this node now, if any: GKE's
        "now" signals at once (the impending-termination and maintenance-window-started taints, the
        active-node-maintenance label), a scheduled host maintenance once `now` is within `lead` of its
        time (at once when the label's time cannot be read)."""
        for t in self.taints:
            if t.key in (api.IMPENDING_TERMINATION_TAINT, api.MAINTENANCE_WINDOW_STARTED_TAINT):
                return f"taint {t.key}"
        active = self.labels.get(api.ACTIVE_MAINTENANCE_LABEL)
        if active in api.ACTIVE_MAINTENANCE_VALUES:
            return f"label {api.ACTIVE_MAINTENANCE_LABEL}={active}"
        raw = self.labels.get(api.SCHEDULED_MAINTENANCE_LABEL)
        if raw is None:
            return None
        when = self.maintenance_time()
        if when is None:
            return f"label {api.SCHEDULED_MAINTENANCE_LABEL}={raw} (not a time: acting now)"
        if now >= when - lead:
            return (f"label {api.SCHEDULED_MAINTENANCE_LABEL}={raw}: host maintenance at "
                    f"{st.format_time(when)}, within the lead of {int(lead.total_seconds())}s")
        return None

    def maintenance_time(self) -> datetime | None:
        """The time of the scheduled host maintenance (the label's Unix epoch seconds; an RFC 3339 time is
        read too); None without the label or when its value is not a time."""
        return parse_maintenance_time(self.labels.get(api.SCHEDULED_MAINTENANCE_LABEL))

    def down_since(self, now: datetime) -> datetime | None:
        """When the node stopped being Ready (or got the unreachable taint); None while it is Ready, and
        while it is NotReady (Ready=False) with a live Lease: its kubelet runs and still manages the pods
        (a runtime or network-plugin hiccup), so it is no node loss and nothing on it is force-deleted.
        A node whose kubelet says it is shutting down (graceful node shutdown: a spot VM's preemption) is
        down whatever its Lease: it is going away."""
        if self.ready == "False" and self.lease_live_until is not None and now < self.lease_live_until \
                and SHUTTING_DOWN_MESSAGE not in self.ready_message \
                and not any(t.key == api.UNREACHABLE_TAINT for t in self.taints):
            return None
        if self.ready != "True":
            return self.ready_since or now
        if any(t.key == api.UNREACHABLE_TAINT for t in self.taints):
            return self.ready_since or now
        proof = self.lease_proof_at()
        if proof is not None and now >= proof:
            # Still Ready for the node lifecycle controller, but its Lease (read for a Ready node only when
            # a worker exited 76, a witness, or a lost pod's replacement is due: `nodes_needing_lease`)
            # missed two renewals: the same evidence as the controller's, without its grace
            # (WITNESSED_LEASE_FRACTION).
            return proof
        return None

    def lease_proof_at(self) -> datetime | None:
        """When this node's Lease, as read, proves its kubelet dead to a witness (None: not read)."""
        if self.lease_live_until is None:
            return None
        return self.lease_live_until - timedelta(seconds=self.lease_seconds * (1 - WITNESSED_LEASE_FRACTION))

    def lease_lags(self, now: datetime) -> bool:
        """Held down only by a witnessed Lease whose full duration has not passed: Ready for the node
        lifecycle controller, no unreachable taint, `lease_proof_at` reached but `lease_live_until` not. Its
        kubelet's renewals may merely lag: capacity planning does not shrink the job for it yet
        (`capacity.plan_lease_wait`), while new pods still avoid it (`Observed.avoid_list`)."""
        proof = self.lease_proof_at()
        return (self.ready == "True" and proof is not None and self.lease_live_until is not None
                and proof <= now < self.lease_live_until
                and not any(t.key == api.UNREACHABLE_TAINT for t in self.taints))

    def schedulable(self, now: datetime, lead: timedelta = timedelta(0)) -> bool:
        """Whether a new generation may use this node: up, no notice within `lead`, not cordoned."""
        return (self.ready == "True" and self.down_since(now) is None and self.notice(now, lead) is None
                and not self.unschedulable and not self.kept_out
                and not any(t.key == api.NOT_READY_TAINT for t in self.taints))


def parse_maintenance_time(raw: str | None) -> datetime | None:
    """`cloud.google.com/scheduled-maintenance-time` → a time: Unix epoch seconds as GKE writes them (an
    RFC 3339 time is accepted too); None when absent or unreadable."""
    if not raw:
        return None
    try:
        return datetime.fromtimestamp(int(raw), UTC)
    except (ValueError, OverflowError, OSError):
        pass
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def parse_lease(raw: Mapping[str, Any]) -> datetime | None:
    """A node's Lease (coordination.k8s.io/v1, namespace kube-node-lease) → until when it says the
    kubelet is alive (renewTime + leaseDurationSeconds); None when it has no renewTime."""
    spec = raw.get("spec") or {}
    try:
        renewed = st.parse_time(spec.get("renewTime"))
    except ValueError:
        return None
    if renewed is None:
        return None
    return renewed + timedelta(seconds=parse_lease_seconds(raw))


def parse_lease_seconds(raw: Mapping[str, Any]) -> int:
    """A node's Lease → its leaseDurationSeconds (DEFAULT_LEASE_SECONDS when it names none)."""
    try:
        return int((raw.get("spec") or {}).get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS)
    except (TypeError, ValueError):
        return DEFAULT_LEASE_SECONDS


def parse_node(raw: Mapping[str, Any], in_use_by_others: Mapping[str, int] | None = None,
               lease_live_until: datetime | None = None) -> ObservedNode:
    """A Node as the API returns it → ObservedNode. `in_use_by_others`: see `devices.count_devices_in_use`;
    `lease_live_until`: see `parse_lease`."""
    meta = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    status = raw.get("status") or {}
    ready: Mapping[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    allocatable = {}
    for r in DEVICE_RESOURCES:
        value = (status.get("allocatable") or {}).get(r)
        if value is not None:
            allocatable[r] = int(str(value))
    return ObservedNode(
        name=str(meta.get("name", "")), labels=dict(meta.get("labels") or {}),
        taints=tuple(Taint(str(t.get("key", "")), str(t.get("value", "") or ""), str(t.get("effect", "")))
                     for t in spec.get("taints") or []),
        ready=str(ready.get("status", "Unknown")), ready_since=st.parse_time(ready.get("lastTransitionTime")),
        ready_message=str(ready.get("message") or ""),
        unschedulable=bool(spec.get("unschedulable", False)), allocatable=allocatable,
        in_use_by_others=dict(in_use_by_others or {}), lease_live_until=lease_live_until)
