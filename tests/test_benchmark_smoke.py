"""The issue-11 benchmark scripts run end to end in their smoke mode (times nothing: the machines are noisy)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script, args, rows", [
    ("bench_cnn_clients.py", ["--smoke", "--models", "cnn_bn", "--epochs", "1"], ["bare", "engine-1by1", "engine"]),
    ("bench_flbench.py", ["--smoke", "--algorithms", "fedavg"], ["fedavg"]),
    ("bench_gpu.py", ["--smoke", "--models", "lenet5"], ["bare", "engine-1by1", "engine-lockstep"]),
    ("bench_batch_runs.py", ["--smoke"], ["one", "ratio"]),
])
def test_benchmark_runs_in_smoke_mode(script, args, rows):
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    assert all(r in names for r in rows), done.stdout
