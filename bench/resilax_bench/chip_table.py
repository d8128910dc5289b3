"""The accelerator run's compact table (issue 37's layout) from ``--accel --json`` files:
``python -m resilax_bench.chip_table TMPFS.json [DISK.json ...]``.

The first file gives the full table (each library against the device's own limits); each further file
(e.g. the 9p disk) adds a line per figure. Every number is printed beside its platform and device.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from resilax_bench import report

LIBS = (("resilax", "resilax"), ("orbax", "Orbax"), ("numpy", "np.save/np.load+device_put"))
ROWS = (
    ("save_s", "steady durable save (state changes every step)"),
    ("blocked_s", "loop blocked in save(), steady"),
    ("blocked_with_step_s", "loop blocked, steady: save() + next step's extra wait"),
    ("first_blocked_with_step_s", "loop blocked, first save: save() + next step's extra wait"),
    ("cold_restore_s", "cold restore"),
    ("first_restore_s", "first restore of a fresh process"),
    ("rss_save_x", "peak host RSS during a save, x state"),
    ("rss_save_own_x", "a save's own host memory (peak − RSS at save()), x state"),
    ("open_restore_s", "opening the library for a restore (fresh process, not in the rows above)"),
)


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    data.setdefault("summary", report.summarize(data.get("rounds", []), data.get("libs", [])))
    return data


def _where(data: dict[str, Any]) -> str:
    facts = data.get("facts", {})
    d = facts.get("devices") or {}
    fs = (facts.get("filesystem") or "").split()
    first = next((rec["save"] for r in data.get("rounds", []) for rec in r["libs"].values()), {})
    gib = first.get("state_bytes", 0) / (1 << 30)
    return (
        f"{gib:.2f} GiB in {first.get('leaves', '?')} leaves, {facts.get('target', '?')} "
        f"({fs[1] if len(fs) > 1 else '?'}), {d.get('device_count', '?')} x {d.get('device_kind', '?')} "
        f"({d.get('platform', '?')}), {len(data.get('rounds', []))} round(s)"
    )


def _cell(data: dict[str, Any], lib: str, key: str) -> str:
    s = data["summary"]
    if key == "open_restore_s":
        opened = [r["libs"][lib]["restore"]["open_s"] for r in data.get("rounds", []) if "open_s" in r["libs"].get(lib, {}).get("restore", {})]
        return f"{min(opened):.3f} s" if opened else "—"
    v = s["medians"].get(lib, {}).get(key)
    if v is None:
        return "—"
    if key.endswith("_x"):
        return f"{v:.2f}x"
    text = f"{v:.3f} s"
    ratios = s["ratios"].get(lib, {}).get(key, {})
    extra = []
    if ratios.get("floor") is not None:
        extra.append(f"{ratios['floor']:.2f}x floor")
    if lib != "orbax" and ratios.get("orbax") is not None:
        extra.append(f"{ratios['orbax']:.2f}x Orbax")
    return text + (f" ({', '.join(extra)})" if extra else "")


def _limit(data: dict[str, Any], key: str) -> str:
    f = data["summary"].get("floors") or {}
    dd = data["summary"]["medians"].get("dd", {})
    nbytes = next((rec["save"]["state_bytes"] for r in data.get("rounds", []) for rec in r["libs"].values()), 0)

    def gbps(v: float) -> str:
        return f"{nbytes / v / 1e9:.2f} GB/s" if nbytes and v else "?"

    if key == "save_s":
        parts = []
        if f.get("d2h_batched_s") is not None:
            parts.append(f"device-to-host {f['d2h_batched_s']:.3f} s ({gbps(f['d2h_batched_s'])})")
        if dd.get("save_s") is not None:
            parts.append(f"dd write {dd['first_save_s']:.3f} s new, {dd['save_s']:.3f} s in place")
        return "; ".join(parts) or "—"
    if key == "cold_restore_s":
        parts = []
        if f.get("h2d_batched_s") is not None:
            parts.append(f"host-to-device {f['h2d_batched_s']:.3f} s ({gbps(f['h2d_batched_s'])})")
        if dd.get("cold_restore_s") is not None:
            parts.append(f"dd read {dd['cold_restore_s']:.3f} s")
        return " + ".join(parts) or "—"
    return ""


def render(paths: list[str]) -> str:
    lines: list[str] = []
    for i, path in enumerate(paths):
        try:
            data = _load(path)
        except (OSError, ValueError, KeyError) as e:
            lines += ["", f"{path}: no result ({type(e).__name__}: {e})"]
            continue
        libs = [(k, name) for k, name in LIBS if k in data.get("libs", [])]
        lines += ["", f"| {_where(data)} | " + " | ".join(name for _, name in libs) + " | the device's own limit |"]
        lines.append("|---|" + "---:|" * (len(libs) + 1))
        for key, label in ROWS:
            lines.append(
                f"| {label} | " + " | ".join(_cell(data, k, key) for k, _ in libs) + f" | {_limit(data, key)} |"
            )
        f = data["summary"].get("floors")
        if f and i == 0:
            lines.append(
                f"\nDevice floors: d2h batched {f['d2h_batched_s']:.3f} s, leaf by leaf {f['d2h_leafwise_s']:.3f} s, "
                f"one array {f['d2h_one_s']:.3f} s; h2d batched {f['h2d_batched_s']:.3f} s, leaf by leaf "
                f"{f['h2d_leafwise_s']:.3f} s, one array {f['h2d_one_s']:.3f} s."
            )
        if "resilax" in data.get("libs", []) and i == 0:
            nbytes = next((rec["save"]["state_bytes"] for r in data["rounds"] for rec in r["libs"].values()), 0)
            lines.append("\nIssue 37 targets (resilax): " + "; ".join(
                f"{name}: {shown} {verdict}" for name, _, shown, verdict in report.accel_targets(data["summary"], nbytes)
            ))
        reports = [
            report.save_path_line(s)
            for r in data.get("rounds", [])
            for s in r["libs"].get("resilax", {}).get("save", {}).get("saves", [])
            if s.get("save_info")
        ]
        if reports:
            lines.append("resilax save path: " + "; ".join(reports))
        opts = next(
            (r["libs"]["resilax"]["save"].get("resilax_options") for r in data.get("rounds", []) if "resilax" in r["libs"]),
            None,
        )
        if opts:
            lines.append("resilax options: " + ", ".join(f"{k}={v}" for k, v in opts.items()))
        for lib, msg in data.get("errors", {}).items():
            lines.append(f"- not measured: {lib}: {msg[:300]}")
        facts = data.get("facts", {})
        lines.append(f"commit {str(facts.get('commit', '?'))[:12]} ({facts.get('commit_source', '?')}), {facts.get('date', '?')}")
    return "\n".join(lines).lstrip("\n")


if __name__ == "__main__":
    print(render(sys.argv[1:]))
