"""How the suite shares the cores: with the README's `-n auto --dist loadgroup`, tests/conftest.py's scheduler keeps
each test file whole in one worker (its module fixtures, such as a built wheel, are made once, never twice at once)
and the Flower files together in one. Checked by running this conftest over small test files in a real pytest-xdist
session of two workers, each test writing down the worker it ran in."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

RECORD = """import os
from pathlib import Path


def record(name):
    with open(Path(__file__).parent / "workers.txt", "a") as f:
        f.write(f"{Path(__file__).stem} {name} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""


def test_each_file_runs_whole_in_one_worker_and_the_flower_files_in_the_same(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    files = ["test_alpha", "test_beta", "test_flower_one", "test_flower_two"]
    for stem in files:
        tests = "".join(f"\n\ndef test_{i}():\n    record({i})\n" for i in range(8))
        (tmp_path / f"{stem}.py").write_text(RECORD + tests)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line.split() for line in (tmp_path / "workers.txt").read_text().splitlines()]
    assert len(ran) == 4 * 8
    workers = {stem: {w for s, _, w in ran if s == stem} for stem in files}
    assert all(len(w) == 1 for w in workers.values()), workers  # a file never spread over the two workers
    assert workers["test_flower_one"] == workers["test_flower_two"], workers
    assert len({w for _, _, w in ran}) == 2  # and the work still went to both
