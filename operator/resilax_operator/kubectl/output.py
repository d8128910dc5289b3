"""`kubectl resilax ... -o json|yaml`, `list` and `version`: what the read commands print for a program
(pure functions of the job, its events and the time; kubectl/plugin.py does the calls).

Each read command's `-o json` is one JSON document (`-o yaml` the same as YAML): an object whose
`kind` names it (`JAXJobStatus`, `JAXJobGoodput`, `JAXJobTimeline`, `JAXJobList`, `Version`), so a
script can tell them apart, with the job's `namespace` and `name` and the status fields it shows.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from .. import api

OUTPUT_FORMATS = ("json", "yaml")


def _ref(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = job.get("metadata") or {}
    return {"namespace": meta.get("namespace"), "name": meta.get("name"), "uid": meta.get("uid")}


def build_status_data(job: Mapping[str, Any], last_fault: str) -> dict[str, Any]:
    """`status NAME -o json`: the job's status (as the operator keeps it) and the last fault."""
    status = dict(job.get("status") or {})
    status.pop("lastValidSpec", None)  # a copy of the spec: `kubectl get jj NAME -o json` has it
    return {"kind": "JAXJobStatus", **_ref(job), "suspend": bool((job.get("spec") or {}).get("suspend")),
            "status": status, "lastFault": last_fault}


def build_goodput_data(job: Mapping[str, Any]) -> dict[str, Any]:
    """`goodput NAME -o json`: status.goodput (null before the first generation)."""
    return {"kind": "JAXJobGoodput", **_ref(job), "goodput": (job.get("status") or {}).get("goodput")}


def build_timeline_data(job: Mapping[str, Any]) -> dict[str, Any]:
    """`timeline NAME -o json`: status.history, one entry per generation."""
    return {"kind": "JAXJobTimeline", **_ref(job), "history": list((job.get("status") or {}).get("history") or [])}


def _row(job: Mapping[str, Any]) -> dict[str, Any]:
    status = job.get("status") or {}
    shape = status.get("shape") or {}
    return {**_ref(job), "phase": status.get("phase") or api.PHASE_PENDING,
            "generation": int(status.get("generation") or 0),
            "count": shape.get("count"), "topology": shape.get("topology"),
            "savedStep": (status.get("checkpoint") or {}).get("step"),
            "goodput": (status.get("goodput") or {}).get("ratio"),
            "created": (job.get("metadata") or {}).get("creationTimestamp")}


def build_list_data(jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`list [-A] -o json`: one row per job, sorted by namespace and name."""
    rows = sorted((_row(j) for j in jobs), key=lambda r: (str(r["namespace"]), str(r["name"])))
    return {"kind": "JAXJobList", "items": rows}


def build_list_screen(jobs: Sequence[Mapping[str, Any]], all_namespaces: bool) -> str:
    """`list [-A]`: a table as `kubectl get` prints one (NAMESPACE only with -A)."""
    rows = build_list_data(jobs)["items"]
    if not rows:
        return "No JAXJobs found."
    header = [*(["NAMESPACE"] if all_namespaces else []), "NAME", "PHASE", "GENERATION", "SHAPE", "SAVED", "GOODPUT"]
    table = [header]
    for r in rows:
        shape = f"{r['count']} x {r['topology']}" if r["count"] is not None else "-"
        goodput = f"{100 * float(r['goodput']):.1f}%" if r["goodput"] is not None else "-"
        saved = "-" if r["savedStep"] is None else str(r["savedStep"])
        table.append([*([str(r["namespace"])] if all_namespaces else []), str(r["name"]), str(r["phase"]),
                      str(r["generation"]), shape, saved, goodput])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table)


def build_version_data() -> dict[str, Any]:
    """`version -o json`: the plugin's version and the JAXJob API it speaks."""
    try:
        version = importlib.metadata.version("resilax")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"kind": "Version", "clientVersion": version, "apiVersion": api.API_VERSION}


def render(data: Mapping[str, Any], output: str) -> str:
    """`data` as `output` (json or yaml)."""
    if output == "json":
        return json.dumps(data, indent=2, sort_keys=False, default=_plain)
    import yaml

    return str(yaml.safe_dump(json.loads(json.dumps(data, default=_plain)), sort_keys=False)).rstrip("\n")


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"not JSON: {type(value).__name__}")
