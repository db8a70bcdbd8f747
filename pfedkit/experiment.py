"""Run one or several algorithms on the same data, partition and client-sampling stream, and report them."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from .config import Config, dump_config, load_config
from .data import FederatedData, build_federated
from .engine import Run, atomic_write
from .errors import FAILED_FILE, ConfigError, PfedkitError, UpdateError
from .report.plots import plot_comparison, plot_run, plot_seed_comparison
from .report.tables import write_comparison, write_seed_comparison


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'device': cuda is not available on this machine; allowed here: cpu, auto")
    return torch.device(name)


def prepare(cfg: Config) -> FederatedData:
    """Everything that can fail on bad input, before anything is written."""
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return build_federated(cfg, device)


def default_out(cfg: Config) -> Path:
    return Path("runs") / f"{cfg.dataset.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an output folder that would lose or mix results, before anything is written: a file, a place that
    cannot be written, or a folder that already holds something (a run: replaced only with `overwrite`)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PfedkitError(f"--out {out} is a file, not a folder; choose another --out")
    parent = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PfedkitError(f"--out {out}: {parent} is not a writable folder; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not is_run_folder(out):
            raise PfedkitError(f"--out {out} is a folder with other files in it, not a pfedkit run; choose an empty "
                               "or new folder")
        if not overwrite:
            raise PfedkitError(f"--out {out} already holds a run: continue it with `pfedkit run --resume {out}`, or "
                               "replace it with --overwrite")


def is_run_folder(path: Path) -> bool:
    return (Path(path) / "config.yaml").is_file()


def run_experiment(cfg: Config, out: Path, *, resume: bool = False, overwrite: bool = False,
                   data: FederatedData | None = None, log: Callable[[str], None] = print,
                   stop_after: int | None = None, runtime: dict | None = None) -> list[dict]:
    """Train every algorithm of `cfg` into `out/<algorithm>/`, then write comparison.md and comparison.png.
    With `seeds`, once per seed into `out/seed<s>/`, and the comparison gives mean ± std over the seeds.
    Every run is built (data, model, algorithm, sampler: everything that can refuse the config) before anything is
    written; `out` must be new or empty unless `overwrite` (or `resume`). A run whose clients send non-finite
    updates is recorded (`failed.txt`) and the others still run; the experiment then ends with an error naming it."""
    out = Path(out)
    if not resume:
        check_out(out, overwrite)
    summaries = _run_seeds(cfg, out, resume, data, log, stop_after, runtime)
    folders = [out / f"seed{s}" for s in cfg.seed_list()] or [out]
    failed = [f / name / FAILED_FILE for f in folders for name in cfg.algorithms() if (f / name / FAILED_FILE).is_file()]
    if failed:
        first = failed[0]
        raise UpdateError(f"{len(failed)} run(s) failed, e.g. {first.parent.relative_to(out)}: "
                          f"{first.read_text()}; the other results are in {out}/comparison.md")
    return summaries


def build_runs(cfg: Config, data: FederatedData, out: Path, runtime: dict | None = None,
               log: Callable[[str], None] = print) -> list[Run]:
    """One Run per algorithm spec: each checks its own keys (variants such as `heurpfedla@k=99`, the sampler an
    algorithm can use, the `local.*` keys it reads) without writing anything."""
    return [_one_run(cfg.for_algorithm(name), data, out / name, runtime, log) for name in cfg.algorithms()]


def _one_run(cfg: Config, data: FederatedData, out: Path, runtime: dict | None, log: Callable[[str], None]) -> Run:
    if not runtime:
        return Run(cfg, data, out, log=log)
    return Run(cfg, data, out, clients=runtime["clients_for"](cfg, data), min_replies=runtime.get("min_replies", 1),
               log=log)


def _start(out: Path, resume: bool) -> None:
    """The first write of an experiment: an --overwrite'n run folder is emptied (so no stale run of another config
    stays beside the new ones), then created."""
    if not resume and out.is_dir() and is_run_folder(out):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _run_seeds(cfg: Config, out: Path, resume: bool, data: FederatedData | None, log: Callable[[str], None],
               stop_after: int | None, runtime: dict | None = None) -> list[dict]:
    seeds = cfg.seed_list()
    if not seeds:
        data = data or prepare(cfg)
        runs = build_runs(cfg, data, out, runtime, log)
        _start(out, resume)
        return _run_algorithms(cfg, out, resume, data, log, stop_after, runs)
    first = prepare(cfg.with_seed(seeds[0]))  # fail on bad input before writing anything
    runs = build_runs(cfg.with_seed(seeds[0]), first, out / f"seed{seeds[0]}", runtime, log)
    for seed in seeds[1:]:  # each seed draws its own partition, which may refuse: check it now, keep only one
        build_runs(cfg.with_seed(seed), prepare(cfg.with_seed(seed)), out / f"seed{seed}")
    _start(out, resume)
    if not resume:
        atomic_write(out / "config.yaml", dump_config(cfg).encode())
    summaries = []
    for i, seed in enumerate(seeds):
        one, seed_dir = cfg.with_seed(seed), out / f"seed{seed}"
        seed_data = first if i == 0 else prepare(one)
        summaries += _run_algorithms(one, seed_dir, resume and seed_dir.is_dir(), seed_data, log, stop_after,
                                     runs if i == 0 else build_runs(one, seed_data, seed_dir, runtime, log))
    seed_dirs = [out / f"seed{s}" for s in seeds]
    table = write_seed_comparison(out, seed_dirs, cfg.algorithms(),
                                  f"# Comparison over seeds {cfg.seeds} on {first.summary()}")
    if cfg.plots:
        plot_seed_comparison(out, seed_dirs, cfg.algorithms())
    log(table.read_text())
    return summaries


def _run_algorithms(cfg: Config, out: Path, resume: bool, data: FederatedData, log: Callable[[str], None],
                    stop_after: int | None, runs: list[Run]) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        atomic_write(out / "config.yaml", dump_config(cfg).encode())
    log(data.summary())
    for warning in data.warnings:
        log(f"warning: {warning}")
    run_dirs, summaries = [], []
    for name, run in zip(cfg.algorithms(), runs):
        run_dir = out / name
        run_dirs.append(run_dir)
        if resume and ((run_dir / "summary.json").is_file() or (run_dir / FAILED_FILE).is_file()):
            continue
        again = resume and (run_dir / "checkpoint.pt").is_file()
        try:
            summary = run.run(resume=again, stop_after=stop_after)
        except UpdateError as exc:  # e.g. a study's largest step size diverges: Run recorded it; run the others
            log(f"{name}: {exc}")
            continue
        if summary is None:  # stopped early on request
            return summaries
        summaries.append(summary)
        run.release()  # one run's training state in memory at a time
        if cfg.plots:
            plot_run(run_dir)
    header = f"# Comparison on {data.summary()}\n\nConfig: `{out / 'config.yaml'}`; seed {cfg.seed}, " \
             f"{cfg.rounds} rounds, {cfg.clients_per_round or data.num_clients} clients per round."
    table = write_comparison(out, run_dirs, header)
    if cfg.plots:
        plot_comparison(out, run_dirs)
    log(table.read_text())
    log(f"wrote {out}/")
    return summaries


def resume_experiment(path: Path, log: Callable[[str], None] = print, runtime: dict | None = None) -> list[dict]:
    """`pfedkit run --resume DIR`: DIR is an experiment folder or one algorithm's run folder."""
    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise PfedkitError(f"cannot resume: {path / 'config.yaml'} not found (is {path} a pfedkit run folder?)")
    one_run = (path / "algorithm.json").is_file() or (path / "metrics.jsonl").is_file()
    if one_run:  # one algorithm's folder: it continues from its own checkpoint or not at all
        if (path / "summary.json").is_file():
            raise PfedkitError(f"cannot resume {path}: the run has finished (summary.json); start a new one with "
                               "another --out")
        if not (path / "checkpoint.pt").is_file():
            raise PfedkitError(f"cannot resume {path}: it holds no checkpoint.pt (the run stopped before its first "
                               f"checkpoint); start it again with `pfedkit run ... --out {path} --overwrite`")
        cfg = load_config(path / "config.yaml")
        data = prepare(cfg)
        summary = _one_run(cfg, data, path, runtime, log).run(resume=True)
        if cfg.plots:
            plot_run(path)
        parent = path.parent
        if (parent / "comparison.md").is_file():
            parent_cfg = load_config(parent / "config.yaml")
            dirs = [parent / n for n in parent_cfg.algorithms()]
            write_comparison(parent, dirs, (parent / "comparison.md").read_text().split("\n\n")[0])
            if cfg.plots:
                plot_comparison(parent, dirs)
        return [summary]
    cfg = load_config(path / "config.yaml")
    return run_experiment(cfg, path, resume=True, log=log, runtime=runtime)
