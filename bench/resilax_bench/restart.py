"""A trainer restart measured part by part (issue 38): ``python -m resilax_bench.restart [--preset tpu-v5e]
[--workdir /dev/shm/resilax-restart] [--phases cold,warm,kept,prefetch,inplace,restore,restore-overlap]
[--json F]
[--markdown F]`` (on the TPU host: ``bash bench/tpu/restart``).

Each phase is a fresh process of examples/transformer.py, one after another (one program at a time
holds a TPU chip), started with ``--report-startup`` so it prints the wall-clock time of each part of
its start. The parent passes its own launch time in ``RESILAX_BENCH_LAUNCH_TIME``.

* ``cold``: an empty persistent compilation cache, nothing to restore: launch to first step, then a
  few more steps and a forced save into a local tier on tmpfs (the save's time is reported too).
* ``warm``: the cache now warm, nothing to restore (RESILAX_RESTORE_STEP=none): the floor of a
  restart of this model on this machine.
* ``kept``: the trainer kept across a generation (`rc.run_kept`, docs/architecture.md "Keep what can be
  kept"): incarnation 1 under the supervisor (`resilax run`) restores the cold phase's save as
  ``prefetch`` does; after its first step a stop request and an assignment for generation 2: SIGTERM,
  the final save, the entry's return, `jax.extend.backend.clear_backends()`, and incarnation 2 in the
  SAME process: the new environment, the devices reopened, the compile (a cache load), the restore of
  that save from the local tier, its first step. Its parts run from the stop request; its "launch"
  is incarnation 2's start in the kept process (the resume).
* ``prefetch``: warm cache, restore of the saved step from the local tier as the trainer does it by
  default: the restore prefetch (resilax_ckpt.start_prefetch, the trainer's line 0) reads the step into
  host memory from the script's first lines, under the imports and the devices' opening, and the
  compile (a cache load) runs in a thread while the restore finishes; reported as not available when
  resilax_ckpt has no prefetch.
* ``inplace``: run with ``prefetch``: that phase's trainer is incarnation 1 under the supervisor
  (`resilax run`, its control files written here as the sidecar writes them in a pod); after its first
  step a stop request and an assignment for generation 2: SIGTERM, the trainer's final save, its exit,
  incarnation 2 in the same "container", restored from that save, to its first step. Keeping is off
  here (RESILAX_KEEP_TRAINER=0): incarnation 2 is a fresh process.
* ``restore``: the same restore without the prefetch (RESILAX_RESTORE_PREFETCH=0) and serial: restore,
  then compile (each part on its own).
* ``restore-overlap``: without the prefetch, the compile in a thread while the restore reads.
* ``prefetch-read`` (only when named in --phases): as ``prefetch`` (no supervisor) with
  RESILAX_RESTORE_PREFETCH=read: the step read ahead into host memory even where, on accelerators with the local tier on tmpfs, the default only
  faults the restore's host ring in (prefetch.PrefetchSettings.ring_only): the two side by side.
* ``reopen`` (only when named in --phases; ``kept`` measures it inside the trainer): can one process
  give its devices back and open them again (what keeping a trainer
  process across a generation needs: `jax.extend.backend.clear_backends()`, then `jax.devices()`), and
  at what cost against the first open: a small probe, not the trainer (docs/architecture.md, "Keep
  what can be kept").

The supervisor needs no sidecar and no network (its control is files, its channel to a kept trainer a
Unix socket pair), so it runs on the TPU host too; each incarnation is a fresh process unless the
trainer is kept (``kept``; docs/architecture.md, "Keep what can be kept").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformer.py"
PHASES = ("cold", "warm", "kept", "prefetch", "inplace", "restore", "restore-overlap", "prefetch-read", "reopen")
"""In the order they run: the ones the issue's target needs first, should a time budget cut the run."""
DEFAULT_PHASES = ("cold", "warm", "kept", "prefetch", "inplace", "restore", "restore-overlap")
"""Without --phases: `prefetch-read` and `reopen` repeat what was measured on the chip (2026-12-06) and
what `kept` measures inside the trainer; they run when named."""
RESTARTS = ("kept", "prefetch", "inplace", "restore", "restore-overlap", "prefetch-read")
"""The phases that restore: each compared with the warm start that does not."""
TRAIN_STEPS = 3
"""Steps of the cold phase before its save (the restore phases restore this step and run one more)."""
PHASE_TIMEOUT_S = 300
REOPEN_ESTIMATE_S = 20.0
"""The reopen probe's time for the budget: imports and two opens of the devices (~6 s each on a v5e chip)."""
REOPEN_TIMEOUT_S = 90.0
"""A runtime that cannot open the chip again in the same process may hang rather than fail: give up then."""

#: The parts of a start, in order: (name, from mark, to mark). A part whose marks a phase lacks is
#: left out of that phase (a phase that restores has no init; one that does not, no restore).
PARTS: tuple[tuple[str, str, str], ...] = (
    ("interpreter start (launch to the script's first line)", "launch", "script_start"),
    ("line 0: import resilax_ckpt, start the prefetch", "script_start", "line0_done"),
    ("imports (jax, numpy)", "line0_done", "imports_done"),
    ("prefetch: read into host memory", "prefetch_read_start", "prefetch_read_done"),
    ("open the devices (jax.devices())", "devices_start", "devices_done"),
    ("checkpoint manager", "devices_done", "manager_done"),
    ("trace + lower", "lower_start", "lower_done"),
    ("compile or compilation-cache load", "lower_done", "compile_done"),
    ("init a fresh state (its own compile or cache load + run)", "init_start", "init_done"),
    ("restore: read (transfers issued)", "restore_start", "restore_returned"),
    ("restore: host-to-device wait", "restore_returned", "restore_on_device"),
    ("first step", "ready", "first_step_done"),
    ("launch to first step done", "launch", "first_step_done"),
    # a kept process (the `kept` phase): from the stop request, in the same process
    ("kept: stop request to the entry's return (final save)", "stop_requested", "entry_returned"),
    ("kept: drop the backends (clear_backends)", "entry_returned", "backends_dropped"),
    ("kept: parked until the next incarnation's start", "backends_dropped", "resume_received"),
    ("kept: new environment, restore prefetch started", "resume_received", "prefetch_started"),
    ("kept: reopen the devices", "prefetch_started", "devices_reopened"),
    ("kept: stop request to first step done", "stop_requested", "first_step_done"),
)


class RestartBenchError(RuntimeError):
    """A phase failed or printed no startup report."""


# ---------------------------------------------------------------------------- pure


def with_ready_mark(marks: Mapping[str, float]) -> dict[str, float]:
    """The marks plus `ready`: when the first step could start (the later of the compile and the state)."""
    out = dict(marks)
    state = [marks[k] for k in ("init_done", "restore_on_device") if k in marks]
    if "compile_done" in marks and state:
        out["ready"] = max(marks["compile_done"], *state)
    if "launch" not in out and "process_start" in out:
        out["launch"] = out["process_start"]
    return out


def plan_parts(marks: Mapping[str, float]) -> list[dict[str, Any]]:
    """Each part a phase's marks allow: its name, start and end as seconds after launch, duration."""
    m = with_ready_mark(marks)
    zero = m["launch"]
    out = []
    for name, begin, end in PARTS:
        if begin in m and end in m:
            out.append({"part": name, "start_s": round(m[begin] - zero, 3), "end_s": round(m[end] - zero, 3),
                        "seconds": round(m[end] - m[begin], 3)})
    return out


def overlaps(parts: Sequence[Mapping[str, Any]]) -> list[str]:
    """Pairs of the start's parts that ran at the same time (the whole-start row aside), as text."""
    rows = [p for p in parts if not p["part"].startswith("launch to")]
    found = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            shared = min(a["end_s"], b["end_s"]) - max(a["start_s"], b["start_s"])
            if shared > 0.005 and a["seconds"] > 0 and b["seconds"] > 0:
                found.append(f"{a['part']} || {b['part']}: {shared:.2f} s")
    return found


def summarize(phases: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The issue's target: a restart with restore from launch to first step against the same model
    with no restore (warm cache), and against (open devices + cache load + first step) of that run."""
    out: dict[str, Any] = {}
    warm = phases.get("warm", {}).get("parts")
    if not warm:
        return out
    by = {p["part"]: p["seconds"] for p in warm}
    floor = sum(by.get(k, 0.0) for k in ("open the devices (jax.devices())", "compile or compilation-cache load",
                                         "first step"))
    out["warm_launch_to_first_step_s"] = by.get("launch to first step done")
    out["warm_open_compile_first_step_s"] = round(floor, 3)
    for name in RESTARTS:
        parts = phases.get(name, {}).get("parts")
        if not parts:
            continue
        total = {p["part"]: p["seconds"] for p in parts}.get("launch to first step done")
        if total is None:
            continue
        out[name] = {"launch_to_first_step_s": total,
                     "vs_warm_launch_to_first_step": round(total / by["launch to first step done"], 3)
                     if by.get("launch to first step done") else None,
                     "vs_open_compile_first_step": round(total / floor, 3) if floor else None}
    return out


def build_markdown(result: Mapping[str, Any]) -> str:
    """The phases side by side (seconds per part), then each phase's timeline (seconds after launch)."""
    phases = result["phases"]
    names = [n for n in PHASES if n in phases and phases[n].get("parts")]
    env = result.get("environment", {})
    lines = [f"Trainer restart, part by part: {env.get('platform', '?')} ({env.get('device_kind', '?')}, "
             f"{env.get('devices', '?')} device(s)), {env.get('parameters', 0) / 1e9:.3g}B parameters, "
             f"state {env.get('state_bytes', 0) / 2**30:.2f} GiB, commit {result.get('commit', '?')}", ""]
    lines.append("| part (seconds) | " + " | ".join(names) + " |")
    lines.append("|---|" + "---:|" * len(names))
    seen = [name for name, _, _ in PARTS]
    for part in seen:
        cells = []
        for n in names:
            hit = [p["seconds"] for p in phases[n]["parts"] if p["part"] == part]
            cells.append(f"{hit[0]:.2f}" if hit else "")
        if any(cells):
            lines.append(f"| {part} | " + " | ".join(cells) + " |")
    extra = [n for n in PHASES if n in phases and not phases[n].get("parts") and n != "reopen"]
    for n in extra:
        lines.append(f"\n{n}: {phases[n].get('skipped') or phases[n].get('error')}")
    if "cold" in phases and phases["cold"].get("final_save_s") is not None:
        lines.append(f"\nSave of the trained state into the local tier (cold phase, step {TRAIN_STEPS}): "
                     f"{phases['cold']['final_save_s']:.2f} s")
    reopen = phases.get("reopen")
    if reopen:
        if reopen.get("seconds"):
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in reopen["seconds"].items())
            lines.append(f"\nreopen (one process gives its devices back and opens them again): "
                         f"{'works' if reopen.get('reopened') else 'FAILS'}: {parts}"
                         + (f"; error: {reopen['error']}" if reopen.get("error") else ""))
        else:
            lines.append(f"\nreopen: {reopen.get('error')}")
    summary = result.get("summary") or {}
    stop = phases.get("inplace", {}).get("stop")
    if stop and stop.get("request_to_first_step_s") is not None:
        lines.append(f"\nIn-place restart under the supervisor (`resilax run`): stop requested -> incarnation 2's "
                     f"process started {stop['request_to_new_process_s']:.2f} s (SIGTERM, the final save of step "
                     f"{stop['saved_step']} in {stop['final_save_s']} s, the old process's exit, the respawn) -> "
                     f"its first step {stop['request_to_first_step_s']:.2f} s")
    kept = phases.get("kept", {}).get("stop")
    if kept and kept.get("request_to_first_step_s") is not None:
        lines.append(f"\nKept restart (`rc.run_kept` under `resilax run`, the same process: "
                     f"{phases['kept'].get('same_process')}): stop requested -> incarnation 2's start in the kept "
                     f"process {kept['request_to_resume_s']:.2f} s (SIGTERM, the final save of step "
                     f"{kept['saved_step']} in {kept['final_save_s']} s, clear_backends) -> its first step "
                     f"{kept['request_to_first_step_s']:.2f} s")
    for n in RESTARTS:
        if n in summary:
            s = summary[n]
            lines.append(f"\n{n}: launch to first step {s['launch_to_first_step_s']:.2f} s = "
                         f"{s['vs_warm_launch_to_first_step']}x warm no-restore "
                         f"({summary['warm_launch_to_first_step_s']:.2f} s), "
                         f"{s['vs_open_compile_first_step']}x (open devices + cache load + first step "
                         f"= {summary['warm_open_compile_first_step_s']:.2f} s)")
    for n in names:
        lines += ["", f"Timeline of `{n}` (seconds after launch):", "", "| part | start | end |", "|---|---:|---:|"]
        for p in sorted(phases[n]["parts"], key=lambda p: (p["start_s"], p["end_s"])):
            lines.append(f"| {p['part']} | {p['start_s']:.2f} | {p['end_s']:.2f} |")
        if phases[n].get("overlaps"):
            lines.append("\nOverlaps: " + "; ".join(phases[n]["overlaps"]))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- I/O

#: The `reopen` phase's probe: open the devices, run a jitted matmul, clear the backends, open and run
#: again; one JSON line {"reopen": {...}} with the wall-clock seconds of each part.
REOPEN_PROBE = """
import json, time
t = {"start": time.time()}
import jax, jax.numpy as jnp
from jax.extend.backend import clear_backends
t["imports_done"] = time.time()
jax.devices()
t["opened"] = time.time()
run = lambda: float(jax.jit(lambda a: (a @ a).sum())(jnp.ones((1024, 1024), jnp.float32)))
run()
t["first_run"] = time.time()
kind = jax.devices()[0].device_kind
clear_backends()
t["cleared"] = time.time()
out = {"device_kind": kind, "platform": jax.default_backend()}
try:
    jax.devices()
    t["reopened"] = time.time()
    run()
    t["second_run"] = time.time()
    out["reopened"] = True
except Exception as e:
    out["reopened"] = False
    out["error"] = repr(e)[-800:]
out["marks"] = t
print(json.dumps({"reopen": out}), flush=True)
"""


def run_reopen(timeout: float) -> dict[str, Any]:
    """The `reopen` probe in a fresh process: first open, clear, second open (seconds)."""
    began = time.time()
    proc = subprocess.run([sys.executable, "-c", REOPEN_PROBE], capture_output=True, text=True, timeout=timeout)
    out: dict[str, Any] = {"returncode": proc.returncode, "process_seconds": round(time.time() - began, 3)}
    line = next((json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"reopen"')), None)
    if line is None:
        out["error"] = f"exit {proc.returncode}, no result line; stderr: {proc.stderr.strip()[-3000:]}"
        return out
    probe = line["reopen"]
    m = probe.pop("marks")
    out.update(probe)
    out["seconds"] = {name: round(m[b] - m[a], 3) for name, a, b in (
        ("imports", "start", "imports_done"), ("first open", "imports_done", "opened"),
        ("first jit + run", "opened", "first_run"), ("clear_backends", "first_run", "cleared"),
        ("second open", "cleared", "reopened"), ("second jit + run", "reopened", "second_run"))
        if a in m and b in m}
    return out


def prefetch_available() -> str | None:
    """None when the trainer can prefetch (resilax_ckpt has the API), else why not."""
    probe = ("import resilax_ckpt as rc, sys; "
             "sys.exit(0 if hasattr(rc, 'start_prefetch') else 3)")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    if proc.returncode == 3:
        return "resilax_ckpt has no restore prefetch (start_prefetch) in this checkout"
    return f"resilax_ckpt cannot be imported: {proc.stderr.strip()[-500:]}"


def phase_command(phase: str, preset: str, steps: int, extra: Sequence[str]) -> list[str]:
    cmd = [sys.executable, str(EXAMPLE), "--preset", preset, "--report-startup"]
    if phase == "cold":
        cmd += ["--steps", str(steps)]
    elif phase == "warm":
        cmd += ["--steps", "1", "--no-final-save"]
    elif phase == "inplace":
        cmd += ["--extra-steps", "1000000", "--no-final-save"]  # until stopped (incarnation 1) or killed (2)
    else:
        cmd += ["--extra-steps", "1", "--no-final-save"]
    if phase == "restore":
        cmd.append("--serial-start")
    return cmd + list(extra)


def phase_env(phase: str, workdir: Path) -> dict[str, str]:
    """The trainer's environment for `phase`: the tiers and the compilation cache under `workdir`."""
    env = dict(os.environ)
    env.update({
        "RESILAX_CHECKPOINT_DIR": str(workdir / "persistent"),
        "RESILAX_LOCAL_DIR": str(workdir / "local"),
        "JAX_COMPILATION_CACHE_DIR": str(workdir / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "RESILAX_RESTORE_STEP": "none" if phase in ("cold", "warm") else "latest",
        "RESILAX_RESTORE_PREFETCH": {"prefetch": "1", "inplace": "1", "kept": "1", "prefetch-read": "read"}.get(phase, "0"),
        "RESILAX_EXIT_GRACE_SECONDS": "0",
    })
    # Only forced saves save: the cold phase's final one, a stop's (without a policy every save() would).
    env["RESILAX_SAVE_EVERY_STEPS"] = "1000000000"
    for name in ("RESILAX_SAVE_EVERY_SECONDS", "RESILAX_CONTROL_DIR", "RESILAX_GENERATION"):
        env.pop(name, None)
    return env


def outcome_of(phase: str, records: Sequence[Mapping[str, Any]], stderr: str) -> dict[str, Any]:
    """A trainer's startup report, parts, steps, restore line and save time, from its JSON lines."""
    startup = next((r["startup"] for r in records if "startup" in r), None)
    if startup is None:
        raise RestartBenchError(f"phase {phase}: no startup line; stderr: {stderr.strip()[-3000:]}")
    out: dict[str, Any] = {"startup": startup, "parts": plan_parts(startup["marks"])}
    out["overlaps"] = overlaps(out["parts"])
    out["steps"] = [{"step": r["step"], "loss": r["loss"]} for r in records if "step" in r]
    restored = [r for r in records if "restored" in r]
    if restored:
        out["restored"] = {k: restored[0].get(k) for k in ("restored", "from", "sources")}
    save = next((r["final_save"] for r in records if "final_save" in r), None)
    if save:
        out["final_save_s"] = round(save["done"] - save["start"], 3)
    # The TPU runtime's own warnings about the host (transparent huge pages: docs/operations.md).
    out["runtime_warnings"] = [line.strip()[-400:] for line in stderr.splitlines() if "huge" in line.lower()][:5]
    return out


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def run_phase(phase: str, cmd: Sequence[str], workdir: Path, timeout: float) -> dict[str, Any]:
    """One fresh trainer process; its startup report, restore line and save time."""
    env = phase_env(phase, workdir)
    env["RESILAX_BENCH_LAUNCH_TIME"] = repr(time.time())
    began = time.time()
    proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout)
    ended = time.time()
    if proc.returncode != 0:
        raise RestartBenchError(f"phase {phase}: exit {proc.returncode}; stderr: {proc.stderr.strip()[-3000:]}")
    out = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "process_seconds": round(ended - began, 3),
           **outcome_of(phase, json_lines(proc.stdout), proc.stderr)}
    out["exit_after_first_step_s"] = round(ended - out["startup"]["marks"]["first_step_done"], 3)
    return out


SUPERVISOR = "import sys; from resilax_ckpt.trainer.supervisor import main; sys.exit(main(sys.argv[1:]))"
"""`resilax run` without the console script (the TPU host has the packages on PYTHONPATH only)."""


def run_inplace(cmd: Sequence[str], workdir: Path, timeout: float,
                keep: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefetch phase as incarnation 1 under the supervisor (`resilax run`, which needs no sidecar:
    its control is files in RESILAX_CONTROL_DIR, which the sidecar writes in a pod and this bench writes
    here), then an in-place restart: once incarnation 1 reported its first step, a stop request and an
    assignment for generation 2 (the supervisor SIGTERMs it, the trainer saves and exits, the supervisor
    starts incarnation 2 in the same container), up to incarnation 2's first step; then the supervisor
    and its child are killed. Returns (incarnation 1 as the `prefetch` phase, the `inplace` phase).
    `keep`: the `kept` phase instead: the supervisor may keep the trainer process (RESILAX_KEEP_TRAINER),
    and incarnation 2 runs in incarnation 1's process."""
    import queue
    import threading

    from resilax_ckpt.control import trainer_control as tc

    phase = "kept" if keep else "inplace"
    control = workdir / f"control-{phase}"  # each supervisor its own: the files outlive it
    control.mkdir(parents=True, exist_ok=True)
    env = phase_env(phase, workdir)
    env.update({"RESILAX_CONTROL_DIR": str(control), "RESILAX_GENERATION": "1", "RESILAX_KEEP_TRAINER": str(int(keep)),
                "RESILAX_RESTART_GRACE_SECONDS": str(int(timeout))})  # the stop's final save may finish
    env["RESILAX_BENCH_LAUNCH_TIME"] = repr(time.time())
    stderr_path = workdir / f"{phase}.stderr"
    lines: queue.Queue[str | None] = queue.Queue()
    deadline = time.time() + timeout
    with stderr_path.open("w") as err, subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR, "--", *cmd], env=env, stdout=subprocess.PIPE, stderr=err,
            text=True, start_new_session=True) as proc:
        assert proc.stdout is not None
        stdout = proc.stdout

        def pump() -> None:
            for line in stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        records: list[dict[str, Any]] = []

        def until(done: Any, what: str) -> None:
            while not done():
                try:
                    line = lines.get(timeout=max(0.1, deadline - time.time()))
                except queue.Empty:
                    line = None
                if line is None or time.time() > deadline:
                    raise RestartBenchError(f"phase {phase}: no {what} (supervisor exit {proc.poll()}); stderr: "
                                            f"{stderr_path.read_text(errors='replace').strip()[-3000:]}")
                records.extend(json_lines(line))

        second_error = None
        try:
            until(lambda: any("startup" in r for r in records), "startup line of incarnation 1")
            first = list(records)
            stop_at = time.time()
            # Incarnation 2's launch is its own process start (the supervisor spawns it), not the bench's;
            # in a kept process, its resume (a variable that changed would make it a new world: not kept).
            tc.write_json(str(control), tc.ASSIGNMENT_FILE,
                          {"generation": 2, "env": {} if keep else {"RESILAX_BENCH_LAUNCH_TIME": ""}})
            tc.write_json(str(control), tc.STOP_FILE, {"generation": 2, "reason": "bench: in-place restart"})
            try:
                until(lambda: sum("startup" in r for r in records) >= 2, "startup line of incarnation 2")
            except RestartBenchError as e:
                second_error = str(e)
        finally:
            incarnation = tc.read_incarnation(str(control)) or {}
            for target in (incarnation.get("pid"), proc.pid):  # the child's own group, then the supervisor's
                if isinstance(target, int):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(target, signal.SIGKILL)
            proc.wait(timeout=60)
    stderr = stderr_path.read_text(errors="replace")
    prefetch = {"command": "resilax run -- " + " ".join(cmd[1:]), "under_supervisor": True,
                **outcome_of("prefetch", first, stderr)}
    second = records[len(first):]
    stopped = next((r["stopped"] for r in second if "stopped" in r), None)
    stop: dict[str, Any] = {"requested": stop_at, "saved_step": stopped["step"] if stopped else None,
                            "final_save_s": round(stopped["done"] - stopped["save_start"], 3) if stopped else None}
    if second_error is not None:
        return prefetch, {"command": prefetch["command"], "stop": stop, "error": second_error[-4000:]}
    own = [r for r in second if r.get("generation", 2) == 2]  # incarnation 1's steps after the stop left out
    inplace = {"command": prefetch["command"], **outcome_of(phase, own, stderr)}
    marks = inplace["startup"]["marks"]
    if keep:
        marks["stop_requested"] = stop_at
        inplace["parts"] = plan_parts(marks)
        inplace["overlaps"] = overlaps(inplace["parts"])
        inplace["same_process"] = inplace["startup"].get("pid") == prefetch["startup"].get("pid")
        inplace["restarts"] = incarnation.get("restarts")
        inplace["stop"] = {**stop, "request_to_resume_s": round(marks["process_start"] - stop_at, 3),
                           "request_to_first_step_s": round(marks["first_step_done"] - stop_at, 3)}
        if not inplace["startup"].get("kept"):
            inplace["error"] = ("incarnation 2 was not kept (a fresh process); the supervisor said: "
                                + " | ".join(line for line in stderr.splitlines() if "resilax run:" in line)[-3000:])
        return prefetch, inplace
    inplace["stop"] = {
        **stop,
        # the stop's request to the new incarnation's process start: SIGTERM, the final save, the old
        # process's exit (the TPU runtime's shutdown among it), the supervisor's reaping and spawn
        "request_to_new_process_s": round(marks["process_start"] - stop_at, 3),
        "request_to_first_step_s": round(marks["first_step_done"] - stop_at, 3),
    }
    return prefetch, inplace


def commit_of_checkout() -> str:
    given = os.environ.get("RESILAX_COMMIT", "").strip()
    if given:
        return given
    try:
        proc = subprocess.run(["git", "-C", str(EXAMPLE.parents[1]), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return proc.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-tiny", help="examples/transformer.py's --preset")
    parser.add_argument("--workdir", default="/dev/shm/resilax-restart",
                        help="the local tier, persistent tier and compilation cache (emptied first)")
    parser.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                        help=f"comma-separated, of {', '.join(PHASES)} (default: {', '.join(DEFAULT_PHASES)})")
    parser.add_argument("--steps", type=int, default=TRAIN_STEPS, help="steps of the cold phase before its save")
    parser.add_argument("--timeout", type=float, default=PHASE_TIMEOUT_S, help="seconds per phase")
    parser.add_argument("--json", help="write the raw result here")
    parser.add_argument("--markdown", help="write the tables here")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (default: removed at the end)")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds for the whole run: a phase that would not fit (the longest phase after "
                             "cold so far) is skipped and said so (0: no budget)")
    parser.add_argument("trainer_args", nargs="*", help="after --: more flags for examples/transformer.py")
    args = parser.parse_args(argv)
    wanted = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in wanted if p not in PHASES]
    if bad:
        parser.error(f"--phases: {', '.join(bad)} unknown; allowed: {', '.join(PHASES)}")
    if "inplace" in wanted and "prefetch" not in wanted:
        parser.error("--phases: inplace runs as the prefetch phase's second incarnation: name prefetch too")
    if any(p not in ("cold", "reopen") for p in wanted) and "cold" not in wanted:
        parser.error("--phases: the other phases need `cold` (it fills the cache and saves the checkpoint)")
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    result: dict[str, Any] = {
        "bench": "restart", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit_of_checkout(), "preset": args.preset, "workdir": str(workdir),
        "trainer_args": args.trainer_args, "phases": {},
        "note": "each phase a fresh process, one after another; times are wall-clock seconds",
    }
    began = time.monotonic()
    longest = 0.0  # the longest phase after cold so far: what the next one may take

    def write() -> str:
        first: dict[str, Any] = next((p["startup"] for p in result["phases"].values() if "startup" in p), {})
        result["environment"] = {k: first.get(k) for k in ("platform", "device_kind", "devices", "processes",
                                                            "jax", "parameters", "state_bytes", "config")}
        result["summary"] = summarize(result["phases"])
        result["elapsed_s"] = round(time.monotonic() - began, 1)
        text = build_markdown(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        if args.markdown:
            Path(args.markdown).write_text(text)
        return text

    try:
        for phase in (p for p in PHASES if p in wanted):
            elapsed = time.monotonic() - began
            needs = REOPEN_ESTIMATE_S if phase == "reopen" else max(longest, 15.0)
            if phase == "kept" or (phase == "prefetch" and "inplace" in wanted):
                needs *= 2.5  # incarnation 1, the stop's final save, incarnation 2
            if args.budget and phase != "cold" and elapsed + needs > args.budget:
                why = f"time budget: {elapsed:.0f} s of --budget {args.budget:.0f} s spent"
                result["phases"][phase] = {"skipped": why}
                print(f"restart bench: {phase}: skipped ({why})", file=sys.stderr, flush=True)
                continue
            if phase in ("prefetch", "prefetch-read"):
                why_not = prefetch_available()
                if why_not:
                    result["phases"][phase] = {"skipped": why_not}
                    print(f"restart bench: {phase}: skipped ({why_not})", file=sys.stderr, flush=True)
                    continue
            started = time.monotonic()
            if phase == "inplace":
                continue  # run with the prefetch phase (its incarnation 1)
            if phase == "kept":
                cmd = phase_command("inplace", args.preset, args.steps, args.trainer_args)
                try:
                    first, result["phases"]["kept"] = run_inplace(cmd, workdir, args.timeout, keep=True)
                    result["phases"]["kept"]["first_incarnation"] = {k: first.get(k) for k in ("parts", "restored")}
                except (RestartBenchError, subprocess.TimeoutExpired, OSError) as e:
                    result["phases"]["kept"] = {"error": f"under the supervisor: {str(e)[-4000:]}"}
                longest = max(longest, (time.monotonic() - started) / 2)
                got = result["phases"]["kept"]
                print(f"restart bench: kept: {got.get('stop', '')} {got.get('error', '')}", file=sys.stderr, flush=True)
                write()
                continue
            if phase == "prefetch" and "inplace" in wanted:
                cmd = phase_command("inplace", args.preset, args.steps, args.trainer_args)
                try:
                    result["phases"]["prefetch"], result["phases"]["inplace"] = run_inplace(cmd, workdir, args.timeout)
                except (RestartBenchError, subprocess.TimeoutExpired, OSError) as e:
                    result["phases"]["prefetch"] = {"error": f"under the supervisor: {str(e)[-4000:]}"}
                    print(f"restart bench: prefetch + inplace: FAILED: {e}", file=sys.stderr, flush=True)
                longest = max(longest, (time.monotonic() - started) / 2)
                for name in ("prefetch", "inplace"):
                    got = result["phases"].get(name, {})
                    total = [p["seconds"] for p in got.get("parts", []) if p["part"].startswith("launch to")]
                    print(f"restart bench: {name}: launch to first step {total[0] if total else '?'} s "
                          f"{got.get('stop', '')}", file=sys.stderr, flush=True)
                write()
                continue
            if phase == "reopen":
                try:
                    result["phases"][phase] = run_reopen(min(args.timeout, REOPEN_TIMEOUT_S))
                except subprocess.TimeoutExpired as e:
                    result["phases"][phase] = {"error": f"timed out: {e}"}
                print(f"restart bench: reopen: {result['phases'][phase]}", file=sys.stderr, flush=True)
                write()
                continue
            cmd = phase_command(phase, args.preset, args.steps, args.trainer_args)
            try:
                outcome = run_phase(phase, cmd, workdir, args.timeout)
            except (RestartBenchError, subprocess.TimeoutExpired) as e:
                result["phases"][phase] = {"error": str(e)[-4000:]}
                print(f"restart bench: {phase}: FAILED: {e}", file=sys.stderr, flush=True)
                write()
                if phase == "cold":
                    break
                continue
            if phase != "cold":
                longest = max(longest, time.monotonic() - started)
            result["phases"][phase] = outcome
            total = [p["seconds"] for p in outcome["parts"] if p["part"].startswith("launch to")]
            print(f"restart bench: {phase}: launch to first step {total[0] if total else '?'} s "
                  f"(process {outcome['process_seconds']} s)", file=sys.stderr, flush=True)
            write()  # after every phase: a run cut short keeps what it measured
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(write())
    # The reopen probe answers a question (can a process reopen its devices?): "no" is a result.
    failed = [n for n, p in result["phases"].items() if "error" in p and n != "reopen"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
