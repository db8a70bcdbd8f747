"""Where the C kernels come from: the package's build (setup.py), one library per CPU capability beside
runtime/native.py, the one PyTorch's capability check picks loaded from there and from nowhere else. Nothing is
compiled or written at run time, so no cache folder can hand pfedkit a library: one planted where earlier pfedkits
kept their cache (under every name it could take) is never loaded (its constructor would write a marker file). An
install without a build, or with a damaged one, runs on PyTorch's ops and says why in one line. Real files, real
libraries compiled here, real processes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pfedkit
from pfedkit.runtime import native

CC = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler: nothing to plant")

PROBE = """
import json, torch, torch.nn.functional as F
from pfedkit.runtime import native
loaded = native.library() is not None
x = torch.randn(2, 8, 6, 10)
assert torch.equal(native.relu_pool(x), F.max_pool2d(torch.relu(x), 2))
print(json.dumps({"loaded": loaded, "why_not": native.why_not, "variant": native.variant,
                  "path": str(native.built(native.variant)) if loaded else ""}))
"""


def run(env: dict[str, str] | None = None, path: Path | None = None) -> dict:
    """A fresh process's answer (pfedkit from `path` when given); it must exit 0 without a traceback."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PFEDKIT_CACHE", "PFEDKIT_NATIVE")}
    if path is not None:
        environ["PYTHONPATH"] = str(path)
    done = subprocess.run([sys.executable, "-c", PROBE], env={**environ, **(env or {})}, capture_output=True,
                          text=True, timeout=300, cwd=path or None)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return json.loads(done.stdout)


def planted_library(folder: Path, marker: Path) -> Path:
    """A real shared library whose constructor (run by dlopen) writes `marker`."""
    source = folder / "planted.c"
    source.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {{ '
                      f'FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("planted code ran", f); fclose(f); }} }}\n'
                      f'int answer(void) {{ return 42; }}\n')
    done = subprocess.run([CC, "-shared", "-fPIC", "-o", str(folder / "planted.so"), str(source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return folder / "planted.so"


def test_a_planted_library_runs_its_code_when_loaded(tmp_path):
    """The control for every `not marker.exists()` below: loading the planted library does write the marker."""
    marker = tmp_path / "marker"
    library = planted_library(tmp_path, marker)
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(library)!r})"], check=True, timeout=60)
    assert marker.read_text() == "planted code ran"


def test_the_library_loaded_is_the_packages_own_build_and_nothing_is_made_at_run_time(tmp_path):
    """A library planted in the cache folder of earlier pfedkits ($PFEDKIT_CACHE/native and ~/.cache/pfedkit),
    under their names and the build's: never loaded; the kernels come from the package folder; the run compiles
    nothing (a compiler that leaves a marker when called is never called) and writes nothing under HOME."""
    marker, called = tmp_path / "marker", tmp_path / "compiler-called"
    planted = planted_library(tmp_path, marker)
    home, cache = tmp_path / "home", tmp_path / "cache"
    for folder in (cache / "native", home / ".cache" / "pfedkit" / "native"):
        folder.mkdir(parents=True)
        for name in ["kernels-0123456789abcdef0123.so", *(native.built(v).name for v in native.CAPABILITIES)]:
            shutil.copy(planted, folder / name)
    compiler = tmp_path / "cc"
    compiler.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    compiler.chmod(0o755)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    said = run({"PFEDKIT_CACHE": str(cache), "HOME": str(home), "CC": str(compiler)})
    assert said["loaded"] and not marker.exists() and not called.exists()
    assert Path(said["path"]).parent == Path(native.__file__).parent and said["variant"] in native.CAPABILITIES
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def package_copy(tmp_path: Path, keep_builds: bool) -> Path:
    """This checkout's pfedkit package copied into a folder of its own, with or without the kernels' builds."""
    site = tmp_path / "site"
    ignore = None if keep_builds else shutil.ignore_patterns("_kernels_*")
    shutil.copytree(Path(pfedkit.__file__).parent, site / "pfedkit", ignore=ignore)
    return site


def test_an_install_without_a_build_runs_on_pytorch_and_says_why(tmp_path):
    site = package_copy(tmp_path, keep_builds=False)
    said = run(path=site)
    assert not said["loaded"] and "has no build of kernels.c" in said["why_not"] and "\n" not in said["why_not"]


def test_a_damaged_build_is_not_used_and_named(tmp_path):
    """The build PyTorch's capability picks, truncated: refused by the loader, named in the line, PyTorch's ops."""
    site = package_copy(tmp_path, keep_builds=True)
    best = run()["variant"]
    damaged = site / "pfedkit" / "runtime" / native.built(best).name
    damaged.write_bytes(damaged.read_bytes()[:4096])
    said = run(path=site)
    assert not said["loaded"] and said["why_not"].startswith(f"{damaged.name} does not load as this source's kernels")


def test_each_capability_build_is_taken_where_pytorch_says_so():
    """ATEN_CPU_CAPABILITY lowers PyTorch's own CPU capability, and the kernels follow it (down to the portable
    DEFAULT build, which every x86-64 CPU runs); each gives the same pooling, bit for bit (the probe checks)."""
    for capability in native.CAPABILITIES:
        if not native.built(capability).is_file():
            continue
        said = run({"ATEN_CPU_CAPABILITY": capability})
        assert said["loaded"], said
        assert native.CAPABILITIES.index(said["variant"]) >= native.CAPABILITIES.index(capability)
