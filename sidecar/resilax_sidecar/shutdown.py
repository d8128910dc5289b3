"""The sidecar's final save on SIGTERM (docs/sidecar.md, "SIGTERM"; app.py runs it): ask the trainer
for a save with `stop` (or take the stop request already made), wait for its answer while the trainer
lives, then, with a local tier, for that step (or the trainer's newest local step once it is gone) to be
committed in the persistent tier, within RESILAX_SIDECAR_GRACE_SECONDS. That last wait also ends once
the step can never be committed: the operator said (`POST /v1/peers/lost`) that a process of the step's
generation is lost (its node proven down) and that process's upload marker is not in the step's
attempt (its commit needs every process's marker; docs/architecture.md, "A lost peer's survivors go at
once")."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from resilax_ckpt.control.health_verdict import read_verdict

from resilax_sidecar import control
from resilax_sidecar.uploader import list_local_steps

if TYPE_CHECKING:
    from resilax_sidecar.app import Sidecar

log = logging.getLogger(__name__)

#: How often the final save looks at the trainer's answer and at the lost peers (seconds).
WATCH_SECONDS = 0.2


async def final_save(sidecar: Sidecar) -> bool:
    """Ask for a save with stop, wait for its commit (and its upload) within the grace period.
    True when the final step is durable in the tier that matters."""
    sidecar.stopping = True
    cfg = sidecar.config
    # A pod whose health check failed never ran its trainer: nobody would answer, nothing can be lost.
    nothing = control.plan_nothing_to_save(read_verdict(str(cfg.control_dir)),
                                           control.trainer_alive(cfg.control_dir))
    if nothing is not None:
        log.info("SIGTERM: no final save: %s", nothing)
        return True
    sidecar.make_urgent()
    deadline = time.monotonic() + cfg.grace_seconds
    # A stop request already made (e.g. the operator's final save before a resize) is the final
    # save: the trainer stops after it and would never answer a second one.
    request_id = sidecar.last_stop_request
    if request_id is not None:
        earlier = control.read_result(cfg.control_dir, request_id)
        if earlier is not None and not earlier.committed:
            request_id = None  # it failed: ask again
    if request_id is None:
        request_id = await sidecar.request_save("preemption", True)
    sidecar.final_request = request_id
    log.info("SIGTERM: final save %s; waiting up to %.0f s", request_id, cfg.grace_seconds)
    result = None
    trainer_gone = False
    while time.monotonic() < deadline:
        result = control.read_result(cfg.control_dir, request_id)
        if result is not None:
            break
        # A native sidecar gets SIGTERM after the trainer exited (it saved on its own SIGTERM):
        # nobody will answer, what is left is to persist its newest local step.
        if control.trainer_alive(cfg.control_dir) is False:
            result = control.read_result(cfg.control_dir, request_id)  # it may have answered, then gone
            trainer_gone = result is None
            break
        await asyncio.sleep(WATCH_SECONDS)
    if result is None:
        control.withdraw_request(cfg.control_dir, request_id)
    step: int | None
    if trainer_gone:
        local_steps = list_local_steps(cfg.local_dir, cfg.process_id) if cfg.local_dir else []
        if sidecar.uploader is not None:  # only what goes to the persistent tier at all
            local_steps = [s for s in local_steps if sidecar.uploader.persists(s)]
        step = local_steps[-1] if local_steps else None
        log.info("final save %s: the trainer has exited; persisting its newest local step %s", request_id, step)
        if step is None:
            return not cfg.uploads
    elif result is None:
        log.error("final save %s: no answer from the trainer within %.0f s", request_id, cfg.grace_seconds)
        return False
    elif not result.committed or result.step is None:
        log.error("final save %s failed: %s", request_id, result.error)
        return False
    else:
        step = result.step
        if sidecar.uploader is not None:
            sidecar.uploader.requested_steps.add(step)
    if cfg.uploads and not await asyncio.to_thread(
        sidecar.storage_ready.wait, max(0.0, deadline - time.monotonic())
    ):
        log.error("final save %s: step %s is local only; %s", request_id, step, sidecar.storage_error)
        return False
    if sidecar.uploader is None:
        log.info("final save %s: step %s committed", request_id, step)
        return True
    sidecar.uploader.wake()
    lost = await wait_persisted(sidecar, step, deadline)
    if lost is None:
        log.info("final save %s: step %d committed and uploaded", request_id, step)
        return True
    if lost:
        log.warning("final save %s: step %d can never be committed: processes %s of its generation are lost, "
                    "the operator says, and their uploads are not in it; not waiting for them (the step stays "
                    "local only, the newest committed step is unaffected)", request_id, step, lost)
        return False
    log.error(
        "final save %s: step %d committed locally but not persisted within the grace period (last error: %s)",
        request_id,
        step,
        sidecar.uploader.state.last_error,
    )
    return False

async def wait_persisted(sidecar: Sidecar, step: int, deadline: float) -> list[int] | None:
    """Wait until this host's save of `step` is persisted (None) or the grace runs out ([]); once
    the operator said processes of the step's generation are lost (`Sidecar.note_lost_peers`), also until
    the step is known never to be committed: the lost processes whose upload marker it lacks."""
    uploader = sidecar.uploader
    assert uploader is not None
    while True:
        left = deadline - time.monotonic()
        if await asyncio.to_thread(uploader.wait_persisted, step, max(0.0, min(left, WATCH_SECONDS))):
            return None
        if sidecar.lost_peers:
            try:
                lost = await asyncio.to_thread(uploader.lost_uploads, step, dict(sidecar.lost_peers))
            except Exception as e:  # the local step gone, the store failing: not known, so keep waiting
                log.debug("step %d: cannot tell whether the lost peers uploaded it: %s", step, e)
                lost = []
            if lost:
                return lost
        if left <= 0:
            return []
