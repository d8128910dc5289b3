"""Find or build the local cluster's binaries: Kubernetes, etcd, fake-gcs-server, Kueue (and optionally kwok).

Everything is built with the Go toolchain and the Go module proxy only, and cached under
`~/.cache/resilax/bin/<name>-<version>/` (`$RESILAX_CACHE` moves the cache). A binary is built only
when it is missing; `KUBEBUILDER_ASSETS` (the envtest convention: a folder of ready binaries) is
looked at first, binary by binary.

Kubernetes is built from a wrapper module that requires `k8s.io/kubernetes` and replaces each staging
module (`k8s.io/api`, `k8s.io/client-go`, ...) with its published `v0.<minor>.<patch>` twin: the
upstream go.mod points them at `./staging/...` folders that a module download does not have. etcd's
server module has directory replaces too, so it gets a wrapper of its own. Kueue's module has no
replaces: `go install` builds its manager, and the manifests it needs at start-up (CRDs, webhooks) are
copied from the downloaded module beside the binary, so a cluster starts it without Go.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import BinaryError

log = logging.getLogger(__name__)

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"
FAKE_GCS_SERVER_VERSION = "v1.56.1"
KWOK_VERSION = "v0.7.0"
HELM_VERSION = "v4.3.2"
#: The newest Kueue the Go module proxy served (`go list -m -versions sigs.k8s.io/kueue`, 2026-12).
KUEUE_VERSION = "v0.17.0"
#: What a Kueue start needs from its module, copied beside the binary (relative to the module root).
KUEUE_MANIFESTS = ("config/components/crd/bases", "config/components/crd/kustomization.yaml",
                   "config/components/webhook/manifests.yaml")

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")


def cache_dir() -> Path:
    """The cache root: `$RESILAX_CACHE` or `~/.cache/resilax`."""
    return Path(os.environ.get("RESILAX_CACHE") or Path.home() / ".cache" / "resilax")


@dataclass(frozen=True)
class Binaries:
    """Paths of the control plane's executables."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    etcd: Path

    def as_dict(self) -> dict[str, str]:
        return {
            "kube-apiserver": str(self.kube_apiserver),
            "kube-controller-manager": str(self.kube_controller_manager),
            "kube-scheduler": str(self.kube_scheduler),
            "etcd": str(self.etcd),
        }


def _assets_binary(name: str) -> Path | None:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        candidate = Path(assets) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BinaryError(
            "the local cluster's binaries are missing and there is no Go toolchain to build them: install Go "
            f"1.26 or newer (https://go.dev/dl/) and put `go` on PATH, or set KUBEBUILDER_ASSETS to a folder "
            f"holding {', '.join(KUBERNETES_COMMANDS)} ({KUBERNETES_VERSION}) and etcd ({ETCD_VERSION}), "
            f"or place them in {cache_dir() / 'bin'}/k8s-{KUBERNETES_VERSION}/ and "
            f"{cache_dir() / 'bin'}/etcd-{ETCD_VERSION}/"
        )
    return go


#: Seconds between two "still building" lines while a build step runs.
HEARTBEAT_SECONDS = 30.0


def _run_build(cmd: list[str], cwd: Path, log_name: str, env: dict[str, str] | None = None) -> None:
    """Run a build step, under `/usr/bin/time -v` when present, appending its output to a log file."""
    log_path = cache_dir() / log_name
    timed = ["/usr/bin/time", "-v", *cmd] if Path("/usr/bin/time").exists() else cmd
    log.info("building: %s (log: %s)", " ".join(cmd), log_path)
    start = time.monotonic()
    with log_path.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}   (in {cwd})\n")
        out.flush()
        proc = subprocess.Popen(timed, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:  # a heartbeat, so that a 30-minute Kubernetes build is not 30 minutes of silence
            try:
                proc.wait(timeout=HEARTBEAT_SECONDS)
                break
            except subprocess.TimeoutExpired:
                log.info("  still building %s: %.0f s so far (log: %s)", cmd[-1].rsplit("/", 1)[-1],
                         time.monotonic() - start, log_path)
        out.write(f"# wall time {time.monotonic() - start:.0f} s, exit {proc.returncode}\n")
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise BinaryError(f"build failed ({' '.join(cmd)}), see {log_path}:\n" + "\n".join(tail))


def staging_replaces(kubernetes_go_mod: str, version: str) -> list[str]:
    """The wrapper's replace lines: every `k8s.io/x => ./staging/...` of upstream's go.mod, at v0.<minor>.<patch>."""
    staging_version = "v0." + version.removeprefix("v").split(".", 1)[1]
    modules = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", kubernetes_go_mod, flags=re.M)
    return [f"\t{m} => {m} {staging_version}" for m in sorted(set(modules))]


def _prepare_kubernetes_module(src: Path, version: str) -> None:
    go = _go()
    src.mkdir(parents=True, exist_ok=True)
    if (src / "go.mod").exists() and (src / "go.sum").exists():
        return
    info = subprocess.run(
        [go, "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
        capture_output=True, text=True, check=False, cwd=src,
    )
    if info.returncode != 0:
        raise BinaryError(f"go mod download k8s.io/kubernetes@{version} failed: {info.stdout}{info.stderr}")
    upstream = Path(json.loads(info.stdout)["GoMod"]).read_text()
    replaces = staging_replaces(upstream, version)
    if not replaces:
        raise BinaryError(f"k8s.io/kubernetes@{version}'s go.mod has no ./staging replace lines")
    (src / "go.mod").write_text(
        "module resilax.dev/k8sbuild\n\ngo 1.26.0\n\n"
        f"require k8s.io/kubernetes {version}\n\nreplace (\n" + "\n".join(replaces) + "\n)\n"
    )
    imports = "\n".join(f'\t_ "k8s.io/kubernetes/cmd/{c}"' for c in KUBERNETES_COMMANDS)
    (src / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")
    _run_build([go, "mod", "tidy"], src, "k8s-build.log")


def _reports_version(binary: Path, version: str) -> bool:
    """Whether `binary --version` names `version` (a build without the version ldflags says v0.0.0-master,
    which tools such as helm reject; relinking it with them costs only the link step)."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return version in out


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """One build of `name` at a time across processes (a test run and the demo started together would
    otherwise build into the same staging folder); callers look for the binary again once they hold it."""
    path = cache_dir() / "bin" / f".{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def kubernetes_dir(version: str = KUBERNETES_VERSION) -> Path:
    return cache_dir() / "bin" / f"k8s-{version}"


def ensure_kubernetes(version: str = KUBERNETES_VERSION, build: bool = True) -> dict[str, Path]:
    """kube-apiserver, kube-controller-manager and kube-scheduler: from KUBEBUILDER_ASSETS, the cache, or built."""
    out_dir = kubernetes_dir(version)
    missing = _missing_kubernetes(out_dir, version, build)
    if not missing:
        return {name: _assets_binary(name) or out_dir / name for name in KUBERNETES_COMMANDS}
    if not build:
        raise BinaryError(f"missing {', '.join(missing)} in {out_dir} (run `resilax local binaries` to build them)")
    with _build_lock(f"k8s-{version}"):
        missing = _missing_kubernetes(out_dir, version, build)
        if missing:
            _build_kubernetes(out_dir, version, missing)
    return {name: _assets_binary(name) or out_dir / name for name in KUBERNETES_COMMANDS}


def _missing_kubernetes(out_dir: Path, version: str, build: bool) -> list[str]:
    missing = []
    for name in KUBERNETES_COMMANDS:
        assets = _assets_binary(name)
        path = assets or out_dir / name
        if not (path.is_file() and (assets or not build or _reports_version(path, version))):
            missing.append(name)
    return missing


def _build_kubernetes(out_dir: Path, version: str, missing: list[str]) -> None:
    src = cache_dir() / "src" / f"k8s-{version}"
    _prepare_kubernetes_module(src, version)
    minor = version.removeprefix("v").split(".")[1]
    ldflags = (
        "-s -w"
        f" -X k8s.io/component-base/version.gitVersion={version}"
        f" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor={minor}"
        " -X k8s.io/component-base/version.gitTreeState=clean"
    )
    staging = out_dir / ".partial"
    staging.mkdir(parents=True, exist_ok=True)
    cmd = [_go(), "build", "-trimpath", f"-ldflags={ldflags}", "-o", f"{staging}/"]
    _run_build([*cmd, *(f"k8s.io/kubernetes/cmd/{c}" for c in missing)], src, "k8s-build.log")
    for name in missing:  # rename into place: safe even while an older binary is running
        (staging / name).rename(out_dir / name)


def ensure_etcd(version: str = ETCD_VERSION, build: bool = True) -> Path:
    """etcd from KUBEBUILDER_ASSETS, the cache, or built from a wrapper around go.etcd.io/etcd/server/v3."""
    found = _assets_binary("etcd")
    if found:
        return found
    out = cache_dir() / "bin" / f"etcd-{version}" / "etcd"
    if out.is_file():
        return out
    if not build:
        raise BinaryError(f"missing {out} (run `resilax local binaries` to build it)")
    with _build_lock(f"etcd-{version}"):
        if not out.is_file():
            _build_etcd(version, out)
    return out


def _build_etcd(version: str, out: Path) -> None:
    go = _go()
    src = cache_dir() / "src" / f"etcd-{version}"
    src.mkdir(parents=True, exist_ok=True)
    if not (src / "go.sum").exists():
        (src / "go.mod").write_text(
            f"module resilax.dev/etcdbuild\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 {version}\n"
        )
        (src / "tools.go").write_text('//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n')
        _run_build([go, "mod", "tidy"], src, "etcd-build.log")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    _run_build([go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(partial), "go.etcd.io/etcd/server/v3"],
               src, "etcd-build.log")
    partial.rename(out)


def _go_install(package: str, version: str, name: str, build: bool) -> Path:
    out_dir = cache_dir() / "bin" / f"{name}-{version}"
    out = out_dir / name
    if out.is_file():
        return out
    on_path = _assets_binary(name)
    if on_path:
        return on_path
    if not build:
        raise BinaryError(f"missing {out} (run `resilax local binaries` to build it)")
    with _build_lock(f"{name}-{version}"):
        if not out.is_file():
            out_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "GOBIN": str(out_dir)}
            _run_build([_go(), "install", "-trimpath", "-ldflags=-s -w", f"{package}@{version}"], out_dir,
                       f"{name}-build.log", env=env)
    return out


def ensure_fake_gcs_server(version: str = FAKE_GCS_SERVER_VERSION, build: bool = True) -> Path:
    """fake-gcs-server, `go install`ed into ~/.cache/resilax/bin/fake-gcs-server-<version>/."""
    return _go_install("github.com/fsouza/fake-gcs-server", version, "fake-gcs-server", build)


def ensure_kwok(version: str = KWOK_VERSION, build: bool = True) -> Path:
    """kwok (optional: the node agent's no-process mode covers scale tests without it)."""
    return _go_install("sigs.k8s.io/kwok/cmd/kwok", version, "kwok", build)


def ensure_helm(version: str = HELM_VERSION, build: bool = True) -> Path:
    """helm (`go install helm.sh/helm/v4/cmd/helm@<version>`), for the chart tests."""
    return _go_install("helm.sh/helm/v4/cmd/helm", version, "helm", build)


@dataclass(frozen=True)
class KueueBinary:
    """Kueue's manager and the manifests of its module (`<manifests>/config/components/...`)."""

    manager: Path
    manifests: Path
    version: str


def kueue_dir(version: str = KUEUE_VERSION) -> Path:
    return cache_dir() / "bin" / f"kueue-{version}"


def ensure_kueue(version: str = KUEUE_VERSION, build: bool = True) -> KueueBinary:
    """Kueue's manager (`go install sigs.k8s.io/kueue/cmd/kueue@<version>`, the version stamped in) and
    its CRD and webhook manifests, in ~/.cache/resilax/bin/kueue-<version>/ (a cold build: minutes)."""
    out_dir = kueue_dir(version)
    found = KueueBinary(out_dir / "kueue", out_dir / "manifests", version)
    if _kueue_complete(found):
        return found
    if not build:
        raise BinaryError(f"missing Kueue {version} in {out_dir} (run `resilax local binaries` to build it)")
    with _build_lock(f"kueue-{version}"):
        if not found.manager.is_file():
            out_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "GOBIN": str(out_dir)}
            ldflags = f"-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion={version}"
            _run_build([_go(), "install", "-trimpath", f"-ldflags={ldflags}", f"sigs.k8s.io/kueue/cmd/kueue@{version}"],
                       out_dir, "kueue-build.log", env=env)
        if not _kueue_complete(found):
            _copy_kueue_manifests(version, found.manifests)
    return found


def _kueue_complete(found: KueueBinary) -> bool:
    return found.manager.is_file() and all((found.manifests / m).exists() for m in KUEUE_MANIFESTS)


def _copy_kueue_manifests(version: str, target: Path) -> None:
    info = subprocess.run([_go(), "mod", "download", "-json", f"sigs.k8s.io/kueue@{version}"],
                          capture_output=True, text=True, check=False, cwd=cache_dir())
    if info.returncode != 0:
        raise BinaryError(f"go mod download sigs.k8s.io/kueue@{version} failed: {info.stdout}{info.stderr}")
    module = Path(json.loads(info.stdout)["Dir"])
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for item in KUEUE_MANIFESTS:  # file by file: the module cache's read-only modes stay behind
        source = module / item
        for path in sorted(source.rglob("*.yaml")) if source.is_dir() else [source]:
            dest = partial / path.relative_to(module)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(path.read_bytes())
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def go_install(package: str, version: str, name: str, build: bool = True) -> Path:
    """Any `go install`able tool, cached in ~/.cache/resilax/bin/<name>-<version>/ (KUBEBUILDER_ASSETS first)."""
    return _go_install(package, version, name, build)


def ensure_binaries(build: bool = True) -> Binaries:
    """The control plane's binaries, built if missing (and `build`)."""
    kube = ensure_kubernetes(build=build)
    return Binaries(
        kube_apiserver=kube["kube-apiserver"],
        kube_controller_manager=kube["kube-controller-manager"],
        kube_scheduler=kube["kube-scheduler"],
        etcd=ensure_etcd(build=build),
    )
