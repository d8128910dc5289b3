"""`kubectl resilax timeline --png FILE`: the picture of a job's generations, drawn with matplotlib.

The demo's picture (resilax_local.demo.outputs.render_plot) from what a real cluster keeps, the job's
status.history: on the left the generations on a time axis (start-up light, training dark, checkpoints as
ticks, each end marked by its reason: red for a fault, orange for a notice, green for a planned end); on
the right the step against time, one line per generation from its first step to its last, the restored
step circled, grey where a fault or resize cost time. The figures are timeline.build_plot's (pure); this
module only draws them. matplotlib is the `plot` extra (`pip install 'resilax[plot]'`), imported here only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from .timeline import TimelinePlot

PLOT_EXTRA: Final = "plot"
END_COLOURS: Final = {"fault": "red", "notice": "darkorange", "planned": "green", "running": "grey"}


class MissingPlotExtraError(ImportError):
    """matplotlib is not installed: the message names the extra that brings it."""


def render_png(plot: TimelinePlot, path: Path) -> None:
    """Draw `plot` into the PNG file `path`."""
    try:
        import matplotlib
    except ImportError as e:
        raise MissingPlotExtraError(f"--png needs matplotlib, which the {PLOT_EXTRA!r} extra brings: "
                                    f"pip install 'resilax[{PLOT_EXTRA}]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gantt, ax_steps) = plt.subplots(1, 2, figsize=(14, 5.5), constrained_layout=True)
    colours = plt.get_cmap("tab10")
    rows = len(plot.bars)
    for i, bar in enumerate(plot.bars):
        colour = colours(i % 10)
        y = rows - 1 - i
        ax_gantt.broken_barh([(bar.start, bar.first_step_at - bar.start)], (y - 0.35, 0.7), color=colour, alpha=0.3)
        ax_gantt.broken_barh([(bar.first_step_at, bar.end - bar.first_step_at)], (y - 0.35, 0.7), color=colour)
        for _, at in bar.checkpoints:
            ax_gantt.plot([at, at], [y - 0.35, y + 0.35], color="black", lw=0.8)
        mark = END_COLOURS[bar.end_kind]
        ax_gantt.annotate(bar.end_reason or "running", (bar.end, y + 0.4), fontsize=8, color=mark, ha="right",
                          va="bottom")
        if bar.end_kind != "running":
            for ax in (ax_gantt, ax_steps):
                ax.axvline(bar.end, ls="--", lw=1, color=mark)
        if bar.first_step is not None and bar.last_step is not None:
            label = f"generation {bar.generation} ({bar.label})"
            ax_steps.plot([bar.first_step_at, bar.end], [bar.first_step, bar.last_step], "-", lw=1.5, color=colour,
                          label=label)
            ax_steps.plot([at for _, at in bar.checkpoints], [s for s, _ in bar.checkpoints], "|", ms=8,
                          color="black")
            if bar.restored != "fresh":
                ax_steps.plot([bar.first_step_at], [bar.first_step], "o", ms=9, mfc="none", mew=1.5, color=colour)
                ax_steps.annotate(f"restored {bar.restored}", (bar.first_step_at, bar.first_step), fontsize=8,
                                  color=colour, xytext=(4, -12), textcoords="offset points")
    for start, end, reason in plot.gaps:
        ax_steps.axvspan(start, end, color="grey", alpha=0.15, lw=0)
        ax_steps.annotate(reason, ((start + end) / 2, 0.5), xycoords=("data", "axes fraction"), rotation=90,
                          va="center", ha="center", fontsize=8, color="dimgrey")
    ax_gantt.set_yticks(range(rows), [f"gen {b.generation}\n{b.label}" for b in reversed(plot.bars)], fontsize=8)
    ax_gantt.set_xlabel(f"seconds since {plot.origin.strftime('%Y-%m-%d %H:%M:%S')}Z")
    ax_gantt.set_title("generations: light = start-up, dark = training, ticks = checkpoints")
    ax_steps.set_xlabel(f"seconds since {plot.origin.strftime('%Y-%m-%d %H:%M:%S')}Z")
    ax_steps.set_ylabel("step")
    ax_steps.set_title("progress: grey = fault or resize until the next generation's first step")
    if any(b.first_step is not None for b in plot.bars):
        ax_steps.legend(loc="lower right", fontsize=8)
    fig.suptitle(plot.title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
