"""One run: the wiring (model, algorithm, sampler, server, clients) and the one round loop, with the run folder's
files, the checkpoint, the progress bar and the summary as observers around it.

The loop is the same whatever carries the messages: `clients` is the in-process simulator by default, or a Flower
Grid (flower/server.py) whose ServerApp builds this same Run. Randomness comes from generators keyed by (seed,
round, client), so a run resumed from a checkpoint continues exactly as the uninterrupted run would.
"""
from __future__ import annotations

import dataclasses
import json
import pickle
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from ..algorithms import build_algorithm
from ..config import Config, dump_config, load_config, moved_keys, short_repr
from ..data import FederatedData
from ..errors import FAILED_FILE, ConfigError, PfedkitError, UpdateError
from ..models import FlatModel, build_model
from ..provenance import provenance
from ..report.plots import row_problem
from ..runtime.threads import on_one_thread
from ..sampling import Sampler
from .clients import InProcessClients
from .files import ObservableLog, append_line, atomic_write, flatten_config, resumable, structure_mismatch
from .folder import mark, root_of
from .server import RoundStats, Server, _sync, metrics_row

TIMING_KEYS = ("wall_s", "server_s", "eval_s")  # measure the machine, not the algorithm


class Observer:
    """Something that happens around the loop, not in it (pfl-research's callbacks): the run folder's files, the
    progress bar, the checkpoint, and what a user adds (`run_experiment(..., observers=[...])`: a logger, early
    stopping). Each method is called once per run of an experiment, in order; override the ones you need:

    - `start(run, resumed)`: before the first round (of this process: `resumed` after a checkpoint);
    - `round_done(run, rnd, stats, row)`: after each round; `row` is the metrics row (metrics.jsonl's) at an
      evaluated round, else None. `run.request_stop(reason)` ends the run at this evaluated round (or at the next
      evaluated one): it is then finished, with its checkpoint and summary.json (`stopped_at`, `stop_reason`);
    - `close(run)`: after the last round, also when the run stops on an error or an interrupt;
    - `finish(run, summary)`: with the summary of a finished run, before summary.json is written.
    `run.cfg`, `run.out`, `run.metrics` (the rows so far) and `run.data` say what the run is.

    Runs side by side (`runtime.batch_runs`) call their observers from threads of their own, interleaved: an
    observer that keeps nothing shared between runs says so with `side_by_side = True`; one that does not makes the
    experiment run its runs one after another."""

    side_by_side = False

    def start(self, run: "Run", resumed: bool) -> None: ...

    def round_done(self, run: "Run", rnd: int, stats: RoundStats, row: dict | None) -> None: ...

    def close(self, run: "Run") -> None: ...

    def finish(self, run: "Run", summary: dict) -> None: ...


def keep_config_current(folder: Path, cfg: Config) -> None:
    """A resumed folder's config.yaml says what it continues with: written again where it differs (a finished run
    given more rounds), left as it is where it does not (a user's edit keeps its comments)."""
    path = folder / "config.yaml"
    try:
        same = load_config(path).to_dict() == cfg.to_dict()
    except (ConfigError, OSError):
        same = False
    if not same:
        atomic_write(path, dump_config(cfg).encode())


class RunFiles(Observer):
    """config.yaml, partition.json, algorithm.json of a fresh run; the stale failure record of a folder removed."""

    side_by_side = True  # touches its own run only

    def start(self, run, resumed):
        if resumed:
            keep_config_current(run.out, run.cfg)  # a finished run given more rounds says so
            return
        (run.out / FAILED_FILE).unlink(missing_ok=True)
        mark(run.out)
        atomic_write(run.out / "config.yaml", dump_config(run.cfg).encode())
        d = run.data
        info = {"dataset": d.name, "num_classes": d.num_classes, "train_counts": d.train_counts.tolist(),
                "test_counts": d.test_counts.tolist(), "label_sets": [s.tolist() for s in d.label_sets]}
        atomic_write(run.out / "partition.json", json.dumps(info).encode())
        m = run.model
        info = {"name": run.cfg.algorithm, "params": dataclasses.asdict(run.algo.params),
                "model_layers": [{"name": l.name, "kind": l.kind, "params": l.num_params} for l in m.layers],
                "model_params": m.param_size, "model_buffers": m.size - m.param_size, **run.algo.describe()}
        atomic_write(run.out / "algorithm.json", json.dumps(info, indent=1).encode())


class MetricsFile(Observer):
    """metrics.jsonl: one JSON row per evaluation; a resumed run rewrites it from its checkpoint's rows (the file
    may hold rows written after the checkpoint)."""

    side_by_side = True  # touches its own run only

    def start(self, run, resumed):
        run.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(run.metrics_path, "".join(json.dumps(r) + "\n" for r in run.metrics).encode())

    def round_done(self, run, rnd, stats, row):
        if row is not None:
            append_line(run.metrics_path, json.dumps(row))


class Observables(Observer):
    """The algorithm's arrays at each evaluation (pFedLA's weights), packed into <name>.npz at the end."""

    side_by_side = True  # touches its own run only

    def start(self, run, resumed):
        if resumed:
            run.observed.reopen(run.totals["round"])
        else:
            run.observed.clear()

    def round_done(self, run, rnd, stats, row):
        if row is not None:
            run.observed.write(rnd, run.algo.observables(run.server.state))

    def finish(self, run, summary):
        run.observed.pack()


class Checkpoints(Observer):
    """checkpoint.pt every `checkpoint_every` rounds and at the end (atomically: a crash keeps the previous one)."""

    side_by_side = True  # touches its own run only

    def round_done(self, run, rnd, stats, row):
        every = run.cfg.checkpoint_every
        if (every and rnd % every == 0) or rnd == run.cfg.rounds:
            run.save_checkpoint()
            if hasattr(run.clients, "bind_run"):  # clients that keep their own states prune what no resume needs
                run.clients.bind_run(run.out, rnd)


class ProgressBar(Observer):
    side_by_side = True  # touches its own run only

    def start(self, run, resumed):
        cfg = run.cfg
        self.bar = tqdm(total=cfg.rounds, initial=run.totals["round"], desc=f"{cfg.algorithm:>10}",
                        disable=not cfg.progress, unit="round", dynamic_ncols=True, mininterval=0.5)

    def round_done(self, run, rnd, stats, row):
        if row is not None:
            self.bar.set_postfix(acc=f"{100 * row['personalized_acc']:.1f}%", refresh=False)  # % as in the tables
        self.bar.update(1)

    def close(self, run):
        self.bar.close()


class JobProgress(Observer):
    """One progress bar for a job's runs: rounds done over all of them."""
    side_by_side = True

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="runs", disable=not enabled, unit="round", dynamic_ncols=True,
                        mininterval=0.5)
        self.lock = threading.Lock()

    def start(self, run, resumed):
        with self.lock:
            self.bar.update(run.totals["round"])

    def round_done(self, run, rnd, stats, row):
        with self.lock:
            self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


class Run:
    """One algorithm on one federated dataset, writing its run folder."""

    def __init__(self, cfg: Config, data: FederatedData, out: Path, clients: Any = None, min_replies: int = 1,
                 log: Callable[[str], None] = print, observers: list[Observer] = (), across_versions: bool = False):
        self.cfg, self.data, self.out = cfg, data, Path(out)
        self.across_versions = across_versions  # --allow-version-change: a checkpoint may lack keys added since
        self.device = data.device
        module = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed).to(self.device)
        self.model = FlatModel(module)
        self.algo = build_algorithm(cfg, self.model, data.num_clients)
        scheme = self.algo.default_sampling if cfg.sampling == "auto" else cfg.sampling
        self.sampler = Sampler(scheme, data.train_sizes, cfg.clients_per_round, cfg.seed, cfg.clustering,
                               cfg.importance)
        if self.sampler.needs_gradients and not self.algo.has_global_model:
            raise ConfigError(f"config key 'sampling': clustered_similarity compares clients' updates to a global "
                              f"model, which {self.algo.name} does not have; allowed here: uniform, md, clustered_size")
        # in process a bad update is a bug or diverged training: stop; from a deployment it is one faulty client
        self.server = Server(self.algo, self.sampler, self.device, strict=clients is None, min_replies=min_replies,
                             log=log)
        self.clients = clients or InProcessClients(self.algo, data, self.model, cfg.local, cfg.seed, cfg.runtime)
        self.ckpt_path = self.out / "checkpoint.pt"
        self.metrics_path = self.out / "metrics.jsonl"
        self.observed = ObservableLog(self.out)
        self.observers: list[Observer] = [RunFiles(), MetricsFile(), Observables(), Checkpoints(), *observers,
                                          ProgressBar()]
        self.stop_reason: str | None = None

    def request_stop(self, reason: str) -> None:
        """End the run at this evaluated round, or at the next one (an observer's early stopping)."""
        self.stop_reason = str(reason)

    # what the run holds now (tests and tools read these)
    @property
    def state(self) -> dict:
        return self.server.state

    @property
    def cstates(self) -> list[dict]:
        return self.clients.state()

    @property
    def sampler_state(self) -> dict:
        return self.server.sampler_state

    # -- state --------------------------------------------------------------------------------------------------
    def _fresh(self) -> None:
        init = self.model.state()
        self.server.reset(init)
        self.clients.reset(init)
        self.metrics: list[dict] = []
        self.totals = {"round": 0, "bytes_up": 0, "bytes_down": 0, "wall_s": 0.0, "server_s": 0.0}
        self.out.mkdir(parents=True, exist_ok=True)

    def _resume(self) -> None:
        ck = self._load_checkpoint()
        self.server.state, self.server.sampler_state = ck["server"], ck["sampler"]
        self.clients.restore(ck["clients"])
        self.metrics, self.totals = ck["metrics"], ck["totals"]
        torch.set_rng_state(ck["torch_rng"])

    def _load_checkpoint(self) -> dict:
        """The checkpoint as plain data (tensors, numbers, strings, containers: `weights_only` never runs code from
        the file), checked against what this run's config builds, so a damaged, foreign or stale checkpoint is one
        line rather than a traceback or a silently different run."""
        path = self.ckpt_path
        again = f"start it afresh with `pfedkit run ... --out {root_of(self.out)} --overwrite`"
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
        layout = ck.get("layout", "standard")  # checkpoints before the layout was recorded: standard
        if layout != self.model.layout:
            raise PfedkitError(f"cannot resume from {path}: its vectors are in parameter layout {str(layout)[:40]!r}, "
                               f"this pfedkit holds this model in {self.model.layout!r} (a checkpoint of another "
                               f"pfedkit version); {again}")
        mine, theirs = flatten_config(self.cfg.to_dict()), flatten_config(moved_keys(ck["config"])) if isinstance(
            ck["config"], dict) else {}
        # a key added since takes as its default what the earlier versions did (perfedavg.alpha 0: local.lr), so a
        # checkpoint without it continues at that default, where the user allowed the version change
        defaults = flatten_config(load_config(None, [], self.algo.name).to_dict())
        added = {k for k in set(mine) - set(theirs) if k in defaults and mine[k] == defaults[k]}
        changed = [k for k in sorted(set(mine) | set(theirs)) if not resumable(k) and mine.get(k) != theirs.get(k)
                   and not (self.across_versions and k in added)]
        if changed:
            k = changed[0]
            more = f" (and {len(changed) - 1} more keys differ)" if len(changed) > 1 else ""
            if k not in theirs or k not in mine:  # another pfedkit's keys: no edit of config.yaml can restore them
                if k in mine:
                    default = defaults.get(k, mine[k])
                    sets = "" if mine[k] == default else f"; config.yaml sets {short_repr(mine[k])}"
                    had = f"without config key {k} (this one's default: {short_repr(default)}{sets})"
                else:
                    had = f"with config key {short_repr(k)}={short_repr(theirs[k])}, which this pfedkit does not have"
                allow = (" (or continue it with --allow-version-change, which takes a key added since at its default, "
                         "what the earlier versions did)" if k in added else "")
                raise PfedkitError(f"cannot resume from {path}: it was written by a pfedkit {had}{more}; resume it "
                                   f"with the pfedkit that wrote it, or {again}{allow}")
            raise PfedkitError(f"cannot resume from {path}: it was written with {k}={short_repr(theirs.get(k))} but "
                               f"{self.out / 'config.yaml'} says {short_repr(mine.get(k))}{more}; restore the config or "
                               f"{again}")
        init = self.model.state()
        expected = {"server": self.algo.init_server(init), "clients": self.clients.init_states(init),
                    "sampler": self.sampler.init_state(self.model.param_size, init),
                    "torch_rng": torch.get_rng_state()}
        for key, want in expected.items():
            problem = structure_mismatch(want, ck[key], key)
            if problem:
                raise PfedkitError(f"cannot resume from {path}: {problem} (another model, dataset or client count?); "
                                   f"{again}")
        totals = ck["totals"]
        if not (isinstance(ck["metrics"], list) and all(row_problem(r) is None for r in ck["metrics"])
                and isinstance(totals, dict) and isinstance(totals.get("round"), int)
                and 0 <= totals["round"] <= self.cfg.rounds):
            raise PfedkitError(f"cannot resume from {path}: its metrics or round counter are damaged; {again}")
        return ck

    def ended(self) -> bool:
        """Whether a resume leaves this run as it is: it failed (`--resume` does not retry it), stopped on an
        observer's request, or finished at `cfg.rounds`. A finished run whose config now asks for more rounds has
        not ended: it goes on from the checkpoint it finished with, as a run started with those rounds would (the
        generators are keyed by round, so the rounds it adds are those rounds' of the longer run)."""
        if (self.out / FAILED_FILE).is_file():
            return True
        path = self.out / "summary.json"
        if not path.is_file():
            return False
        try:
            done = json.loads(path.read_text())
        except (OSError, ValueError):
            done = None
        rounds = done.get("rounds") if isinstance(done, dict) else None
        if not isinstance(rounds, int) or rounds < 0:
            raise PfedkitError(f"cannot resume {self.out}: its summary.json is damaged (no round count); delete it to "
                               "run the run on from its checkpoint")
        if done.get("stop_reason") is not None or rounds == self.cfg.rounds:
            return True
        if rounds > self.cfg.rounds:
            raise PfedkitError(f"cannot resume {self.out}: it finished {rounds} rounds and its config asks for "
                               f"{self.cfg.rounds}; a finished run is not cut short (its metrics.jsonl holds every "
                               f"evaluation to round {rounds})")
        if not self.ckpt_path.is_file():
            raise PfedkitError(f"cannot run {self.out} on to {self.cfg.rounds} rounds: the checkpoint.pt it finished "
                               f"{rounds} rounds with is gone; start it afresh with `--set rounds={self.cfg.rounds}`")
        return False

    def save_checkpoint(self) -> None:
        checkpoint = {"server": self.server.state, "clients": self.clients.state(),
                      "sampler": self.server.sampler_state, "metrics": self.metrics, "totals": self.totals,
                      "torch_rng": torch.get_rng_state(), "config": self.cfg.to_dict(), "layout": self.model.layout,
                      "pfedkit": provenance()}
        atomic_write(self.ckpt_path, lambda fh: torch.save(checkpoint, fh))

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self, resume: bool = False, stop_after: int | None = None) -> dict | None:
        """Train to `cfg.rounds` and write summary.json; `stop_after` ends early as an interrupted run would.
        The run's own work (server, sampler, evaluation) runs on one intra-op thread, its clients' work on the
        runner's workers, each on one thread too: so its numbers depend neither on the machine's core count
        (`runtime.threads`) nor on the runs that share the process with it (runtime/batch_runs.py)."""
        return on_one_thread(self._run, resume, stop_after)

    def _run(self, resume: bool, stop_after: int | None) -> dict | None:
        if resume:
            if not self.ckpt_path.is_file():
                raise PfedkitError(f"cannot resume: {self.ckpt_path} does not exist")
            self._resume()
            (self.out / "summary.json").unlink(missing_ok=True)  # a finished run going on: written at its new end
        else:
            self._fresh()
        cfg = self.cfg
        if hasattr(self.clients, "bind_run"):
            self.clients.bind_run(self.out, self.totals["round"])
        for obs in self.observers:
            obs.start(self, resume)
        try:
            for rnd in range(self.totals["round"] + 1, cfg.rounds + 1):
                t0 = time.perf_counter()
                stats = self.server.train_round(rnd, self.clients)
                t = self.totals
                t["round"] = rnd
                t["bytes_up"] += stats.bytes_up
                t["bytes_down"] += stats.bytes_down
                t["server_s"] += stats.server_s
                row = None
                if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
                    row = self._evaluate(rnd, stats, t0)
                else:
                    t["wall_s"] += time.perf_counter() - t0
                for obs in self.observers:
                    obs.round_done(self, rnd, stats, row)
                if self.stop_reason is not None and row is not None and rnd < cfg.rounds:
                    self.save_checkpoint()  # the state it ended with, as a run that reached cfg.rounds keeps it
                    break
                if stop_after is not None and stop_after <= rnd < cfg.rounds:
                    return None
        except UpdateError as exc:  # recorded, so an experiment can report it beside the runs that finished
            atomic_write(self.out / FAILED_FILE, str(exc).encode())
            raise
        finally:
            for obs in self.observers:
                obs.close(self)
        if not hasattr(self, "last_per_client"):  # resumed after the last evaluation: evaluate again
            self.last_per_client = self._scores(cfg.rounds, False)[1]
        summary = self._summary()
        for obs in self.observers:
            obs.finish(self, summary)
        atomic_write(self.out / "summary.json", json.dumps(summary, indent=1).encode())
        return summary

    def release(self) -> None:
        """Let go of a finished run's training state (server, sampler, in-process clients; the files keep what was
        written): a comparison builds all its Runs first, and pFedLA's server state alone is gigabytes at N = 1,000."""
        self.server.state = self.server.sampler_state = None
        if hasattr(self.clients, "cstates"):
            self.clients.cstates = []

    def _scores(self, rnd: int, train_loss: bool) -> tuple[dict, np.ndarray]:
        scores = self.server.evaluate(rnd, self.clients, self.data.num_clients, train_loss)
        return metrics_row(scores, self.data.test_sizes, self.data.train_sizes, self.algo.has_global_model,
                           train_loss)

    def _evaluate(self, rnd: int, stats: RoundStats, t0: float) -> dict:
        """Evaluate every client and make the metrics row."""
        te = time.perf_counter()
        result, per_client = self._scores(rnd, self.cfg.eval_train)
        _sync(self.device)
        eval_s = time.perf_counter() - te
        t = self.totals
        t["wall_s"] += time.perf_counter() - t0
        row = {"round": rnd, **result, "train_loss": stats.train_loss(),
               "bytes_up": stats.bytes_up, "bytes_down": stats.bytes_down,
               "bytes_up_total": t["bytes_up"], "bytes_down_total": t["bytes_down"],
               "clients": stats.clients, "aggregated": stats.aggregated,
               "wall_s": t["wall_s"], "server_s": stats.server_s, "eval_s": eval_s}
        self.metrics.append(row)
        self.last_per_client = per_client
        return row

    def _first_round(self, key: str) -> int | None:
        """The first evaluated round whose `key` reached `target_acc` (None: never, or no target set)."""
        target = self.cfg.target_acc
        return next((r["round"] for r in self.metrics if target and r[key] is not None and r[key] >= target), None)

    def _summary(self) -> dict:
        last = self.metrics[-1]
        tail = self.metrics[-5:]
        return {
            "algorithm": self.cfg.algorithm, "dataset": self.data.name, "seed": self.cfg.seed, "pfedkit": provenance(),
            "rounds": self.cfg.rounds,
            **{k: v for k, v in last.items() if k not in ("bytes_up", "bytes_down")},
            "final_last5": float(np.mean([r["personalized_acc"] for r in tail])),
            "global_acc_last5": (float(np.mean([r["global_acc"] for r in tail]))
                                 if last["global_acc"] is not None else None),
            "mb_up_total": self.totals["bytes_up"] / 1e6, "mb_down_total": self.totals["bytes_down"] / 1e6,
            "server_s_total": self.totals["server_s"],
            "majority_label_acc": float(self.data.majority_label_accuracy().mean()),
            "majority_label_acc_weighted": float((self.data.majority_label_accuracy() * self.data.test_sizes).sum()
                                                 / max(int(self.data.test_sizes.sum()), 1)),
            "target_acc": self.cfg.target_acc or None,
            "stopped_at": self.totals["round"] if self.stop_reason else None, "stop_reason": self.stop_reason,
            "rounds_to_target": self._first_round("personalized_acc"),
            "rounds_to_target_global": self._first_round("global_acc"),
            "personalized_acc_per_client": [float(a) for a in self.last_per_client],
        }
