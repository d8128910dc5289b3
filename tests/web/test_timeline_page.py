"""The static timeline page (`kubectl resilax web FILE`) in a real headless browser: Chromium loads the
file, runs its script, and the DOM it leaves (`--dump-dom`) holds one block per generation of every job,
placed on the job's time axis, with a table row per generation; a job without history says so.

Debian's chromium, not Playwright's: Playwright's browsers download from its own CDN, which CI cannot
reach (only PyPI, npm, Debian and the Go proxy); `--dump-dom` prints the DOM after the page's scripts ran
and is all this test needs (docs/operations.md, "The web page")."""

from __future__ import annotations

import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from history_fixtures import HISTORY, NOW, job
from resilax_operator.kubectl import timeline_page


class Elements(HTMLParser):
    """Every element's tag and attributes, and the text of each element by id-less path (enough here)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _render(chromium: str, page: Path, tmp_path: Path) -> Elements:
    """The DOM after the page's scripts ran, as Chromium serialises it."""
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = Elements()
    parsed.feed(proc.stdout)
    return parsed


def _percent(style: str, key: str) -> float:
    for part in style.split(";"):
        name, _, value = part.partition(":")
        if name.strip() == key:
            return float(value.strip().removesuffix("%"))
    raise AssertionError(f"no {key} in {style!r}")


def test_the_page_shows_each_generation_of_every_job(chromium: str, tmp_path: Path) -> None:
    jobs = [job(), job(name="small", namespace="team-b", history=HISTORY[:2], phase="Recovering"),
            job(name="new", history=[], phase="Pending")]
    page = tmp_path / "timelines.html"
    page.write_text(timeline_page.build_page(timeline_page.build_page_data(jobs, NOW)))

    dom = _render(chromium, page, tmp_path)
    body = next(attrs for tag, attrs in dom.elements if tag == "body")
    assert body.get("data-rendered") == "true", "the page's script did not run to its end"
    blocks = [attrs for tag, attrs in dom.elements if tag == "div" and "generation" in attrs.get("class", "").split()]
    by_job: dict[str, list[int]] = {}
    for attrs in blocks:
        by_job.setdefault(attrs["data-job"], []).append(int(attrs["data-generation"]))
    assert by_job == {"team-a/llama": [1, 2, 3], "team-b/small": [1, 2]}

    # Placed on the job's axis: generation 2 of team-a/llama starts 640 s into 1800 s and lasts 600 s;
    # each end coloured by its kind (a fault, a planned end, running).
    llama = [attrs for attrs in blocks if attrs["data-job"] == "team-a/llama"]
    assert _percent(llama[1]["style"], "left") == pytest.approx(100 * 640 / 1800, abs=0.01)
    assert _percent(llama[1]["style"], "width") == pytest.approx(100 * 600 / 1800, abs=0.01)
    assert [a["class"].split()[-1] for a in llama] == ["end-fault", "end-planned", "end-running"]
    ticks = [attrs for tag, attrs in dom.elements if tag == "div" and attrs.get("class") == "checkpoint"]
    assert len(ticks) == sum(len(e["checkpoints"]) for e in HISTORY) + sum(len(e["checkpoints"]) for e in HISTORY[:2])

    rows = [attrs for tag, attrs in dom.elements if tag == "tr" and attrs.get("class") == "generation-row"]
    assert [int(r["data-generation"]) for r in rows] == [1, 2, 3, 1, 2]
    text = " ".join(dom.text)
    assert "team-a/new (Pending)" in text and "no history yet" in text
    assert "500 (persistent)" in text and "NodeLost: node tpu-1" in text
