"""`rc.run_kept(main)`: a trainer's entry point that `resilax run` may call again in the same process
for the next incarnation (kept.py says when; docs/architecture.md, "Keep what can be kept").

```python
import resilax_ckpt as rc

def main() -> int:          # the five lines as always; returns rc.EXIT_CODE_STOPPED after a stop
    ...

if __name__ == "__main__":
    sys.exit(rc.run_kept(main))
```

Steps, in order:
1. Without `resilax run` (no RESILAX_KEPT_FD): `main()` once, its code returned.
2. Each incarnation: `main()`. A raise, a code other than EXIT_CODE_STOPPED, or several JAX processes:
   the supervisor is told why (kept.decide_park) and the code is returned (or the error re-raised), so
   the process exits as it always did.
3. Park. From the entry's return to the next call, SIGTERM is only recorded (`terms_while_parking`): it
   can only be the supervisor's stop, sent the moment the operator asks for the next generation, which
   may come after the final save let the entry return but before `{"parked"}` reached the supervisor.
   The supervisor then takes the park as that stop's end; when it is ending instead, it says `{"exit"}`
   (or kills the process after its grace). Before, such a SIGTERM killed the process on its way to park
   (exit 143) and the next generation paid a fresh process. Then: the restore prefetch stopped,
   garbage collected, `jax.extend.backend.clear_backends()` (every backend client, compiled executable
   and device buffer of the process dropped: the chip is free), then `{"parked"}` to the supervisor,
   and wait.
4. `{"resume"}`: the generation's own variables take the new incarnation's values (the generation,
   its fencing token, the restore's step choice: kept.plan_env_update; the rest of os.environ stays as
   the process made it, e.g. what JAX's TPU start-up added), the restore prefetch starts again
   (as line 0 would), the devices open again (`jax.devices()`; a failure here exits, and the supervisor
   starts a fresh process for the incarnation), `{"resumed"}`, then back to 2. `{"exit"}` or the
   supervisor gone: the last code is returned.

`last_restart()` gives the wall-clock times of the latest kept restart (None in a fresh process), for a
trainer's own start-up report (examples/transformer.py `--report-startup`).
Called on: the trainer's main thread, as its whole program.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from resilax_ckpt.trainer import kept
from resilax_ckpt.trainer.kept_channel import Channel

log = logging.getLogger(__name__)

_last: dict[str, float] | None = None
terms_while_parking: list[float] = []
"""Wall-clock times of the SIGTERMs this process received between an entry's return and the next call."""


def last_restart() -> dict[str, float] | None:
    """Wall-clock times of this process's latest kept restart: `entry_returned`, `backends_dropped`,
    `resume_received`, `prefetch_started`, `devices_reopened`, and `live_arrays_at_drop` (a count: the
    device arrays still referenced when the backends were dropped) (None: the process's first incarnation)."""
    return None if _last is None else dict(_last)


def run_kept(entry: Callable[[], int | None]) -> int:
    """Run `entry` as this process's trainer, again for each incarnation the supervisor keeps it for
    (module docstring). Returns the code to exit with."""
    global _last
    channel = Channel.from_env(os.environ)
    os.environ.pop(kept.FD_ENV, None)  # the trainer's own children never see the channel
    if channel is None:
        return _code(entry())
    while True:
        try:
            code = _code(entry())
        except BaseException as e:
            refusal = kept.decide_park(None, e, 1)
            assert refusal is not None
            channel.send("leaving", {"key": refusal.key, "message": refusal.message})
            raise
        marks = {"entry_returned": time.time()}
        with _sigterm_recorded():
            refusal = kept.decide_park(code, None, _process_count())
            if refusal is None:
                refusal = _drop_backends(marks)
            if refusal is not None:
                log.info("resilax: the trainer process is not kept: %s", refusal.message)
                channel.send("leaving", {"key": refusal.key, "message": refusal.message})
                return code
            marks["backends_dropped"] = time.time()
            if not channel.send("parked", {"pid": os.getpid(), "exit_code": code, "processes": 1, "marks": marks}):
                return code
            message = channel.receive()
            if message is None or message[0] != "resume":
                return code
            marks["resume_received"] = time.time()
            body = message[1]
            failure = _resume(body.get("env"), marks)
            if failure is not None:
                log.error("resilax: the kept restart failed (the supervisor starts a fresh process): %s", failure)
                channel.send("leaving", {"key": kept.KEPT_FAILED, "message": failure})
                return 1
            _last = marks
            channel.send("resumed", {"incarnation": body.get("incarnation"), "marks": marks})


def _code(result: int | None) -> int:
    return 0 if result is None else int(result)


@contextlib.contextmanager
def _sigterm_recorded() -> Iterator[None]:
    """SIGTERM only recorded while this process parks or is parked (module docstring, step 3); the handler
    before it comes back for the next entry call (the manager installs its own there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda _signum, _frame: terms_while_parking.append(time.time()))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _process_count() -> int:
    if "jax" not in sys.modules:
        return 1
    import jax

    return int(jax.process_count())


def _drop_backends(marks: dict[str, float]) -> kept.Refusal | None:
    """Give every device back: nothing of the incarnation survives but host memory."""
    from resilax_ckpt.restoring import prefetch

    prefetch.stop()
    gc.collect()
    if "jax" not in sys.modules:
        return None
    try:
        import jax
        from jax.extend.backend import clear_backends

        live = len(jax.live_arrays())
        marks["live_arrays_at_drop"] = live
        if live:
            log.warning("resilax: %d device arrays of the incarnation are still referenced when its backends are "
                        "dropped (module globals?); they are unusable afterwards", live)
        clear_backends()
    except Exception as e:
        return kept.Refusal(kept.DROP_FAILED, f"jax.extend.backend.clear_backends() raised {type(e).__name__}: {e}")
    return None


def _resume(env: Any, marks: dict[str, float]) -> str | None:
    """Take the new incarnation's environment, start the prefetch, open the devices; why it failed, or None."""
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return f"resume.env: {type(env).__name__} is not allowed; allowed: an object of strings"
    for name, value in kept.plan_env_update(os.environ, env).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        from resilax_ckpt.restoring import prefetch

        prefetch.start_prefetch(os.environ)
        marks["prefetch_started"] = time.time()
        if "jax" in sys.modules:
            import jax

            jax.devices()
        marks["devices_reopened"] = time.time()
    except Exception as e:
        return f"reopening the devices raised {type(e).__name__}: {e}"
    return None
