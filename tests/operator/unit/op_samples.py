"""Sample JAXJob specs shared by the operator unit tests."""

from __future__ import annotations

from typing import Any


def good_spec() -> dict[str, Any]:
    return {
        "slices": {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4", "count": 4},
        "elastic": {"minCount": 2, "maxCount": 4, "topologies": ["4x4", "2x4"], "growBack": True},
        "checkpoint": {
            "storage": "gs://bucket/runs/llama",
            "local": {"scope": "Pod", "medium": "Memory", "sizeLimit": "64Gi"},
            "every": {"steps": 1000, "minutes": 30},
            "keep": {"last": 3, "everySteps": 10000},
            "finalSave": {"onPreemption": True, "onResize": True, "timeoutSeconds": 300},
            "restore": {"step": "latest"},
        },
        "recovery": {"maxRestarts": 20, "backoffSeconds": 10, "nodeLossGraceSeconds": 30},
        "template": {"spec": {"containers": [{"name": "trainer", "image": "example/train:1",
                                              "command": ["python", "train.py"]}]}},
    }
