"""The fast test tier's guard: no local cluster and no fake-gcs-server start in it, by any route.

`scripts/test --fast` sets `RESILAX_FAST_TIER=1` and deselects the tests marked `cluster`, `gcs`, ...
The fixtures mark the tests that use them (pytest_plugin.FIXTURE_MARKS); a test that builds a
`LocalCluster` or a `FakeGCS` itself (or starts a program that does: the variable is inherited) would
slip through that, so their `start()` asks here first and refuses, naming the marker the test lacks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import FastTierError

FAST_TIER_ENV = "RESILAX_FAST_TIER"


def refuse_in_fast_tier(what: str, marker: str, environ: Mapping[str, str] | None = None) -> None:
    """Raise FastTierError when the fast tier runs. Called on: every start of `what`."""
    env = os.environ if environ is None else environ
    if env.get(FAST_TIER_ENV, "") not in ("", "0"):
        raise FastTierError(
            f"{what} started in the fast test tier ({FAST_TIER_ENV}={env[FAST_TIER_ENV]}, set by "
            f"`scripts/test --fast`): the test that starts it needs the {marker!r} marker "
            f"(@pytest.mark.{marker}, or use the fixture that brings it), which keeps it out of the fast tier")
