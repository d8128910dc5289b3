"""Every bad operator setting fails at start naming the variable, its value and what is allowed
(issue 41), all of them in one error; `resilax operator` says so and exits 2 before it connects."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields

import pytest
from resilax_operator.errors import InvalidSettingError
from resilax_operator.settings import ENV_PREFIX, INTEGER_BOUNDS, OperatorSettings

INTEGERS = [f.name for f in fields(OperatorSettings) if f.type in ("int", int)]


@pytest.mark.parametrize("name", INTEGERS)
def test_a_setting_that_is_not_an_integer_is_named_with_what_is_allowed(name: str) -> None:
    variable = ENV_PREFIX + name.upper()
    low, high = INTEGER_BOUNDS.get(name, (0, None))
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    with pytest.raises(InvalidSettingError) as info:
        OperatorSettings.from_env({variable: "5m"})
    assert str(info.value) == f"{variable}='5m' is not an integer; allowed: {allowed}"


@pytest.mark.parametrize("name", [n for n in INTEGERS if not n.endswith("_port")])
def test_an_integer_below_its_bound_is_named(name: str) -> None:
    variable = ENV_PREFIX + name.upper()
    low, _ = INTEGER_BOUNDS.get(name, (0, None))
    with pytest.raises(InvalidSettingError, match=f"{variable}={low - 1}: allowed: an integer "):
        OperatorSettings.from_env({variable: str(low - 1)})
    assert getattr(OperatorSettings.from_env({variable: f" {low} "}), name) == low


@pytest.mark.parametrize(("env", "expected"), [
    pytest.param({"NODE_LOSS_GUARD_PERCENT": "101"}, "NODE_LOSS_GUARD_PERCENT=101: allowed: an integer from 0 to 100",
                 id="percent"),
    pytest.param({"IMAGE_PULL_POLICY": "sometimes"},
                 "IMAGE_PULL_POLICY='sometimes': allowed: Always, IfNotPresent, Never", id="pull-policy"),
    pytest.param({"ALLOW_HOST_ACCESS": "maybe"}, "ALLOW_HOST_ACCESS='maybe' is not a boolean; allowed: true, false",
                 id="boolean"),
    pytest.param({"SIDECAR_RESOURCES": "{"}, "SIDECAR_RESOURCES='{' is not JSON", id="resources"),
])
def test_other_bad_settings_are_named(env: dict[str, str], expected: str) -> None:
    with pytest.raises(InvalidSettingError, match="^" + ENV_PREFIX + expected.replace("(", r"\(").replace("{", r"\{")):
        OperatorSettings.from_env({ENV_PREFIX + k: v for k, v in env.items()})


def test_every_bad_setting_is_named_at_once() -> None:
    env = {ENV_PREFIX + "RECONCILE_THREADS": "many", ENV_PREFIX + "STUCK_TERMINATING_SECONDS": "-5",
           ENV_PREFIX + "ALLOW_HOST_ACCESS": "maybe", ENV_PREFIX + "SIDECAR_LOG_FORMAT": "xml"}
    with pytest.raises(InvalidSettingError) as info:
        OperatorSettings.from_env(env)
    message = str(info.value)
    for variable in env:
        assert variable in message, message
    assert isinstance(info.value, ValueError)


def test_the_operator_exits_at_start_naming_the_bad_setting() -> None:
    env = {**os.environ, ENV_PREFIX + "SCHEDULE_TIMEOUT_SECONDS": "5m"}
    proc = subprocess.run([sys.executable, "-m", "resilax_operator.main", "--standalone"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"{ENV_PREFIX}SCHEDULE_TIMEOUT_SECONDS='5m' is not an integer; allowed: an integer >= 0"
            in proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
