"""A pod's volumes as host folders, the way a kubelet mounts them: emptyDir (memory medium on tmpfs),
hostPath (each fake node has its own root: all nodes are one machine), PersistentVolumeClaim (a folder
per claim), and the files of configMap, secret, downwardAPI and projected volumes (with bound
service-account tokens from the TokenRequest API). launch.py binds them at their `mountPath`. While the
pod runs, its configMap and secret volumes follow their objects (`refresh_volumes`, every
REFRESH_SECONDS), as a kubelet's sync does: a rotated Secret reaches the running containers."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, Final

from ..errors import KubeAPIError
from . import podspec
from .podhost import Pod, PodHost

#: `lookup(kind, name)`: a ConfigMap or Secret of the pod's namespace ("configmaps", "secrets"), None if absent.
Lookup = Callable[[str, str], "dict[str, Any] | None"]


class PrepareError(Exception):
    """The pod cannot start yet (a ConfigMap, Secret or key is missing); retried like the kubelet does."""


#: How often a running pod's configMap and secret volumes are read again (a kubelet's sync period is about a
#: minute; a GET per volume and pod each time).
REFRESH_SECONDS: Final = 20.0

#: Memory-medium volumes live under this tmpfs folder (`emptyDir` per pod uid, hostPath per cluster and node).
MEMORY_ROOT = Path("/dev/shm/resilax-local")
SHM = PurePosixPath("/dev/shm")


def memory_root(run_dir: Path) -> Path:
    """This cluster's tmpfs folder for hostPath volumes under /dev/shm (one per run folder)."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return MEMORY_ROOT / f"cluster-{digest}"


def map_host_path(run_dir: Path, node: str, path: str) -> Path:
    """Where a hostPath `path` of a pod on `node` lives: all fake nodes are one machine, so each node
    gets its own root, `<run_dir>/nodes/<node>/root/<path>` (two nodes never share files; removing the
    node removes them), or `<memory_root>/nodes/<node>/<path below /dev/shm>` for a path on /dev/shm
    (tmpfs, as on the node)."""
    pure = PurePosixPath(path)
    if not pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"hostPath {path!r}: must be an absolute path without '..'")
    if pure == SHM or SHM in pure.parents:
        return memory_root(run_dir) / "nodes" / node / pure.relative_to(SHM)
    return run_dir / "nodes" / node / "root" / pure.relative_to("/")


def node_roots(run_dir: Path, node: str) -> list[Path]:
    """The folders that hold `node`'s hostPath volumes (disk and tmpfs)."""
    return [run_dir / "nodes" / node, memory_root(run_dir) / "nodes" / node]


def build_volumes(host: PodHost, pod: Pod, pod_dir: Path, lookup: Lookup, memory_dirs: list[Path]) -> dict[str, Path]:
    """Each volume of `pod` as a host folder (emptyDir, hostPath, PVC, configMap/secret/downwardAPI/projected
    files); memory-medium emptyDirs are recorded in `memory_dirs` (removed with the pod). Raises
    PrepareError while something the pod needs is missing (the kubelet retries)."""
    meta = pod["metadata"]
    uid, namespace, node = meta["uid"], meta["namespace"], pod["spec"]["nodeName"]
    volumes: dict[str, Path] = {}
    root = pod_dir / "volumes"
    for vol in pod["spec"].get("volumes") or []:
        name = vol["name"]
        path = root / name
        if "emptyDir" in vol:
            if (vol["emptyDir"] or {}).get("medium") == "Memory":
                path = MEMORY_ROOT / uid / name
                memory_dirs.append(path.parent)
            path.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in vol:
            try:
                path = host.host_path(node, str(vol["hostPath"]["path"]))
            except ValueError as e:
                raise PrepareError(f"volume {name!r}: {e}") from e
            kind = vol["hostPath"].get("type", "")
            if kind in ("Directory", "File") and not path.exists():
                raise PrepareError(f"volume {name!r}: hostPath {vol['hostPath']['path']} does not exist on "
                                   f"node {node} ({path}) and its type is {kind}")
            if kind == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate":
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
        elif "persistentVolumeClaim" in vol:
            path = host.run_dir / "pvcs" / namespace / vol["persistentVolumeClaim"]["claimName"]
            path.mkdir(parents=True, exist_ok=True)
        elif "configMap" in vol or "secret" in vol or "downwardAPI" in vol or "projected" in vol:
            try:
                files = projected_files(host, pod, vol, lookup)
            except PrepareError as e:
                raise PrepareError(f'MountVolume.SetUp failed for volume "{name}" : {e}') from e
            path.mkdir(parents=True, exist_ok=True)
            write_files(path, files, default_mode(vol))
        else:
            kinds = ", ".join(k for k in vol if k != "name")
            raise PrepareError(f"volume {name!r}: type {kinds} is not supported by the local node agent")
        volumes[name] = path
    return volumes

def write_files(path: Path, files: dict[str, tuple[bytes, int | None]], mode: int) -> list[str]:
    """Write each file under `path` whose content differs, atomically (a temporary file renamed over it,
    so a container never reads half a file); the paths written."""
    written = []
    for rel, (content, file_mode) in files.items():
        target = path / rel
        with contextlib.suppress(OSError):
            if target.read_bytes() == content:
                continue
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.tmp")
        temporary.write_bytes(content)
        temporary.chmod(file_mode if file_mode is not None else mode)
        os.replace(temporary, target)
        written.append(rel)
    return written


def refresh_volumes(host: PodHost, pod: Pod, volumes: dict[str, Path], lookup: Lookup) -> list[str]:
    """A running pod's configMap and secret volumes written again where their object changed (each
    changed file replaced atomically); an object or key gone leaves the files as they were. Projected
    and downwardAPI volumes are left alone (their tokens are not re-issued here). The volumes changed."""
    changed = []
    for vol in pod["spec"].get("volumes") or []:
        name = vol["name"]
        if ("configMap" not in vol and "secret" not in vol) or name not in volumes:
            continue
        try:
            files = projected_files(host, pod, vol, lookup)
        except PrepareError:
            continue
        if write_files(volumes[name], files, default_mode(vol)):
            changed.append(name)
    return changed


def default_mode(vol: dict[str, Any]) -> int:
    for key in ("configMap", "secret", "downwardAPI", "projected"):
        if key in vol and vol[key] and "defaultMode" in vol[key]:
            return int(vol[key]["defaultMode"])
    return 0o644

def projected_files(host: PodHost, pod: Pod, vol: dict[str, Any], lookup: Lookup) -> dict[str, tuple[bytes, int | None]]:
    """Files of a configMap/secret/downwardAPI/projected volume: relative path -> (bytes, mode)."""
    sources: list[dict[str, Any]]
    if "projected" in vol:
        sources = (vol["projected"] or {}).get("sources") or []
    else:
        sources = [{k: v for k, v in vol.items() if k != "name"}]
    files: dict[str, tuple[bytes, int | None]] = {}
    for source in sources:
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            files[sat["path"]] = (request_token(host, pod, sat).encode(), 0o600)
        for key, kind, name_key in (("configMap", "configmaps", "name"), ("secret", "secrets", "secretName")):
            if key not in source:
                continue
            ref = source[key] or {}
            obj_name = str(ref.get(name_key) or ref.get("name"))
            obj = lookup(kind, obj_name)
            if obj is None:
                if ref.get("optional"):
                    continue
                raise PrepareError(f"{kind[:-1]} {obj_name!r} not found")
            raw = raw_data(obj, kind)
            items = ref.get("items")
            if items:
                for item in items:
                    if item["key"] not in raw:
                        if ref.get("optional"):
                            continue
                        raise PrepareError(f"key {item['key']!r} not in {kind[:-1]} {obj_name!r}")
                    files[item["path"]] = (raw[item["key"]], item.get("mode"))
            else:
                for k, v in raw.items():
                    files[k] = (v, None)
        if "downwardAPI" in source:
            for item in (source["downwardAPI"] or {}).get("items") or []:
                if "fieldRef" in item:
                    value = podspec.field_value(pod, item["fieldRef"]["fieldPath"])
                else:
                    ref = item["resourceFieldRef"]
                    specs = [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]
                    container = next((c for c in specs if c["name"] == ref.get("containerName")), specs[-1])
                    value = podspec.resource_value(container, ref["resource"], ref.get("divisor"))
                files[item["path"]] = (value.encode(), item.get("mode"))
    return files

def raw_data(obj: dict[str, Any], kind: str) -> dict[str, bytes]:
    if kind == "secrets":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out

def request_token(host: PodHost, pod: Pod, sat: dict[str, Any]) -> str:
    """A bound service-account token through the TokenRequest API, as the kubelet asks for it."""
    meta = pod["metadata"]
    account = pod["spec"].get("serviceAccountName") or "default"
    spec: dict[str, Any] = {
        "expirationSeconds": int(sat.get("expirationSeconds", 3600)),
        "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]},
    }
    if sat.get("audience"):
        spec["audiences"] = [sat["audience"]]
    try:
        answer = host.client.create(
            f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
    except KubeAPIError as e:
        raise PrepareError(f"token for service account {account!r}: {e}") from e
    return str(answer["status"]["token"])
