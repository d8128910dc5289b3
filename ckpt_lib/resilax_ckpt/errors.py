"""The errors of resilax_ckpt: one base class; each leaf also subclasses the built-in it means."""

from __future__ import annotations


class ResilaxCkptError(Exception):
    """Base class of every error raised by resilax_ckpt."""


class StepNotFoundError(ResilaxCkptError, FileNotFoundError):
    """The requested step has no folder (or no step is committed at all)."""


class StepNotCommittedError(ResilaxCkptError, FileNotFoundError):
    """The step's folder exists but its commit marker does not (an interrupted or fenced save)."""


class IncompleteStepError(ResilaxCkptError, FileNotFoundError):
    """A committed step lacks array chunks a restore needs (e.g. a local-tier step holds only the
    shards of its own host): restore from the persistent tier instead."""


class MetadataError(ResilaxCkptError, ValueError):
    """A step's `_METADATA.json` is missing, unreadable or of an unknown format version."""


class TreeMismatchError(ResilaxCkptError, ValueError):
    """The restore target's tree does not match what the checkpoint holds (missing leaf or item)."""


class ShapeMismatchError(TreeMismatchError):
    """A target leaf's shape differs from the shape on disk."""


class StorageError(ResilaxCkptError, OSError):
    """Reading or writing the storage failed (local disk or gs://)."""


class SaveError(ResilaxCkptError, RuntimeError):
    """A (background) save failed; raised from `wait()`, the next `save()` or `close()`."""


class FencedError(SaveError):
    """A newer generation of workers exists: this (older) generation may no longer commit."""


class StepExistsError(ResilaxCkptError, FileExistsError):
    """A committed checkpoint already exists for the step being saved."""


class ForeignDataError(ResilaxCkptError, FileExistsError):
    """A folder Resilax did not write is where a step must go; Resilax never deletes or overwrites it."""


class CorruptCheckpointError(ResilaxCkptError, ValueError):
    """A committed step's file is corrupt or truncated; the message names the file."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A chunk (or a shard index) does not match the crc32c stored with it; the message names the file."""


class MissingChunkError(IncompleteStepError):
    """A chunk file a restore needs does not exist; the message names the file."""


class StorageInUseError(ResilaxCkptError, RuntimeError):
    """A live JAXJob of another uid holds the checkpoint storage (fencing.decide_claim): this job neither
    takes it over (unless told to: spec.checkpoint.takeOver) nor runs on it. The worker exits with
    EXIT_CODE_STORAGE_IN_USE (78) and this message as its termination message."""

    def __init__(self, message: str, holder_uid: str | None = None, holder_job: str | None = None,
                 taken_over: bool = False) -> None:
        super().__init__(message)
        self.holder_uid = holder_uid
        self.holder_job = holder_job
        self.taken_over = taken_over
