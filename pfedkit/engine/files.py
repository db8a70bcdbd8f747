"""The run folder's files: atomic writes, the observables log, and what a checkpoint is checked against."""
from __future__ import annotations

import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch

from ..errors import PfedkitError
from ..stopping import held


def atomic_write(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write then rename, so a crash or a full disk never leaves a half-written file under `path`: the previous
    version stays until the new one is complete. `data` is the bytes, or a function that writes them to the open
    file (a checkpoint streams its tensors: serialized in memory first, pFedLA's at N = 1,000 would double the
    process's memory)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with held():  # a Ctrl-C meanwhile stops the run right after the file is in place
            with open(tmp, "wb") as fh:
                if callable(data):
                    data(fh)
                else:
                    fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
    except OSError as exc:
        kept = f"; the previous {path.name} is intact" if path.exists() else ""
        raise PfedkitError(f"could not write {path}: {exc.strerror or exc} (disk full or not writable?){kept}") from None
    finally:
        tmp.unlink(missing_ok=True)  # whatever stopped the write (after the rename there is nothing to remove)


def append_line(path: Path, line: str) -> None:
    """Append one whole line to a log (metrics.jsonl): a write that fails part way (a full disk) is cut back, so the
    file never ends in half a row, and the error names the file."""
    data = memoryview((line + "\n").encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:  # unbuffered: a short write is seen here, not at close
                data = data[os.write(fd, data):]
        except OSError as exc:
            os.ftruncate(fd, size)
            raise PfedkitError(f"could not write {path}: {exc.strerror or exc} (disk full or not writable?); the "
                               "rows before this one are intact") from None
    finally:
        os.close(fd)


# may change on resume: the `runtime` section whole (how clients run, never what they compute), and how a run is
# shown, saved, where it runs and how long it goes on
RESUMABLE_KEYS = {"runtime", "rounds", "progress", "plots", "device", "checkpoint_every"}


def resumable(key: str, keys: set[str] = RESUMABLE_KEYS) -> bool:
    """Whether flattened config key `key` ('runtime.workers') is one of `keys` or in a section of them."""
    return key in keys or key.split(".")[0] in keys


def flatten_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def structure_mismatch(want: Any, got: Any, where: str) -> str | None:
    """Where `got` differs from `want` in its containers' keys and lengths or its tensors' shapes and dtypes."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return f"{where} holds {shape}, this config makes {tuple(want.shape)}"
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where} holds keys {sorted(got) if isinstance(got, dict) else type(got).__name__}, " \
                   f"this config makes {sorted(want)}"
        return next(filter(None, (structure_mismatch(want[k], got[k], f"{where}.{k}") for k in want)), None)
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{where} holds {len(got) if isinstance(got, list) else type(got).__name__} entries, " \
                   f"this config makes {len(want)}"
        return next(filter(None, (structure_mismatch(w, g, f"{where}[{i}]") for i, (w, g) in enumerate(zip(want, got)))),
                    None)
    return None


ROUND_FILE = re.compile(r"r\d{5,}\.npy")  # one evaluation's array in a packed log


class ObservableLog:
    """Arrays an algorithm exposes at each evaluation (pFedLA's aggregation weights). During the run each is one
    atomically written `observables/<name>/r<round>.npy`; at the end they are packed into `<name>.npz`, keyed
    `r<round>` (e.g. `np.load("alpha.npz")["r00040"]`). A resumed run drops the files written after its checkpoint.
    """

    def __init__(self, out: Path):
        self.out = out
        self.dir = out / "observables"

    def write(self, rnd: int, arrays: dict[str, Any]) -> None:
        for name, array in arrays.items():
            folder = self.dir / name
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(folder / f"r{rnd:05d}.npy", lambda fh: np.save(fh, np.asarray(array), allow_pickle=False))

    def reopen(self, last_round: int) -> None:
        """A resumed run's arrays as they were at its checkpoint: those a finished run packed back in the folder (it
        goes on to more rounds, and `pack` writes them again with the new ones), those written after it dropped."""
        for packed in self.out.glob("*.npz"):
            try:
                with zipfile.ZipFile(packed) as zf:
                    for name in zf.namelist():
                        kept = self.dir / packed.stem / name
                        if ROUND_FILE.fullmatch(name) and int(name[1:-4]) <= last_round and not kept.exists():
                            kept.parent.mkdir(parents=True, exist_ok=True)
                            atomic_write(kept, zf.read(name))
            except (zipfile.BadZipFile, OSError) as exc:
                raise PfedkitError(f"cannot resume from {packed}: it is damaged ({exc}); the run would lose its "
                                   "arrays of the rounds before its checkpoint") from None
        for f in self.dir.glob("*/r*.npy"):
            if int(f.stem[1:]) > last_round:
                f.unlink()

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        for stale in self.out.glob("*.npz"):  # packed logs of an earlier run in this folder
            stale.unlink()

    def pack(self) -> None:
        if not self.dir.is_dir():
            return
        for folder in sorted(p for p in self.dir.iterdir() if p.is_dir()):
            target = self.out / f"{folder.name}.npz"
            tmp = target.with_name(target.name + ".tmp")
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for f in sorted(folder.glob("r*.npy")):
                    zf.write(f, arcname=f.name)
            os.replace(tmp, target)
        shutil.rmtree(self.dir)
