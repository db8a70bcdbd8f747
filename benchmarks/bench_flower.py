"""The same config in process, on Flower's simulation runtime, and on a Flower deployment on loopback (Flower's
own flower-superlink / flower-supernode processes, flwr run): seconds per round of each, their ratios to the
in-process engine, and Flower's per-message overhead (seconds waited per message beyond the clients' work, bytes
of the serialized .npy arrays beyond the tensors).

    python benchmarks/bench_flower.py [--clients 4] [--rounds 3] [--algorithm fedavg] [--no-loopback]

The startup (Ray, the SuperLink, the partition mapping) is reported apart: a round's time is the run's
wall_s / rounds from metrics.jsonl, the same clock for all three runtimes."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from pfedkit.config import dump_config, load_config
from pfedkit.experiment import run_experiment


def wall_per_round(folder: Path) -> float:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["wall_s"] / rows[-1]["round"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--no-loopback", action="store_true")
    args = ap.parse_args()
    from pfedkit.flower.loopback import Loopback
    from pfedkit.flower.simulation import run_simulation

    sets = ["dataset.name=mnist5k", f"partition.num_clients={args.clients}", "partition.samples_per_client=200",
            f"model.name={args.model}", f"rounds={args.rounds}", "local.epochs=1", "progress=false", "plots=false",
            "checkpoint_every=0"]
    cfg = load_config(None, sets, args.algorithm)
    tmp = Path(tempfile.mkdtemp(prefix="bench_flower_"))
    results = {}
    t = time.perf_counter()
    run_experiment(cfg, tmp / "inprocess", log=lambda s: None)
    results["inprocess"] = (wall_per_round(tmp / "inprocess" / args.algorithm), time.perf_counter() - t, None)
    t = time.perf_counter()
    run_simulation(cfg, tmp / "simulation", log=lambda s: None)
    results["flower simulation"] = (wall_per_round(tmp / "simulation" / args.algorithm), time.perf_counter() - t,
                                    json.loads((tmp / "simulation" / "flower.json").read_text()))
    if not args.no_loopback:
        (tmp / "cfg.yaml").write_text(dump_config(cfg))
        t = time.perf_counter()
        with Loopback(args.clients, tmp / "flwr", log=lambda s: None) as dep:
            run_id = dep.submit(config=tmp / "cfg.yaml", out=tmp / "loopback")
            dep.wait(run_id, 3600)
        results["flower loopback"] = (wall_per_round(tmp / "loopback" / args.algorithm), time.perf_counter() - t,
                                      json.loads((tmp / "loopback" / "flower.json").read_text()))
    base = results["inprocess"][0]
    print(f"{args.algorithm}, {args.model}, mnist5k, {args.clients} clients x 200 samples, 1 local epoch, "
          f"{args.rounds} rounds")
    print(f"{'runtime':<20} {'s/round':>8} {'x in-process':>13} {'total s':>8} {'messages':>9} {'wait s/msg':>11} "
          f"{'npy bytes/msg over tensors':>27}")
    for name, (per_round, total, stats) in results.items():
        extra = ("", "", "") if stats is None else (
            stats["round_trips"], f"{stats['wait_s_per_round_trip']:.3f}",
            f"{stats['overhead_bytes_per_message']:.0f}")
        print(f"{name:<20} {per_round:>8.3f} {per_round / base:>13.1f} {total:>8.1f} {extra[0]!s:>9} {extra[1]:>11} "
              f"{extra[2]:>27}")
    print("messages: train and evaluate messages sent (each with its reply); wait s/msg: seconds the server waited "
          "per message, the client's work included; the in-process engine sends none.")


if __name__ == "__main__":
    main()
