"""Turn the rounds' raw results into medians, per-round ratios and the issue's targets (markdown)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

ANCHORS = ("orbax", "dcp", "numpy", "dd", "floor")
# The columns of the ratio table: the CPU run's four, plus the device floor where one was measured.
CPU_ANCHORS = ANCHORS[:4]

# (key, label, kind): kind "save"/"restore" says which dd figure anchors it; "x" is a memory ratio.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("save_s", "steady-state durable save (median of saves 2-4, keep newest 1)", "save"),
    ("blocked_s", "loop blocked by a steady-state async save", "blocked"),
    ("first_save_s", "first save of a job (new files)", "save"),
    ("first_blocked_s", "loop blocked by the first save of a job", "blocked"),
    ("first_restore_s", "first restore of a fresh process (cold)", "restore"),
    ("cold_restore_s", "cold restore (4,2)", "restore"),
    ("reshard_s", "cold restore onto (2,4), specs transposed", "restore"),
    ("params_s", "cold params-only restore", "restore"),
    ("rss_save_x", "peak RSS over a save, x state bytes", "x"),
    ("rss_save_own_x", "a save's own host memory: peak RSS over it − RSS when save() was called, x state bytes", "x"),
    ("rss_restore_x", "peak RSS over a restore, x state bytes", "x"),
    ("rss_kept_x", "RSS kept after the first restore's arrays are freed, x state bytes", "x"),
    # --accel only (a donating step before and after every save):
    ("step_s", "--accel: a donating step with no save in flight", "step"),
    ("step_after_save_s", "--accel: the donating step right after a steady save returned", "step"),
    ("blocked_with_step_s", "--accel: loop blocked by a steady save, + the next step's extra wait", "blocked"),
    ("first_blocked_with_step_s", "--accel: loop blocked by the first save, + the next step's extra wait", "blocked"),
)
ACCEL_KEYS = frozenset({"step_s", "step_after_save_s", "blocked_with_step_s", "first_blocked_with_step_s"})


def _save(rec: dict[str, Any], index: int) -> dict[str, Any] | None:
    saves = rec.get("save", {}).get("saves")
    return saves[index] if saves else None


def _restore(rec: dict[str, Any], label: str) -> dict[str, Any] | None:
    for r in rec.get("restore", {}).get("restores", []):
        if r["label"] == label and "seconds" in r:
            return r
    return None


def lib_metrics(rec: dict[str, Any]) -> dict[str, float]:
    """The figures of one library in one round (a metric is absent when not measured)."""
    out: dict[str, float] = {}
    saves = rec.get("save", {}).get("saves") or []
    first, later = _save(rec, 0), saves[1:]
    if first and later:
        # Steady state: the saves after the first, each under the library's retention (keep 1).
        out["save_s"] = statistics.median(s["durable_s"] for s in later)
        out["blocked_s"] = statistics.median(s["blocked_s"] for s in later)
        out["first_save_s"] = first["durable_s"]
        out["first_blocked_s"] = first["blocked_s"]
        base = rec["save"]["rss_before_state"]
        nbytes = rec["save"]["state_bytes"]
        out["rss_save_x"] = max(s["peak_rss"] - base for s in rec["save"]["saves"]) / nbytes
        out["rss_save_own_x"] = max(s["peak_rss"] - s["rss_at_start"] for s in rec["save"]["saves"]) / nbytes
        if "step_s" in first:
            out["step_s"] = statistics.median(s["step_s"] for s in saves)
            out["step_after_save_s"] = statistics.median(s["step_after_save_s"] for s in later)

            def with_step(s: dict[str, Any]) -> float:
                return float(s["blocked_s"] + max(0.0, s["step_after_save_s"] - s["step_s"]))

            out["blocked_with_step_s"] = statistics.median(with_step(s) for s in later)
            out["first_blocked_with_step_s"] = with_step(first)
    for key, label in (
        ("first_restore_s", "first"),
        ("cold_restore_s", "cold"),
        ("reshard_s", "reshard"),
        ("params_s", "params"),
    ):
        r = _restore(rec, label)
        if r:
            out[key] = r["seconds"]
    full = [r for r in (_restore(rec, "first"), _restore(rec, "cold"), _restore(rec, "reshard")) if r]
    if full:
        nbytes = rec["restore"]["state_bytes"]
        # Each restore's own growth over the RSS it started from (the previous result freed).
        out["rss_restore_x"] = max(r["peak_rss"] - r["rss_at_start"] for r in full) / nbytes
        cold = _restore(rec, "cold")
        if cold:
            out["rss_kept_x"] = (cold["rss_at_start"] - rec["restore"]["rss_before_restores"]) / nbytes
    return out


def dd_metrics(dd: dict[str, Any]) -> dict[str, float]:
    # A steady-state save may rewrite files in place: its anchor is dd's in-place rewrite.
    return {
        "save_s": dd.get("rewrite_s", dd["write_s"]),
        "first_save_s": dd["write_s"],
        "first_restore_s": dd["read_s"],
        "cold_restore_s": dd["read_s"],
        "reshard_s": dd["read_s"],
        "params_s": dd["read_s"] / 3,
    }


def floor_metrics(floors: dict[str, Any], dd: dict[str, Any] | None) -> dict[str, float]:
    """The device's own limit for each figure: a save can be no faster than one batched
    device-to-host transfer; a restore no faster than reading the bytes (dd) plus one batched
    host-to-device transfer."""
    d2h, h2d = floors["d2h_batched_s"], floors["h2d_batched_s"]
    read = dd["read_s"] if dd else 0.0
    return {
        "save_s": d2h,
        "first_save_s": d2h,
        "first_restore_s": read + h2d,
        "cold_restore_s": read + h2d,
        "reshard_s": read + h2d,
        "params_s": (read + h2d) / 3,
    }


def round_metrics(rnd: dict[str, Any], libs: list[str]) -> dict[str, dict[str, float]]:
    out = {lib: lib_metrics(rnd["libs"][lib]) for lib in libs if lib in rnd["libs"]}
    if rnd.get("dd"):
        out["dd"] = dd_metrics(rnd["dd"])
    if rnd.get("floors"):
        out["floor"] = floor_metrics(rnd["floors"], rnd.get("dd"))
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(rounds: list[dict[str, Any]], libs: list[str]) -> dict[str, Any]:
    """Medians of each figure and medians of the per-round ratios against each anchor."""
    per_round = [round_metrics(r, libs) for r in rounds]
    names = [*libs, "dd", "floor"]
    medians: dict[str, dict[str, float | None]] = {}
    ratios: dict[str, dict[str, dict[str, float | None]]] = {}
    for lib in names:
        medians[lib] = {}
        ratios[lib] = {}
        for key, _, _ in METRICS:
            medians[lib][key] = _median([m[lib][key] for m in per_round if key in m.get(lib, {})])
            ratios[lib][key] = {}
            for anchor in ANCHORS:
                vals = [
                    m[lib][key] / m[anchor][key]
                    for m in per_round
                    if key in m.get(lib, {}) and key in m.get(anchor, {}) and m[anchor][key] > 0
                ]
                ratios[lib][key][anchor] = _median(vals)
    # Within-library ratio: reshard over plain, per round.
    reshard_over_plain = {
        lib: _median(
            [
                m[lib]["reshard_s"] / m[lib]["cold_restore_s"]
                for m in per_round
                if "reshard_s" in m.get(lib, {}) and "cold_restore_s" in m.get(lib, {})
            ]
        )
        for lib in libs
    }
    floors = [r["floors"] for r in rounds if r.get("floors")]
    floor_medians = {
        k: _median([f[k] for f in floors])
        for k in ("d2h_batched_s", "d2h_leafwise_s", "d2h_one_s", "h2d_batched_s", "h2d_leafwise_s", "h2d_one_s")
    }
    return {
        "medians": medians,
        "ratios": ratios,
        "reshard_over_plain": reshard_over_plain,
        "floors": floor_medians if floors else None,
    }


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "—"
    return f"{v:.2f}{unit}" if v >= 0.1 or v == 0 else f"{v:.3f}{unit}"


Check = tuple[str, Callable[[dict[str, Any]], float | None], float, str]


def targets(summary: dict[str, Any], lib: str = "resilax") -> list[tuple[str, float | None, str, str]]:
    """The issue's targets for ``lib``: (target, measured, how it reads, met/missed/not measured)."""
    r, m = summary["ratios"][lib], summary["medians"][lib]
    dd_write_ratio = r["first_save_s"]["dd"]
    checks: list[tuple[str, float | None, float, str]] = [
        ("steady-state durable save ≤ 0.5x Orbax's", r["save_s"]["orbax"], 0.5, "x"),
        ("steady-state durable save no slower than DCP's", r["save_s"]["dcp"], 1.0, "x"),
        (
            "first save of a job ≥ 90% of dd new-file write speed",
            None if dd_write_ratio is None else 1 / dd_write_ratio,
            -0.9,
            "of dd",
        ),
        ("loop blocked by a steady-state save ≤ 0.1 s (1 GiB)", m["blocked_s"], 0.1, "s"),
        ("loop blocked by the first save of a job ≤ 0.1 s (1 GiB)", m["first_blocked_s"], 0.1, "s"),
        ("cold restore ≤ 0.5x Orbax", r["cold_restore_s"]["orbax"], 0.5, "x"),
        ("cold restore no slower than DCP", r["cold_restore_s"]["dcp"], 1.0, "x"),
        ("first restore of a process ≤ 0.4x Orbax's", r["first_restore_s"]["orbax"], 0.4, "x"),
        ("restore onto (2,4) ≤ 1.1x plain restore", summary["reshard_over_plain"].get(lib), 1.1, "x"),
        ("peak RSS during save ≤ 2.2x state", m["rss_save_x"], 2.2, "x"),
        ("peak RSS during restore ≤ 1.3x state", m["rss_restore_x"], 1.3, "x"),
    ]
    out = []
    for name, value, limit, unit in checks:
        if value is None:
            verdict = "not measured"
        elif limit < 0:
            verdict = "met" if value >= -limit else "missed"
        else:
            verdict = "met" if value <= limit else "missed"
        shown = "—" if value is None else (f"{value:.0%} {unit}" if unit == "of dd" else f"{value:.3g}{unit}")
        out.append((name, value, shown, verdict))
    return out


def save_path_line(save: dict[str, Any]) -> str:
    """One save's report from resilax (which transfer path, why, what HBM it held), short."""
    info = save["save_info"]
    if "device_copy" in info:
        parts = [f"{info['device_copy']} ({info.get('reason', '?')})"]
        if isinstance(info.get("device_bytes"), int):
            parts.append(f"HBM {info['device_bytes'] / (1 << 30):.2f} GiB")
        for key, label in (("blocked_seconds", "blocked"), ("transfer_seconds", "transfer")):
            if isinstance(info.get(key), float):
                parts.append(f"{label} {info[key]:.3f} s")
        if info.get("runtime_copy"):
            parts.append("runtime copy")
        if info.get("bounced_writes"):
            parts.append(f"bounce copies so far {info['bounced_writes']} ({info.get('bounced_layout', '')})")
        if info.get("drain_held_peak_bytes"):
            parts.append(f"drain held ≤ {info['drain_held_peak_bytes'] / (1 << 20):.0f} MiB")
        if isinstance(save.get("peak_rss"), int) and isinstance(save.get("rss_at_start"), int):
            own = f"RSS +{(save['peak_rss'] - save['rss_at_start']) / (1 << 30):.2f} GiB over save()"
            heap = save.get("malloc_at_peak")
            if isinstance(heap, dict):
                own += (f" (glibc malloc then: {heap['in_use'] / (1 << 30):.2f} GiB in use, "
                        f"{heap['free'] / (1 << 30):.2f} GiB free in its arenas)")
            parts.append(own)
        return f"step {save['step']}: " + ", ".join(parts)
    return f"step {save['step']}: " + ", ".join(f"{k}={v}" for k, v in sorted(info.items()))


def accel_targets(
    summary: dict[str, Any], state_bytes: int, lib: str = "resilax"
) -> list[tuple[str, float | None, str, str]]:
    """Issue 37's targets on an accelerator (``--accel``), as ``targets`` gives issue 2's."""
    r, m = summary["ratios"][lib], summary["medians"][lib]
    gib = state_bytes / (1 << 30) if state_bytes else None

    def per_gib(v: float | None) -> float | None:
        return None if v is None or not gib else v / gib

    checks: list[tuple[str, float | None, float, str]] = [
        ("steady durable save ≤ 1.5x the device-to-host floor", r["save_s"]["floor"], 1.5, "x"),
        ("steady durable save ≤ 0.35x Orbax", r["save_s"]["orbax"], 0.35, "x"),
        ("loop blocked by a steady save (+ next step's wait) ≤ 0.1 s per GiB", per_gib(m["blocked_with_step_s"]), 0.1, "s/GiB"),
        ("loop blocked by the first save (+ next step's wait) ≤ 0.1 s per GiB", per_gib(m["first_blocked_with_step_s"]), 0.1, "s/GiB"),
        ("cold restore ≤ 2x the (read + host-to-device) floor", r["cold_restore_s"]["floor"], 2.0, "x"),
        ("cold restore ≤ 0.25x Orbax", r["cold_restore_s"]["orbax"], 0.25, "x"),
        ("first restore of a fresh process ≤ 0.3x Orbax", r["first_restore_s"]["orbax"], 0.3, "x"),
        ("peak host RSS during a save ≤ 1.3x state", m["rss_save_x"], 1.3, "x"),
        # The state lives on the devices: what a save adds to the host is the 1.3x less the state.
        ("a save's own host memory (peak − RSS at save()) ≤ 0.3x state", m.get("rss_save_own_x"), 0.3, "x"),
    ]
    out = []
    for name, value, limit, unit in checks:
        verdict = "not measured" if value is None else ("met" if value <= limit else "missed")
        shown = "—" if value is None else f"{value:.3g}{unit}"
        out.append((name, value, shown, verdict))
    return out


def render_floors(summary: dict[str, Any], state_bytes: int) -> list[str]:
    f = summary.get("floors")
    if not f:
        return []

    def cell(key: str) -> str:
        v = f.get(key)
        if v is None:
            return "—"
        return f"{v:.3f} s ({state_bytes / v / 1e9:.2f} GB/s)" if state_bytes and v > 0 else f"{v:.3f} s"

    return [
        "",
        "The device's own transfer limits (same leaves and shardings as the state; median of repeats):",
        "",
        "| transfer | batched (all leaves at once) | leaf by leaf | one array of the same size |",
        "|---|---:|---:|---:|",
        f"| device-to-host | {cell('d2h_batched_s')} | {cell('d2h_leafwise_s')} | {cell('d2h_one_s')} |",
        f"| host-to-device | {cell('h2d_batched_s')} | {cell('h2d_leafwise_s')} | {cell('h2d_one_s')} |",
        "",
        "Floors in the ratio table (/floor): a save against the batched device-to-host time; a restore "
        "against dd's cold read + the batched host-to-device time.",
    ]


def render(
    summary: dict[str, Any],
    libs: list[str],
    errors: dict[str, str],
    header: str,
    state_bytes: int = 0,
    notes: list[str] | None = None,
    accel: bool = False,
) -> str:
    accel = accel or bool(summary.get("floors")) or any(
        summary["medians"][lib].get("step_s") is not None for lib in libs
    )
    names = [*libs, "dd"]
    anchors = ANCHORS if accel else CPU_ANCHORS
    lines = [
        header,
        "",
        "Seconds (median over rounds). Peak RSS: for a save, (peak − RSS before the state was built) / state "
        "bytes, so the state itself counts 1x (on CPU devices it is host memory; on an accelerator it is not, "
        "and that figure also holds what building the state and compiling the first step left on the host), "
        "and a save's own host memory, (peak − RSS when save() was called) / state bytes; for a restore, "
        "(peak − RSS when it started) / state bytes.",
        "",
    ]
    lines.append("| metric | " + " | ".join(names) + " |")
    lines.append("|---|" + "---:|" * len(names))
    for key, label, _ in METRICS:
        if key in ACCEL_KEYS and not accel:
            continue
        cells = [_fmt(summary["medians"][lib][key], "x" if key.endswith("_x") else "") for lib in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += render_floors(summary, state_bytes)
    lines += [
        "",
        "Ratios (median of the per-round ratios; < 1 is faster than the anchor; dd: new-file write "
        "for the first save, in-place rewrite for the steady-state save, cold read for restores, a "
        "third of it for params-only).",
        "",
    ]
    lines.append("| metric | library | " + " | ".join(f"/{a}" for a in anchors) + " |")
    lines.append("|---|---|" + "---:|" * len(anchors))
    for key, label, kind in METRICS:
        if kind in ("x", "blocked", "step"):
            continue
        for lib in libs:
            row = summary["ratios"][lib][key]
            if summary["medians"][lib][key] is None:
                continue
            lines.append(f"| {label} | {lib} | " + " | ".join(_fmt(row[a]) for a in anchors) + " |")
    lines += [
        "",
        "Restore onto (2,4) over plain restore, same library: "
        + ", ".join(f"{lib} {_fmt(v)}" for lib, v in summary["reshard_over_plain"].items()),
    ]
    if "resilax" in libs and accel:
        lines += [
            "",
            "Targets for resilax_ckpt on an accelerator (issue 37):",
            "",
            "| target | measured | result |",
            "|---|---:|---|",
        ]
        lines += [f"| {name} | {shown} | {verdict} |" for name, _, shown, verdict in accel_targets(summary, state_bytes)]
    elif "resilax" in libs:
        lines += [
            "",
            "Targets for resilax_ckpt (issue 2):",
            "",
            "| target | measured | result |",
            "|---|---:|---|",
        ]
        lines += [f"| {name} | {shown} | {verdict} |" for name, _, shown, verdict in targets(summary)]
    if notes:
        lines += ["", *notes]
    if errors:
        lines += ["", "Not measured:"]
        lines += [f"- {lib}: {msg}" for lib, msg in errors.items()]
    return "\n".join(lines)
