"""A reproduction's column as one job against its runs one after another (`runtime.batch_runs`, runtime/batch_runs.py):
every method of the table x the seeds, the preset's protocol, `pfedkit run` in a fresh process each way. For each way
the script prints wall time, CPU time and the share of the cores it kept busy, run-rounds per second (rounds of all
runs over the wall time), the process's peak memory, the ratio of the two wall times, and whether every run's
metrics came out identical (they must: the job changes only the time).

    python benchmarks/bench_batch_runs.py [--preset pfedla/table1_fmnist_10clients_reduced] [--seeds 0,1,2]
                                          [--algorithms ...] [--rounds N] [--smoke]

Default methods: the table's (pfedkit reproduce's list; FedBN only with a BatchNorm model). Needs the full
Fashion-MNIST for the default preset (`apt-get install -y dataset-fashion-mnist`); `--smoke` runs 2 rounds of two
methods at one seed on mnist5k (for CI: it checks the script runs, it times nothing meaningful). On a GPU the runs
go one after another either way (the job is taken on a CPU only): the script says so and times nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pfedkit.config import BATCHNORM_MODELS, load_config
from pfedkit.reproduce import PFEDCS_METHODS, PFEDLA_METHODS, PRESETS

TIMING = ("wall_s", "server_s", "eval_s")


def timed_run(args: list[str], out: Path) -> dict:
    """`pfedkit run ARGS --out OUT` in a fresh process: wall and CPU seconds, peak resident memory (the child's own
    rusage, os.wait4)."""
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pfedkit", "run", *args, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    err = proc.stderr.read().decode()[-2000:]
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"pfedkit run failed ({proc.returncode}): {err}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024}


def metrics(out: Path) -> dict:
    rows = {}
    for path in sorted(out.rglob("metrics.jsonl")):
        rows[str(path.parent.relative_to(out))] = [
            {k: v for k, v in json.loads(line).items() if k not in TIMING} for line in path.read_text().splitlines()]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="pfedla/table1_fmnist_10clients_reduced")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--algorithms", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    preset = PRESETS / f"{args.preset}.yaml"
    sets = ["progress=false", "plots=false", f"seeds={args.seeds}"]
    if args.rounds:
        sets.append(f"rounds={args.rounds}")
    if args.smoke:
        sets += ["dataset.name=mnist5k", "rounds=2", "seeds=0", "partition.samples_per_client=100"]
        args.algorithms = args.algorithms or "fedavg,pfedla"
    cfg = load_config(preset, sets, None)
    methods = PFEDCS_METHODS if args.preset.startswith("pfedcs/") else PFEDLA_METHODS
    algorithms = args.algorithms or ",".join(m for m in methods if m != "fedbn" or cfg.model.name in BATCHNORM_MODELS)
    runs = len(algorithms.split(",")) * max(1, len(cfg.seed_list()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; {args.preset}: "
          f"{runs} runs ({algorithms} x seeds {cfg.seeds}), {cfg.rounds} rounds each")
    if torch.cuda.is_available():
        print("GPU: the runs go one after another there (runtime.batch_runs is taken on a CPU only); timing the CPU")
    base = [str(preset), "--algorithms", algorithms]
    base += [x for s in sets for x in ("--set", s)] + ["--set", "device=cpu"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flag in (("one after another", "false"), ("one job", "true")):
            out = Path(tmp) / flag
            results[name] = timed_run(base + ["--set", f"runtime.batch_runs={flag}"], out)
            results[name]["metrics"] = metrics(out)
    print(f"{'way':<18} {'wall s':>8} {'CPU s':>8} {'cores busy':>10} {'run-rounds/s':>12} {'peak MB':>8}")
    for name, r in results.items():
        print(f"{name:<18} {r['wall']:8.1f} {r['cpu']:8.1f} {r['cpu'] / r['wall']:10.2f} "
              f"{runs * cfg.rounds / r['wall']:12.2f} {r['peak_mb']:8.0f}")
    alone, job = results["one after another"], results["one job"]
    same = alone["metrics"] == job["metrics"] and len(job["metrics"]) == runs
    print(f"ratio (one after another / one job): {alone['wall'] / job['wall']:.2f}x; every run's metrics identical: "
          f"{'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
