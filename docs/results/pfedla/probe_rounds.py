"""How much one round moves every client's evaluated model: the probe behind docs/reproduce.md, 'pFedHN at 100
clients'. It resumes a run folder's checkpoint in a scratch copy (the folder itself is only read), runs ROUNDS more
rounds, optionally with some of the algorithm's hyperparameters changed from there on, and evaluates every client
after each round. Per round it prints the pooled personalized accuracy and the mean change (and mean absolute
change) of the accuracies of the clients that trained in it and of those that did not, in points.

    python docs/results/pfedla/probe_rounds.py RUN_FOLDER ROUNDS ['{"sequential": true}']

RUN_FOLDER: one run (`<out>/seed0/pfedhn`), with its checkpoint.pt.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from pfedkit.config import load_config
from pfedkit.data.federated import build_federated
from pfedkit.engine.run import Run


def probe(folder: Path, rounds: int, changes: dict | None = None, log=print) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "run"
        shutil.copytree(folder, copy)
        cfg = load_config(copy / "config.yaml")
        start = cfg.rounds
        cfg.rounds = start + rounds  # rounds may change on resume; the checkpoint is checked against the rest
        run = Run(cfg, build_federated(cfg), copy)
        run._resume()
        if changes:  # from here on, as a run whose config said so (e.g. pfedhn's sequential or hn_lr)
            run.algo.params = dataclasses.replace(run.algo.params, **changes)
            run.algo.sequential = getattr(run.algo.params, "sequential", run.algo.sequential)
        select, chosen = run.server.sampler.select, []

        def recorded(state, rnd):
            weights = select(state, rnd)
            chosen.append(sorted(weights))
            return weights

        run.server.sampler.select = recorded
        torch.set_num_threads(1)
        acc, rows = run._scores(start, False)[1], []
        for rnd in range(start + 1, start + rounds + 1):
            run.server.train_round(rnd, run.clients)
            new = run._scores(rnd, False)[1]
            trained = np.zeros(len(new), bool)
            trained[chosen[-1]] = True
            change = 100 * (new - acc)
            rows.append({"round": rnd, "acc": 100 * float(new.mean()),
                         "trained_abs": float(np.abs(change[trained]).mean()), "trained": float(change[trained].mean()),
                         "others_abs": float(np.abs(change[~trained]).mean()), "others": float(change[~trained].mean())})
            log("round {round}: mean {acc:.2f} | trained: |d| {trained_abs:.2f}, d {trained:+.2f} | others: |d| "
                "{others_abs:.2f}, d {others:+.2f}".format(**rows[-1]))
            acc = new
    means = {k: float(np.mean([r[k] for r in rows])) for k in ("trained_abs", "others_abs")}
    log(f"over {rounds} rounds: mean |d| trained {means['trained_abs']:.2f}, others {means['others_abs']:.2f} "
        f"points; pooled accuracy {min(r['acc'] for r in rows):.2f}-{max(r['acc'] for r in rows):.2f}, "
        f"std {np.std([r['acc'] for r in rows]):.2f}")
    return rows


if __name__ == "__main__":
    probe(Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
