"""The checkpoint layout names the uploader needs, and the fence rule it must respect.

These mirror `resilax_ckpt.layout` and `resilax_ckpt.fencing` (docs/architecture.md, "Checkpoint
layout"; docs/checkpointing.md). They are repeated here, not imported, because importing
`resilax_ckpt` loads JAX, which the sidecar container neither has the memory for nor needs;
tests/sidecar/test_layout.py fails if the two ever disagree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

METADATA_FILE = "_METADATA.json"
COMMIT_FILE = "_COMMIT"
UPLOADED_PREFIX = "_UPLOADED."
FENCES_DIR = "_fences"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"

_STEP_RE = re.compile(r"^[0-9]+$")


def parse_step(name: str) -> int | None:
    """The step of a folder name (a plain decimal number), or None when it is not a step folder."""
    name = name.rstrip("/")
    return int(name) if _STEP_RE.match(name) else None


def commit_name(process_id: int | None) -> str:
    """`_COMMIT`, or `_COMMIT.<id>` for one process of several sharing a local folder (tests)."""
    return COMMIT_FILE if process_id is None else f"{COMMIT_FILE}.{process_id}"


def metadata_name(process_id: int | None) -> str:
    """`_METADATA.json`, or `_METADATA.<id>.json` for one process of several sharing a local folder."""
    return METADATA_FILE if process_id is None else f"_METADATA.{process_id}.json"


def uploaded_name(process_id: int) -> str:
    """The marker a sidecar writes into a persistent step when its process's files are all there."""
    return f"{UPLOADED_PREFIX}{process_id}"


def parse_uploaded(name: str) -> int | None:
    """The process id of an `_UPLOADED.<id>` marker name, or None."""
    if not name.startswith(UPLOADED_PREFIX):
        return None
    rest = name[len(UPLOADED_PREFIX) :]
    return int(rest) if rest.isdigit() else None


def parse_fence(name: str, data: bytes) -> tuple[int, int | None] | None:
    """(generation, latest_step) of a `_fences/<generation>.json` record, or None if unreadable."""
    if not name.endswith(".json") or not name[:-5].isdigit():
        return None
    try:
        raw = json.loads(data)
        latest = raw.get("latest_step")
        return int(raw["generation"]), (None if latest is None else int(latest))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def decide_visible(step: int, step_generation: int, fences: Mapping[int, int | None]) -> bool:
    """Whether a step committed by `step_generation` would be visible under the fences (pure).

    Same rule as `resilax_ckpt.fencing.decide_visible`: a fence of a newer generation that started
    when `latest` was the newest step hides every step of older generations above `latest`.
    """
    for generation, latest in fences.items():
        if generation > step_generation and (latest is None or step > latest):
            return False
    return True
