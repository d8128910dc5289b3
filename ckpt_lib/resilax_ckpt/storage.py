"""Small-file storage (metadata, markers, listing, deletion) for local folders and gs:// buckets.

Array data goes through tensorstore (tensorstore_io.py); this module handles everything else.
Local paths use the os module; gs:// uses gcsfs, which supports create-only writes
(`ifGenerationMatch=0`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any, Protocol

from resilax_ckpt.errors import StorageError


class ReadStorage(Protocol):
    """What a reader of a root's steps and records needs (visibility.newest_visible, the fences and
    branch records): the sidecar passes its own store through this. `read_bytes` raises
    FileNotFoundError for a missing path; `list_dir` of a missing folder is empty."""

    def join(self, *parts: str) -> str: ...
    def read_bytes(self, path: str) -> bytes: ...
    def exists(self, path: str) -> bool: ...
    def list_dir(self, path: str) -> list[str]: ...


class Storage(ReadStorage, Protocol):
    """Where checkpoints live. Paths are strings; `join` builds them.

    Call order for a save: 1. `write_bytes` of data and metadata, 2. `sync_dir` (local),
    3. `rename_dir` (local) or `write_bytes(..., create_only=True)` of the marker (object stores).
    """

    is_local: bool

    def write_bytes(self, path: str, data: bytes, *, create_only: bool = False) -> None: ...
    def delete_tree(self, path: str) -> None: ...
    def rename_dir(self, src: str, dst: str) -> None: ...
    def sync_dir(self, path: str) -> None: ...
    def kvstore_spec(self, path: str) -> dict[str, Any]: ...


class LocalStorage:
    """A local (or mounted, e.g. NFS/PVC) folder."""

    is_local = True

    def __init__(self, fsync: bool = True) -> None:
        self._fsync = fsync

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_bytes(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if create_only:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            fd = os.open(path, flags, 0o644)
            try:
                os.write(fd, data)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            if self._fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def list_dir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    def delete_tree(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def rename_dir(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def sync_dir(self, path: str) -> None:
        if not self._fsync:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        return {"driver": "file", "path": os.path.abspath(path) + "/"}


class GcsStorage:
    """A gs://bucket/prefix through gcsfs (honours STORAGE_EMULATOR_HOST for fake-gcs-server)."""

    is_local = False

    def __init__(self) -> None:
        # gcsfs reads this when it is first imported, so it is set before the import (its experimental
        # HNS path probes Google's storage control API, which an emulator or an offline host never answers)
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        import gcsfs  # imported lazily: local-only users never pay for it

        emulator = os.environ.get("STORAGE_EMULATOR_HOST") or None
        self._fs = gcsfs.GCSFileSystem(token="anon" if emulator else None, endpoint_url=emulator,
                                       cache_timeout=0, skip_instance_cache=True)

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))

    def _wrap(self, what: str, path: str, error: Exception) -> StorageError:
        return StorageError(f"{what} {path}: {type(error).__name__}: {error}")

    def read_bytes(self, path: str) -> bytes:
        try:
            return bytes(self._fs.cat_file(path))
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._wrap("reading", path, e) from e

    def write_bytes(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        try:
            self._fs.pipe_file(path, data, mode="create" if create_only else "overwrite")
        except FileExistsError:
            raise
        except Exception as e:
            if "412" in str(e) or "Precondition" in str(e):
                raise FileExistsError(f"{path} exists (create-only write refused)") from e
            raise self._wrap("writing", path, e) from e

    def exists(self, path: str) -> bool:
        try:
            self._fs.invalidate_cache()
            return bool(self._fs.exists(path))
        except Exception as e:
            raise self._wrap("checking", path, e) from e

    def list_dir(self, path: str) -> list[str]:
        try:
            self._fs.invalidate_cache()
            entries = self._fs.ls(path.rstrip("/"), detail=False)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._wrap("listing", path, e) from e
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def delete_tree(self, path: str) -> None:
        try:
            self._fs.invalidate_cache()
            if self._fs.exists(path):
                self._fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._wrap("deleting", path, e) from e

    def rename_dir(self, src: str, dst: str) -> None:
        raise StorageError(f"gs:// has no rename; cannot move {src} to {dst}")

    def sync_dir(self, path: str) -> None:
        pass

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        rest = path[len("gs://"):]
        bucket, _, prefix = rest.partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": prefix.rstrip("/") + "/"}


def open_storage(root: str, fsync: bool = True) -> Storage:
    """The storage for a checkpoint root: `gs://...` or a local path."""
    if root.startswith("gs://"):
        return GcsStorage()
    if "://" in root:
        raise StorageError(f"{root}: unsupported scheme; use a local path or gs://bucket/prefix")
    return LocalStorage(fsync=fsync)
