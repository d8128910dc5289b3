"""The scale bench's start-up breakdown (bench/resilax_bench/scale.py `pod_startup`): which part of
the pipeline (operator, scheduler, node agent) the jobs' start-up went to, from pods' API timestamps."""

from __future__ import annotations

import datetime

from resilax_bench.scale import pod_startup

T0 = datetime.datetime(2026, 12, 5, 14, 0, 0, tzinfo=datetime.UTC).timestamp()


def stamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(T0 + seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(created: float, scheduled: float | None, started: list[float | None]) -> dict:
    conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp(scheduled)}] \
        if scheduled is not None else [{"type": "PodScheduled", "status": "False", "lastTransitionTime": stamp(created)}]
    containers = [{"name": f"c{i}", "state": {"running": {"startedAt": stamp(s)}} if s is not None
                   else {"waiting": {"reason": "ContainerCreating"}}} for i, s in enumerate(started)]
    return {"metadata": {"creationTimestamp": stamp(created)},
            "status": {"conditions": conditions, "containerStatuses": containers}}


def test_each_stage_is_timed_from_the_jobs_creation_first_median_last() -> None:
    pods = [pod(2, 5, [9, 10]), pod(3, 20, [30, 31]), pod(40, 41, [42, 45])]
    got = pod_startup(pods, T0)
    assert got["pods"] == 3
    assert got["created"] == {"count": 3, "first": 2.0, "median": 3.0, "last": 40.0}
    assert got["scheduled"] == {"count": 3, "first": 5.0, "median": 20.0, "last": 41.0}
    # a pod has started when its last container has
    assert got["started"] == {"count": 3, "first": 10.0, "median": 31.0, "last": 45.0}


def test_a_pod_not_bound_or_not_started_is_left_out_of_that_stage_only() -> None:
    pods = [pod(1, None, [None]), pod(2, 4, [6, None]), pod(3, 5, [7])]
    got = pod_startup(pods, T0)
    assert got["created"]["count"] == 3
    assert got["scheduled"] == {"count": 2, "first": 4.0, "median": 4.5, "last": 5.0}
    assert got["started"] == {"count": 1, "first": 7.0, "median": 7.0, "last": 7.0}


def test_no_pods_gives_no_stage_figures() -> None:
    assert pod_startup([], T0) == {"pods": 0, "created": None, "scheduled": None, "started": None}
