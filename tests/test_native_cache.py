"""The C kernels' cache never loads a library planted in it (loading runs its code): only a library this user built
for this source is loaded. A cache folder of another user's, or one others may write to, is refused with one line
and the kernels go unused (PyTorch's ops give the same values); a library that is truncated, foreign, a symbolic
link, another user's or writable by others is never loaded but rebuilt in its place, with one line. Real files,
real libraries compiled here (a planted one writes a marker file from its constructor), real processes.

These tests see the cache only from outside: which library files lie under $PFEDKIT_CACHE (`*.so`), and that
whatever records their hash is forged along with a planted library (as someone who can write there could)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

OTHER_UID = 12345  # a user that is not us
CC = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler: the kernels are never built here")

PROBE = """
import json, torch, torch.nn.functional as F
from pfedkit.models import native
loaded = native.library() is not None
x = torch.randn(2, 8, 6, 10)
assert torch.equal(native.relu_pool(x), F.max_pool2d(torch.relu(x), 2))
print(json.dumps({"loaded": loaded, "why_not": native.why_not}))
"""


def probe(cache: Path | None, umask: int | None = None, **env: str) -> subprocess.Popen:
    """A fresh process that takes pfedkit's kernels from `cache` (or the default ~/.cache/pfedkit with HOME in
    env), computes relu_pool through them (or PyTorch where they are unused) and says whether they loaded."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PFEDKIT_CACHE", "PFEDKIT_NATIVE")}
    if cache is not None:
        environ["PFEDKIT_CACHE"] = str(cache)
    return subprocess.Popen([sys.executable, "-c", PROBE], env={**environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=None if umask is None else
                            (lambda: os.umask(umask)))


def outcome(process: subprocess.Popen) -> tuple[dict, list[str]]:
    """The probe's answer and its stderr lines; it must exit 0 (no crash, no SIGBUS, no traceback)."""
    try:
        out, err = process.communicate(timeout=300)
    finally:  # never left behind, whatever happened
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, (process.returncode, err)
    assert "Traceback" not in err, err
    return json.loads(out), err.strip().splitlines()


def run(cache: Path | None, **kwargs) -> tuple[dict, list[str]]:
    return outcome(probe(cache, **kwargs))


def libraries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*.so") if p.is_file() or p.is_symlink())


def snapshot(cache: Path) -> dict[str, tuple[int, int]]:
    """Every file under the cache, with its size and modification time: what a run that rebuilds nothing keeps."""
    return {str(p.relative_to(cache)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(cache.rglob("*"))}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache in which a run built the kernels (once for this file; each test copies it)."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    said, lines = run(cache)
    assert said == {"loaded": True, "why_not": ""} and lines == []
    assert len(libraries(cache)) == 1
    return cache


@pytest.fixture
def cache(built, tmp_path) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(built, copy, symlinks=True)  # modes kept; the files ours, as the builder left them
    return copy


def planted_library(folder: Path, marker: Path, constructor: bool = True) -> bytes:
    """A real shared library without pfedkit's kernels, whose constructor (run by dlopen) writes `marker`."""
    source = folder / "planted.c"
    ctor = (f'__attribute__((constructor)) static void planted(void) {{ FILE *f = fopen("{marker}", "w"); '
            f'if (f) {{ fputs("planted code ran", f); fclose(f); }} }}\n') if constructor else ""
    source.write_text(f"#include <stdio.h>\n{ctor}int answer(void) {{ return 42; }}\n")
    done = subprocess.run([CC, "-shared", "-fPIC", "-o", str(folder / "planted.so"), str(source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return (folder / "planted.so").read_bytes()


def test_a_planted_library_runs_its_code_when_loaded(tmp_path):
    """The control for every `not marker.exists()` below: loading the planted library does write the marker."""
    marker = tmp_path / "marker"
    planted_library(tmp_path, marker)
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(tmp_path / 'planted.so')!r})"],
                   check=True, timeout=60)
    assert marker.read_text() == "planted code ran"


def forge_records(cache: Path, original: bytes, planted: bytes) -> None:
    """Whatever under the cache records the original library's SHA-256 now records the planted one's."""
    old, new = (hashlib.sha256(b).hexdigest().encode() for b in (original, planted))
    for path in cache.rglob("*"):
        if path.is_file() and not path.is_symlink() and old in path.read_bytes():
            path.write_bytes(path.read_bytes().replace(old, new))


def plant(cache: Path, tmp_path: Path, marker: Path, constructor: bool = True) -> Path:
    """The cached library replaced by a planted one (its recorded hash forged): the library's path."""
    (library,) = libraries(cache)
    planted = planted_library(tmp_path, marker, constructor)
    forge_records(cache, library.read_bytes(), planted)
    library.write_bytes(planted)
    return library


def chown_tree(folder: Path, uid: int) -> None:
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, uid, -1, follow_symlinks=False)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")


# ---- a folder others control is refused, the kernels unused ------------------------------------------------------

@needs_root
@pytest.mark.parametrize("owned", ["whole cache", "cache folder", "native folder"])
def test_a_cache_folder_of_another_user_is_refused(cache, tmp_path, owned):
    """PFEDKIT_CACHE made by another user, holding their library under the name the kernels would have and a
    matching hash: it never runs (we are root: it would run as root); one line names the folder."""
    marker = tmp_path / "marker"
    library = plant(cache, tmp_path, marker)
    native_folder = library.parent
    if owned == "whole cache":
        chown_tree(cache, OTHER_UID)
    else:
        os.chown(cache if owned == "cache folder" else native_folder, OTHER_UID, -1)
    named = native_folder if owned == "native folder" else cache
    before = snapshot(cache)
    said, lines = run(cache)
    assert not marker.exists()
    assert said["loaded"] is False and "another user" in said["why_not"] and str(named) in said["why_not"]
    assert len(lines) == 1 and str(named) in lines[0] and "another user" in lines[0], lines
    assert snapshot(cache) == before  # another user's folder is left as it was


@needs_root
def test_nothing_is_made_in_a_cache_folder_of_another_user(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chown(cache, OTHER_UID, -1)
    said, lines = run(cache)
    assert said["loaded"] is False and len(lines) == 1 and "another user" in lines[0], lines
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("loose", ["cache folder", "native folder"])
def test_a_cache_folder_others_may_write_to_is_refused(cache, tmp_path, loose):
    """The default folder made mode 777 under umask 000 by an earlier pfedkit: anyone could have put a library
    there (with its hash); it never runs, one line names the folder and says why."""
    marker = tmp_path / "marker"
    library = plant(cache, tmp_path, marker)
    folder = cache if loose == "cache folder" else library.parent
    folder.chmod(0o777)
    said, lines = run(cache)
    assert not marker.exists()
    assert said["loaded"] is False and "writable by group or others" in said["why_not"]
    assert len(lines) == 1 and str(folder) in lines[0] and "writable" in lines[0], lines


def test_a_fresh_default_cache_is_private_whatever_the_umask(tmp_path):
    """Under umask 000 the default ~/.cache/pfedkit/native and every folder above it that pfedkit makes are
    0o700, the library and its record writable by no one else; the kernels load, silently."""
    home = tmp_path / "home"
    home.mkdir()
    said, lines = run(None, umask=0o000, HOME=str(home))
    assert said == {"loaded": True, "why_not": ""} and lines == []
    made = [home / ".cache", home / ".cache" / "pfedkit", home / ".cache" / "pfedkit" / "native"]
    assert [oct(p.stat().st_mode & 0o777) for p in made] == ["0o700"] * 3
    files = list(made[-1].iterdir())
    assert files and all(p.stat().st_mode & 0o022 == 0 and p.stat().st_uid == os.geteuid() for p in files)


# ---- a library this user did not build for this source is rebuilt in its place --------------------------------

def assert_rebuilt(library: Path, lines: list[str], said: dict, why: str) -> None:
    """The kernels loaded from a fresh build at the library's path, after one line naming it and saying why."""
    assert said == {"loaded": True, "why_not": ""}
    assert len(lines) == 1 and str(library) in lines[0] and why in lines[0], lines
    assert library.is_file() and not library.is_symlink()


def test_a_cache_an_earlier_pfedkit_left_is_rebuilt_without_a_word(cache):
    """Only the library, as pfedkit wrote its cache before it recorded hashes: never loaded unchecked, rebuilt,
    and no line (every existing cache looks so once; CLI runs that answer with one line must stay one line)."""
    for path in cache.rglob("*"):
        if path.is_file() and path.suffix != ".so":
            path.unlink()
    (library,) = libraries(cache)
    library.write_bytes(library.read_bytes()[:1000])  # not loadable: it must not be loaded unchecked
    assert run(cache) == ({"loaded": True, "why_not": ""}, [])


def test_a_truncated_library_is_rebuilt(cache):
    """A library cut short (a full disk, a killed copy) once made every run die of SIGBUS: now it is rebuilt, and
    the next run loads the rebuilt one without a word and without building again."""
    (library,) = libraries(cache)
    size = library.stat().st_size
    os.truncate(library, size // 2)
    said, lines = run(cache)
    assert library.stat().st_size == size
    assert_rebuilt(library, lines, said, "differ from the hash")
    before = snapshot(cache)  # the rebuilt library is trusted as it is: the next run loads it, silently
    assert run(cache) == ({"loaded": True, "why_not": ""}, [])
    assert snapshot(cache) == before


@pytest.mark.parametrize("record", ["forged", "stale"])
def test_a_foreign_library_under_the_expected_name_is_rebuilt(cache, tmp_path, record):
    """A library without pfedkit's kernels under the kernels' name: with the hash record left as it was it is
    never loaded (its constructor never runs); with a matching record (this user's own file: loaded) its missing
    kernels are no AttributeError. Either way one line, and the kernels rebuilt."""
    marker = tmp_path / "marker"
    (library,) = libraries(cache)
    planted = planted_library(tmp_path, marker, constructor=record == "stale")
    if record == "forged":
        forge_records(cache, library.read_bytes(), planted)
    library.write_bytes(planted)
    said, lines = run(cache)
    assert not marker.exists()
    assert_rebuilt(library, lines, said, "without pfedkit's kernels" if record == "forged" else "hash")


def test_a_symlink_at_the_library_path_is_never_followed(cache, tmp_path):
    """The library's name a link to a planted library (with its hash recorded): the link is not followed, its
    target never loaded nor touched; a real library takes the link's place."""
    marker = tmp_path / "marker"
    (library,) = libraries(cache)
    planted = planted_library(tmp_path, marker)
    forge_records(cache, library.read_bytes(), planted)
    library.unlink()
    library.symlink_to(tmp_path / "planted.so")
    said, lines = run(cache)
    assert not marker.exists() and (tmp_path / "planted.so").read_bytes() == planted
    assert_rebuilt(library, lines, said, "symbolic link")


@pytest.mark.parametrize("how", ["another user's", "writable by others"])
def test_a_library_that_others_could_have_written_is_rebuilt(cache, tmp_path, how):
    """A planted library with its hash recorded, but owned by another user or writable by group and others: never
    loaded, rebuilt."""
    if how == "another user's" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    marker = tmp_path / "marker"
    library = plant(cache, tmp_path, marker)
    if how == "another user's":
        os.chown(library, OTHER_UID, -1)
    else:
        library.chmod(0o666)
    said, lines = run(cache)
    assert not marker.exists()
    assert_rebuilt(library, lines, said, "another user" if how == "another user's" else "writable")
    assert library.stat().st_uid == os.geteuid() and library.stat().st_mode & 0o022 == 0


def test_processes_building_at_once_all_load_whole_libraries(tmp_path):
    """Two processes that find an empty cache build at once: each loads whole kernels, none says a word, and the
    cache they leave is loaded by the next run as it is."""
    cache = tmp_path / "cache"
    processes = [probe(cache) for _ in range(2)]
    try:
        results = [outcome(process) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert results == [({"loaded": True, "why_not": ""}, [])] * 2
    assert len(libraries(cache)) == 1
    before = snapshot(cache)
    assert run(cache) == ({"loaded": True, "why_not": ""}, [])
    assert snapshot(cache) == before
    assert not [p for p in cache.rglob("*") if p.name.startswith("tmp")]  # no temporary file left behind
