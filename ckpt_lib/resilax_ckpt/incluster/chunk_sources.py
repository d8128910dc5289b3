"""Which host serves each file a process's restore needs, whatever the mesh: the shrink and grow
restore from the in-cluster tiers (docs/checkpointing.md §9, "Restores from the in-cluster tiers").
Pure: no I/O (chunk_fetch.py scans the node and moves the bytes, restorer.py exchanges the views).

Every process of a generation offers what its **node** holds of each step at least as new as the
persistent tier's newest: each `Copy` is one folder — a committed local step (`"local"`, whoever
wrote it: a node-scoped local tier outlives the process numbering, so after a shrink the folder of
old process 3 may sit under new process 1) or a peer replica (`"p<origin>"`) — with the save's
identity, the chunk files it has and how many chunk files the step has in all. Files are paths
relative to the step folder (`<item>/<leaf>/c/<i>/<j>`); within one save a path names the same
bytes wherever it is (a chunk of a data-parallel array is written by every process holding it, with
the same values).

A step is **complete in the cluster** (`complete_saves`) when, for one save, the union of the copies'
chunk files has every chunk file of the step: then any process can assemble any target's chunks
from the hosts, whatever its new mesh. Sources (`plan_file_sources`): this process's own node first
(linked, no transfer), then the other processes in process order (each copy's folder, `"local"`
before replicas), the next tried when one is refused (a checksum mismatch); a file no host holds has
no source and is read from the persistent tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

LOCAL_FOLDER = "local"
"""`Copy.folder` of a committed local step folder `<local>/<step>/`."""


@dataclasses.dataclass(frozen=True)
class Copy:
    """One folder of one step on one node."""

    step: int
    save: str
    """The save's identity (`"save"` of the local `_COMMIT`, the same on every host for one save)."""
    folder: str
    """`"local"` or `"p<origin>"` (a replica held for process `origin`)."""
    chunks: frozenset[str]
    """The chunk files it has (relative paths)."""
    others: frozenset[str]
    """Its other files a restore may read (`zarr.json`, JSON items, per-process items)."""
    total: int
    """How many chunk files the step has in all (from its metadata)."""
    metadata: str
    """The name of its metadata file (`_METADATA.json` or `_METADATA.<process>.json`)."""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "save": self.save, "folder": self.folder, "chunks": sorted(self.chunks),
                "others": sorted(self.others), "total": self.total, "metadata": self.metadata}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Copy:
        return cls(int(raw["step"]), str(raw["save"]), str(raw["folder"]), frozenset(map(str, raw["chunks"])),
                   frozenset(map(str, raw["others"])), int(raw["total"]), str(raw["metadata"]))


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one file can be read: a folder on the node of `process`."""

    process: int
    folder: str


def complete_saves(views: Mapping[int, Sequence[Copy]]) -> dict[int, str]:
    """step -> the save whose copies on all nodes together hold every chunk file of the step (the
    greatest identity when several do: a deterministic choice every process makes alike)."""
    union: dict[tuple[int, str], set[str]] = {}
    total: dict[tuple[int, str], int] = {}
    for copies in views.values():
        for c in copies:
            union.setdefault((c.step, c.save), set()).update(c.chunks)
            total[(c.step, c.save)] = max(total.get((c.step, c.save), 0), c.total)
    out: dict[int, str] = {}
    for (step, save), files in sorted(union.items()):
        if total[(step, save)] > 0 and len(files) >= total[(step, save)]:
            out[step] = save
    return out


def copies_of(views: Mapping[int, Sequence[Copy]], step: int, save: str) -> dict[int, list[Copy]]:
    """process -> its node's copies of (step, save), `"local"` first."""
    return {p: sorted((c for c in copies if c.step == step and c.save == save),
                      key=lambda c: (c.folder != LOCAL_FOLDER, c.folder))
            for p, copies in sorted(views.items())}


def plan_file_sources(views: Mapping[int, Sequence[Copy]], me: int, step: int, save: str,
                      needed: Iterable[str]) -> dict[str, list[Source]]:
    """needed file -> its sources in the order to try them: `me`'s own node first, then the other
    processes in process order; `[]` when no node holds it (read it from the persistent tier)."""
    by_process = copies_of(views, step, save)
    order = ([me] if me in by_process else []) + [p for p in by_process if p != me]
    out: dict[str, list[Source]] = {}
    for path in needed:
        out[path] = [Source(p, c.folder) for p in order for c in by_process[p]
                     if path in c.chunks or path in c.others]
    return out


def other_files(views: Mapping[int, Sequence[Copy]], step: int, save: str, process: int) -> list[str]:
    """The non-chunk files a restore of (step, save) by `process` reads: every `zarr.json` and JSON
    item, and its own per-process items (`<item>/process_<process>.json`), not the other processes'."""
    names = {f for copies in views.values() for c in copies if c.step == step and c.save == save for f in c.others}
    return sorted(f for f in names if not _other_process_file(f, process))


def _other_process_file(path: str, process: int) -> bool:
    name = path.rsplit("/", 1)[-1]
    return "/" in path and name.startswith("process_") and name != f"process_{process}.json"


def summarize_sources(plan: Mapping[str, Sequence[Source]], me: int) -> dict[str, int]:
    """How many needed files each kind of source serves first: own node, a peer, none (persistent)."""
    out = {"local": 0, "peer": 0, "persistent": 0}
    for sources in plan.values():
        out["persistent" if not sources else "local" if sources[0].process == me else "peer"] += 1
    return out
