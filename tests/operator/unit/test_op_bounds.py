"""Bounded jobs (issue 25, item 6): the operator's `max_hosts_per_job` (default: the largest TPU slice ×
32 slices) is enforced in validation with a clear InvalidSpec, so a spec asking for millions of workers
never reaches the builders."""

from __future__ import annotations

from typing import Any

import pytest
from op_samples import good_spec
from op_world import World, tpu_pool
from resilax_operator import api
from resilax_operator.actions import CreateGeneration
from resilax_operator.errors import InvalidSettingError, InvalidSpecError
from resilax_operator.settings import MAX_HOSTS_PER_JOB, OperatorSettings
from resilax_operator.topology import largest_tpu_slice_hosts
from resilax_operator.validation import validate_spec

SETTINGS = OperatorSettings(sidecar_image="resilax:test")


def _spec(slices: dict[str, Any], elastic: dict[str, Any] | None = None) -> dict[str, Any]:
    raw = good_spec()
    raw["slices"] = slices
    raw.pop("elastic")
    if elastic is not None:
        raw["elastic"] = elastic
    return raw


def test_the_default_is_the_largest_tpu_slice_times_32() -> None:
    assert largest_tpu_slice_hosts() == 2304  # tpu7x: 144 cubes of 64 chips, 4 per host
    assert OperatorSettings().max_hosts_per_job == MAX_HOSTS_PER_JOB == 2304 * 32 == 73_728


V5P_LARGEST = {"accelerator": "tpu-v5p-slice", "topology": "16x20x28"}

#: id, spec, the field the InvalidSpec names, words its message must carry (None: valid).
ROWS: list[tuple[str, dict[str, Any], str | None, tuple[str, ...]]] = [
    ("four-million-cpu-workers", _spec({"accelerator": "cpu", "topology": "64x64", "chipsPerHost": 1, "count": 1024}),
     "spec.slices.count", ("1,024 slices of 64x64 (4,096 hosts each) make 4,194,304 worker pods",
                           "at most 73,728 per job", "RESILAX_OPERATOR_MAX_HOSTS_PER_JOB", "18 such slices at most")),
    ("largest-tpu-slice-x32", _spec({**V5P_LARGEST, "count": 32}), None, ()),
    ("largest-tpu-slice-x33", _spec({**V5P_LARGEST, "count": 33}), "spec.slices.count",
     ("33 slices of 16x20x28 (2,240 hosts each) make 73,920 worker pods", "32 such slices at most")),
    ("elastic-max-count", _spec({**V5P_LARGEST, "count": 2}, {"minCount": 1, "maxCount": 40}), "spec.elastic.maxCount",
     ("40 slices of 16x20x28",)),
    ("elastic-largest-topology", _spec({"accelerator": "tpu-v4-podslice", "topology": "4x4x4", "count": 100},
                                       {"minCount": 1, "maxCount": 200, "topologies": ["4x4x4", "8x16x16"]}),
     "spec.elastic.maxCount", ("200 slices of 8x16x16 (512 hosts each) make 102,400 worker pods", "144 such slices at most")),
]


@pytest.mark.parametrize(("raw", "path", "words"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_a_job_over_the_bound_is_an_invalid_spec_naming_the_field(raw: dict[str, Any], path: str | None,
                                                                  words: tuple[str, ...]) -> None:
    if path is None:
        validate_spec(raw, settings=SETTINGS)
        return
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw, settings=SETTINGS)
    problems = {p.path: p.message for p in info.value.problems}
    assert path in problems, problems
    for word in words:
        assert word in problems[path], problems[path]


def test_one_slice_over_the_bound_names_the_topology() -> None:
    raw = _spec({**V5P_LARGEST, "count": 1})
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw, settings=OperatorSettings(max_hosts_per_job=1000))
    assert [p.path for p in info.value.problems] == ["spec.slices.topology"]
    assert "one slice of 16x20x28 is 2,240 hosts" in str(info.value)


def test_the_setting_comes_from_the_environment_and_is_checked() -> None:
    assert OperatorSettings.from_env({"RESILAX_OPERATOR_MAX_HOSTS_PER_JOB": "500"}).max_hosts_per_job == 500
    with pytest.raises(InvalidSettingError, match="RESILAX_OPERATOR_MAX_HOSTS_PER_JOB=0"):
        OperatorSettings(max_hosts_per_job=0)


def test_the_reconcile_threads_come_from_the_environment_and_are_checked() -> None:
    """The reconciles' thread pool (handlers.start_cache): 32 by default, not Python's 6 on 2 cores."""
    assert OperatorSettings().reconcile_threads == 32
    assert OperatorSettings.from_env({"RESILAX_OPERATOR_RECONCILE_THREADS": "64"}).reconcile_threads == 64
    with pytest.raises(InvalidSettingError, match="RESILAX_OPERATOR_RECONCILE_THREADS=0: allowed: an integer >= 1"):
        OperatorSettings(reconcile_threads=0)


def test_the_sidecars_log_format_is_checked_at_start() -> None:
    assert OperatorSettings().sidecar_log_format == "text"
    assert OperatorSettings.from_env({"RESILAX_OPERATOR_SIDECAR_LOG_FORMAT": "json"}).sidecar_log_format == "json"
    with pytest.raises(InvalidSettingError, match="RESILAX_OPERATOR_SIDECAR_LOG_FORMAT='xml': allowed: json, text"):
        OperatorSettings(sidecar_log_format="xml")


def test_an_oversized_job_is_refused_before_anything_is_built() -> None:
    """The reconcile sets InvalidSpec and Failed; no generation, no pods."""
    raw = _spec({"accelerator": "cpu", "topology": "64x64", "chipsPerHost": 1, "count": 1024})
    world = World.make(raw, tpu_pool("a", 4))
    actions = world.step()
    assert not any(isinstance(a, CreateGeneration) for a in actions)
    invalid = world.status.condition(api.COND_INVALID_SPEC)
    assert invalid is not None and invalid.status == "True" and "4,194,304 worker pods" in invalid.message


def test_a_slices_hostnames_are_built_once_and_shared_by_its_pods() -> None:
    """TPU_WORKER_HOSTNAMES names every host of the slice: built per pod it cost O(hosts²) (the largest
    slice, 2240 hosts, took 25 s and 209 MiB); now one string per slice, the same object in each pod."""
    from resilax_operator.builders import GenerationPlan, JobRef, build_pods
    from resilax_operator.spec import Shape

    spec = validate_spec(_spec({"accelerator": "tpu-v5p-slice", "topology": "4x4x8", "count": 2}), settings=SETTINGS)
    pods = build_pods(JobRef("llama", "ml", "u"), spec, GenerationPlan(3, Shape("4x4x8", 2), ("a", "b")), SETTINGS,
                      coordinator_ip="10.0.0.1")
    assert len(pods) == 64
    by_slice: dict[str, list[str]] = {}
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        by_slice.setdefault(pod["metadata"]["labels"][api.LABEL_SLICE], []).append(env["TPU_WORKER_HOSTNAMES"])
    for s, values in by_slice.items():
        assert all(v is values[0] for v in values)  # one string per slice
        assert values[0].split(",") == [f"llama-g3-s{s}-h{h}.llama-workers" for h in range(32)]
    assert by_slice["0"][0] != by_slice["1"][0]


def test_the_sidecar_gets_the_worker_environment_but_the_slices_host_list() -> None:
    """The host list grows with the slice and only TPU runtimes read it: a cached pod carries it once
    (the largest tpu7x slice's pods: 161 KiB each parsed with it twice, 99 KiB once)."""
    from resilax_operator.builders import GenerationPlan, JobRef, build_pods
    from resilax_operator.spec import Shape

    spec = validate_spec(_spec({"accelerator": "tpu7x", "topology": "4x4x4", "count": 2}), settings=SETTINGS)
    for pod in build_pods(JobRef("llama", "ml", "u"), spec, GenerationPlan(1, Shape("4x4x4", 2), ("a", "b")), SETTINGS,
                          coordinator_ip="10.0.0.1"):
        trainer = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
        sidecar = {e["name"] for e in pod["spec"]["initContainers"][0]["env"]}
        assert "TPU_WORKER_HOSTNAMES" in trainer and "TPU_WORKER_HOSTNAMES" not in sidecar
        assert trainer - sidecar == {"TPU_WORKER_HOSTNAMES"}
