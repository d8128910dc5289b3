"""What a demo run leaves in its folder: timeline.txt, the recorded series (snapshots, faults, events,
notes, losses as JSON lines), loss.png (`render_plot`, matplotlib) and result.json (the outcome)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .timeline import (
    Fault,
    JobSnapshot,
    LossRecord,
    PlotData,
    TimelineEvent,
    build_generations,
    build_plot_data,
    build_timeline,
    build_transitions,
    check_loss_continuity,
)


def say(text: str) -> None:
    print(text, flush=True)


def write_run_outputs(run_dir: Path, job_name: str, start: float, snapshots: list[JobSnapshot],
                      faults: list[Fault], records: list[LossRecord], events: dict[str, TimelineEvent],
                      notes: list[TimelineEvent], goodput: dict[str, Any] | None,
                      outcome: dict[str, Any]) -> list[str]:
    """Write timeline.txt, the recorded series (*.jsonl), loss.png and result.json into `run_dir`
    (`outcome` gains what they show); the timeline's lines."""
    lines = build_timeline(start, snapshots, faults, records,
                           events=list(events.values()), notes=notes, goodput=goodput)
    (run_dir / "timeline.txt").write_text("\n".join(lines) + "\n")
    with (run_dir / "losses.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    for name, items in (("snapshots", snapshots), ("faults", faults),
                        ("events", sorted(events.values(), key=lambda e: e.time)), ("notes", notes)):
        with (run_dir / f"{name}.jsonl").open("w") as f:
            for item in items:
                f.write(json.dumps(asdict(item)) + "\n")
    png = run_dir / "loss.png"
    plotted = False
    if records:
        try:
            render_plot(build_plot_data(records, faults, start), png,
                        title=f"JAXJob {job_name}: loss across generations")
            plotted = True
        except ImportError as e:
            say(f"    no plot: {e} (pip install matplotlib)")
    transitions = build_transitions(build_generations(records), faults)
    continuity = check_loss_continuity(records)
    outcome.update({
        "png": str(png) if plotted else None,
        "continuous": continuity.ok and continuity.max_step > 0,
        "max_step": continuity.max_step,
        "generations": [asdict(g) for g in build_generations(records)],
        "transitions": [{"from": t.before.generation, "to": t.after.generation,
                         "cause": t.cause.kind if t.cause else None, "steps_lost": t.steps_lost,
                         "restored_step": t.after.restored_step, "devices": [t.before.devices, t.after.devices],
                         "pause_seconds": round(t.pause_seconds, 1)} for t in transitions],
        "phases": [s.phase for s in snapshots],
        "goodput": goodput,
    })
    (run_dir / "result.json").write_text(json.dumps(outcome, indent=1) + "\n")
    return lines


def render_plot(data: PlotData, path: Path, title: str) -> None:
    """Loss against step (log scale) per generation, and step against time; faults as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(14, 5.5), constrained_layout=True)
    colours = plt.get_cmap("tab10")
    for i, s in enumerate(data.series):
        colour = colours(i % 10)
        label = f"generation {s.generation} ({s.devices} devices)"
        ax_loss.plot(s.steps, s.losses, ".-", ms=3, lw=0.8, color=colour, label=label)
        ax_time.plot(s.times, s.steps, ".", ms=3, color=colour, label=label)
        if i:  # where the restore put this generation: the first step after the restored one
            ax_loss.plot(s.steps[:1], s.losses[:1], "o", ms=9, mfc="none", mew=1.5, color=colour)
            ax_loss.annotate(f"restored step {s.steps[0] - 1}\non {s.devices} devices", (s.steps[0], s.losses[0]),
                             xytext=(s.steps[0] + 6, 0.62 - 0.14 * (i % 2)), textcoords=("data", "axes fraction"),
                             fontsize=8, color=colour, bbox={"fc": "white", "ec": colour, "lw": 0.5, "alpha": 0.9},
                             arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.8})
    for n, m in enumerate(data.markers):
        mark = "red" if m.label.startswith("kill") else "green"
        for ax, x in ((ax_loss, m.step), (ax_time, m.time)):
            ax.axvline(x, ls="--", lw=1, color=mark)
            ax.annotate(m.label, (x, 0.99 - 0.12 * (n % 2)), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=8, color=mark)
    for span in data.spans:
        ax_time.axvspan(span.start, span.end, color="grey", alpha=0.15, lw=0)
        ax_time.annotate(span.label, ((span.start + span.end) / 2, 0.5), xycoords=("data", "axes fraction"),
                         rotation=90, va="center", ha="center", fontsize=8, color="dimgrey")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (per batch)")
    ax_loss.set_title("loss against step: one curve across generations")
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_time.set_xlabel("seconds since the demo started")
    ax_time.set_ylabel("step")
    ax_time.set_title("progress: grey = fault or resize until the next generation's first step")
    ax_time.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
