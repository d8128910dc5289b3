"""Where the uploader copies steps: a `BlobStore` over a local folder or a gs:// bucket.

Keys are `/`-separated and relative to the store's root (`"120/_COMMIT"`). A store promises:
- `upload_file` and `write_bytes` are atomic per key: a reader sees the old object, no object, or the
  whole new one (GCS objects by nature; a folder by writing a hidden temporary file and renaming);
- `create_bytes` is create-only: exactly one of several concurrent callers creates the key, the others
  get `False` (GCS `ifGenerationMatch=0`, a folder `link()` that fails when the name exists);
- listings are strongly consistent (GCS is; a folder trivially).

Call order of one step's upload (uploader.py): 1. `list_files` of the attempt (unless it is known to
be empty), 2. `upload_file` of each missing or different file, 3. `stat` (and `md5`) to verify,
4. `write_bytes` of the `_UPLOADED.<id>` marker, 5. `list_files` and `read_bytes` of every marker
(unless one process is the whole save), `list_files` of the fences, 6. `create_bytes` of `_COMMIT`.
Retention: `delete_keys` of the objects the commit recorded, else `list_files` of the step first.
All methods block; the uploader calls them from worker threads. Failures raise `StoreError`.

Memory: `upload_file` never holds more than `UPLOAD_PIECE_BYTES` of a file at once, whatever its size
(the uploader runs `upload_concurrency` of them): a folder copies in the kernel (`copy_file_range` /
`sendfile`, nothing in the process), gs:// sends a file of at most one piece whole and streams a bigger
one through a resumable upload, piece by piece; MD5s are computed over `_CHUNK` reads.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from resilax_sidecar.errors import StoreError

_CHUNK = 4 << 20

UPLOAD_PIECE_BYTES = 16 << 20
"""The most bytes of one file an upload reads into memory at a time (a multiple of 256 KiB, as GCS's
resumable uploads require of every piece but the last). gcsfs and aiohttp copy a piece about twice
more on its way out, so one upload of a big file to gs:// peaks at ~3.3 pieces above idle
(bench/sidecar_memory.py: 52 MiB with 16 MiB pieces, 29 with 8, 97 with 32). Smaller pieces cost
more requests: against fake-gcs-server 8 MiB pieces took 3x as long as 16 MiB for a 256 MiB file."""


@dataclass(frozen=True)
class BlobInfo:
    """What a store knows about one object without reading it."""

    size: int
    md5: str | None = None
    """Hex MD5 when the store has it for free (GCS object metadata), else None."""


class BlobStore(Protocol):
    """The persistent tier, as the uploader needs it. See the module docstring for the promises."""

    url: str
    """Where the root is, for logs and messages (`/mnt/ckpt`, `gs://bucket/prefix`)."""

    def list_dir(self, prefix: str) -> list[str]:
        """Names (not keys) of the objects and sub-folders directly under `prefix` ("" = the root)."""
        ...

    def list_files(self, prefix: str) -> dict[str, BlobInfo]:
        """Every object under the folder `prefix`, keyed by its path relative to `prefix`."""
        ...

    def stat(self, key: str) -> BlobInfo | None:
        """The object's size (and MD5 when free), or None when it does not exist."""
        ...

    def md5(self, key: str) -> str:
        """The object's hex MD5 (a folder store reads the file)."""
        ...

    def read_bytes(self, key: str) -> bytes: ...

    def write_bytes(self, key: str, data: bytes) -> None:
        """Create or replace the object atomically."""
        ...

    def create_bytes(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist; True when this call created it."""
        ...

    def upload_file(self, local_path: Path, key: str) -> None:
        """Copy a local file to `key`, atomically replacing any object there."""
        ...

    def upload_buffer_bytes(self, size: int) -> int:
        """The most bytes of a file of `size` bytes that `upload_file` holds in memory at once (the
        uploader's byte budget counts it)."""
        ...

    def delete(self, key: str) -> None:
        """Delete one object; a missing one is fine."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete everything under the folder `prefix`; missing is fine."""
        ...

    def delete_keys(self, keys: list[str]) -> None:
        """Delete these objects (missing ones are fine) without listing anything; a folder left empty
        goes with them."""
        ...


def md5_file(path: Path) -> str:
    """Hex MD5 of a local file, read in chunks."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _wrapping(store: str, what: str, key: str) -> Iterator[None]:
    """Turn third-party errors into StoreError naming the store, the call and the key."""
    try:
        yield
    except StoreError:
        raise
    except FileNotFoundError:
        raise
    except Exception as e:
        raise StoreError(f"{store}: {what} {key!r} failed: {type(e).__name__}: {e}") from e


class LocalFolderStore:
    """A local or mounted folder (a PVC, NFS). Temporary files are hidden (`.<name>.tmp-<uuid>`) and
    never listed."""

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self._fsync = fsync

    def _path(self, key: str) -> Path:
        key = key.strip("/")
        return self.root / key if key else self.root

    def _tmp(self, path: Path) -> Path:
        return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")

    def _sync_file(self, path: Path) -> None:
        if self._fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _sync_dir(self, path: Path) -> None:
        if self._fsync:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def list_dir(self, prefix: str) -> list[str]:
        with _wrapping(self.url, "list", prefix):
            try:
                return sorted(n for n in os.listdir(self._path(prefix)) if not n.startswith("."))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def list_files(self, prefix: str) -> dict[str, BlobInfo]:
        base = self._path(prefix)
        out: dict[str, BlobInfo] = {}
        with _wrapping(self.url, "list", prefix):
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for name in filenames:
                    if name.startswith("."):
                        continue
                    full = Path(dirpath) / name
                    with contextlib.suppress(FileNotFoundError):
                        out[full.relative_to(base).as_posix()] = BlobInfo(size=full.stat().st_size)
        return out

    def stat(self, key: str) -> BlobInfo | None:
        with _wrapping(self.url, "stat", key):
            try:
                return BlobInfo(size=self._path(key).stat().st_size)
            except FileNotFoundError:
                return None

    def md5(self, key: str) -> str:
        with _wrapping(self.url, "md5", key):
            return md5_file(self._path(key))

    def read_bytes(self, key: str) -> bytes:
        with _wrapping(self.url, "read", key):
            return self._path(key).read_bytes()

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp(path)
        with open(tmp, "wb") as f:
            f.write(data)
            if self._fsync:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def write_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with _wrapping(self.url, "write", key):
            tmp = self._write_tmp(path, data)
            os.replace(tmp, path)
            self._sync_dir(path.parent)

    def create_bytes(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with _wrapping(self.url, "create", key):
            tmp = self._write_tmp(path, data)
            try:
                # link() fails with EEXIST when the name exists: create-only, and the marker appears
                # with its whole content at once (O_EXCL alone could expose an empty file).
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                tmp.unlink()
            self._sync_dir(path.parent)
            return True

    def upload_buffer_bytes(self, size: int) -> int:
        return 0  # copyfile() copies in the kernel (copy_file_range / sendfile): nothing in the process

    def upload_file(self, local_path: Path, key: str) -> None:
        path = self._path(key)
        with _wrapping(self.url, "upload", key):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._tmp(path)
            try:
                shutil.copyfile(local_path, tmp)
                self._sync_file(tmp)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                raise
            self._sync_dir(path.parent)

    def delete(self, key: str) -> None:
        with _wrapping(self.url, "delete", key), contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def delete_keys(self, keys: list[str]) -> None:
        folders: set[Path] = set()
        with _wrapping(self.url, "delete", ", ".join(keys[:3])):
            for key in keys:
                path = self._path(key)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                folders.update(p for p in path.parents if self.root in p.parents)
            for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(FileNotFoundError, OSError):
                    folder.rmdir()  # only when empty

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if path == self.root:
            raise StoreError(f"{self.url}: refusing to delete the whole root")
        with _wrapping(self.url, "delete", prefix):
            if not path.exists():
                return
            # Hide it first (one rename), so a half-deleted folder is never listed as a step.
            trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(path, trash)
            except FileNotFoundError:
                return
            shutil.rmtree(trash, ignore_errors=True)


def _gcs_md5(info: dict[str, Any]) -> str | None:
    raw = info.get("md5Hash")
    if not raw:
        return None
    try:
        return base64.b64decode(raw).hex()
    except (binascii.Error, ValueError):
        return None


class GcsStore:
    """A gs://bucket/prefix through gcsfs (which honours STORAGE_EMULATOR_HOST for fake-gcs-server).

    gcsfs's listing cache is off: the uploader must see other sidecars' markers at once. A file of at
    most one piece (`piece_bytes`) goes whole through tensorstore's GCS key-value store when it is
    installed (it honours TENSORSTORE_GCS_HTTP_URL): 3-4x the throughput of gcsfs's Python HTTP path
    against the emulator here (docs/sidecar.md); a bigger one streams through gcsfs's resumable upload
    one piece at a time (tensorstore writes an object only whole), so an upload holds at most one piece
    of its file in memory (docs/sidecar.md, "Memory").
    """

    def __init__(
        self, url: str, fs: Any | None = None, use_tensorstore: bool = True, piece_bytes: int = UPLOAD_PIECE_BYTES
    ) -> None:
        if not url.startswith("gs://"):
            raise ValueError(f"{url!r} is not a gs:// URL")
        if piece_bytes <= 0 or piece_bytes % (256 << 10):
            raise ValueError(f"piece_bytes: {piece_bytes} is not a positive multiple of 256 KiB")
        self.piece_bytes = piece_bytes
        self.url = url.rstrip("/")
        self._root = self.url[len("gs://") :]
        if fs is None:
            import gcsfs  # imported here: a local-folder sidecar never pays for it

            kwargs: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                kwargs.update(token="anon", project=os.environ.get("GOOGLE_CLOUD_PROJECT", "resilax-test"))
            fs = gcsfs.GCSFileSystem(**kwargs)
        # gcsfs hands aiohttp each resumable chunk as bytes; aiohttp warns about that on every chunk
        # of a large upload. The chunk is already in memory: the warning has nothing to tell us.
        warnings.filterwarnings("ignore", message="Sending a large body directly", category=ResourceWarning)
        self._fs = fs
        self._kv: Any | None = None
        # tensorstore finds the emulator through its own variable only: with just gcsfs's, it would
        # talk to the real GCS.
        emulated = bool(os.environ.get("STORAGE_EMULATOR_HOST"))
        if use_tensorstore and (not emulated or os.environ.get("TENSORSTORE_GCS_HTTP_URL")):
            try:
                import tensorstore as ts
            except ImportError:
                pass
            else:
                bucket, _, prefix = self._root.partition("/")
                path = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
                self._kv = ts.KvStore.open({"driver": "gcs", "bucket": bucket, "path": path}).result()

    def _full(self, key: str) -> str:
        key = key.strip("/")
        return f"{self._root}/{key}" if key else self._root

    def _list(self, prefix: str, delimiter: str) -> tuple[list[dict[str, Any]], list[str]] | None:
        """One objects.list of the folder `prefix` (one request per page of 5,000): its objects and,
        with a delimiter, its sub-folders' prefixes. gcsfs's own `ls` and `find` cost more: `find`
        lists an empty folder twice (as a folder, then as a file). None: the filesystem has no
        `_do_list_objects` (another fsspec implementation); the caller uses `ls`/`find`."""
        do_list = getattr(self._fs, "_do_list_objects", None)
        if do_list is None or not hasattr(self._fs, "loop"):
            return None
        import fsspec.asyn

        items, prefixes = fsspec.asyn.sync(self._fs.loop, do_list, self._full(prefix), delimiter=delimiter)
        return list(items), list(prefixes)

    def list_dir(self, prefix: str) -> list[str]:
        full = self._full(prefix)
        with _wrapping(self.url, "list", prefix):
            try:
                listed = self._list(prefix, "/")
                if listed is not None:
                    bucket = self._root.split("/", 1)[0]
                    entries = [o["name"] for o in listed[0]] + [f"{bucket}/{p}" for p in listed[1]]
                else:
                    entries = self._fs.ls(full, detail=False, refresh=True)
            except FileNotFoundError:
                return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != full})

    def list_files(self, prefix: str) -> dict[str, BlobInfo]:
        full = self._full(prefix).rstrip("/") + "/"
        with _wrapping(self.url, "list", prefix):
            try:
                listed = self._list(prefix, "")
                if listed is not None:
                    found = {o["name"]: o for o in listed[0]}
                else:
                    found = self._fs.find(full, detail=True, withdirs=False)
            except FileNotFoundError:
                return {}
        out: dict[str, BlobInfo] = {}
        for name, info in found.items():
            if info.get("type") == "directory" or not name.startswith(full):
                continue
            out[name[len(full) :]] = BlobInfo(size=int(info["size"]), md5=_gcs_md5(info))
        return out

    def stat(self, key: str) -> BlobInfo | None:
        """One object's size and MD5: an objects.get only (gcsfs's `info` also LISTs the key as a
        folder, in parallel: a class A operation per file checked, every file of every upload)."""
        with _wrapping(self.url, "stat", key):
            try:
                get_object = getattr(self._fs, "_get_object", None)
                if get_object is not None and hasattr(self._fs, "loop"):
                    import fsspec.asyn

                    info = fsspec.asyn.sync(self._fs.loop, get_object, self._full(key))
                else:
                    info = self._fs.info(self._full(key), refresh=True)
            except FileNotFoundError:
                return None
        if info.get("type") == "directory":
            return None
        return BlobInfo(size=int(info["size"]), md5=_gcs_md5(info))

    def md5(self, key: str) -> str:
        info = self.stat(key)
        if info is None:
            raise FileNotFoundError(f"{self.url}/{key}")
        if info.md5 is None:
            raise StoreError(f"{self.url}: {key!r} has no md5Hash (composite object?)")
        return info.md5

    def read_bytes(self, key: str) -> bytes:
        with _wrapping(self.url, "read", key):
            data: bytes = self._fs.cat_file(self._full(key))
            return data

    def write_bytes(self, key: str, data: bytes) -> None:
        with _wrapping(self.url, "write", key):
            self._fs.pipe_file(self._full(key), data)

    def create_bytes(self, key: str, data: bytes) -> bool:
        with _wrapping(self.url, "create", key):
            try:
                self._fs.pipe_file(self._full(key), data, mode="create")
            except FileExistsError:
                return False
            return True

    def upload_buffer_bytes(self, size: int) -> int:
        return min(size, self.piece_bytes)

    def upload_file(self, local_path: Path, key: str) -> None:
        with _wrapping(self.url, "upload", key):
            if self._kv is not None and local_path.stat().st_size <= self.piece_bytes:
                self._kv.write(key.strip("/"), local_path.read_bytes()).result()
            else:
                # Resumable upload, one piece read and sent at a time (gcsfs reads `chunksize` per request).
                self._fs.put_file(str(local_path), self._full(key), chunksize=self.piece_bytes)

    def delete(self, key: str) -> None:
        with _wrapping(self.url, "delete", key), contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self._full(key))

    def delete_keys(self, keys: list[str]) -> None:
        if keys:
            with _wrapping(self.url, "delete", ", ".join(keys[:3])), contextlib.suppress(FileNotFoundError):
                self._fs.rm([self._full(k) for k in keys])

    def delete_prefix(self, prefix: str) -> None:
        if not prefix.strip("/"):
            raise StoreError(f"{self.url}: refusing to delete the whole root")
        files = self.list_files(prefix)
        with _wrapping(self.url, "delete", prefix):
            paths = [f"{self._full(prefix)}/{rel}" for rel in files]
            if paths:
                self._fs.rm(paths)


def open_store(url: str) -> BlobStore:
    """The store for `RESILAX_CHECKPOINT_DIR`: gs:// through gcsfs, anything else a local folder."""
    if url.startswith("gs://"):
        return GcsStore(url)
    Path(url).mkdir(parents=True, exist_ok=True)  # a missing or read-only mount shows here, at once
    return LocalFolderStore(url)
