"""The local cluster's image registry (pure): which images a node can "pull", and as which user they run.

There is no container runtime: every container runs its `command` with this machine's Python. Images
still decide what a kubelet decides from them, by these rules (docs/local-cluster.md, "Images"):

1. The reference must parse as the container runtimes parse it (`[host[:port]/]path[:tag][@digest]`,
   lower-case path); otherwise the container waits with `InvalidImageName`.
2. An image whose registry host ends in `.invalid` (RFC 2606: a name that never resolves) cannot be
   pulled: the registry is unreachable (`ErrImagePull`, then `ImagePullBackOff`).
3. The registry table (`Registry`; the node agent's `POST /images`, `LocalCluster.set_images`) can say
   of an image, or of every tag of a repository, that it does not exist (`pullable: false`, with an
   optional error text), or which user it runs as (`user`, as an image's `USER`: `0` is root).
4. Every other image is served, is present on every node (as if preloaded), and runs as user 65532
   (non-root).

`ImagePullPolicy: Never` starts a served image (it is present) and refuses any other with
`ErrImageNeverPull`, as a kubelet does for an image missing on the node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from ..errors import LocalClusterError

#: The user of an image the table says nothing about (non-root, as distroless `nonroot` images).
DEFAULT_USER: Final = "65532"
DEFAULT_DOMAIN: Final = "docker.io"
#: Registry hosts under this top-level domain never resolve (RFC 2606).
UNREACHABLE_TLD: Final = ".invalid"

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = re.compile(rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*")
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}")
_NAME_MAX = 255


class InvalidImageError(LocalClusterError, ValueError):
    """An image reference that does not parse (the kubelet's `InvalidImageName`)."""


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference, normalized as containerd does (`python` → `docker.io/library/python`)."""

    domain: str
    path: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        """`domain/path`: the repository."""
        return f"{self.domain}/{self.path}"

    @property
    def full(self) -> str:
        """What the runtime pulls: the repository with its tag (`latest` if none) and digest."""
        out = self.name
        if self.tag is not None or self.digest is None:
            out += f":{self.tag or 'latest'}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out

    @property
    def host(self) -> str:
        """The registry's host name, without a port."""
        return self.domain.rsplit(":", 1)[0] if not self.domain.startswith("[") else self.domain


def parse_reference(image: str) -> ImageRef:
    """`image` as a runtime reads it (docker/distribution's grammar); raises InvalidImageError with the
    kubelet's message (`Failed to apply default image tag ...`) when it does not parse."""
    def invalid(why: str = "invalid reference format") -> InvalidImageError:
        return InvalidImageError(f'Failed to apply default image tag "{image}": couldn\'t parse image name '
                                 f'"{image}": {why}')

    if not image:
        raise invalid()
    rest, digest = image, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise invalid()
    tag = None
    last_slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > last_slash:
        rest, tag = rest[:colon], rest[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise invalid()
    if not rest or len(rest) > _NAME_MAX:
        raise invalid()
    parts = rest.split("/")
    first = parts[0]
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost" or first != first.lower()):
        domain, path_parts = first, parts[1:]
        if not _DOMAIN.fullmatch(domain):
            raise invalid()
    else:
        domain, path_parts = DEFAULT_DOMAIN, parts
        if len(parts) == 1:
            path_parts = ["library", *parts]
    path = "/".join(path_parts)
    if path != path.lower():
        raise invalid("invalid reference format: repository name must be lowercase")
    if not all(_PATH_COMPONENT.fullmatch(p) for p in path_parts):
        raise invalid()
    return ImageRef(domain, path, tag, digest)


@dataclass(frozen=True)
class ImageEntry:
    """One row of the registry table: an image (a repository: every tag; or `repo:tag`) and what the
    registry and the image say."""

    image: str
    pullable: bool = True
    """False: the registry does not have it (`ErrImagePull`)."""
    error: str = ""
    """The pull error's text when not pullable (default: the runtime's "not found")."""
    user: str = DEFAULT_USER
    """The image's `USER`: `0` (or `0:0`) runs as root; a name is a non-numeric user."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageEntry:
        """An entry from the agent's API; raises ValueError naming the field and what is allowed."""
        problems = []
        image = data.get("image")
        if not isinstance(image, str) or not image:
            problems.append(f"image: {image!r} is not an image reference")
        else:
            try:
                parse_reference(image)
            except InvalidImageError as e:
                problems.append(f"image: {e}")
        unknown = sorted(set(data) - {"image", "pullable", "error", "user"})
        if unknown:
            problems.append(f"unknown fields {unknown}; valid: image, pullable, error, user")
        if not isinstance(data.get("pullable", True), bool):
            problems.append(f"pullable: {data['pullable']!r} is not true or false")
        user = data.get("user", DEFAULT_USER)
        if not isinstance(user, (str, int)) or str(user) == "":
            problems.append(f"user: {user!r} is not a user (a number such as 0 or 1000, or a name)")
        if problems:
            raise ValueError("image entry: " + "; ".join(problems))
        return cls(image=str(image), pullable=bool(data.get("pullable", True)), error=str(data.get("error", "")),
                   user=str(user))

    def to_json(self) -> dict[str, Any]:
        return {"image": self.image, "pullable": self.pullable, "error": self.error, "user": self.user}


def _key(ref: ImageRef) -> str:
    return ref.full if ref.tag is not None or ref.digest is not None else ref.name


class Registry:
    """The registry table (rules 3 and 4 of the module docstring); the node agent guards it with its lock."""

    def __init__(self, entries: tuple[ImageEntry, ...] | list[ImageEntry] = ()) -> None:
        self._entries: dict[str, ImageEntry] = {}
        self.set(list(entries))

    def set(self, entries: list[ImageEntry]) -> None:
        """Add entries, replacing any for the same image."""
        for entry in entries:
            self._entries[_key(parse_reference(entry.image))] = entry

    def entries(self) -> list[ImageEntry]:
        return list(self._entries.values())

    def lookup(self, ref: ImageRef) -> ImageEntry:
        """The entry of `repo:tag`, else of the repository, else the default (served, non-root)."""
        if ref.tag is None and ref.digest is None:
            ref = ImageRef(ref.domain, ref.path, "latest")
        return self._entries.get(ref.full) or self._entries.get(ref.name) or ImageEntry(ref.full)


def pull_error(ref: ImageRef, entry: ImageEntry) -> str | None:
    """Why the registry does not serve `ref` (the runtime's message), or None when it does."""
    if ref.host.endswith(UNREACHABLE_TLD):
        manifest = ref.digest or ref.tag or "latest"
        return (f"rpc error: code = Unknown desc = failed to pull and unpack image \"{ref.full}\": failed to "
                f"resolve reference \"{ref.full}\": failed to do request: Head "
                f"\"https://{ref.domain}/v2/{ref.path}/manifests/{manifest}\": dial tcp: lookup {ref.host}: "
                f"no such host")
    if entry.pullable:
        return None
    if entry.error:
        return entry.error
    return (f"rpc error: code = NotFound desc = failed to pull and unpack image \"{ref.full}\": failed to "
            f"resolve reference \"{ref.full}\": {ref.full}: not found")


def image_user(user: str) -> tuple[int | None, str]:
    """An image's `USER` as the runtime reports it: (uid, "") when numeric (`1000`, `1000:1000`),
    (None, name) for a name."""
    name = user.split(":", 1)[0]
    if name.isdigit():
        return int(name), ""
    return None, name


def default_pull_policy(ref: ImageRef) -> str:
    """The API server's default `imagePullPolicy`: Always for `:latest` or no tag, else IfNotPresent."""
    return "Always" if ref.digest is None and ref.tag in (None, "latest") else "IfNotPresent"
