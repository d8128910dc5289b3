"""Fixed status.history bodies in the agreed shape (docs/jaxjob-reference.md, status.history): a job that
lost a node, ran smaller, grew back, and runs on. Shared by the plugin's unit tests and the web page's
browser test."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

NOW = datetime(2026, 12, 4, 12, 30, tzinfo=UTC)


def _goodput(productive: float, scheduling: float = 2.0, jax_startup: float = 3.0, restore: float = 5.0,
             **other: float) -> dict[str, float]:
    return {"productive": productive, "checkpointBlocking": 1.0, "detection": 0.0, "jaxStartup": jax_startup,
            "lostStepsRedone": 0.0, "restore": restore, "scheduling": scheduling, "teardown": 0.0, "other": 0.0,
            **other}


HISTORY: list[dict[str, Any]] = [
    {"generation": 1, "start": "2026-12-04T12:00:00Z", "end": "2026-12-04T12:10:00Z",
     "shape": {"count": 2, "topology": "2x4", "hosts": 4}, "pools": ["pool-a"], "inPlace": False,
     "endReason": "NodeLost", "endMessage": "node tpu-1 hosting generation 1 has not been Ready for 31s (grace 30s)",
     "firstStep": 1, "lastStep": 590, "lostSteps": 90, "goodput": _goodput(580.0, restore=0.0),
     "checkpoints": [100, 200, 300, 400, 500]},
    {"generation": 2, "start": "2026-12-04T12:10:40Z", "end": "2026-12-04T12:20:40Z",
     "shape": {"count": 1, "topology": "2x4", "hosts": 2}, "pools": ["pool-a"], "inPlace": False,
     "endReason": "GrowBack", "endMessage": "capacity returned: growing from 1 x 2x4 to 2 x 2x4",
     "restoredStep": 500, "restoredFrom": "persistent", "firstStep": 501, "lastStep": 1080, "lostSteps": 0,
     "goodput": _goodput(570.0, detection=20.0), "checkpoints": [600, 700, 800, 900, 1000, 1080]},
    {"generation": 3, "start": "2026-12-04T12:21:00Z",
     "shape": {"count": 2, "topology": "2x4", "hosts": 4}, "pools": ["pool-a", "pool-b"], "inPlace": True,
     "restoredStep": 1080, "restoredFrom": "peer", "firstStep": 1081, "lastStep": 1600, "lostSteps": 0,
     "goodput": _goodput(500.0), "checkpoints": [1100, 1200, 1300, 1400, 1500]},
]


def job(name: str = "llama", namespace: str = "team-a", history: list[dict[str, Any]] | None = None,
        phase: str = "Running") -> dict[str, Any]:
    return {"apiVersion": "resilax.dev/v1alpha1", "kind": "JAXJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": {},
            "status": {"phase": phase, "generation": len(HISTORY if history is None else history),
                       "history": HISTORY if history is None else history}}
