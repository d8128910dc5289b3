"""`kubectl resilax web FILE`: one static, read-only HTML page with the timeline of every job (pure).

The page carries the jobs' generations as JSON (timeline.build_plot's bars, per job) and a short script
that lays them out: one row per job, one block per generation on the job's time axis (start-up light,
training dark, a tick per checkpoint, the end coloured by its kind), the same facts as the text Gantt in
a table under it. Nothing is fetched: the file opens from disk, offline, and shows what the plugin read
when it wrote it (the time is on the page). Why a file and not a page the operator serves:
docs/operations.md, "The web page".

Each generation's block is `<div class="generation" data-job="ns/name" data-generation="N">`, which the
browser test (tests/web/test_timeline_page.py) finds after the script ran.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import datetime
from typing import Any

from .timeline import END_GLYPHS, build_plot, parse_history


def build_page_data(jobs: Sequence[Mapping[str, Any]], now: datetime) -> dict[str, Any]:
    """The JSON the page embeds: for each job (by namespace, name) its phase and its plot's bars."""
    entries = []
    for job in sorted(jobs, key=lambda j: ((j.get("metadata") or {}).get("namespace") or "",
                                           (j.get("metadata") or {}).get("name") or "")):
        meta = job.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        plot = build_plot(key, parse_history(job), now)
        entries.append({
            "job": key, "phase": (job.get("status") or {}).get("phase") or "Pending",
            "origin": plot.origin.strftime("%Y-%m-%dT%H:%M:%SZ"), "span": plot.span,
            "generations": [asdict(b) for b in plot.bars],
        })
    return {"generatedAt": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "jobs": entries, "glyphs": END_GLYPHS}


_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
.job { margin-bottom: 2em; }
.axis { position: relative; height: 2.2em; background: #f4f4f4; border: 1px solid #ccc; }
.generation { position: absolute; top: 0.2em; height: 1.8em; overflow: hidden; white-space: nowrap;
  font-size: 11px; line-height: 1.8em; border-right: 3px solid grey; box-sizing: border-box; }
.generation .startup { position: absolute; top: 0; bottom: 0; left: 0; opacity: 0.35; }
.generation .training { position: absolute; top: 0; bottom: 0; }
.generation .label { position: relative; padding-left: 3px; }
.generation .checkpoint { position: absolute; top: 0; bottom: 0; width: 1px; background: black; }
.end-fault { border-right-color: red; } .end-notice { border-right-color: darkorange; }
.end-planned { border-right-color: green; } .end-running { border-right-color: grey; }
table { border-collapse: collapse; margin-top: 0.5em; font-size: 12px; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
"""

_SCRIPT = """
const data = JSON.parse(document.getElementById("timeline-data").textContent);
const colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
const root = document.getElementById("jobs");
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function pct(x, span) { return (span > 0 ? 100 * x / span : 0) + "%"; }
for (const job of data.jobs) {
  const box = el("section", "job");
  box.dataset.job = job.job;
  box.appendChild(el("h2", null, job.job + " (" + job.phase + ")"));
  if (!job.generations.length) { box.appendChild(el("p", "empty", "no history yet")); root.appendChild(box); continue; }
  box.appendChild(el("p", null, job.generations.length + " generations since " + job.origin));
  const axis = el("div", "axis");
  const table = el("table");
  const head = el("tr");
  for (const h of ["gen", "shape", "steps", "restored", "checkpoints", "end"]) head.appendChild(el("th", null, h));
  table.appendChild(head);
  job.generations.forEach((g, i) => {
    const colour = colours[i % colours.length];
    const block = el("div", "generation end-" + g.end_kind);
    block.dataset.job = job.job;
    block.dataset.generation = String(g.generation);
    block.style.left = pct(g.start, job.span);
    block.style.width = pct(Math.max(g.end - g.start, 0), job.span);
    const width = Math.max(g.end - g.start, 1e-9);
    const startup = el("div", "startup");
    startup.style.width = pct(g.first_step_at - g.start, width);
    startup.style.background = colour;
    const training = el("div", "training");
    training.style.left = pct(g.first_step_at - g.start, width);
    training.style.right = "0";
    training.style.background = colour;
    block.append(startup, training);
    for (const [step, at] of g.checkpoints) {
      const tick = el("div", "checkpoint");
      tick.style.left = pct(at - g.start, width);
      tick.title = "checkpoint " + step;
      block.appendChild(tick);
    }
    block.appendChild(el("span", "label", "gen " + g.generation));
    block.title = "generation " + g.generation + ": " + g.label + ", " + (g.end_reason || "running") +
      (g.end_message ? " (" + g.end_message + ")" : "");
    axis.appendChild(block);
    const row = el("tr", "generation-row");
    row.dataset.generation = String(g.generation);
    const steps = g.first_step === null ? "-" : g.first_step + "-" + (g.last_step === null ? "" : g.last_step);
    const end = (data.glyphs[g.end_kind] || "") + " " + (g.end_reason || "running") +
      (g.end_message ? ": " + g.end_message : "");
    for (const cell of ["" + g.generation, g.label, steps, g.restored,
                        g.checkpoints.map(c => c[0]).join(", "), end]) row.appendChild(el("td", null, cell));
    table.appendChild(row);
  });
  box.append(axis, table);
  root.appendChild(box);
}
document.body.dataset.rendered = "true";
"""


def build_page(data: Mapping[str, Any]) -> str:
    """The HTML page of `data` (build_page_data), self-contained: styles, data and script inline."""
    # JSON inside <script>: escape '<' so that no string can close the element.
    payload = json.dumps(data, sort_keys=True).replace("<", "\\u003c")
    generated = html.escape(str(data.get("generatedAt")))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Resilax: JAXJob timelines</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>JAXJob timelines</h1>
<p>As of {generated} (kubectl resilax web). Light: start-up (scheduling, JAX start, restore); dark: training;
ticks: checkpoints (placed by step); the end's colour: red a fault, orange a notice, green planned, grey running.</p>
<div id="jobs"></div>
<script type="application/json" id="timeline-data">{payload}</script>
<script>{_SCRIPT}</script>
</body>
</html>
"""
