"""observed/observe.py reads the Lease of a Ready node once a witness exists (a worker of the generation exited
76, or 134: api.PEER_LOSS_WITNESS_CODES), also when that exit is known only from a sidecar: a supervised trainer (recovery.inPlace Auto)
exits inside a pod that keeps Running, so the witness shows only after the sidecars were asked.
Against the recording in-memory API of test_op_cache."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest
from resilax_operator import api, execute
from resilax_operator.observed.observe import now_utc, observe
from resilax_operator.status import format_time
from test_op_cache import LOG, NS, SETTINGS, FakeAPI, _job, install


class WitnessAPI(FakeAPI):
    """The sidecar at 10.0.0.1 says its trainer exited 76 (a peer is gone); the Lease of `silent`
    missed its renewals for `silent_for`; every other Lease was just renewed."""

    def __init__(self, silent: str, silent_for: timedelta, code: int = api.EXIT_CODE_PEER_LOST) -> None:
        super().__init__()
        self.silent, self.silent_for, self.code = silent, silent_for, code
        self.exited = False
        self.leases_read: list[str] = []

    def sidecar(self, method: str, ip: str, port: int, path: str, body: Mapping[str, Any] | None = None,
                token: str | None = None) -> dict[str, Any]:
        now = now_utc()
        exited = self.exited and ip == "10.0.0.1"
        process = {"incarnation": 1, "generation": 1, "state": "exited" if exited else "running",
                   "exit_code": self.code if exited else None,
                   "started_at": format_time(now - timedelta(minutes=5)),
                   "finished_at": format_time(now - timedelta(seconds=2)) if exited else None}
        return {"newest_persisted_step": 100, "trainer_process": process, "assignment": {"generation": 1}}

    def get_node_lease(self, node: str) -> dict[str, Any] | None:
        self.leases_read.append(node)
        renewed = now_utc() - (self.silent_for if node == self.silent else timedelta(seconds=1))
        return {"spec": {"holderIdentity": node, "leaseDurationSeconds": 40,
                         "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}


def _running_supervised_job(fake: WitnessAPI) -> WitnessAPI:
    job = _job()
    job["spec"]["recovery"] = {"inPlace": "Auto"}
    job["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "train.py"]  # what `resilax run` wraps
    install(fake, job)
    for _ in range(6):
        execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
        fake.run_pods()
    return fake


def _observe(fake: WitnessAPI) -> Any:
    return observe(fake, fake.cache, fake.cache.job(NS, "llama") or {}, SETTINGS, LOG)  # type: ignore[arg-type]


@pytest.mark.parametrize("code", [api.EXIT_CODE_PEER_LOST, api.EXIT_CODE_ABORTED], ids=["exit-76", "aborted-134"])
def test_a_supervised_trainers_exit_76_makes_the_silent_nodes_lease_read_and_proves_it_down(code: int) -> None:
    """Exit 76 (a peer is gone), or 134 (JAX's coordination service aborts the survivors of a lost process)."""
    fake = _running_supervised_job(WitnessAPI("node-1", timedelta(seconds=25), code))
    world = _observe(fake)
    assert all(p.supervised for p in world.observed.pods), world.observed.pods
    assert fake.leases_read == []  # no witness, every node Ready: no Lease read

    fake.exited = True
    world = _observe(fake)
    assert fake.leases_read == ["node-1"]  # the node of the worker that did not exit 76
    assert world.observed.node("node-1").down_since(world.observed.now) is not None  # 25 s > 0.5 x 40 s
    assert world.observed.node("node-0").down_since(world.observed.now) is None
    assert world.observed.nodes_held_down() == ("node-1",)  # Ready for the scheduler, down for us


def test_a_witness_and_a_lease_renewed_in_time_prove_nothing() -> None:
    fake = _running_supervised_job(WitnessAPI("node-1", timedelta(seconds=15)))
    fake.exited = True
    world = _observe(fake)
    assert fake.leases_read == ["node-1"]
    assert world.observed.node("node-1").down_since(world.observed.now) is None  # 15 s < 0.5 x 40 s
