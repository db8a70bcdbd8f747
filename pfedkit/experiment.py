"""Run one or several algorithms on the same data, partition and client-sampling stream, and report them."""
from __future__ import annotations

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


def run_experiment(cfg: Config, out: Path, *, resume: bool = False, data: FederatedData | None = None,
                   log: Callable[[str], None] = print, stop_after: int | None = None) -> list[dict]:
    """Train every algorithm of `cfg` into `out/<algorithm>/`, then write comparison.md and comparison.png.
    With `seeds`, once per seed into `out/seed<s>/`, and the comparison gives mean ± std over the seeds.
    A run whose clients send non-finite updates is recorded (`failed.txt`) and the others still run; the
    experiment then ends with an error naming it."""
    summaries = _run_seeds(cfg, Path(out), resume, data, log, stop_after)
    folders = [Path(out) / f"seed{s}" for s in cfg.seed_list()] or [Path(out)]
    failed = [f / name / FAILED_FILE for f in folders for name in cfg.algorithms() if (f / name / FAILED_FILE).is_file()]
    if failed:
        first = failed[0]
        raise UpdateError(f"{len(failed)} run(s) failed, e.g. {first.parent.relative_to(out)}: "
                          f"{first.read_text()}; the other results are in {out}/comparison.md")
    return summaries


def _run_seeds(cfg: Config, out: Path, resume: bool, data: FederatedData | None, log: Callable[[str], None],
               stop_after: int | None) -> list[dict]:
    seeds = cfg.seed_list()
    if not seeds:
        return _run_algorithms(cfg, Path(out), resume, data or prepare(cfg), log, stop_after)
    out = Path(out)
    first = prepare(cfg.with_seed(seeds[0]))  # fail on bad input before writing anything
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        atomic_write(out / "config.yaml", dump_config(cfg).encode())
    summaries = []
    for i, seed in enumerate(seeds):
        one, seed_dir = cfg.with_seed(seed), out / f"seed{seed}"
        summaries += _run_algorithms(one, seed_dir, resume and seed_dir.is_dir(), first if i == 0 else prepare(one),
                                     log, stop_after)
    seed_dirs = [out / f"seed{s}" for s in seeds]
    table = write_seed_comparison(out, seed_dirs, cfg.algorithms(),
                                  f"# Comparison over seeds {cfg.seeds} on {first.summary()}")
    if cfg.plots:
        plot_seed_comparison(out, seed_dirs, cfg.algorithms())
    log(table.read_text())
    return summaries


def _run_algorithms(cfg: Config, out: Path, resume: bool, data: FederatedData, log: Callable[[str], None],
                    stop_after: int | None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        atomic_write(out / "config.yaml", dump_config(cfg).encode())
    log(data.summary())
    run_dirs, summaries = [], []
    for name in cfg.algorithms():
        run_dir = out / name
        run_dirs.append(run_dir)
        if resume and ((run_dir / "summary.json").is_file() or (run_dir / FAILED_FILE).is_file()):
            continue
        again = resume and (run_dir / "checkpoint.pt").is_file()
        try:
            summary = Run(cfg.for_algorithm(name), data, run_dir).run(resume=again, stop_after=stop_after)
        except UpdateError as exc:  # e.g. a study's largest step size diverges: Run recorded it; run the others
            log(f"{name}: {exc}")
            continue
        if summary is None:  # stopped early on request
            return summaries
        summaries.append(summary)
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


def resume_experiment(path: Path, log: Callable[[str], None] = print) -> list[dict]:
    """`pfedkit run --resume DIR`: DIR is an experiment folder or one algorithm's run folder."""
    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise PfedkitError(f"cannot resume: {path / 'config.yaml'} not found (is {path} a pfedkit run folder?)")
    if (path / "checkpoint.pt").is_file() and not any((p / "config.yaml").is_file() for p in path.iterdir()
                                                      if p.is_dir()):
        cfg = load_config(path / "config.yaml")
        data = prepare(cfg)
        summary = Run(cfg, data, path).run(resume=True)
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
    return run_experiment(cfg, path, resume=True, log=log)
