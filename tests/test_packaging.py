"""What a user gets from a built wheel, outside a clone: the presets, the C kernels' source and the Flower app are
package data, so the default job, `pfedkit reproduce` and the README's Python snippet work from any folder."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, a folder it is installed into), built from this checkout without network or build isolation."""
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(dist), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    wheel = next(dist.glob("pfedkit-*.whl"))
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return wheel, target


def test_the_wheel_carries_the_presets_the_kernels_and_the_flower_app(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "pfedkit" / "configs").rglob("*.yaml"))
    assert len(presets) > 50 and set(presets) <= names
    assert {"pfedkit/models/kernels.c", "pfedkit/flower/app/pyproject.toml"} <= names


SNIPPET = """
import pfedkit
from pfedkit import PRESETS
from pfedkit.config import load_config
from pfedkit.experiment import run_experiment
assert pfedkit.__file__.startswith({site!r}), pfedkit.__file__  # the installed copy, not the clone
cfg = load_config(PRESETS / "default.yaml", ["rounds=1", "progress=false", "plots=false", "dataset.name=digits",
                                             "model.name=mlr"], algorithms="local,fedavg")
summaries = run_experiment(cfg, "runs/demo", log=lambda s: None)
print(len(summaries))
"""


def test_the_readme_snippet_and_reproduce_work_from_an_installed_wheel_outside_a_clone(installed, tmp_path):
    _, site = installed
    env = {**os.environ, "PYTHONPATH": str(site)}
    snippet = subprocess.run([sys.executable, "-c", SNIPPET.format(site=str(site))], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
    assert snippet.returncode == 0, snippet.stderr
    assert snippet.stdout.split()[-1] == "2" and (tmp_path / "runs" / "demo" / "fedavg" / "summary.json").is_file()
    table = subprocess.run([sys.executable, "-m", "pfedkit", "reproduce", "table1", "--dataset", "fmnist", "--out",
                            "t1", "--table-only"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert table.returncode == 0, table.stderr
    assert "pending" in (tmp_path / "t1" / "table1.md").read_text()
