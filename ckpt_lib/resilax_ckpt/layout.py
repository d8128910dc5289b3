"""Names inside a checkpoint root (see docs/architecture.md, "Checkpoint layout").

```
<root>/<step>/_METADATA.json            versioned JSON (metadata.py)
<root>/<step>/<item>/<leaf>/            one zarr3 array per array leaf, chunks = the shard grid (local
                                        shared folders: zarr3 shards, one file per process)
<root>/<step>/<item>.json               a JSON item (written by the primary)
<root>/<step>/<item>/process_<i>.json   a per-process item (written by each process)
<root>/<step>/_COMMIT                   the commit marker, written last (JSON: step, generation, era,
                                        time; on object stores also `attempt`)
<root>/<step>/a-e<era>-g<gen>-<nonce>/  on object stores: one save attempt's files (write-once steps:
                                        every attempt writes into a prefix of its own; `_COMMIT`,
                                        created once, names the attempt that won; readers read only
                                        what it names). The sidecar's uploads from the local tier use
                                        the same form on every persistent tier (gs:// or a folder), with
                                        the nonce derived from the save (`upload_attempt_name`) so that
                                        every host's sidecar uploads one save into one attempt; its
                                        `_WRITER.<i>` and `_UPLOADED.<i>` markers are inside the attempt
<root>/.tmp-<step>-g<generation>/       a local save in progress (renamed to <root>/<step>/)
<root>/.recycle-<step>/                 a step retired by retention, kept to be rewritten in place by
                                        the next save (never a step: ignored by steps() and restore)
<root>/_fences/<generation>.json        fence records, `e<era>-g<generation>.json` and era claims
                                        `era-<era>.json` of re-created jobs (fencing.py)
<root>/_RESILAX.json                    the root marker: written on first use (format version)
<root>/_bad/<step>.json                 a committed step that failed to restore (corrupt, truncated
                                        or missing file, bad metadata): `{"step", "reason", "time"}`;
                                        hidden from steps() and never deleted (commit.mark_bad)
<root>/.bad-<step>-<ns>/                a bad step's folder on local disk, moved aside (kept) when the
                                        step number is saved again (`.superseded-<step>-<ns>/`: the same
                                        for a step of an abandoned timeline, timelines.py)
<root>/_kept/<step>-<ns>.json           a hidden step (bad or superseded) whose number was saved again:
                                        the attempt (object stores) or moved-aside folder that keeps its
                                        files, never deleted (timelines.py)
<root>/_branches/e<E>-g<G>-s<S>.json    a rollback: generation (E, G) restored step S while newer steps
                                        were visible; older epochs' steps above S are superseded
                                        (hidden, kept) from then on (timelines.py)
<root>/<step>/<attempt>/_WRITER.<i>     written by each process before its first file of an attempt on
                                        an object store (and by each sidecar before an upload), so
                                        that an interrupted save is provably Resilax's to clean up
<root>/<step>/<attempt>/_UPLOADED.<i>   a sidecar's record that process i's files of the step are all
                                        in the attempt (the sidecar commits when every process's is)
<local>/_bad/<step>.json                a local-tier step a two-tier restore could not read: hidden
                                        from that host's steps() and from its sidecar's uploads
```
Ownership: Resilax deletes or renames only what it provably wrote — its `.tmp-`, `.trash-` and
`.recycle-` folders, and step folders holding one of its marker files (`owns_step_folder`). Any other
entry of the root (an Orbax step folder `1/`, `2024/notes.txt`, a README) is never touched; a save
whose step folder is taken by such an entry fails with `ForeignDataError` naming it.
The local fast tier (one folder per host) uses the same names, plus a per-process commit marker
`_COMMIT.<process_id>` and metadata `_METADATA.<process_id>.json` when several processes share a
host folder (tests); one process per host writes `_METADATA.json` and `_COMMIT` as above.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

METADATA_FILE = "_METADATA.json"
COMMIT_FILE = "_COMMIT"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
RECYCLE_PREFIX = ".recycle-"
FENCES_DIR = "_fences"
UPLOADED_PREFIX = "_UPLOADED."
ROOT_MARKER = "_RESILAX.json"
BAD_DIR = "_bad"
BAD_PREFIX = ".bad-"
SUPERSEDED_PREFIX = ".superseded-"
KEPT_DIR = "_kept"
BRANCHES_DIR = "_branches"
WRITER_PREFIX = "_WRITER."
#: File names only Resilax writes into a step folder: one of them makes the folder Resilax's.
_OWNED_PREFIXES = (COMMIT_FILE, "_METADATA.", UPLOADED_PREFIX, WRITER_PREFIX)

_STEP_RE = re.compile(r"^[0-9]+$")
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]+")


def step_name(step: int) -> str:
    """The folder name of a step: the plain decimal number."""
    if step < 0:
        raise ValueError(f"step {step} must be >= 0")
    return str(step)


def parse_step(name: str) -> int | None:
    """The step of a folder name, or None when the name is not a step folder."""
    name = name.rstrip("/")
    return int(name) if _STEP_RE.match(name) else None


def tmp_name(step: int, generation: int) -> str:
    """The temporary folder of a local save; deterministic so every process agrees on it."""
    return f"{TMP_PREFIX}{step}-g{generation}"


def parse_tmp_generation(name: str) -> int | None:
    """The generation of a temporary folder name, or None when it is not one."""
    match = re.match(rf"^{re.escape(TMP_PREFIX)}[0-9]+-g([0-9]+)$", name.rstrip("/"))
    return int(match.group(1)) if match else None


def recycle_name(step: int) -> str:
    """The folder a retired step is renamed to, to be reused by a later save (saver.py)."""
    return f"{RECYCLE_PREFIX}{step_name(step)}"


def parse_recycle_step(name: str) -> int | None:
    """The step of a recycle folder name, or None when it is not one."""
    match = re.match(rf"^{re.escape(RECYCLE_PREFIX)}([0-9]+)$", name.rstrip("/"))
    return int(match.group(1)) if match else None


def item_json_name(item: str) -> str:
    return f"{item}.json"


def process_json_name(process_index: int) -> str:
    return f"process_{process_index}.json"


def commit_name(process_index: int | None) -> str:
    return COMMIT_FILE if process_index is None else f"{COMMIT_FILE}.{process_index}"


def metadata_name(process_index: int | None) -> str:
    return METADATA_FILE if process_index is None else f"_METADATA.{process_index}.json"


def validate_item_name(item: str) -> None:
    if not item or item.startswith(("_", ".")) or _UNSAFE_RE.search(item) or is_attempt_name(item):
        raise ValueError(
            f"item name {item!r} is not allowed; use letters, digits, '_', '.', '-', do not start "
            "with '_' or '.', and do not use the form 'a-e<N>-g<N>-<8 hex digits>' (an attempt prefix)"
        )


def leaf_dir_names(keystrs: list[str]) -> list[str]:
    """Unique, filesystem-safe folder names for a tree's leaves, from their key paths."""
    names: list[str] = []
    seen: set[str] = set()
    for index, keystr in enumerate(keystrs):
        base = _UNSAFE_RE.sub(".", keystr).strip(".") or f"leaf{index}"
        base = base.replace("..", ".")[:120]
        name = base
        suffix = 1
        while name in seen or name.startswith("_"):
            name = f"{base}.{suffix}"
            suffix += 1
        seen.add(name)
        names.append(name)
    return names


def writer_name(process_index: int) -> str:
    """The marker a process writes into a step folder before its first file there."""
    return f"{WRITER_PREFIX}{process_index}"


def owns_step_folder(names: Iterable[str]) -> bool:
    """Whether a step folder holding these entries was written by Resilax (pure). A folder without
    any of Resilax's marker files is someone else's, whatever its name."""
    return any(n.rstrip("/") == METADATA_FILE or n.rstrip("/").startswith(_OWNED_PREFIXES) or is_attempt_name(n)
               for n in names)


def uploaded_name(process_index: int) -> str:
    """The marker a sidecar writes into a persistent step when its process's files are all there."""
    return f"{UPLOADED_PREFIX}{process_index}"


def parse_uploaded(name: str) -> int | None:
    """The process index of an `_UPLOADED.<i>` marker name, or None."""
    if not name.startswith(UPLOADED_PREFIX):
        return None
    rest = name[len(UPLOADED_PREFIX):]
    return int(rest) if rest.isdigit() else None


def bad_name(step: int) -> str:
    """The record `<root>/_bad/<step>.json` of a step that failed to restore."""
    return f"{step_name(step)}.json"


_ATTEMPT_RE = re.compile(r"^a-e[0-9]+-g[0-9]+-[0-9a-f]{8}$")


def attempt_name(era: int, generation: int, nonce: str) -> str:
    """The prefix of one save attempt of a step on an object store (`nonce`: 8 hex digits)."""
    return f"a-e{era}-g{generation}-{nonce}"


def is_attempt_name(name: str) -> bool:
    return bool(_ATTEMPT_RE.match(name.rstrip("/")))


def upload_attempt_name(era: int, generation: int, step: int, save: str = "") -> str:
    """The attempt prefix of one save's upload from the local tier (pure): every host's sidecar
    computes the same name from what the save's local commit markers carry, so their uploads meet in
    one attempt without talking to each other, and a restarted sidecar resumes its own attempt.
    `save` is the save's identity agreed by the processes (the library's local marker field "save");
    without it the name is fixed per (era, generation, step), which fencing makes equivalent across
    generations (an older epoch's attempt is never named by a newer epoch's marker)."""
    nonce = hashlib.sha256(f"{era}/{generation}/{step}/{save}".encode()).hexdigest()[:8]
    return attempt_name(era, generation, nonce)
