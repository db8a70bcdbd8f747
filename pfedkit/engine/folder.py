"""A run folder belongs to pfedkit and to one run at a time.

- A marker file (MARKER) says that pfedkit made the folder and which pfedkit (release and source hash): only a
  marked folder is ever cleared by --overwrite, and then only of the files pfedkit writes (anything else in it
  stops the overwrite before a file is deleted); a resume by another pfedkit is refused unless asked for.
- A lock (an flock on LOCK, held for the run's life and let go by the kernel when the process ends, however it
  ends) keeps a second run or resume out of a folder in use: two runs into one folder interleaved their metrics.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from ..errors import PfedkitError
from ..provenance import describe, provenance
from .files import atomic_write

MARKER = ".pfedkit-run"
LOCK = ".pfedkit.lock"
KEPT = {LOCK, ".flower"}  # neither deleted nor foreign: the lock, a loopback deployment's home (its code owns it)
# what pfedkit writes in an experiment's, a seed's or an algorithm's folder
OWN_FILES = {MARKER, "config.yaml", "comparison.md", "comparison.png", "flower.json", "partition.json",
             "algorithm.json", "metrics.jsonl", "summary.json", "failed.txt", "checkpoint.pt", "accuracy.png",
             "partition.png", "alpha_heatmap.png", "alpha_layers.png", "alpha_evolution.png", "alpha.npz",
             "alpha_retained.npz", "affinity.npz"}
OWN_FOLDERS = {"observables", ".client_states", "tensorboard"}


def is_marked(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def mark(folder: Path) -> None:
    """Record that pfedkit (this one) made `folder`."""
    atomic_write(Path(folder) / MARKER, json.dumps({"pfedkit": provenance()}).encode())


def recorded_provenance(folder: Path) -> dict | None:
    """Which pfedkit made the run in `folder` (None: unmarked, an older pfedkit, or an unreadable marker)."""
    try:
        info = json.loads((Path(folder) / MARKER).read_bytes()[:4096]).get("pfedkit")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


def check_version(folder: Path, allow_change: bool) -> None:
    """A resume continues with the pfedkit that started the run, or says why not; with `allow_change` the folder
    then records the pfedkit that continued it."""
    root = root_of(folder)
    theirs, mine = recorded_provenance(root), provenance()
    if theirs == mine:
        return
    if not allow_change:
        raise PfedkitError(f"cannot resume {folder}: it was written by {describe(theirs)} and this is "
                           f"{describe(mine)}, so its results would mix two versions; resume anyway with "
                           "--allow-version-change, or start the run afresh")
    mark(root)


def root_of(folder: Path) -> Path:
    """The outermost marked folder `folder` is part of (an experiment holding it), else `folder` itself."""
    folder = Path(folder).resolve()
    root = folder
    for parent in folder.parents:
        if not is_marked(parent):
            break
        root = parent
    return root


def holder(folder: Path) -> int | None:
    """The process holding `folder`'s lock (0 if its number is unknown), or None when the folder is free."""
    path = Path(folder) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else 0
    finally:
        os.close(fd)


def in_use(folder: Path) -> str:
    pid = holder(folder)
    who = f"process {pid}" if pid else "another process"
    return f"{folder} is in use by another pfedkit run ({who}); wait for it to end or choose another folder"


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold `folder` (created if needed) exclusively for the block; a folder in use is one PfedkitError."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PfedkitError(f"cannot lock {folder}: {path}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PfedkitError(in_use(folder)) from None
            raise PfedkitError(f"cannot lock {folder}: {path}: {exc.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # lets the lock go


def foreign_entries(folder: Path) -> list[Path]:
    """What in the marked `folder` pfedkit did not write (it stops an overwrite): entries that are not pfedkit's
    files, folders or marked run folders."""
    foreign = []
    for p in sorted(Path(folder).iterdir()):
        if p.name in KEPT or (p.is_file() and not p.is_symlink() and (p.name in OWN_FILES or p.name.endswith(".tmp"))):
            continue
        if p.is_dir() and not p.is_symlink() and p.name in OWN_FOLDERS:
            continue
        if p.is_dir() and not p.is_symlink() and is_marked(p):
            foreign += foreign_entries(p)
            continue
        foreign.append(p)
    return foreign


def clear(folder: Path, kept: set[str] = KEPT) -> None:
    """Delete what pfedkit wrote in the marked `folder` (checked first by `foreign_entries`); its lock stays."""
    for p in sorted(Path(folder).iterdir()):
        if p.name in kept:
            continue
        if p.is_dir() and not p.is_symlink():
            if p.name in OWN_FOLDERS:
                shutil.rmtree(p)
            else:
                clear(p, set())
                p.rmdir()
        else:
            p.unlink()


def refuse_to_replace(out: Path, config: Path | None = None) -> str | None:
    """Why the marked run folder `out` must not be replaced by --overwrite (None: it may): it holds files pfedkit did
    not write, or deleting it would delete the working folder or the config being run."""
    out = Path(out)
    here, resolved = Path.cwd().resolve(), out.resolve()
    if resolved == here or resolved in here.parents:
        return f"--out {out} is the current folder or holds it; --overwrite never deletes it; choose another --out"
    if config is not None and resolved in Path(config).resolve().parents:
        return (f"--out {out} holds the config being run ({config}); --overwrite would delete it: copy the config "
                "elsewhere or choose another --out")
    foreign = foreign_entries(out)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        return (f"--out {out} holds {foreign[0]}{more}, which pfedkit did not write; --overwrite deletes only "
                "pfedkit's own files: move it away or choose another --out")
    return None
