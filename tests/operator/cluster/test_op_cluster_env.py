"""The e2e trainers' environment switch (op_cluster.TRAINER_ENV) that bench/e2e-ab uses to compare one
e2e flow with one thing switched in its trainers."""

from __future__ import annotations

import pytest
from op_cluster import TRAINER_ENV, trainer_env_override, worker_template


def test_the_switch_reaches_every_trainer_and_a_test_s_own_env_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRAINER_ENV, "RESILAX_RESTORE_PREFETCH=0, A=b=c")
    assert trainer_env_override() == {"RESILAX_RESTORE_PREFETCH": "0", "A": "b=c"}
    env = {e["name"]: e["value"] for e in worker_template(steps=3, step_seconds=0.1, extra_env={"A": "mine"})
           ["spec"]["containers"][0]["env"]}
    assert env["RESILAX_RESTORE_PREFETCH"] == "0" and env["A"] == "mine" and env["JAX_PLATFORMS"] == "cpu"
    monkeypatch.delenv(TRAINER_ENV)
    assert trainer_env_override() == {}


@pytest.mark.parametrize("raw", ["NOEQUALS", "=1", "A=1,B"])
def test_a_malformed_entry_is_named(raw: str) -> None:
    with pytest.raises(ValueError, match=TRAINER_ENV):
        trainer_env_override(raw)
