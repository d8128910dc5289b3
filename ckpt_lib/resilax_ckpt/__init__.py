"""resilax_ckpt: distributed checkpoints for JAX on tensorstore.

```python
import resilax_ckpt as rc
mgr = rc.CheckpointManager(directory, options=rc.ManagerOptions(save_every_steps=100, keep_last=3))
mgr.save(step, {"params": params, "opt_state": opt_state, "meta": {"epoch": 1}})
state = mgr.restore(target={"params": abstract_params})
```

Where things are (docs/checkpointing.md, "Module map"). At the top, the core: `manager` (the
facade), `oneshot` (save and restore without a manager), `options`, `tiers` (where a manager's steps
live, the state its two halves share), `multihost` (coordination), `layout` (names), `metadata`
(versioned JSON), `items` and `pytrees` (what a checkpoint holds), `planning` (pure: the boxes each
process writes and reads), `commit` (the commit protocol), `storage` (small files: os or gcsfs),
`tensorstore_io` (the tensorstore chunk backend), `errors`. By concern:
- `saving`: save decisions, the device copy, the write and commit, retention;
- `restoring`: the restore path, step folders read onto a target, the restore prefetch, Orbax's format;
- `chunks`: the chunk files' format and I/O, under both;
- `incluster`: peer replicas and restores from what the cluster's nodes hold;
- `history`: fences, timelines, which committed steps readers see;
- `control`: the control folder's files shared with the sidecar;
- `trainer`: the process around the trainer (`resilax run`, the kept process, the health check).
"""

from typing import TYPE_CHECKING, Any

from resilax_ckpt.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    FencedError,
    ForeignDataError,
    IncompleteStepError,
    MetadataError,
    MissingChunkError,
    ResilaxCkptError,
    SaveError,
    ShapeMismatchError,
    StepExistsError,
    StepNotCommittedError,
    StepNotFoundError,
    StorageError,
    StorageInUseError,
    TreeMismatchError,
)

# JAX is imported lazily: the format modules (layout, history.fencing, saving.policy, control.requests,
# storage, errors) are JAX-free, and the sidecar imports them without loading JAX (tests/sidecar/test_layout.py
# checks). The subpackages' __init__ modules import nothing, so importing one module loads no sibling.
_LAZY = {
    "PerProcess": "resilax_ckpt.items", "UnsupportedLeafError": "resilax_ckpt.items",
    "EXIT_CODE_STOPPED": "resilax_ckpt.manager", "CheckpointManager": "resilax_ckpt.manager",
    "restore": "resilax_ckpt.manager", "save": "resilax_ckpt.manager",
    "initialize_distributed_from_env": "resilax_ckpt.multihost", "EXIT_CODE_PEER_LOST": "resilax_ckpt.multihost",
    "EXIT_CODE_STORAGE_IN_USE": "resilax_ckpt.multihost",
    "InvalidOptionsError": "resilax_ckpt.options", "ManagerOptions": "resilax_ckpt.options",
    "restore_orbax": "resilax_ckpt.restoring.orbax_import",
    "InvalidMetricsError": "resilax_ckpt.saving.retention", "StepInfo": "resilax_ckpt.restoring.step_info",
    "start_prefetch": "resilax_ckpt.restoring.prefetch", "run_kept": "resilax_ckpt.trainer.kept_trainer",
}

if TYPE_CHECKING:
    from resilax_ckpt.items import PerProcess, UnsupportedLeafError
    from resilax_ckpt.manager import EXIT_CODE_STOPPED, CheckpointManager, restore, save
    from resilax_ckpt.multihost import (
        EXIT_CODE_PEER_LOST,
        EXIT_CODE_STORAGE_IN_USE,
        initialize_distributed_from_env,
    )
    from resilax_ckpt.options import InvalidOptionsError, ManagerOptions
    from resilax_ckpt.restoring.orbax_import import restore_orbax
    from resilax_ckpt.restoring.prefetch import start_prefetch
    from resilax_ckpt.restoring.step_info import StepInfo
    from resilax_ckpt.saving.retention import InvalidMetricsError
    from resilax_ckpt.trainer.kept_trainer import run_kept


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilax_ckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "EXIT_CODE_PEER_LOST",
    "EXIT_CODE_STOPPED",
    "EXIT_CODE_STORAGE_IN_USE",
    "CheckpointManager",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "FencedError",
    "ForeignDataError",
    "IncompleteStepError",
    "InvalidMetricsError",
    "InvalidOptionsError",
    "ManagerOptions",
    "MetadataError",
    "MissingChunkError",
    "PerProcess",
    "ResilaxCkptError",
    "SaveError",
    "ShapeMismatchError",
    "StepExistsError",
    "StepInfo",
    "StepNotCommittedError",
    "StepNotFoundError",
    "StorageError",
    "StorageInUseError",
    "TreeMismatchError",
    "UnsupportedLeafError",
    "initialize_distributed_from_env",
    "restore",
    "restore_orbax",
    "run_kept",
    "save",
    "start_prefetch",
]
