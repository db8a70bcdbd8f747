"""The round loop: sample -> payloads -> client updates -> aggregate -> evaluate -> log/checkpoint.

This is the only place that does those things; algorithms only say what is sent, what a client does and how the
server folds updates in. Randomness comes from generators keyed by (seed, round, client), so a run resumed from
a checkpoint continues exactly as the uninterrupted run would.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .algorithms import ALGORITHMS, Algorithm
from .algorithms.base import Cohort
from .config import Config, dump_config
from .data import FederatedData
from .errors import FAILED_FILE, ConfigError, PfedkitError, UpdateError
from .models import FlatModel, build_model
from .sampling import Sampler
from .train import predict, seeded_generator

TIMING_KEYS = ("wall_s", "server_s", "eval_s")  # measure the machine, not the algorithm
EVAL_CHUNK = 256  # clients whose personalized vectors are built at once during evaluation


def tensor_bytes(message: dict[str, Any]) -> int:
    """Bytes of the tensors in a payload or update (scalars such as sample counts are not counted)."""
    return sum(v.numel() * v.element_size() for v in message.values() if isinstance(v, torch.Tensor))


def check_update(update: dict[str, Any], cid: int, rnd: int, hint: str = "lower local.lr") -> None:
    """An update holds finite tensors and finite numbers only; `num_samples` and `train_loss` are numbers (a None
    or a string there is a bug of the algorithm, caught here rather than in the metrics)."""
    for key, value in update.items():
        if isinstance(value, torch.Tensor):
            if not torch.isfinite(value).all():
                raise UpdateError(f"round {rnd}: client {cid} sent non-finite values in '{key}' "
                                  f"(diverged training?); {hint}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UpdateError(f"round {rnd}: client {cid} sent '{key}' = {value!r}; an update holds tensors and "
                              "numbers only")
        elif not math.isfinite(value):
            raise UpdateError(f"round {rnd}: client {cid} reported a non-finite '{key}' (diverged training?); {hint}")
    if "num_samples" in update and not (isinstance(update["num_samples"], int) and update["num_samples"] >= 0):
        raise UpdateError(f"round {rnd}: client {cid} sent num_samples = {update['num_samples']!r}; expected a "
                          "count >= 0")


def atomic_write(path: Path, data: bytes) -> None:
    """Write then rename, so a crash or a full disk never leaves a half-written file under `path`: the previous
    version stays until the new one is complete."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        kept = f"; the previous {path.name} is intact" if path.exists() else ""
        raise PfedkitError(f"could not write {path}: {exc.strerror or exc} (disk full or not writable?){kept}") from None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluate(algo: Algorithm, state: dict, cstates: list[dict], data: FederatedData, model: FlatModel, *,
             adapt_cohort: Callable[[list[int]], Cohort] | None = None, train_loss: bool = False) -> dict:
    """Personalized accuracy of every client on its own test split, and the global model's where one exists;
    with `train_loss`, also the models' mean loss on the clients' train splits (the papers' training-loss curves)."""
    test_offsets = torch.as_tensor(data.test_offsets, device=data.device)
    train_offsets = torch.as_tensor(data.train_offsets, device=data.device)

    def per_client(values: torch.Tensor, offsets: torch.Tensor) -> np.ndarray:
        cum = torch.cat([torch.zeros(1, device=values.device, dtype=torch.float64), values.double().cumsum(0)])
        return (cum[offsets[1:]] - cum[offsets[:-1]]).cpu().numpy()

    test_sizes = data.test_sizes.astype(np.float64)
    train_sizes = data.train_sizes.astype(np.float64)
    global_vec = algo.global_model(state)
    global_correct = global_loss = None
    if global_vec is not None:
        model.load(global_vec)
        global_correct = per_client(predict(model, data.x_test, data.y_test)[0], test_offsets)
        if train_loss:
            global_loss = per_client(predict(model, data.x_train, data.y_train)[1], train_offsets)
    correct, losses = [], []  # per-client tensors, read back once at the end
    for first in range(0, data.num_clients, EVAL_CHUNK):
        cids = list(range(first, min(first + EVAL_CHUNK, data.num_clients)))
        vectors = algo.personalized_many(state, cstates, cids)
        if algo.adapts:
            vectors = algo.adapt_many(vectors, adapt_cohort(cids))
        # One client at a time: scoring the chunk's models as one batched product was measured no faster (the
        # per-client forward is already one matrix product over the client's samples; gathering costs more).
        for cid, vec in zip(cids, vectors):
            if vec is global_vec and global_correct is not None:
                correct.append(torch.tensor(global_correct[cid]))
                losses.append(torch.tensor(global_loss[cid] if train_loss else 0.0))
                continue
            model.load(vec)
            c = data.client(cid)
            correct.append(predict(model, c.x_test, c.y_test)[0].sum())
            losses.append(predict(model, c.x_train, c.y_train)[1].sum() if train_loss else torch.tensor(0.0))
    acc = torch.stack([t.double().cpu() for t in correct]).numpy() / test_sizes
    loss = torch.stack([t.double().cpu() for t in losses]).numpy()
    row = {
        "personalized_acc": float(acc.mean()),
        "personalized_acc_weighted": float((acc * test_sizes).sum() / test_sizes.sum()),
        "personalized_acc_std": float(acc.std()),
        "personalized_acc_p10": float(np.percentile(acc, 10)),
        "global_acc": None if global_correct is None else float((global_correct / test_sizes).mean()),
        "global_acc_weighted": None if global_correct is None else float(global_correct.sum() / test_sizes.sum()),
        "personalized_train_loss": float(loss.sum() / train_sizes.sum()) if train_loss else None,
        "global_train_loss": float(global_loss.sum() / train_sizes.sum()) if global_loss is not None else None,
    }
    return {"row": row, "per_client": acc}


RESUMABLE_KEYS = {"rounds", "progress", "plots", "threads", "device", "checkpoint_every"}  # may change on resume


def flatten_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def structure_mismatch(want: Any, got: Any, where: str) -> str | None:
    """Where `got` differs from `want` in its containers' keys and lengths or its tensors' shapes and dtypes."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return f"{where} holds {shape}, this config makes {tuple(want.shape)}"
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where} holds keys {sorted(got) if isinstance(got, dict) else type(got).__name__}, " \
                   f"this config makes {sorted(want)}"
        return next(filter(None, (structure_mismatch(want[k], got[k], f"{where}.{k}") for k in want)), None)
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{where} holds {len(got) if isinstance(got, list) else type(got).__name__} entries, " \
                   f"this config makes {len(want)}"
        return next(filter(None, (structure_mismatch(w, g, f"{where}[{i}]") for i, (w, g) in enumerate(zip(want, got)))),
                    None)
    return None


class ObservableLog:
    """Arrays an algorithm exposes at each evaluation (pFedLA's aggregation weights). During the run each is one
    atomically written `observables/<name>/r<round>.npy`; at the end they are packed into `<name>.npz`, keyed
    `r<round>` (e.g. `np.load("alpha.npz")["r00040"]`). A resumed run drops the files written after its checkpoint.
    """

    def __init__(self, out: Path):
        self.out = out
        self.dir = out / "observables"

    def write(self, rnd: int, arrays: dict[str, Any]) -> None:
        for name, array in arrays.items():
            folder = self.dir / name
            folder.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            np.save(buf, np.asarray(array), allow_pickle=False)
            atomic_write(folder / f"r{rnd:05d}.npy", buf.getvalue())

    def truncate(self, last_round: int) -> None:
        for f in self.dir.glob("*/r*.npy"):
            if int(f.stem[1:]) > last_round:
                f.unlink()

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        for stale in self.out.glob("*.npz"):  # packed logs of an earlier run in this folder
            stale.unlink()

    def pack(self) -> None:
        if not self.dir.is_dir():
            return
        for folder in sorted(p for p in self.dir.iterdir() if p.is_dir()):
            target = self.out / f"{folder.name}.npz"
            tmp = target.with_name(target.name + ".tmp")
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for f in sorted(folder.glob("r*.npy")):
                    zf.write(f, arcname=f.name)
            os.replace(tmp, target)
        shutil.rmtree(self.dir)


class Run:
    """One algorithm on one federated dataset, writing its run folder."""

    def __init__(self, cfg: Config, data: FederatedData, out: Path):
        self.cfg, self.data, self.out = cfg, data, Path(out)
        self.device = data.device
        module = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed).to(self.device)
        self.model = FlatModel(module)
        name = cfg.algorithm_name
        self.algo = ALGORITHMS[name](cfg.params(name), self.model, data.num_clients, cfg)
        scheme = self.algo.default_sampling if cfg.sampling == "auto" else cfg.sampling
        self.sampler = Sampler(scheme, data.train_sizes, cfg.clients_per_round, cfg.seed, cfg.clustering,
                               cfg.importance)
        if self.sampler.needs_gradients and not self.algo.has_global_model:
            raise ConfigError(f"config key 'sampling': clustered_similarity compares clients' updates to a global "
                              f"model, which {name} does not have; allowed here: uniform, md, clustered_size")
        self.ckpt_path = self.out / "checkpoint.pt"
        self.metrics_path = self.out / "metrics.jsonl"
        self.observed = ObservableLog(self.out)
        self.train_only = data.train_only()  # what evaluation-time adaptation may read

    # -- state --------------------------------------------------------------------------------------------------
    def _fresh(self) -> None:
        init = self.model.state()
        self.state = self.algo.init_server(init)
        self.cstates = [self.algo.init_client(cid, init) for cid in range(self.data.num_clients)]
        # representative gradients over the parameters only: BatchNorm running statistics are no gradient (and
        # would carry most of the norm, making every client look alike)
        self.sampler_state = self.sampler.init_state(self.model.param_size, init)
        self.metrics: list[dict] = []
        self.totals = {"round": 0, "bytes_up": 0, "bytes_down": 0, "wall_s": 0.0, "server_s": 0.0}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / FAILED_FILE).unlink(missing_ok=True)
        atomic_write(self.out / "config.yaml", dump_config(self.cfg).encode())
        atomic_write(self.metrics_path, b"")
        self.observed.clear()
        self._write_partition()
        info = {"name": self.cfg.algorithm, "params": dataclasses.asdict(self.algo.params),
                "model_layers": [{"name": l.name, "kind": l.kind, "params": l.num_params} for l in self.model.layers],
                "model_params": self.model.param_size, "model_buffers": self.model.size - self.model.param_size,
                **self.algo.describe()}
        atomic_write(self.out / "algorithm.json", json.dumps(info, indent=1).encode())

    def _resume(self) -> None:
        ck = self._load_checkpoint()
        self.state, self.cstates, self.metrics, self.totals = ck["server"], ck["clients"], ck["metrics"], ck["totals"]
        self.sampler_state = ck["sampler"]
        torch.set_rng_state(ck["torch_rng"])
        # the log may hold rows written after the checkpoint: rewrite it from the checkpoint's rows
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.metrics).encode())
        self.observed.truncate(self.totals["round"])

    def _load_checkpoint(self) -> dict:
        """The checkpoint as plain data (tensors, numbers, strings, containers: `weights_only` never runs code from
        the file), checked against what this run's config builds, so a damaged, foreign or stale checkpoint is one
        line rather than a traceback or a silently different run."""
        path = self.ckpt_path
        again = f"start it afresh with `pfedkit run ... --out {self.out.parent} --overwrite`"
        try:
            ck = torch.load(path, map_location=self.device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to read it means the same to the user
            refused = isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower()
            why = ("it holds objects other than tensors, numbers and strings, refused unread" if refused else
                   f"it is empty, damaged or not a checkpoint ({exc.__class__.__name__})")
            raise PfedkitError(f"cannot resume from {path}: {why}; {again}") from None
        keys = {"server", "clients", "sampler", "metrics", "totals", "torch_rng", "config"}
        if not isinstance(ck, dict) or not keys <= set(ck):
            raise PfedkitError(f"cannot resume from {path}: not a pfedkit checkpoint (no {', '.join(sorted(keys))}); "
                               f"{again}")
        mine, theirs = flatten_config(self.cfg.to_dict()), flatten_config(ck["config"]) if isinstance(
            ck["config"], dict) else {}
        changed = [k for k in sorted(set(mine) | set(theirs)) if k.split(".")[0] not in RESUMABLE_KEYS
                   and mine.get(k) != theirs.get(k)]
        if changed:
            k = changed[0]
            raise PfedkitError(f"cannot resume from {path}: it was written with {k}={theirs.get(k)!r} but "
                               f"{self.out / 'config.yaml'} says {mine.get(k)!r}"
                               f"{f' (and {len(changed) - 1} more keys differ)' if len(changed) > 1 else ''}; "
                               f"restore the config or {again}")
        init = self.model.state()
        expected = {"server": self.algo.init_server(init),
                    "clients": [self.algo.init_client(c, init) for c in range(self.data.num_clients)],
                    "sampler": self.sampler.init_state(self.model.param_size, init),
                    "torch_rng": torch.get_rng_state()}
        for key, want in expected.items():
            problem = structure_mismatch(want, ck[key], key)
            if problem:
                raise PfedkitError(f"cannot resume from {path}: {problem} (another model, dataset or client count?); "
                                   f"{again}")
        totals = ck["totals"]
        if not (isinstance(ck["metrics"], list) and all(isinstance(r, dict) for r in ck["metrics"])
                and isinstance(totals, dict) and isinstance(totals.get("round"), int)
                and 0 <= totals["round"] <= self.cfg.rounds):
            raise PfedkitError(f"cannot resume from {path}: its metrics or round counter are damaged; {again}")
        return ck

    def _checkpoint(self) -> None:
        buf = io.BytesIO()
        torch.save({"server": self.state, "clients": self.cstates, "sampler": self.sampler_state,
                    "metrics": self.metrics, "totals": self.totals,
                    "torch_rng": torch.get_rng_state(), "config": self.cfg.to_dict()}, buf)
        atomic_write(self.ckpt_path, buf.getvalue())

    def _write_partition(self) -> None:
        d = self.data
        info = {"dataset": d.name, "num_classes": d.num_classes, "train_counts": d.train_counts.tolist(),
                "test_counts": d.test_counts.tolist(), "label_sets": [s.tolist() for s in d.label_sets]}
        atomic_write(self.out / "partition.json", json.dumps(info).encode())

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self, resume: bool = False, stop_after: int | None = None) -> dict | None:
        """Train to `cfg.rounds` and write summary.json; `stop_after` ends early as an interrupted run would."""
        if resume:
            if not self.ckpt_path.is_file():
                raise PfedkitError(f"cannot resume: {self.ckpt_path} does not exist")
            self._resume()
        else:
            self._fresh()
        cfg = self.cfg
        start = self.totals["round"]
        bar = tqdm(total=cfg.rounds, initial=start, desc=f"{cfg.algorithm:>10}", disable=not cfg.progress,
                   unit="round", dynamic_ncols=True, mininterval=0.5)
        try:
            for rnd in range(start + 1, cfg.rounds + 1):
                t0 = time.perf_counter()
                stats = self._train_round(rnd)
                t = self.totals
                t["round"] = rnd
                t["bytes_up"] += stats["bytes_up"]
                t["bytes_down"] += stats["bytes_down"]
                t["server_s"] += stats["server_s"]
                if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
                    row = self._evaluate(rnd, stats, t0)
                    bar.set_postfix(pacc=f"{row['personalized_acc']:.3f}", refresh=False)
                else:
                    t["wall_s"] += time.perf_counter() - t0
                bar.update(1)
                if (cfg.checkpoint_every and rnd % cfg.checkpoint_every == 0) or rnd == cfg.rounds:
                    self._checkpoint()
                if stop_after is not None and stop_after <= rnd < cfg.rounds:
                    return None
        except UpdateError as exc:  # recorded, so an experiment can report it beside the runs that finished
            atomic_write(self.out / FAILED_FILE, str(exc).encode())
            raise
        finally:
            bar.close()
        if not hasattr(self, "last_per_client"):  # resumed after the last evaluation: evaluate again
            self.last_per_client = evaluate(self.algo, self.state, self.cstates, self.data, self.model,
                                            adapt_cohort=lambda cids: self._adapt_cohort(cfg.rounds, cids))["per_client"]
        summary = self._summary()
        self.observed.pack()
        atomic_write(self.out / "summary.json", json.dumps(summary, indent=1).encode())
        return summary

    def _train_round(self, rnd: int) -> dict:
        """Sample, send, train, aggregate: one round. Synchronous by default (every client starts from the same
        server state); an algorithm may ask for its clients to be served one after another. Where every client
        trains (pFedMe's code), the sampler picks who aggregates after training, from fresh gradients."""
        cfg, data, algo, sampler = self.cfg, self.data, self.algo, self.sampler
        weights = None if algo.trains_all else sampler.select(self.sampler_state, rnd)
        cids = list(range(data.num_clients)) if algo.trains_all else list(weights)
        stats = {"clients": len(cids), "server_s": 0.0, "bytes_up": 0, "bytes_down": 0, "losses": []}
        sent_global = algo.global_model(self.state) if sampler.needs_gradients else None
        sent_global = None if sent_global is None else sent_global[: self.model.param_size].clone()
        updates: dict[int, dict] = {}
        for group in ([[c] for c in cids] if algo.sequential else [cids]):
            ts = time.perf_counter()
            payloads = algo.payloads(self.state, group, rnd)
            _sync(self.device)
            stats["server_s"] += time.perf_counter() - ts
            cohort = Cohort(group, rnd, data, self.model, cfg.local, [seeded_generator(cfg.seed, rnd, c) for c in group])
            new_updates, new_states = algo.client_update_many([payloads[c] for c in group],
                                                              [self.cstates[c] for c in group], cohort)
            for cid, update, cstate in zip(group, new_updates, new_states):
                check_update(update, cid, rnd, self.algo.divergence_hint)
                updates[cid], self.cstates[cid] = update, cstate
                if "train_loss" in update:
                    stats["losses"].append((update["train_loss"], update.get("num_samples", 1)))
            stats["bytes_down"] += sum(tensor_bytes(payloads[c]) for c in group)
            stats["bytes_up"] += sum(tensor_bytes(updates[c]) for c in group)
            if algo.sequential:
                self._aggregate({c: updates[c] for c in group}, {c: 1.0 for c in group}, rnd, stats)
        if sent_global is not None:  # representative gradients: what each client's training did to the model
            self.sampler_state = sampler.observe(self.sampler_state, {
                c: u["gradient"] if "gradient" in u else u["weights"][: len(sent_global)] - sent_global
                for c, u in updates.items()})
        if algo.trains_all:
            weights = sampler.select(self.sampler_state, rnd)
        if not algo.sequential:
            self._aggregate(updates, weights, rnd, stats)
        stats["aggregated"] = len(weights)
        return stats

    def _aggregate(self, updates: dict, weights: dict, rnd: int, stats: dict) -> None:
        ts = time.perf_counter()
        self.state = self.algo.aggregate(self.state, updates, weights, rnd)
        _sync(self.device)
        stats["server_s"] += time.perf_counter() - ts

    def _adapt_cohort(self, rnd: int, cids: list[int]) -> Cohort:
        """What clients may fine-tune on before they are evaluated: their train splits only (the test splits are
        not even in reach), each with a generator of its own for this evaluation."""
        return Cohort(cids, rnd, self.train_only, self.model, self.cfg.local,
                      [seeded_generator(self.cfg.seed, rnd, cid, 0xE7A1) for cid in cids])

    def _evaluate(self, rnd: int, stats: dict, t0: float) -> dict:
        """Evaluate every client, append the metrics row and the algorithm's observables."""
        te = time.perf_counter()
        result = evaluate(self.algo, self.state, self.cstates, self.data, self.model,
                          adapt_cohort=lambda cids: self._adapt_cohort(rnd, cids), train_loss=self.cfg.eval_train)
        _sync(self.device)
        eval_s = time.perf_counter() - te
        t = self.totals
        t["wall_s"] += time.perf_counter() - t0
        weight = sum(w for _, w in stats["losses"])
        row = {"round": rnd, **result["row"],
               "train_loss": sum(l * w for l, w in stats["losses"]) / weight if weight else None,
               "bytes_up": stats["bytes_up"], "bytes_down": stats["bytes_down"],
               "bytes_up_total": t["bytes_up"], "bytes_down_total": t["bytes_down"],
               "clients": stats["clients"], "aggregated": stats["aggregated"],
               "wall_s": t["wall_s"], "server_s": stats["server_s"], "eval_s": eval_s}
        self.metrics.append(row)
        self.last_per_client = result["per_client"]
        self.observed.write(rnd, self.algo.observables(self.state))
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        return row

    def _first_round(self, key: str) -> int | None:
        """The first evaluated round whose `key` reached `target_acc` (None: never, or no target set)."""
        target = self.cfg.target_acc
        return next((r["round"] for r in self.metrics if target and r[key] is not None and r[key] >= target), None)

    def _summary(self) -> dict:
        last = self.metrics[-1]
        tail = self.metrics[-5:]
        return {
            "algorithm": self.cfg.algorithm, "dataset": self.data.name, "seed": self.cfg.seed,
            "rounds": self.cfg.rounds,
            **{k: v for k, v in last.items() if k not in ("bytes_up", "bytes_down")},
            "final_last5": float(np.mean([r["personalized_acc"] for r in tail])),
            "global_acc_last5": (float(np.mean([r["global_acc"] for r in tail]))
                                 if last["global_acc"] is not None else None),
            "mb_up_total": self.totals["bytes_up"] / 1e6, "mb_down_total": self.totals["bytes_down"] / 1e6,
            "server_s_total": self.totals["server_s"],
            "majority_label_acc": float(self.data.majority_label_accuracy().mean()),
            "target_acc": self.cfg.target_acc or None,
            "rounds_to_target": self._first_round("personalized_acc"),
            "rounds_to_target_global": self._first_round("global_acc"),
            "personalized_acc_per_client": [float(a) for a in self.last_per_client],
        }
