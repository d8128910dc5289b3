"""resilax_ckpt: distributed checkpoints for JAX on tensorstore.

```python
import resilax_ckpt as rc
mgr = rc.CheckpointManager(directory, options=rc.ManagerOptions(save_every_steps=100, keep_last=3))
mgr.save(step, {"params": params, "opt_state": opt_state, "meta": {"epoch": 1}})
state = mgr.restore(target={"params": abstract_params})
```
"""

from resilax_ckpt.errors import (
    FencedError,
    IncompleteStepError,
    MetadataError,
    ResilaxCkptError,
    SaveError,
    ShapeMismatchError,
    StepExistsError,
    StepNotCommittedError,
    StepNotFoundError,
    StorageError,
    TreeMismatchError,
)
from resilax_ckpt.items import PerProcess, UnsupportedLeafError
from resilax_ckpt.manager import EXIT_CODE_STOPPED, CheckpointManager, restore, save
from resilax_ckpt.multihost import initialize_distributed_from_env
from resilax_ckpt.options import InvalidOptionsError, ManagerOptions

__all__ = [
    "EXIT_CODE_STOPPED",
    "CheckpointManager",
    "FencedError",
    "IncompleteStepError",
    "InvalidOptionsError",
    "ManagerOptions",
    "MetadataError",
    "PerProcess",
    "ResilaxCkptError",
    "SaveError",
    "ShapeMismatchError",
    "StepExistsError",
    "StepNotCommittedError",
    "StepNotFoundError",
    "StorageError",
    "TreeMismatchError",
    "UnsupportedLeafError",
    "initialize_distributed_from_env",
    "restore",
    "save",
]
