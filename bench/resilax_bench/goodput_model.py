"""Goodput under a failure schedule, computed from what a run recorded (pure: no I/O, no clock).

Two pure pieces the goodput benchmark (`resilax_bench.goodput`) drives:

* `build_schedule(seed, ...)`: the seeded failure schedule (hard node losses every ~`kill_every`
  seconds with jitter, one preemption notice in place of the second loss, each followed by the node's
  return after `restore_after` seconds, which lets the job grow back). The same seed gives the same
  schedule, so both variants of one run (Resilax, restart-from-persistent) face the same faults.
* `compute_goodput(...)`: goodput = time of the steps that count toward the final model / wall time,
  and where the rest of the wall time went. Inputs are process 0's step records (`LossRecord`: step,
  generation, wall time; resilax_local.demo.timeline), the faults injected, and per generation the times the
  harness saw from the API and the trainer: the operator's reaction (detected), the new pods created,
  running, the trainer's restore began and ended.

The breakdown is the operator's own accounting (`resilax_operator.status_fields.goodput`: the buckets, how a
generation's window is split at its marks, checkpoint blocking and lost steps), fed with what the
harness saw instead of what the operator sees: each step's time from the loss lines (a generation's
checkpoint blocking = the excess of its step gaps over their median), the injected fault's time (the
time from the last step to a later fault is `other`, from the fault to the reaction `detection`), pod
times from the API, the restore from process 0's restore line. See that module for the table.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from resilax_local.demo.timeline import Fault, JobSnapshot, LossRecord, TimelineEvent
from resilax_operator.status_fields import goodput
from resilax_operator.status_fields.goodput import BUCKETS

KILL, PREEMPT, RESTORE = "kill-node", "preempt-node", "restore-node"
__all__ = ["BUCKETS", "KILL", "PREEMPT", "RESTORE", "GenerationMarks", "Goodput", "GoodputInputError", "PlannedFault",
           "ProjectedGeneration", "Projection", "Recovery", "build_generation_marks", "build_projected_generations",
           "build_schedule", "compute_goodput", "find_reaction", "project_goodput", "project_testbed_run",
           "recoveries", "restart_costs"]


class GoodputInputError(ValueError):
    """A schedule or a run record that cannot be measured (names the field and the value)."""


@dataclass(frozen=True)
class PlannedFault:
    """One fault of the schedule, `at` seconds after the job started training."""

    at: float
    kind: str  # KILL, PREEMPT or RESTORE
    victim: int  # which fault this is (a RESTORE names the fault whose node returns)


def build_schedule(seed: int, duration: float, kill_every: float = 300.0, restore_after: float = 90.0,
                   jitter: float = 0.2, preempt_index: int = 1) -> tuple[PlannedFault, ...]:
    """Faults at ~`kill_every` s (± `jitter` of it, from `seed`), the first at ~`kill_every`; fault
    number `preempt_index` (0-based) is a preemption notice instead of a hard loss; every fault's node
    returns `restore_after` s later (grow-back). Faults that would return after `duration` are left out,
    so every fault's recovery and grow-back happen within the run."""
    for name, value in (("duration", duration), ("kill_every", kill_every), ("restore_after", restore_after)):
        if value <= 0:
            raise GoodputInputError(f"{name} must be > 0 seconds, got {value!r}")
    if not 0 <= jitter < 0.5:
        raise GoodputInputError(f"jitter must be in [0, 0.5), got {jitter!r}")
    if restore_after >= kill_every * (1 - 2 * jitter):
        raise GoodputInputError(f"restore_after ({restore_after!r}) must be shorter than the shortest gap "
                                f"between faults, kill_every * (1 - 2 * jitter) = {kill_every * (1 - 2 * jitter)!r}")
    rng = random.Random(seed)
    out: list[PlannedFault] = []
    i = 0
    while True:
        at = (i + 1) * kill_every + rng.uniform(-jitter, jitter) * kill_every
        if at + restore_after > duration:
            break
        out.append(PlannedFault(round(at, 1), PREEMPT if i == preempt_index else KILL, i))
        out.append(PlannedFault(round(at + restore_after, 1), RESTORE, i))
        i += 1
    return tuple(sorted(out, key=lambda f: f.at))


@dataclass(frozen=True)
class GenerationMarks:
    """What the harness saw of one generation's start (epoch seconds; None: not seen)."""

    detected: float | None = None  # the operator reacted to replace the generation BEFORE this one
    pods_created: float | None = None  # the first pod of the generation was created
    pods_running: float | None = None  # every pod of the generation was Running (containers started)
    restored: float | None = None  # the trainer finished its restore (process 0's restore line)
    restore_began: float | None = None  # the trainer began its restore (the restore line's `began`)


@dataclass(frozen=True)
class Goodput:
    wall_seconds: float
    buckets: Mapping[str, float]
    final_step: int
    steps_trained: int  # step records, counting redone ones
    steps_lost: int  # steps a later generation trained again (the operator's accounting's count)
    generations: int  # generations that trained
    faults: int
    #: Productive seconds, each weighted by its generation's devices over the job's full devices (the
    #: operator accounting's device_productive; None: every generation at the full shape).
    device_productive: float | None = None

    @property
    def goodput(self) -> float:
        return self.buckets["productive"] / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def device_weighted_goodput(self) -> float:
        """A second trained at half the devices counts half (`resilax_operator.status_fields.goodput.Goodput.device_ratio`)."""
        weighted = self.buckets["productive"] if self.device_productive is None else self.device_productive
        return weighted / self.wall_seconds if self.wall_seconds > 0 else 0.0


def _blocking(rs: Sequence[LossRecord]) -> float:
    """A generation's checkpoint blocking: the excess of its step gaps over their median."""
    gaps = [b.time - a.time for a, b in pairwise(rs)]
    if not gaps:
        return 0.0
    median = statistics.median(gaps)
    return sum(max(0.0, g - median) for g in gaps)


def build_generation_marks(records: Sequence[LossRecord], faults: Sequence[Fault], end: float,
                           marks: Mapping[int, GenerationMarks],
                           full_devices: int | None = None) -> list[goodput.GenerationMarks]:
    """The operator accounting's marks of each generation, from what the harness recorded. Each
    generation's `devices_share`: the devices its step lines report over `full_devices` (None: the
    most any generation reported, the job's full shape), at most 1; 1 for a generation without steps."""
    by_gen: dict[int, list[LossRecord]] = {}
    for r in sorted(records, key=lambda r: (r.time, r.step)):
        by_gen.setdefault(r.generation, []).append(r)
    hard = sorted(f.time for f in faults if f.kind in (KILL, PREEMPT))
    gens = sorted(set(by_gen) | set(marks))
    full = full_devices if full_devices is not None else max((r.devices for r in records), default=0)
    if full_devices is not None and full_devices < 1:
        raise GoodputInputError(f"full_devices must be >= 1, got {full_devices!r}")
    out: list[goodput.GenerationMarks] = []
    for n, g in enumerate(gens):
        m = marks.get(g, GenerationMarks())
        nxt = marks.get(gens[n + 1], GenerationMarks()) if n + 1 < len(gens) else None
        rs = by_gen.get(g, [])
        began = m.pods_created or m.pods_running or (rs[0].time if rs else None)
        nxt_rs = by_gen.get(gens[n + 1], []) if nxt is not None else []
        nxt_begins = (nxt.pods_created or nxt.pods_running or (nxt_rs[0].time if nxt_rs else None)) \
            if nxt is not None else None
        window_end = nxt_begins if nxt_begins is not None else end
        after = rs[-1].time if rs else began
        fault = max((t for t in hard if after is not None and after <= t <= window_end), default=None)
        out.append(goodput.GenerationMarks(
            generation=g, created=m.pods_created, running=m.pods_running, restore_began=m.restore_began,
            restore_ended=m.restored, first_step=rs[0].step if rs else None, first_step_time=rs[0].time if rs else None,
            last_step=rs[-1].step if rs else None, last_step_time=rs[-1].time if rs else None,
            blocking_seconds=_blocking(rs), detected=nxt.detected if nxt is not None else None, fault=fault,
            devices_share=min(1.0, max(r.devices for r in rs) / full) if rs and full else 1.0))
    return out


#: The operator's Event of an in-place restart (policies/inplace.py): "RestartingInPlace: generation N: ...".
IN_PLACE_REASON = "RestartingInPlace"


def pod_marks(generation: int, created: float | None, running: float | None,
              events: Iterable[TimelineEvent]) -> tuple[float | None, float | None]:
    """A generation's pods' `created` and `running` marks (the earliest creation, the latest container
    start). A generation started in place keeps pods created and started for an earlier one: its pods
    count from its RestartingInPlace Event (a new pod's own times when later)."""
    prefix = f"{IN_PLACE_REASON}: generation {generation}:"
    start = min((e.time for e in events if e.text.startswith(prefix)), default=None)
    if start is None:
        return created, running
    return (start if created is None or created < start else created,
            start if running is None or running < start else running)


#: Job Events that announce a wait, not the move to a new generation (the operator's accounting starts
#: detection's end at the transition too): not a reaction.
WAITING_REASONS = ("PeerLost", "NodeNotReady", "NodeLossGuard", "MaintenanceScheduled")


def find_reaction(previous: int, steps: Sequence[float], started: float | None, until: float | None,
                  snapshots: Sequence[JobSnapshot], events: Iterable[TimelineEvent]) -> float | None:
    """When the operator began replacing generation `previous`: the first job snapshot not Running (or
    on a newer generation), or the first job Event other than a wait's (`WAITING_REASONS`), from
    `previous`'s first step (`steps`: its step times; without steps, `started`) up to one second after
    the next generation's pods were created (`until`; the API's times have whole seconds). From the
    first step, not the last: a preemption's or a grow-back's reaction comes before the last step (the
    trainers step on to their final save); a later reaction (to the next fault) is not this one's."""
    since = min(steps) if steps else started
    if since is None:
        return None
    end = until + 1.0 if until is not None else float("inf")
    reacted = [s.time for s in snapshots if since <= s.time <= end
               and (s.phase != "Running" or (s.generation or 0) > previous)]
    reacted += [e.time for e in events if since <= e.time <= end and not e.text.startswith(WAITING_REASONS)]
    return min(reacted, default=None)


def compute_goodput(records: Sequence[LossRecord], faults: Sequence[Fault], start: float, end: float,
                    marks: Mapping[int, GenerationMarks] | None = None, full_devices: int | None = None) -> Goodput:
    """Goodput of the run from `start` (job applied) to `end` (measurement stopped); see the module doc.
    Device-weighted goodput weighs each generation by its devices over `full_devices` (None: the most
    any generation reported)."""
    if end <= start:
        raise GoodputInputError(f"end ({end!r}) must be after start ({start!r})")
    recs = [r for r in records if start <= r.time <= end]
    hard = [f for f in faults if f.kind in (KILL, PREEMPT)]
    gens = build_generation_marks(recs, faults, end, marks or {}, full_devices)
    if not recs:
        return Goodput(end - start, {**dict.fromkeys(BUCKETS, 0.0), "other": end - start}, 0, 0, 0, 0, len(hard))
    result = goodput.account(start, end, gens)
    final = max(recs, key=lambda r: r.time).step
    return Goodput(result.wall_seconds, result.buckets, final, len(recs), result.lost_steps,
                   len({r.generation for r in recs}), len(hard), result.device_productive)


@dataclass(frozen=True)
class Recovery:
    """A hard fault and the job's first step after it: `seconds` from the fault to the first step a
    newer generation logged (None: none did before the run ended), at `devices` of `full`."""

    at: float
    kind: str
    seconds: float | None
    devices: int | None
    full: int


def recoveries(records: Sequence[LossRecord], faults: Sequence[Fault], start: float) -> list[Recovery]:
    """For each kill or preemption, the time to the first step of the next generation (issue 39's "hard
    loss to the spare's first step"), `at` in seconds after `start`, with the devices it ran on."""
    full = max((r.devices for r in records), default=0)
    out = []
    for fault in sorted((f for f in faults if f.kind in (KILL, PREEMPT)), key=lambda f: f.time):
        before = [r for r in records if r.time <= fault.time]
        running = max(before, key=lambda r: r.time).generation if before else 0
        after = [r for r in records if r.time > fault.time and r.generation > running]
        first = min(after, key=lambda r: r.time) if after else None
        out.append(Recovery(round(fault.time - start, 1), fault.kind,
                            round(first.time - fault.time, 1) if first else None,
                            first.devices if first else None, full))
    return out


# ---------------------------------------------------------------------------- projection on other costs
#
# The 20-minute bench measures a run on CPU devices, where a trainer's start (JAX, the restore, the first
# step) costs seconds. `project_goodput` keeps what the test bed measured of the control plane (each
# fault's detection, the teardown and the wait for capacity, the scheduling of the new pods) and of the
# training loop (checkpoint blocking, steps redone, hangs, the rest), and puts another trainer start in
# place of the test bed's: from the pods Running (the trainer process launched) to its first step. Fed
# the TPU's measured restart (bench/resilax_bench/restart.py), it projects the same run on the chip.


@dataclass(frozen=True)
class ProjectedGeneration:
    """One generation of a recorded run, as the projection needs it (seconds after the job started)."""

    generation: int
    stopped_previous: float
    """When the previous generation stopped making progress: the hard loss, or, for a planned move
    (preemption notice, grow-back) that saves first, the operator's reaction. 0 for the first."""
    detected: float
    """The operator's reaction (the stop itself for the first generation and planned moves)."""
    pods_created: float
    pods_running: float
    devices_share: float
    """The share of the job's full devices this generation trains on (0.5: one of two slices)."""


@dataclass(frozen=True)
class Projection:
    wall_seconds: float
    buckets: Mapping[str, float]
    """productive, detection, waiting (teardown and the wait for capacity), scheduling, trainer_start
    (launch to first step: the projected part), and as recorded: checkpoint_blocking,
    lost_steps_redone, hang, other."""
    weighted_productive_seconds: float

    @property
    def goodput(self) -> float:
        return self.buckets["productive"] / self.wall_seconds

    @property
    def device_weighted_goodput(self) -> float:
        return self.weighted_productive_seconds / self.wall_seconds


#: Buckets of the recorded run that the projection carries over as they were (seconds, whole run).
CARRIED_BUCKETS = ("checkpoint_blocking", "lost_steps_redone", "hang", "other")


def project_goodput(wall_seconds: float, generations: Sequence[ProjectedGeneration], starts: Sequence[float],
                    carried: Mapping[str, float]) -> Projection:
    """Goodput of a run whose generations start as recorded but whose trainers take `starts[n]` seconds
    from launch to their first step (`trainer_starts`: the first generation's, then every later one's).
    Each generation trains from then until the next one's `stopped_previous` (the last: the run's end);
    `carried` seconds (CARRIED_BUCKETS) come off the productive time in proportion to each generation's
    share of it. Device-weighted: each generation's productive seconds times its `devices_share`."""
    if wall_seconds <= 0:
        raise GoodputInputError(f"wall_seconds must be > 0, got {wall_seconds!r}")
    if not generations:
        raise GoodputInputError("generations: none given; a run has at least its first generation")
    if len(starts) != len(generations):
        raise GoodputInputError(f"starts: {len(starts)} given for {len(generations)} generations; one each")
    for name, value in (*((f"starts[{n}]", v) for n, v in enumerate(starts)), *carried.items()):
        if value < 0:
            raise GoodputInputError(f"{name} must be >= 0 seconds, got {value!r}")
    buckets = dict.fromkeys(("productive", "detection", "waiting", "scheduling", "trainer_start"), 0.0)
    trained: list[float] = []
    for n, g in enumerate(generations):
        start = g.pods_running + starts[n]
        end = generations[n + 1].stopped_previous if n + 1 < len(generations) else wall_seconds
        if n:
            buckets["detection"] += g.detected - g.stopped_previous
            buckets["waiting"] += g.pods_created - g.detected
        buckets["scheduling"] += g.pods_running - g.pods_created
        buckets["trainer_start"] += min(start, end) - g.pods_running
        trained.append(max(0.0, end - start))
    total = sum(trained)
    lost = sum(carried.get(k, 0.0) for k in CARRIED_BUCKETS)
    kept = max(0.0, total - lost) / total if total else 0.0
    buckets["productive"] = total * kept
    for k in CARRIED_BUCKETS:
        buckets[k] = carried.get(k, 0.0)
    weighted = sum(t * kept * g.devices_share for t, g in zip(trained, generations, strict=True))
    return Projection(wall_seconds, buckets, weighted)


def build_projected_generations(marks: Mapping[str, Mapping[str, float | None]],
                                faults: Sequence[Mapping[str, Any]], elastic: bool,
                                lost_share: float = 0.5) -> list[ProjectedGeneration]:
    """A recorded variant's generations (the goodput JSON's `marks` and `faults`, seconds after the
    start) for `project_goodput`. A generation whose reaction follows a hard loss stopped its
    predecessor at the loss; any other (a preemption notice, a grow-back) at the reaction. An elastic
    job runs on `lost_share` of its devices from a loss or preemption until the next grow-back (the
    lost node's return); a non-elastic one always on all of them."""
    out: list[ProjectedGeneration] = []
    share = 1.0
    for n, key in enumerate(sorted(marks, key=int)):
        m = marks[key]
        running = m.get("pods_running")
        created = m.get("pods_created")
        if running is None and created is None:
            raise GoodputInputError(f"marks[{key}]: no pods_created nor pods_running; cannot place generation {key}")
        created = created if created is not None else running
        running = running if running is not None else created
        assert created is not None and running is not None
        if n == 0:
            out.append(ProjectedGeneration(int(key), 0.0, 0.0, max(created, 0.0), max(running, 0.0), 1.0))
            continue
        detected = m.get("detected")
        if detected is None:
            raise GoodputInputError(f"marks[{key}].detected: missing; the projection needs each later "
                                    "generation's reaction")
        since = out[-1].pods_running
        cause = max((f for f in faults if since < float(f["at"]) <= detected + 1.0), key=lambda f: float(f["at"]),
                    default=None)
        kind = cause["kind"] if cause is not None else None
        stopped = float(cause["at"]) if kind == KILL and cause is not None else detected
        if elastic:
            share = lost_share if kind in (KILL, PREEMPT) else 1.0 if kind == RESTORE else share
        out.append(ProjectedGeneration(int(key), min(stopped, detected), detected, created, running, share))
    return out


def trainer_starts(count: int, first_start: float, restart: float) -> list[float]:
    """`project_goodput`'s starts: `first_start` for the first generation, `restart` for the others."""
    return [first_start] + [restart] * (count - 1)


def testbed_starts(variant: Mapping[str, Any], generations: int) -> list[float]:
    """The recorded run's own trainer starts, as far as its JSON tells them: a later generation's
    pods Running to its restore line, plus an equal share (every generation's) of what the recorded
    `jax_startup` and `restore` buckets hold beyond those (the first generation's start, each restored
    trainer's first step). Projecting a run with these must give back about its recorded goodput: the
    check of the projection's own accounting."""
    marks = [variant["marks"][k] for k in sorted(variant["marks"], key=int)][:generations]
    known = [0.0] + [max(0.0, float(m["restored"]) - float(m["pods_running"]))
                     if m.get("restored") is not None and m.get("pods_running") is not None else 0.0
                     for m in marks[1:]]
    recorded = sum(float(variant["buckets_seconds"].get(k, 0.0)) for k in ("jax_startup", "restore"))
    rest = max(0.0, recorded - sum(known)) / generations
    return [k + rest for k in known]


def restart_costs(restart_result: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """From a restart bench JSON (resilax_bench.restart): the launch-to-first-step seconds that the
    projection uses, with the phase each came from: `first_start` (cold), `resilax` (prefetch when
    measured, else restore-overlap, else restore) and `baseline` (restore: a plain trainer that
    restores, then compiles)."""
    def total(phase: str) -> float | None:
        for part in restart_result.get("phases", {}).get(phase, {}).get("parts") or []:
            if part["part"].startswith("launch to first step"):
                return float(part["seconds"])
        return None

    out: dict[str, tuple[str, float]] = {}
    for role, choices in (("first_start", ("cold",)), ("resilax", ("prefetch", "restore-overlap", "restore")),
                          ("baseline", ("restore", "restore-overlap"))):
        for phase in choices:
            seconds = total(phase)
            if seconds is not None:
                out[role] = (phase, seconds)
                break
        else:
            raise GoodputInputError(f"restart JSON: no measured phase for {role} (looked for "
                                    f"{', '.join(choices)} with a 'launch to first step' part)")
    return out


RESILAX_VARIANTS = ("resilax", "resilax-spare")
"""The goodput bench's variants whose trainers start as Resilax's do (`goodput_variants.VARIANTS`; the
restore prefetch): their restarts are projected with the `resilax` phase, the others with `baseline`."""
SHRINKING_VARIANTS = ("resilax",)
"""Those that shrink to the slices left after a loss; `resilax-spare` takes its spare at full size."""


def project_testbed_run(testbed: Mapping[str, Any], costs: Mapping[str, tuple[str, float]]) -> list[dict[str, Any]]:
    """Each variant of a 20-minute goodput JSON projected with `costs` (`restart_costs`): the recorded
    goodput beside the projected plain and device-weighted goodput."""
    rows = []
    for v in testbed["variants"]:
        gens = build_projected_generations(v["marks"], v["faults"], elastic=v["variant"] in SHRINKING_VARIANTS)
        phase, restart = costs["resilax" if v["variant"] in RESILAX_VARIANTS else "baseline"]
        carried = {k: float(v["buckets_seconds"].get(k, 0.0)) for k in CARRIED_BUCKETS}
        wall = float(v["wall_seconds"])
        p = project_goodput(wall, gens, trainer_starts(len(gens), costs["first_start"][1], restart), carried)
        own = project_goodput(wall, gens, testbed_starts(v, len(gens)), carried)
        rows.append({
            "seed": testbed.get("seed"), "variant": v["variant"], "recorded_goodput": v["goodput"],
            "testbed_model_goodput": round(own.goodput, 4),
            "testbed_model_device_weighted_goodput": round(own.device_weighted_goodput, 4),
            "first_start_s": costs["first_start"][1], "restart_s": restart, "restart_phase": phase,
            "goodput": round(p.goodput, 4), "device_weighted_goodput": round(p.device_weighted_goodput, 4),
            "buckets_seconds": {k: round(val, 1) for k, val in p.buckets.items()},
            "generations": len(gens),
        })
    return rows


def render_projection(rows: Sequence[Mapping[str, Any]], platform: str) -> str:
    lines = [f"PROJECTION (not a measurement): the 20-minute goodput runs' control-plane times, with each "
             f"trainer start replaced by the one measured on {platform}", "",
             "| seed | variant | trainer start: first / restart (phase) | recorded goodput (CPU test bed) | "
             "the model on the test bed's own starts: goodput / device-weighted | "
             "projected goodput | projected device-weighted |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['variant']} | {r['first_start_s']:.1f} s / {r['restart_s']:.1f} s "
                     f"({r['restart_phase']}) | {100 * r['recorded_goodput']:.1f}% | "
                     f"{100 * r['testbed_model_goodput']:.1f}% / {100 * r['testbed_model_device_weighted_goodput']:.1f}% | "
                     f"{100 * r['goodput']:.1f}% | "
                     f"{100 * r['device_weighted_goodput']:.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="python -m resilax_bench.goodput_model",
        description="Project the 20-minute goodput runs onto another trainer start (e.g. the TPU's)")
    parser.add_argument("--restart-json", type=Path, required=True,
                        help="a restart bench result (python -m resilax_bench.restart --json)")
    parser.add_argument("--testbed-json", type=Path, nargs="+", required=True,
                        help="goodput runs (bench/results/goodput-20min-*.json)")
    parser.add_argument("--json", type=Path, help="write the projection here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(list(argv) if argv is not None else None)
    restart_result = json.loads(args.restart_json.read_text())
    costs = restart_costs(restart_result)
    env = restart_result.get("environment") or {}
    platform = f"{env.get('platform', '?')} ({env.get('device_kind', '?')})"
    rows = []
    for path in args.testbed_json:
        rows += [{**r, "testbed": path.name} for r in project_testbed_run(json.loads(path.read_text()), costs)]
    text = render_projection(rows, platform)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"projection": True, "platform": platform,
                                         "restart_json": str(args.restart_json),
                                         "restart_commit": restart_result.get("commit"),
                                         "costs": {k: {"phase": p, "seconds": s} for k, (p, s) in costs.items()},
                                         "rows": rows}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
