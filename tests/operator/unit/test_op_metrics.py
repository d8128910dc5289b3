"""The operator's metrics: steps lost per recovery from the trainers' reports, the job labels."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import REGISTRY, generate_latest
from resilax_operator import api, metrics
from resilax_operator import status as st
from resilax_operator.builders import JobRef
from resilax_operator.pods.spares import SpareStatus

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _lost(kind: str, job: JobRef) -> tuple[float, float]:
    labels = {"namespace": job.namespace, "jaxjob": job.name, "kind": kind}
    return (REGISTRY.get_sample_value("resilax_operator_steps_lost_sum", labels) or 0.0,
            REGISTRY.get_sample_value("resilax_operator_steps_lost_count", labels) or 0.0)


def test_steps_lost_is_the_step_reached_minus_the_step_restored() -> None:
    assert metrics.steps_lost({1: 37}, 2, 20, saved=False) == 17
    assert metrics.steps_lost({1: 37, 2: 50}, 2, 20, saved=False) == 17  # the new generation's own steps do not count
    assert metrics.steps_lost({1: 37}, 2, None, saved=False) == 37  # restored nothing: from scratch
    assert metrics.steps_lost({1: 20}, 2, 20, saved=True) == 0
    assert metrics.steps_lost({}, 2, 20, saved=True) == 0  # no trainer report: the committed final save says 0
    assert metrics.steps_lost({}, 2, 20, saved=False) is None  # unknown: not observed


def _recover(job: JobRef, kind: str, reached: int, restored: int | None, saved: bool = False) -> None:
    running1 = st.JobStatus(phase=api.PHASE_RUNNING, generation=1)
    metrics.record_worker_state(job, 1, {"trainer": {"step": reached - 5}, "restore": None})
    metrics.record_worker_state(job, 1, {"trainer": {"step": reached}, "restore": None})
    moving = st.JobStatus(phase=api.PHASE_RECOVERING, generation=1,
                          transition=st.Transition(kind=kind, generation=1, since=T0, save_done=saved))
    metrics.record_status(job, running1, moving, T0)
    running2 = st.JobStatus(phase=api.PHASE_RUNNING, generation=2)
    metrics.record_status(job, moving, running2, T0 + timedelta(seconds=30))
    # Before the new trainer restored: nothing observed yet.
    metrics.record_worker_state(job, 2, {"trainer": None, "restore": None})
    metrics.record_worker_state(job, 2, {"trainer": {"step": (restored or 0) + 1},
                                         "restore": {"step": restored, "skipped": []}})
    # Later looks at the same generation observe nothing more.
    metrics.record_worker_state(job, 2, {"trainer": {"step": (restored or 0) + 9},
                                         "restore": {"step": restored, "skipped": []}})


def test_a_recovery_observes_the_steps_it_lost_once() -> None:
    job = JobRef("a", "ns", "uid-a")
    before = _lost(st.NODE_LOSS, job)
    _recover(job, st.NODE_LOSS, reached=37, restored=20)
    after = _lost(st.NODE_LOSS, job)
    assert (after[0] - before[0], after[1] - before[1]) == (17.0, 1.0)


def test_without_trainer_reports_a_committed_final_save_counts_as_nothing_lost() -> None:
    job = JobRef("b", "ns", "uid-b")
    before = _lost(st.PREEMPTION, job)
    running1 = st.JobStatus(phase=api.PHASE_RUNNING, generation=1)
    moving = st.JobStatus(phase=api.PHASE_RECOVERING, generation=1,
                          transition=st.Transition(kind=st.PREEMPTION, generation=1, since=T0, save_done=True),
                          checkpoint=st.CheckpointInfo(40, T0, True, "persistent"))
    metrics.record_status(job, running1, moving, T0)
    metrics.record_status(job, moving, st.JobStatus(phase=api.PHASE_RUNNING, generation=2), T0)
    metrics.record_worker_state(job, 2, {"restore": {"step": 40, "skipped": []}})
    after = _lost(st.PREEMPTION, job)
    assert (after[0] - before[0], after[1] - before[1]) == (0.0, 1.0)


def test_every_transition_kind_has_series_and_job_labels_are_namespace_and_jaxjob() -> None:
    job = JobRef("kinds", "team-k", "uid-kinds")
    metrics.record_job_status(job, st.JobStatus(phase=api.PHASE_RUNNING, generation=1))
    text = generate_latest(REGISTRY).decode()
    for kind in st.TRANSITION_KINDS:  # at 0 from the job's start, so increase() sees its first recovery
        labels = f'jaxjob="kinds",kind="{kind}",namespace="team-k"'
        assert f"resilax_operator_recoveries_total{{{labels}}} 0.0" in text
        assert f"resilax_operator_steps_lost_count{{{labels}}} 0.0" in text
        assert f"resilax_operator_recovery_seconds_count{{{labels}}} 0.0" in text
    assert metrics.CHECKPOINT_AGE._labelnames == ("namespace", "jaxjob")
    for metric in (metrics.RECOVERIES, metrics.RECOVERY_SECONDS, metrics.STEPS_LOST):
        assert metric._labelnames == ("namespace", "jaxjob", "kind")
    metrics.forget_job(job)
    for metric in REGISTRY.collect():
        if metric.name.startswith("resilax_operator"):
            for sample in metric.samples:
                assert "job" not in sample.labels, sample


def test_the_trainers_figures_tell_the_restored_step_without_a_restore_report() -> None:
    """A trainer that restored an explicit step writes no restore report; its figures say the step."""
    job = JobRef("c", "ns", "uid-c")
    before = _lost(st.WORKER_FAILURE, job)
    metrics.record_worker_state(job, 1, {"trainer": {"step": 30}, "restore": None})
    moving = st.JobStatus(phase=api.PHASE_RECOVERING, generation=1,
                          transition=st.Transition(kind=st.WORKER_FAILURE, generation=1, since=T0))
    metrics.record_status(job, st.JobStatus(phase=api.PHASE_RUNNING, generation=1), moving, T0)
    metrics.record_status(job, moving, st.JobStatus(phase=api.PHASE_RUNNING, generation=2), T0)
    metrics.record_worker_state(job, 2, {"trainer": None, "restore": None})  # not restored yet: nothing
    assert _lost(st.WORKER_FAILURE, job) == before
    metrics.record_worker_state(job, 2, {"trainer": {"step": 26, "restores": 1, "restored_step": 25}, "restore": None})
    after = _lost(st.WORKER_FAILURE, job)
    assert (after[0] - before[0], after[1] - before[1]) == (5.0, 1.0)


def test_goodput_gauges_per_job_and_bucket_are_set_and_removed_with_the_job() -> None:
    from resilax_operator.status_fields import goodput as gp

    job = JobRef("gp", "team-a", "uid-gp")
    ledger = gp.advance(None, gp.GenerationMarks(1, created=0.0, running=2.0, first_step=1, first_step_time=5.0,
                                                 last_step=11, last_step_time=15.0), start=0.0)
    metrics.record_goodput(job, st.GoodputRecord(ledger, datetime.fromtimestamp(20, UTC)))
    labels = {"namespace": "team-a", "jaxjob": "gp"}
    assert REGISTRY.get_sample_value("resilax_operator_goodput_ratio", labels) == 11 / 20
    seconds = {b: REGISTRY.get_sample_value("resilax_operator_goodput_seconds", {**labels, "bucket": b})
               for b in gp.BUCKETS}
    assert seconds == {**dict.fromkeys(gp.BUCKETS, 0.0), "productive": 11.0, "scheduling": 2.0, "jax_startup": 2.0,
                       "other": 5.0}
    metrics.forget_job(job)
    assert REGISTRY.get_sample_value("resilax_operator_goodput_ratio", labels) is None
    assert REGISTRY.get_sample_value("resilax_operator_goodput_seconds", {**labels, "bucket": "productive"}) is None


def test_phase_and_generation_gauges_follow_the_status_and_go_with_the_job() -> None:
    job = JobRef("ph", "team-b", "uid-ph")
    labels = {"namespace": "team-b", "jaxjob": "ph"}

    def phases() -> dict[str, float | None]:
        return {p: REGISTRY.get_sample_value("resilax_operator_job_phase", {**labels, "phase": p})
                for p in api.PHASES}

    running1 = st.JobStatus(phase=api.PHASE_RUNNING, generation=1)
    metrics.record_status(job, st.JobStatus(), running1, T0)
    assert phases() == {**dict.fromkeys(api.PHASES, 0.0), api.PHASE_RUNNING: 1.0}
    assert REGISTRY.get_sample_value("resilax_operator_job_generation", labels) == 1
    moving = st.JobStatus(phase=api.PHASE_RECOVERING, generation=2,
                          transition=st.Transition(kind=st.NODE_LOSS, generation=1, since=T0))
    metrics.record_status(job, running1, moving, T0)
    assert phases() == {**dict.fromkeys(api.PHASES, 0.0), api.PHASE_RECOVERING: 1.0}
    assert REGISTRY.get_sample_value("resilax_operator_job_generation", labels) == 2
    metrics.forget_job(job)
    assert set(phases().values()) == {None}
    assert REGISTRY.get_sample_value("resilax_operator_job_generation", labels) is None


def test_build_info_names_the_operator_and_the_installed_version() -> None:
    import importlib.metadata

    version = importlib.metadata.version("resilax")
    assert REGISTRY.get_sample_value("resilax_build_info", {"version": version, "component": "operator"}) == 1


def test_recovery_series_and_invalid_spec_name_the_job_and_go_with_it() -> None:
    """Alerts name the job (issue 41): the recovery metrics carry namespace and jaxjob; a deleted job's
    series go (bounded label sets), those of another job stay."""
    job, other = JobRef("rj", "team-r", "uid-rj"), JobRef("keep", "team-r", "uid-keep")
    labels = {"namespace": "team-r", "jaxjob": "rj"}
    _recover(job, st.RESIZE, reached=30, restored=30, saved=True)
    _recover(other, st.RESIZE, reached=30, restored=30, saved=True)
    resize = {**labels, "kind": st.RESIZE}
    assert REGISTRY.get_sample_value("resilax_operator_recoveries_total", resize) == 1
    assert REGISTRY.get_sample_value("resilax_operator_recovery_seconds_count", resize) == 1
    assert REGISTRY.get_sample_value("resilax_operator_steps_lost_count", resize) == 1
    invalid = st.set_condition(st.JobStatus(phase=api.PHASE_RUNNING), api.COND_INVALID_SPEC, True, "R", "m", T0)
    metrics.record_job_status(job, invalid)
    assert REGISTRY.get_sample_value("resilax_operator_job_invalid_spec", labels) == 1
    metrics.record_job_status(job, st.set_condition(invalid, api.COND_INVALID_SPEC, False, "R", "m", T0))
    assert REGISTRY.get_sample_value("resilax_operator_job_invalid_spec", labels) == 0
    metrics.forget_job(job)
    text = generate_latest(REGISTRY).decode()
    assert 'jaxjob="rj"' not in text
    assert REGISTRY.get_sample_value("resilax_operator_recoveries_total",
                                     {"namespace": "team-r", "jaxjob": "keep", "kind": st.RESIZE}) == 1
    metrics.forget_job(other)


def test_spare_slice_gauges_follow_status_spares_and_go_with_the_job() -> None:
    job = JobRef("sp", "team-c", "uid-sp")

    def value(state: str) -> float | None:
        return REGISTRY.get_sample_value("resilax_operator_spare_slices",
                                         {"namespace": "team-c", "jaxjob": "sp", "state": state})

    metrics.record_status(job, st.JobStatus(), st.JobStatus(phase=api.PHASE_RUNNING, generation=1), T0)
    assert value("desired") is None  # a job without spares has no series
    held = st.JobStatus(phase=api.PHASE_RUNNING, generation=1, spares=SpareStatus(desired=2, ready=1))
    metrics.record_status(job, st.JobStatus(), held, T0)
    assert (value("desired"), value("ready")) == (2.0, 1.0)
    metrics.forget_job(job)
    assert (value("desired"), value("ready")) == (None, None)


def test_an_in_place_restart_is_a_recovery_with_its_seconds_and_steps_lost() -> None:
    """recovery.inPlace Auto (the default): a node loss records status.inPlace, no transition; it is
    counted, timed and its steps lost observed like a full replacement's (issue 39)."""
    job = JobRef("ip", "ns", "uid-ip")
    labels = {"namespace": "ns", "jaxjob": "ip", "kind": st.NODE_LOSS}
    count = REGISTRY.get_sample_value("resilax_operator_recoveries_total", labels) or 0.0
    seconds = REGISTRY.get_sample_value("resilax_operator_recovery_seconds_count", labels) or 0.0
    lost = _lost(st.NODE_LOSS, job)
    running1 = st.JobStatus(phase=api.PHASE_RUNNING, generation=1)
    metrics.record_worker_state(job, 1, {"trainer": {"step": 37}, "restore": None})
    ip = st.InPlace(2, 1, st.IN_PLACE_STOPPING, T0, T0 + timedelta(seconds=30), kind=st.NODE_LOSS)
    stopping = st.JobStatus(phase=api.PHASE_RECOVERING, generation=2, in_place=ip)
    starting = st.JobStatus(phase=api.PHASE_RECOVERING, generation=2, in_place=st.InPlace(
        2, 1, st.IN_PLACE_STARTING, T0, T0 + timedelta(seconds=30), kind=st.NODE_LOSS))
    metrics.record_status(job, running1, stopping, T0)
    metrics.record_status(job, stopping, starting, T0 + timedelta(seconds=2))  # the same restart: counted once
    metrics.record_status(job, starting, st.JobStatus(phase=api.PHASE_RUNNING, generation=2), T0 + timedelta(seconds=9))
    metrics.record_worker_state(job, 2, {"trainer": {"step": 21}, "restore": {"step": 20, "skipped": []}})
    assert REGISTRY.get_sample_value("resilax_operator_recoveries_total", labels) == count + 1
    assert REGISTRY.get_sample_value("resilax_operator_recovery_seconds_count", labels) == seconds + 1
    after = _lost(st.NODE_LOSS, job)
    assert (after[0] - lost[0], after[1] - lost[1]) == (17.0, 1.0)


def test_an_in_place_restart_after_a_planned_moves_final_save_is_counted_once() -> None:
    job = JobRef("pm", "ns", "uid-pm")
    labels = {"namespace": "ns", "jaxjob": "pm", "kind": st.GROW_BACK}
    count = REGISTRY.get_sample_value("resilax_operator_recoveries_total", labels) or 0.0
    running1 = st.JobStatus(phase=api.PHASE_RUNNING, generation=1)
    saving = st.JobStatus(phase=api.PHASE_RESIZING, generation=1,
                          transition=st.Transition(kind=st.GROW_BACK, generation=1, since=T0, save_done=True))
    ip = st.InPlace(2, 1, st.IN_PLACE_STOPPING, T0 + timedelta(seconds=5), T0 + timedelta(seconds=35),
                    kind=st.GROW_BACK)
    metrics.record_status(job, running1, saving, T0)
    metrics.record_status(job, saving, st.JobStatus(phase=api.PHASE_RESIZING, generation=2, in_place=ip), T0)
    assert REGISTRY.get_sample_value("resilax_operator_recoveries_total", labels) == count + 1


def test_a_kept_pods_old_figures_are_not_taken_for_the_new_generations_restore() -> None:
    """In place, pod 0 is kept: its sidecar reports generation 1's trainer (step 10, no restore) until
    generation 2's trainer restores step 8; only then are the steps lost observed: 2, not 10."""
    job = JobRef("kp", "ns", "uid-kp")
    lost = _lost(st.NODE_LOSS, job)
    running1 = st.JobStatus(phase=api.PHASE_RUNNING, generation=1)
    metrics.record_worker_state(job, 1, {"trainer": {"step": 10, "generation": 1}, "restore": None})
    ip = st.InPlace(2, 1, st.IN_PLACE_STOPPING, T0, T0 + timedelta(seconds=30), kind=st.NODE_LOSS)
    moving = st.JobStatus(phase=api.PHASE_RECOVERING, generation=2, in_place=ip)
    metrics.record_status(job, running1, moving, T0)
    metrics.record_status(job, moving, st.JobStatus(phase=api.PHASE_RUNNING, generation=2), T0)
    metrics.record_worker_state(job, 2, {"trainer": {"step": 10, "generation": 1}, "restore": None})  # stale
    assert _lost(st.NODE_LOSS, job) == lost
    metrics.record_worker_state(job, 2, {"trainer": {"step": 9, "generation": 2, "restores": 1, "restored_step": 8},
                                         "restore": {"step": 8, "skipped": [], "generation": 2}})
    after = _lost(st.NODE_LOSS, job)
    assert (after[0] - lost[0], after[1] - lost[1]) == (2.0, 1.0)
