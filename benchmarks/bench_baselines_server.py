"""The server's share of a round for the baselines with server-side work (pFedHN's hypernetwork, FedFomo's peer
selection and affinity matrix), beside FedAvg and pFedLA, in the real engine.

Fashion-MNIST (the Debian package), N clients of at most 500 samples with 4 classes each, 10 % sampled per round,
1 local epoch of the CNN, the evaluation only after the last round (so the rounds' time is training + server).
Prints per method: s/round (training rounds only), the server's s/round and its share of the round.

    python benchmarks/bench_baselines_server.py [--clients 100] [--rounds 5] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

METHODS = "fedavg,pfedla,pfedhn,fedfomo"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny run on mnist5k (CI): checks the script, no timing")
    args = ap.parse_args()
    from pfedkit.config import load_config
    from pfedkit.experiment import run_experiment

    n, rounds = (6, 2) if args.smoke else (args.clients, args.rounds)
    sets = [f"dataset.name={'mnist5k' if args.smoke else 'fmnist'}", f"partition.num_clients={n}",
            "partition.samples_per_client=500", f"clients_per_round={max(2, n // 10)}", f"rounds={rounds}",
            f"eval_every={rounds}", "model.name=cnn", "local.epochs=1", "progress=false", "plots=false",
            "checkpoint_every=0"]
    cfg = load_config(None, sets, METHODS)
    with tempfile.TemporaryDirectory() as tmp:
        run_experiment(cfg, Path(tmp), log=lambda s: None)
        print(f"N = {n}, {max(2, n // 10)} clients per round, {rounds} rounds, CNN, 1 local epoch")
        print(f"{'method':<10} {'s/round':>9} {'server s/round':>15} {'server share':>13}")
        for name in METHODS.split(","):
            summary = json.loads((Path(tmp) / name / "summary.json").read_text())
            last = json.loads((Path(tmp) / name / "metrics.jsonl").read_text().splitlines()[-1])
            train_s = (summary["wall_s"] - last["eval_s"]) / rounds
            server_s = summary["server_s_total"] / rounds
            print(f"{name:<10} {train_s:>9.3f} {server_s:>15.4f} {server_s / train_s:>12.1%}")


if __name__ == "__main__":
    main()
