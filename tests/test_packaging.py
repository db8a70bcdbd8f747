"""What a user gets from a built wheel, outside a clone: the presets, the C kernels (built by the package's build,
one per CPU capability) and the Flower app are in it, so the default job, `pfedkit reproduce` and the README's
Python snippet work from any folder, and the kernels are in use in a fresh virtual environment."""
from __future__ import annotations

import json
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
    assert {"pfedkit/runtime/kernels.c", "pfedkit/flower/app/pyproject.toml"} <= names
    assert any(n.startswith("pfedkit/runtime/_kernels_default") and n.endswith(".so") for n in names)


KERNELS = """
import json, pfedkit, torch
from pfedkit.runtime import native
from pfedkit.runtime.runner import ClientRunner
from pfedkit.config import ModelConfig
from pfedkit.models import FlatModel, build_model
runner = ClientRunner(FlatModel(build_model(ModelConfig("lenet5"), (1, 28, 28), 10, 0)))
loaded = native.library() is not None
print(json.dumps({"package": pfedkit.__file__, "library": str(native.built(native.variant)), "loaded": loaded, "why_not": native.why_not, "says": runner.describe()}))
"""


def test_the_kernels_are_in_use_from_the_wheel_in_a_fresh_venv(installed, tmp_path):
    """A new virtual environment, the wheel installed into it (its dependencies borrowed from this environment by
    a .pth line, nothing downloaded): the kernels load from the installed package and the run says so."""
    wheel, _ = installed
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    torch_site = str(Path(__import__("torch").__file__).parents[1])  # this environment's site-packages
    deps = Path(torch_site)
    (Path(own_site) / "deps.pth").write_text(torch_site + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                           "--ignore-installed",  # the borrowed site-packages hold an editable pfedkit
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    probe = subprocess.run([str(python), "-c", KERNELS], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PFEDKIT_NATIVE")})
    assert probe.returncode == 0, probe.stderr
    said = json.loads(probe.stdout)
    assert said["package"].startswith(own_site) and said["library"].startswith(own_site) and deps.is_dir()
    assert said["loaded"], said["why_not"]
    variant = Path(said["library"]).name.split(".")[0].removeprefix("_kernels_")  # _kernels_avx2.cpython-...so
    assert said["says"].endswith(f"pfedkit's C kernels ({variant} build)"), said["says"]


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
