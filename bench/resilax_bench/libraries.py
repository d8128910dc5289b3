"""One adapter per library under test, all driven by ``worker.py`` in the same order.

Each adapter's call order, in a save process:
  1. ``open_save(directory, leaves, seed)``: build the state in memory the library's way.
  2. ``save(step)``: returns when the training loop could go on (the blocked time).
  3. ``wait()``: returns when the step is committed and on stable storage (the durable time), and
     the library's retention (keep the newest step) has retired the older one.
  4. ``close()``.
In a restore process (a fresh one, so its first restore is what a recovering job pays):
  1. ``open_restore(directory, leaves)``.
  2. ``restore(step, kind)`` with kind ``plain`` (mesh (4, 2), the save's specs), ``reshard`` (mesh
     (2, 4), specs transposed) or ``params`` (params only, mesh (4, 2)); returns the restored leaves as
     ``{leaf name: array}`` once every byte is in place.
  3. ``close()``.
A library that cannot do a kind raises ``NotApplicable``.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from resilax_bench import state as st


class NotApplicable(Exception):
    """The library has no such operation (e.g. a mesh restore for single-process torch tensors)."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete_older_steps(directory: str, step: int) -> None:
    """Retention of a job keeping the newest step: delete the step folders older than `step`."""
    import shutil

    for name in os.listdir(directory):
        if name.isdigit() and int(name) < step:
            shutil.rmtree(os.path.join(directory, name))


def _block(tree: Any) -> None:
    import jax

    jax.block_until_ready(tree)


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` -> ``{key: value}``, values read as JSON where they parse
    (``true``, ``3``, ``0.5``, ``"x"``), else kept as strings (``device_copy``)."""
    import json

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--resilax-option: {pair!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


class Library:
    name: ClassVar[str] = ""
    module: ClassVar[str] = ""
    # The meshes of the save (and plain restores) and of the reshard restore; --accel sets them from
    # the devices present.
    save_mesh: tuple[int, int] = st.SAVE_MESH
    reshard_mesh: tuple[int, int] = st.RESHARD_MESH

    def save_info(self) -> dict[str, Any] | None:
        """What the library says about its last save (e.g. which transfer path it took), if anything."""
        return None

    def open_save(self, directory: str, leaves: list[st.LeafSpec], seed: int) -> None:
        raise NotImplementedError

    def save(self, step: int) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def open_restore(self, directory: str, leaves: list[st.LeafSpec]) -> None:
        raise NotImplementedError

    def restore(self, step: int, kind: str) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def version(self) -> str:
        from importlib import metadata

        try:
            return metadata.version(self.module)
        except metadata.PackageNotFoundError:
            return "unknown"


class _JaxLibrary(Library):
    """Shared by the libraries that hold the state as sharded ``jax.Array``s."""

    def open_save(self, directory: str, leaves: list[st.LeafSpec], seed: int) -> None:
        self.directory = directory
        self.leaves = leaves
        self.state = st.build_jax_state(leaves, st.make_mesh(self.save_mesh), seed)

    def open_restore(self, directory: str, leaves: list[st.LeafSpec]) -> None:
        self.directory = directory
        self.leaves = leaves
        self.meshes = {"plain": st.make_mesh(self.save_mesh), "reshard": st.make_mesh(self.reshard_mesh)}

    def target(self, kind: str) -> dict[str, Any]:
        mesh = self.meshes["reshard" if kind == "reshard" else "plain"]
        items = ("params",) if kind == "params" else None
        return st.build_abstract_state(self.leaves, mesh, transpose=kind == "reshard", items=items)

    @staticmethod
    def named(tree: dict[str, Any]) -> dict[str, Any]:
        return {"/".join(path): value for path, value in st.flatten(tree).items()}


def _resilax() -> Any:
    import resilax_ckpt as rc

    missing = [n for n in ("CheckpointManager", "ManagerOptions") if not hasattr(rc, n)]
    if missing:
        raise RuntimeError(f"resilax_ckpt is not usable yet: it has no {', '.join(missing)}")
    return rc


class ResilaxLibrary(_JaxLibrary):
    name = "resilax"
    module = "resilax"

    def __init__(self) -> None:
        self.options: dict[str, Any] = {}
        """Extra ``ManagerOptions`` fields (``--resilax-option KEY=VALUE``), e.g. a forced save path."""

    def _options(self, rc: Any, **base: Any) -> Any:
        import dataclasses

        known = {f.name for f in dataclasses.fields(rc.ManagerOptions)}
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise ValueError(
                f"--resilax-option: ManagerOptions has no field {', '.join(unknown)}; fields: {', '.join(sorted(known))}"
            )
        return rc.ManagerOptions(**{**base, **self.options})

    def open_save(self, directory: str, leaves: list[st.LeafSpec], seed: int) -> None:
        rc = _resilax()
        self.mgr = rc.CheckpointManager(directory, options=self._options(rc, async_save=True, keep_last=1))
        # As Resilax's trainer starts (examples/transformer.py): it asks which step to restore, with its
        # state's target, before it makes the state; with none to restore, the save's on-device copy
        # compiles in the background meanwhile (the first save then blocks as a later one does).
        target = st.build_abstract_state(leaves, st.make_mesh(self.save_mesh))
        self.mgr.restore_step_from_env({}, target={"params": target["params"], "opt_state": target["opt_state"]})
        super().open_save(directory, leaves, seed)

    def save_info(self) -> dict[str, Any] | None:
        """The manager's report of its last save, under whichever name it has one (none: None)."""
        import dataclasses

        mgr = getattr(self, "mgr", None)
        for attr in ("last_save_report", "save_report", "last_save"):
            found = getattr(mgr, attr, None)
            if callable(found):
                try:
                    found = found()
                except TypeError:
                    continue
            if found is None:
                continue
            if dataclasses.is_dataclass(found) and not isinstance(found, type):
                found = dataclasses.asdict(found)
            if isinstance(found, dict):
                found = {**found, **_bounced_writes()}
                return {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in found.items()}
            return {"repr": repr(found)}
        return None

    def save(self, step: int) -> None:
        saved = self.mgr.save(
            step, {"params": self.state["params"], "opt_state": self.state["opt_state"]}, force=True
        )
        if not saved:
            raise RuntimeError(f"resilax_ckpt: save({step}, force=True) returned False")

    def wait(self) -> None:
        self.mgr.wait()

    def open_restore(self, directory: str, leaves: list[st.LeafSpec]) -> None:
        rc = _resilax()
        super().open_restore(directory, leaves)
        self.mgr = rc.CheckpointManager(directory, options=self._options(rc, async_save=True))

    def restore(self, step: int, kind: str) -> dict[str, Any]:
        items = ["params"] if kind == "params" else None
        out = self.mgr.restore(step, target=self.target(kind), items=items)
        _block(out)
        return self.named(out)

    def close(self) -> None:
        mgr = getattr(self, "mgr", None)
        if mgr is not None:
            mgr.close()


def _bounced_writes() -> dict[str, Any]:
    """resilax_ckpt's count of chunk writes copied through its staging buffer so far in this process
    (chunk_writer.bounced_writes; {} where this resilax_ckpt has none)."""
    try:
        from resilax_ckpt.chunks import chunk_writer

        counts = chunk_writer.bounced_writes()
    except (ImportError, AttributeError):
        return {}
    return {"bounced_writes": counts["writes"], "bounced_bytes": counts["bytes"], "bounced_layout": counts["layout"]}


class OrbaxLibrary(_JaxLibrary):
    """Orbax's CheckpointManager with its defaults (async save on, zstd on), one Composite per step."""

    name = "orbax"
    module = "orbax-checkpoint"

    def _manager(self, directory: str, max_to_keep: int | None = None) -> Any:
        import orbax.checkpoint as ocp

        return ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=max_to_keep),
        )

    def open_save(self, directory: str, leaves: list[st.LeafSpec], seed: int) -> None:
        super().open_save(directory, leaves, seed)
        self.mgr = self._manager(directory, max_to_keep=1)

    def save(self, step: int) -> None:
        import orbax.checkpoint as ocp

        args = ocp.args.Composite(
            params=ocp.args.StandardSave(self.state["params"]),
            opt_state=ocp.args.StandardSave(self.state["opt_state"]),
        )
        if not self.mgr.save(step, args=args, force=True):
            raise RuntimeError(f"orbax: save({step}) returned False")

    def wait(self) -> None:
        self.mgr.wait_until_finished()

    def open_restore(self, directory: str, leaves: list[st.LeafSpec]) -> None:
        super().open_restore(directory, leaves)
        self.mgr = self._manager(directory)

    def restore(self, step: int, kind: str) -> dict[str, Any]:
        import orbax.checkpoint as ocp

        target = self.target(kind)
        args = ocp.args.Composite(**{k: ocp.args.StandardRestore(v) for k, v in target.items()})
        out = self.mgr.restore(step, args=args)
        tree = {k: out[k] for k in target}
        _block(tree)
        return self.named(tree)

    def close(self) -> None:
        mgr = getattr(self, "mgr", None)
        if mgr is not None:
            mgr.close()


class NumpyLibrary(_JaxLibrary):
    """``np.save`` of each leaf's full bytes into its own file, fsynced; restore is ``np.load`` then
    ``jax.device_put`` onto the target sharding (what a checkpoint library must do as well)."""

    name = "numpy"
    module = "numpy"

    def save(self, step: int) -> None:
        import numpy as np

        folder = os.path.join(self.directory, str(step))
        os.makedirs(folder)
        for path, value in st.flatten(self.state).items():
            with open(os.path.join(folder, "__".join(path) + ".npy"), "wb") as f:
                np.save(f, np.asarray(value))
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(folder)
        _fsync_dir(self.directory)
        _delete_older_steps(self.directory, step)

    def wait(self) -> None:
        pass

    def restore(self, step: int, kind: str) -> dict[str, Any]:
        import jax
        import numpy as np

        folder = os.path.join(self.directory, str(step))
        out = {}
        for path, target in st.flatten(self.target(kind)).items():
            host = np.load(os.path.join(folder, "__".join(path) + ".npy"))
            out["/".join(path)] = jax.device_put(host, target.sharding)
            del host
        _block(out)
        return out


class DcpLibrary(Library):
    """PyTorch DCP, single process, on plain CPU tensors holding the same bytes: ``async_save`` (its
    staging copy is the blocked time) and ``load`` into preallocated tensors."""

    name = "dcp"
    module = "torch"

    def open_save(self, directory: str, leaves: list[st.LeafSpec], seed: int) -> None:
        import torch

        self.directory = directory
        # from_numpy shares the host array's memory: the tensors are the state, no second copy.
        flat = {spec.path: torch.from_numpy(host) for spec, host in st.iter_host_leaves(leaves, seed)}
        self.state = st.nest(flat)
        self.future: Any = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.directory, str(step))
        self.step = step
        self.future = dcp.async_save(self.state, checkpoint_id=path, no_dist=True)

    def wait(self) -> None:
        future, self.future = self.future, None
        if future is not None:
            # async_save returns a Future, or (with a stager) a response holding one.
            getattr(future, "upload_completion", future).result()
        _fsync_dir(self.directory)
        _delete_older_steps(self.directory, self.step)

    def open_restore(self, directory: str, leaves: list[st.LeafSpec]) -> None:
        self.directory = directory
        self.leaves = leaves

    def restore(self, step: int, kind: str) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp

        if kind == "reshard":
            raise NotApplicable("single-process torch tensors have no device mesh to restore onto")
        flat = {
            spec.path: torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
            for spec in self.leaves
            if kind != "params" or spec.path[0] == "params"
        }
        state = st.nest(flat)
        dcp.load(state, checkpoint_id=os.path.join(self.directory, str(step)), no_dist=True)
        return {"/".join(path): t.numpy() for path, t in st.flatten(state).items()}


LIBRARIES: dict[str, type[Library]] = {
    cls.name: cls for cls in (ResilaxLibrary, OrbaxLibrary, DcpLibrary, NumpyLibrary)
}
IMPORTS = {
    "resilax": "resilax_ckpt",
    "orbax": "orbax.checkpoint",
    "dcp": "torch.distributed.checkpoint",
    "numpy": "numpy",
}
