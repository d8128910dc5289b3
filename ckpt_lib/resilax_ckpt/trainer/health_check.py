"""`resilax health-check`: is this host fit to run a generation's trainer? (issue 39, "Health-checked starts")

Runs in the worker image before the trainer (docs/architecture.md, "Health-checked starts"), within a
time bound, four parts in order:
0. `rendezvous`: when the environment describes several processes (`JAX_NUM_PROCESSES` > 1),
   `jax.distributed.initialize` with the slice's other processes (JAX wants it before any device use).
1. `devices`: the local devices are visible, as many as the operator planned (`RESILAX_DEVICES_PER_HOST`)
   and of the expected platform (`RESILAX_HEALTH_PLATFORM`: tpu, gpu or cpu; unset: any).
2. `matmul`: a small deterministic matmul on every local device gives the known checksum. The inputs are
   small integers in bfloat16 (exact), the products are accumulated in float32 (every partial sum is an
   integer below 2**24: exact on every backend) and the checksum is an int32 weighted sum (no overflow),
   so one value holds on CPU, GPU and TPU; `expected_checksum` computes it with NumPy in int64.
3. `collective`: with several processes, a psum over all devices of the slice gives N(N+1)/2 for N
   devices. Rendezvous and collective are skipped (passed) for one process.
A part that fails stops the check (a host whose devices are missing does not join the collective).
`devices` and `matmul` are this host's own (HOST_PARTS: a failure there blames the host); `rendezvous`
and `collective` need the others (SLICE_PARTS: a failure there may be any host's, e.g. one that left
after failing its own part).

Prints one JSON line on stdout (`{"healthy": ..., "parts": [...], "seconds": ...}`), writes the same to
`--result FILE` (the pod's termination message: the operator reads it from its watch cache), writes its
verdict to `health.json` in `$RESILAX_CONTROL_DIR` when that is set (control/health_verdict.py: the
sidecar reads it, and on SIGTERM does not wait for a final save from a trainer that never ran because
the check failed) and exits 0 (healthy), EXIT_UNHEALTHY (a part failed or
ran past the time bound) or 2 (a usage error).
`decide_health` is the pure decision over the measurements; the rest only measures.

Test only: `RESILAX_HEALTH_FAULT=devices|matmul|collective|hang` makes this host fail that part for
real (one device fewer is listed; one input element on the first device is off by one; this process's
psum contribution is off by one; the check sleeps past its bound). The local cluster's node agent sets it
on the containers of a node given the `unhealthy` fault (`Cluster.make_node_unhealthy`); nothing else may.

Runs with JAX and NumPy only (no tensorstore): `python3 -m resilax_ckpt.trainer.health_check --timeout 60`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from resilax_ckpt.control.health_verdict import HEALTH_FILE, build_verdict, write_verdict
from resilax_ckpt.multihost import wait_for_coordinator

EXIT_HEALTHY: Final = 0
EXIT_USAGE: Final = 2
#: The exit code of a host that failed its check (resilax's own; the JSON result says which part and why).
EXIT_UNHEALTHY: Final = 79
PARTS: Final = ("rendezvous", "devices", "matmul", "collective")
#: Parts whose failure is this host's own; a failure in the others (SLICE_PARTS) may be any host's.
HOST_PARTS: Final = ("devices", "matmul")
SLICE_PARTS: Final = ("rendezvous", "collective")
FAULTS: Final = ("devices", "matmul", "collective", "hang")
PLATFORMS: Final = ("tpu", "gpu", "cpu")
DEFAULT_TIMEOUT_SECONDS: Final = 120.0
#: The matmul's side: 256x256 bfloat16 inputs in -2..2, so each product entry is at most 256*4 = 1024.
MATMUL_SIZE: Final = 256
#: The check's own key prefix in the coordination service.
RESULT_PREFIX: Final = "RESILAX_HEALTH "


@dataclasses.dataclass(frozen=True)
class HealthSettings:
    """What the check expects, from the environment the operator injects (and the command line)."""

    expected_devices: int | None = None
    """`RESILAX_DEVICES_PER_HOST`: the local devices this host must show; None: any number >= 1."""
    expected_platform: str | None = None
    """`RESILAX_HEALTH_PLATFORM` (tpu, gpu, cpu); None: any. Defaults to tpu where `TPU_WORKER_ID` is set."""
    num_processes: int = 1
    """`JAX_NUM_PROCESSES`: more than one runs the collective."""
    process_id: int = 0
    """`JAX_PROCESS_ID`."""
    coordinator: str = ""
    """`JAX_COORDINATOR_ADDRESS` (host:port)."""
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    """`--timeout` or `RESILAX_HEALTH_TIMEOUT_SECONDS`: the whole check's bound."""
    fault: str | None = None
    """`RESILAX_HEALTH_FAULT` (test only): the part this host fails on purpose."""
    control_dir: str | None = None
    """`RESILAX_CONTROL_DIR`: the pod's control folder, where HEALTH_FILE goes; None: no verdict file."""

    @classmethod
    def from_env(cls, env: Mapping[str, str], timeout: float | None = None) -> HealthSettings:
        """Raises ValueError naming the variable, its value and what is allowed; all problems at once."""
        problems: list[str] = []

        def integer(name: str, default: int | None, minimum: int) -> int | None:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            if not raw.isdigit() or int(raw) < minimum:
                problems.append(f"{name}: {raw!r} is not allowed; allowed: an integer >= {minimum}")
                return default
            return int(raw)

        devices = integer("RESILAX_DEVICES_PER_HOST", None, 1)
        processes = integer("JAX_NUM_PROCESSES", 1, 1) or 1
        process_id = integer("JAX_PROCESS_ID", 0, 0) or 0
        platform = env.get("RESILAX_HEALTH_PLATFORM", "").strip().lower() or None
        if platform is None and env.get("TPU_WORKER_ID", "").strip():
            platform = "tpu"
        if platform is not None and platform not in PLATFORMS:
            problems.append(f"RESILAX_HEALTH_PLATFORM: {platform!r} is not allowed; allowed: {', '.join(PLATFORMS)}")
        fault = env.get("RESILAX_HEALTH_FAULT", "").strip() or None
        if fault is not None and fault not in FAULTS:
            problems.append(f"RESILAX_HEALTH_FAULT: {fault!r} is not allowed; allowed: {', '.join(FAULTS)} (test only)")
        if timeout is None:
            raw = env.get("RESILAX_HEALTH_TIMEOUT_SECONDS", "").strip()
            try:
                timeout = float(raw) if raw else DEFAULT_TIMEOUT_SECONDS
            except ValueError:
                timeout = -1.0
            if timeout <= 0:
                problems.append(f"RESILAX_HEALTH_TIMEOUT_SECONDS: {raw!r} is not allowed; allowed: a number of "
                                "seconds > 0")
        elif timeout <= 0:
            problems.append(f"--timeout: {timeout:g} is not allowed; allowed: a number of seconds > 0")
        coordinator = env.get("JAX_COORDINATOR_ADDRESS", "").strip()
        if processes > 1 and not coordinator:
            problems.append(f"JAX_COORDINATOR_ADDRESS: empty with JAX_NUM_PROCESSES={processes}; allowed: host:port")
        if processes > 1 and process_id >= processes:
            problems.append(f"JAX_PROCESS_ID: {process_id} is not allowed; allowed: 0..{processes - 1}")
        if problems:
            raise ValueError("; ".join(problems))
        control_dir = env.get("RESILAX_CONTROL_DIR", "").strip() or None
        return cls(devices, platform, processes, process_id, coordinator, max(timeout, 1e-3), fault, control_dir)


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What the check saw. None where a part did not run (an earlier part failed, or it timed out)."""

    rendezvous_error: str | None = None
    """The exception `jax.distributed.initialize` raised, if any."""
    platform: str | None = None
    device_kinds: tuple[str, ...] = ()
    device_error: str | None = None
    """The exception listing the devices raised, if any."""
    matmul_checksums: tuple[int, ...] | None = None
    """The checksum each local device computed, in device order."""
    matmul_error: str | None = None
    collective_value: int | None = None
    collective_expected: int | None = None
    collective_error: str | None = None
    timed_out_in: str | None = None
    """The part that was running when the time bound passed."""


@dataclasses.dataclass(frozen=True)
class PartResult:
    name: str
    ok: bool
    reason: str
    """Why it failed (one line, for the Event and the condition), or what passed."""


def decide_health(settings: HealthSettings, m: Measurements, expected_checksum: int) -> list[PartResult]:
    """Pass or fail of each part that ran, in order, from the measurements (pure). A part after a failed
    one is not listed (it did not run)."""
    results: list[PartResult] = []

    def timed_out(part: str) -> bool:
        if m.timed_out_in != part:
            return False
        results.append(PartResult(part, False, f"did not finish within the {settings.timeout_seconds:g} s bound"))
        return True

    distributed = settings.num_processes > 1
    # rendezvous
    if timed_out("rendezvous"):
        return results
    if m.rendezvous_error is not None:
        results.append(PartResult("rendezvous", False, f"jax.distributed.initialize with "
                                  f"{settings.num_processes} processes failed: {m.rendezvous_error}"))
        return results
    results.append(PartResult("rendezvous", True, f"{settings.num_processes} processes met" if distributed
                              else "one process: no rendezvous"))
    # devices
    if timed_out("devices"):
        return results
    count = len(m.device_kinds)
    if m.device_error is not None:
        results.append(PartResult("devices", False, f"listing the devices failed: {m.device_error}"))
        return results
    if count == 0:
        results.append(PartResult("devices", False, "no device is visible"))
        return results
    if settings.expected_devices is not None and count != settings.expected_devices:
        results.append(PartResult("devices", False, f"{count} devices visible, {settings.expected_devices} expected "
                                  f"(RESILAX_DEVICES_PER_HOST)"))
        return results
    if settings.expected_platform is not None and m.platform != settings.expected_platform:
        results.append(PartResult("devices", False, f"platform {m.platform!r}, {settings.expected_platform!r} expected"))
        return results
    kinds = sorted(set(m.device_kinds))
    results.append(PartResult("devices", True, f"{count} {m.platform} devices ({', '.join(kinds)})"))
    # matmul
    if timed_out("matmul"):
        return results
    if m.matmul_error is not None:
        results.append(PartResult("matmul", False, f"the matmul failed: {m.matmul_error}"))
        return results
    sums = m.matmul_checksums or ()
    if len(sums) != count:
        results.append(PartResult("matmul", False, f"{len(sums)} checksums for {count} devices"))
        return results
    wrong = [i for i, s in enumerate(sums) if s != expected_checksum]
    if wrong:
        first = wrong[0]
        results.append(PartResult("matmul", False, f"wrong checksum on local device {first} ({sums[first]}, "
                                  f"expected {expected_checksum})"
                                  + (f" and {len(wrong) - 1} more device(s)" if len(wrong) > 1 else "")))
        return results
    results.append(PartResult("matmul", True, f"checksum {expected_checksum} on {count} devices"))
    # collective
    if not distributed:
        results.append(PartResult("collective", True, "one process: no collective to run"))
        return results
    if timed_out("collective"):
        return results
    if m.collective_error is not None:
        results.append(PartResult("collective", False, f"the collective failed: {m.collective_error}"))
        return results
    if m.collective_value is None or m.collective_value != m.collective_expected:
        results.append(PartResult("collective", False, f"psum over the slice gave {m.collective_value}, expected "
                                  f"{m.collective_expected}"))
        return results
    results.append(PartResult("collective", True, f"psum over {settings.num_processes} processes gave "
                              f"{m.collective_value}"))
    return results


def is_healthy(results: Sequence[PartResult]) -> bool:
    """Every part passed (pure): a check cut short lists fewer parts than PARTS."""
    return len(results) == len(PARTS) and all(r.ok for r in results)


def build_matmul_inputs(size: int = MATMUL_SIZE) -> tuple[Any, Any, Any]:
    """The inputs as int64 NumPy arrays: A and B in -2..2, the checksum weights in 0..12 (pure)."""
    import numpy as np

    idx = np.arange(size * size, dtype=np.int64).reshape(size, size)
    a = (idx * 7 + 3) % 5 - 2
    b = (idx * 11 + 1) % 5 - 2
    w = idx % 13
    return a, b, w


def expected_checksum(size: int = MATMUL_SIZE) -> int:
    """The exact checksum: sum((A @ B) * W) in int64 (pure)."""
    a, b, w = build_matmul_inputs(size)
    return int(((a @ b) * w).sum())


# ------------------------------------------------------------------------------------------- measuring


class _Progress:
    """The part running now and what was measured so far (read by the watchdog thread)."""

    def __init__(self) -> None:
        self.part = "devices"
        self.m = Measurements()
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}


def measure(settings: HealthSettings, progress: _Progress) -> None:
    """Run the parts in order, recording into `progress`; stops after a part that failed. Importing JAX
    counts as this host's `devices` part (`_Progress` starts there)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def finished(part: str, began: float) -> None:
        progress.seconds[part] = round(time.monotonic() - began, 3)

    distributed = settings.num_processes > 1
    progress.part = "rendezvous"
    began = time.monotonic()
    if distributed:
        try:  # joins once the coordinator listens, not on gRPC's next reconnect try (multihost.wait_for_coordinator)
            waited = wait_for_coordinator(settings.coordinator, settings.timeout_seconds) if settings.process_id else 0.0
            jax.distributed.initialize(settings.coordinator, settings.num_processes, settings.process_id,
                                       initialization_timeout=max(1, int(settings.timeout_seconds - waited)))
        except Exception as e:  # the check reports any failure
            progress.m = dataclasses.replace(progress.m, rendezvous_error=f"{type(e).__name__}: {e}")
            return
        finished("rendezvous", began)

    progress.part = "devices"
    began = time.monotonic()
    if settings.fault == "hang":
        time.sleep(settings.timeout_seconds + 3600)
    try:
        devices = list(jax.local_devices())
        if settings.fault == "devices":
            devices = devices[:-1]
        platform = devices[0].platform if devices else None
        progress.m = dataclasses.replace(progress.m, platform=platform,
                                         device_kinds=tuple(str(d.device_kind) for d in devices))
    except Exception as e:  # the check reports any failure as the host's
        progress.m = dataclasses.replace(progress.m, device_error=f"{type(e).__name__}: {e}")
        return
    finished("devices", began)
    so_far = decide_health(settings, progress.m, 0)
    if len(so_far) < 2 or not so_far[1].ok:
        return

    progress.part = "matmul"
    began = time.monotonic()
    try:
        a, b, w = build_matmul_inputs()

        @jax.jit
        def checksum(x: Any, y: Any, weights: Any) -> Any:
            product = jnp.dot(x, y, preferred_element_type=jnp.float32)
            return jnp.sum(product.astype(jnp.int32) * weights)

        sums = []
        for i, d in enumerate(devices):
            b_here = b.copy()
            if settings.fault == "matmul" and i == 0:
                b_here[0, 0] += 1
            args = [jax.device_put(jnp.asarray(v, dtype=t), d)
                    for v, t in ((a, jnp.bfloat16), (b_here, jnp.bfloat16), (w, jnp.int32))]
            sums.append(checksum(*args))
        progress.m = dataclasses.replace(progress.m, matmul_checksums=tuple(int(s) for s in sums))
    except Exception as e:
        progress.m = dataclasses.replace(progress.m, matmul_error=f"{type(e).__name__}: {e}")
        return
    finished("matmul", began)
    so_far = decide_health(settings, progress.m, expected_checksum())
    if not distributed or len(so_far) < 3 or not so_far[2].ok:
        return  # a host whose own part failed leaves: the others' collective fails, not blaming them

    progress.part = "collective"
    began = time.monotonic()
    try:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        everyone = jax.devices()
        mesh = Mesh(np.array(everyone), ("d",))
        sharding = NamedSharding(mesh, PartitionSpec("d"))
        bump = 1 if settings.fault == "collective" else 0
        ids = {d.id: i for i, d in enumerate(everyone)}
        local = [jax.device_put(np.array([ids[d.id] + 1 + bump], dtype=np.int32), d)
                 for d in everyone if d.process_index == jax.process_index()]
        x = jax.make_array_from_single_device_arrays((len(everyone),), sharding, local)
        total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=PartitionSpec("d"),
                                      out_specs=PartitionSpec()))(x)
        value = int(np.asarray(total.addressable_data(0))[0])
        n = len(everyone)
        progress.m = dataclasses.replace(progress.m, collective_value=value, collective_expected=n * (n + 1) // 2)
    except Exception as e:
        progress.m = dataclasses.replace(progress.m, collective_error=f"{type(e).__name__}: {e}")
        return
    finished("collective", began)


def build_result(settings: HealthSettings, progress: _Progress, results: Sequence[PartResult]) -> dict[str, Any]:
    """The JSON result (pure): healthy, each part's verdict, the devices and the seconds."""
    failed = next((r for r in results if not r.ok), None)
    return {
        "healthy": is_healthy(results),
        "failed_part": failed.name if failed else None,
        "host_fault": failed is not None and failed.name in HOST_PARTS,
        "reason": failed.reason if failed else None,
        "parts": [dataclasses.asdict(r) for r in results],
        "platform": progress.m.platform,
        "devices": len(progress.m.device_kinds),
        "device_kind": progress.m.device_kinds[0] if progress.m.device_kinds else None,
        "process_id": settings.process_id,
        "num_processes": settings.num_processes,
        "seconds": round(time.monotonic() - progress.started, 3),
        "part_seconds": dict(progress.seconds),
    }


def _report(result: dict[str, Any], result_path: str | None, control_dir: str | None = None) -> int:
    line = json.dumps(result, sort_keys=True)
    # One write, starting on a fresh line: Gloo's C++ logging writes to the same stdout from its own
    # threads, and print() (several writes when unbuffered) once let a Gloo line land inside ours.
    sys.stdout.write(f"\n{RESULT_PREFIX}{line}\n")
    sys.stdout.flush()
    if result_path:
        try:
            with open(result_path, "w") as f:
                f.write(line[:4000])  # the kubelet keeps at most 4096 bytes of a termination message
        except OSError as e:
            print(f"resilax health-check: could not write {result_path}: {e}", file=sys.stderr, flush=True)
    if control_dir:
        try:
            write_verdict(control_dir, build_verdict(result))
        except OSError as e:  # the sidecar then waits for a final save as if no check had run
            print(f"resilax health-check: could not write {HEALTH_FILE} in {control_dir}: {e}", file=sys.stderr,
                  flush=True)
    return EXIT_HEALTHY if result["healthy"] else EXIT_UNHEALTHY


def run_check(settings: HealthSettings, result_path: str | None) -> int:
    """Measure within the time bound, decide, report. A part still running at the bound ends the process
    (os._exit: a hung device call or collective cannot be interrupted) with its result written."""
    progress = _Progress()
    done = threading.Event()
    lock = threading.Lock()
    reported: list[int] = []

    def finish(timed_out_in: str | None) -> int:
        with lock:
            if reported:
                return reported[0]
            if timed_out_in is not None:
                progress.m = dataclasses.replace(progress.m, timed_out_in=timed_out_in)
            results = decide_health(settings, progress.m, expected_checksum())
            reported.append(_report(build_result(settings, progress, results), result_path, settings.control_dir))
            return reported[0]

    def watchdog() -> None:
        if not done.wait(settings.timeout_seconds):
            code = finish(progress.part)
            os._exit(code)

    threading.Thread(target=watchdog, name="health-check-bound", daemon=True).start()
    measure(settings, progress)
    code = finish(None)
    if settings.num_processes > 1:
        if code == EXIT_HEALTHY:
            _leave_together()
        os._exit(code)  # an unhealthy one leaves at once: jax.distributed's shutdown would wait for every peer
    done.set()
    return code


def _leave_together() -> None:
    """A healthy process of several leaves through jax.distributed's shutdown barrier, still within the
    watchdog's bound: one that exits as soon as its own psum returned can close its collective
    connections while a peer still reads its last message ("Gloo all-reduce failed: Connection
    closed by peer"), which failed that peer's check. Every process reaches the barrier only after its
    psum completed, so none leaves while a collective is in flight."""
    import jax

    try:
        jax.distributed.shutdown()
    except Exception as e:  # the result is out already; a peer that left early is no reason to fail
        print(f"resilax health-check: leaving the slice's processes: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)


def main(argv: Sequence[str]) -> int:
    """`resilax health-check [--timeout S] [--result FILE]` (the console script's subcommand)."""
    parser = argparse.ArgumentParser(prog="resilax health-check", description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds for the whole check (default: RESILAX_HEALTH_TIMEOUT_SECONDS or "
                             f"{DEFAULT_TIMEOUT_SECONDS:g})")
    parser.add_argument("--result", default=None,
                        help="also write the JSON result to this file (the pod's termination message)")
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:
        return EXIT_HEALTHY if e.code == 0 else EXIT_USAGE
    try:
        settings = HealthSettings.from_env(os.environ, args.timeout)
    except ValueError as e:
        print(f"resilax health-check: {e}", file=sys.stderr)
        return EXIT_USAGE
    return run_check(settings, args.result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
