"""Run one or several algorithms on the same data, partition and client-sampling stream, and report them."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from .config import Config, dump_config, load_config
from .data import FederatedData, build_federated
from .engine import Observer, Run, atomic_write
from .engine.run import JobProgress, ProgressBar, keep_config_current
from .runtime import batch_runs
from .engine import folder as run_folder
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
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    return build_federated(cfg, device)


def default_out(cfg: Config) -> Path:
    return Path("runs") / f"{cfg.dataset.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_out(out: Path, overwrite: bool, config: Path | None = None) -> None:
    """Refuse an output folder that would lose or mix results, before anything is written: a file, a place that
    cannot be written, a folder in use by another run, or a folder that already holds something (a pfedkit run is
    replaced only with `overwrite`, and only if it holds nothing pfedkit did not write: run_folder.refuse_to_replace)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PfedkitError(f"--out {out} is a file, not a folder; choose another --out")
    parent = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PfedkitError(f"--out {out}: {parent} is not a writable folder; choose another --out")
    if not out.is_dir():
        return
    if run_folder.holder(run_folder.root_of(out)) is not None:
        raise PfedkitError(f"--out {run_folder.in_use(run_folder.root_of(out))}")
    _check_contents(out, overwrite, config)


def _check_contents(out: Path, overwrite: bool, config: Path | None) -> None:
    if not any(p.name not in run_folder.KEPT for p in out.iterdir()):
        return
    if not is_run_folder(out):
        raise PfedkitError(f"--out {out} is a folder with other files in it, not a pfedkit run (no "
                           f"{run_folder.MARKER} marker; or a run of an older pfedkit); choose an empty or new folder")
    if not overwrite:
        raise PfedkitError(f"--out {out} already holds a run: continue it with `pfedkit run --resume {out}`, or "
                           "replace it with --overwrite")
    why = run_folder.refuse_to_replace(out, config)
    if why:
        raise PfedkitError(why)


def is_run_folder(path: Path) -> bool:
    """A folder pfedkit made for a run (its marker says so)."""
    return run_folder.is_marked(path)


def run_experiment(cfg: Config, out: Path, *, resume: bool = False, overwrite: bool = False,
                   data: FederatedData | None = None, log: Callable[[str], None] = print,
                   stop_after: int | None = None, runtime: dict | None = None, config_file: Path | None = None,
                   allow_version_change: bool = False, observers: list[Observer] = ()) -> list[dict]:
    """Train every algorithm of `cfg` into `out/<algorithm>/`, then write comparison.md and comparison.png.
    With `seeds`, once per seed into `out/seed<s>/`, and the comparison gives mean ± std over the seeds.
    Every run is built (data, model, algorithm, sampler: everything that can refuse the config) before anything is
    written; `out` must be new or empty unless `overwrite` (or `resume`). A run whose clients send non-finite
    updates is recorded (`failed.txt`) and the others still run; the experiment then ends with an error naming it.
    `config_file`: where `cfg` was read from (an overwrite never deletes it); `allow_version_change`: a resume
    continues a run that another pfedkit started; `observers`: engine.Observer objects that every run calls (a
    logger, early stopping, report.tensorboard.TensorBoard). `runtime`: how runs reach their clients (Flower's
    ServerApp gives `clients_for` and `min_replies`)."""
    out = Path(out)
    runtime = {**(runtime or {}), "observers": list(observers), "across_versions": allow_version_change}
    if not resume:
        check_out(out, overwrite, config_file)
    plan = _plan(cfg, out, resume, data, log, runtime)
    with _claim(out, resume, overwrite, config_file, allow_version_change):
        summaries = _run_plans([plan], log, stop_after)
    _raise_failed([plan])
    return summaries


def run_experiments(experiments: list[tuple[Config, Path, bool]], *, log: Callable[[str], None] = print,
                    allow_version_change: bool = False) -> list[dict]:
    """Several experiments, each `(cfg, out, resume)` as `run_experiment` would run it (a fresh `out` must be new or
    empty; a resumed one continues with its config), as one job where `runtime.batch_runs` pays: every experiment's
    runs of every seed side by side (a reproduction's columns). Each experiment's folders, files and comparisons are
    what it writes alone. Every experiment is built before anything is written."""
    for cfg, out, resume in experiments:
        if not resume:
            check_out(Path(out), False)
    runtime = {"observers": [], "across_versions": allow_version_change}
    plans = [_plan(cfg, Path(out), resume, None, log, runtime) for cfg, out, resume in experiments]
    with contextlib.ExitStack() as claims:
        for plan in plans:
            claims.enter_context(_claim(plan.out, plan.resume, False, None, allow_version_change))
        summaries = _run_plans(plans, log, None)
    _raise_failed(plans)
    return summaries


def _raise_failed(plans: list[Plan]) -> None:
    failed = [d / name / FAILED_FILE for p in plans for d in p.dirs() for name in p.cfg.algorithms()
              if (d / name / FAILED_FILE).is_file()]
    if failed:
        first, out = failed[0], next(p.out for p in plans if p.out in failed[0].parents)
        raise UpdateError(f"{len(failed)} run(s) failed, e.g. {first.parent.relative_to(out)}: "
                          f"{first.read_text()}; the other results are in {out}/comparison.md")


def build_runs(cfg: Config, data: FederatedData, out: Path, runtime: dict | None = None,
               log: Callable[[str], None] = print) -> list[Run]:
    """One Run per algorithm spec: each checks its own keys (variants such as `heurpfedla@k=99`, the sampler an
    algorithm can use, the `local.*` keys it reads) without writing anything."""
    return [_one_run(cfg.for_algorithm(name), data, out / name, runtime, log) for name in cfg.algorithms()]


def _one_run(cfg: Config, data: FederatedData, out: Path, runtime: dict | None, log: Callable[[str], None]) -> Run:
    runtime = runtime or {}
    clients = runtime["clients_for"](cfg, data) if "clients_for" in runtime else None
    return Run(cfg, data, out, clients=clients, min_replies=runtime.get("min_replies", 1), log=log,
               observers=runtime.get("observers", ()), across_versions=runtime.get("across_versions", False))


@contextlib.contextmanager
def _claim(out: Path, resume: bool, overwrite: bool, config: Path | None, allow_version_change: bool
           ) -> Iterator[None]:
    """The first write of an experiment: `out` created and held by this run for the block (a second run into it
    is refused); a resume goes on only with the pfedkit that started it (or when allowed); a fresh run checks `out`
    again under the lock (another run may have started there since the first check), clears an --overwrite'n run
    of pfedkit's own files (so no stale run of another config stays beside the new ones) and marks the folder as
    this pfedkit's."""
    with run_folder.locked(run_folder.root_of(out)):
        if resume:
            run_folder.check_version(out, allow_version_change)
        else:
            _check_contents(out, overwrite, config)
            if run_folder.is_marked(out):
                run_folder.clear(out)
            run_folder.mark(out)
        yield


@dataclasses.dataclass
class Plan:
    """One experiment, built before anything is written (everything that can refuse its config has been built): its
    config, folder, and its first seed's data and runs; another seed's are built when it runs (`seed_folder`), so
    that only one seed's runs are in memory unless they run side by side."""
    cfg: Config
    out: Path
    resume: bool
    first: FederatedData
    runs: list[Run]
    runtime: dict | None
    log: Callable[[str], None]

    def dirs(self) -> list[Path]:
        """Where each seed's runs go (`out` itself without seeds)."""
        return [self.out / f"seed{s}" for s in self.cfg.seed_list()] or [self.out]

    def seed_folder(self, i: int) -> Folder:
        seeds = self.cfg.seed_list()
        if not seeds:
            return Folder(self.cfg, self.out, self.resume, self.first, self.runs)
        one, seed_dir = self.cfg.with_seed(seeds[i]), self.out / f"seed{seeds[i]}"
        data = self.first if i == 0 else prepare(one)
        if self.resume and seed_dir.is_dir():
            keep_config_current(seed_dir, one)
        return Folder(one, seed_dir, self.resume and seed_dir.is_dir(), data,
                      self.runs if i == 0 else build_runs(one, data, seed_dir, self.runtime, self.log))

    def begin(self) -> None:
        if self.cfg.seed_list() and not self.resume:
            atomic_write(self.out / "config.yaml", dump_config(self.cfg).encode())

    def end(self) -> None:
        """The comparison over seeds (one seed's comparison is written when its runs end: `_close_folder`)."""
        if not self.cfg.seed_list():
            return
        seed_dirs = self.dirs()
        table = write_seed_comparison(self.out, seed_dirs, self.cfg.algorithms(),
                                      f"# Comparison over seeds {self.cfg.seeds} on {self.first.summary()}")
        if self.cfg.plots:
            plot_seed_comparison(self.out, seed_dirs, self.cfg.algorithms())
        self.log(table.read_text())


def _plan(cfg: Config, out: Path, resume: bool, data: FederatedData | None, log: Callable[[str], None],
          runtime: dict | None) -> Plan:
    seeds = cfg.seed_list()
    if not seeds:
        data = data or prepare(cfg)
        return Plan(cfg, out, resume, data, build_runs(cfg, data, out, runtime, log), runtime, log)
    first = prepare(cfg.with_seed(seeds[0]))  # fail on bad input before writing anything
    runs = build_runs(cfg.with_seed(seeds[0]), first, out / f"seed{seeds[0]}", runtime, log)
    for seed in seeds[1:]:  # each seed draws its own partition, which may refuse: check it now, keep only one
        build_runs(cfg.with_seed(seed), prepare(cfg.with_seed(seed)), out / f"seed{seed}")
    return Plan(cfg, out, resume, first, runs, runtime, log)


def _run_plans(plans: list[Plan], log: Callable[[str], None], stop_after: int | None) -> list[dict]:
    for plan in plans:
        plan.begin()
    seeds = [(plan, i) for plan in plans for i in range(len(plan.dirs()))]
    if _batched(plans[0].cfg, [r for plan, _ in seeds for r in plan.runs]):  # side by side, a seed's data shared
        groups = _memory_steps(seeds, log)
    else:  # one seed's runs in memory at a time
        groups = [[j] for j in range(len(seeds))]
    summaries = [s for group in groups
                 for s in _run_folders([seeds[j][0].seed_folder(seeds[j][1]) for j in group], log, stop_after)]
    for plan in plans:
        plan.end()
    return summaries


def _memory_steps(seeds: list[tuple[Plan, int]], log: Callable[[str], None]) -> list[list[int]]:
    """The seeds' runs in as few steps as `runtime.job_memory_gb` allows (each step one job), said in one line when
    more than one: a seed's need is its data and twice its runs' fresh training state (the working copies)."""
    runtime = seeds[0][0].cfg.runtime
    budget = int(runtime.job_memory_gb * 1e9) if runtime.job_memory_gb else int(0.8 * batch_runs.free_memory())
    needs = {id(plan): _data_bytes(plan.first) + 2 * sum(_state_bytes(run) for run in plan.runs)
             for plan, _ in seeds}
    sizes = [needs[id(plan)] for plan, _ in seeds]
    groups = batch_runs.steps(sizes, budget)
    if len(groups) > 1:
        log(f"runs: {sum(len(plan.runs) for plan, _ in seeds)} in {len(groups)} steps to fit memory (each step one "
            f"job of at most {budget / 1e9:.1f} GB, runtime.job_memory_gb; a seed's runs need about "
            f"{max(sizes) / 1e9:.2f} GB)")
    return groups


def _data_bytes(data: FederatedData) -> int:
    return sum(t.nbytes for t in (data.x_train, data.y_train, data.x_test, data.y_test))


def _state_bytes(run: Run) -> int:
    """Bytes of a run's fresh training state (server, sampler, clients), built and let go (its own generators: no
    stream of the run is drawn from)."""
    rng = torch.get_rng_state()
    try:
        init = run.model.state()
        run.server.reset(init)
        run.clients.reset(init)
        return _tensor_bytes([run.server.state, run.server.sampler_state, run.clients.state()])
    finally:
        run.release()
        torch.set_rng_state(rng)


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


@dataclasses.dataclass
class Folder:
    """One seed's experiment folder: its config, where it goes, whether it resumes, its data and its runs."""
    cfg: Config
    out: Path
    resume: bool
    data: FederatedData
    runs: list[Run]


def _batched(cfg: Config, runs: list[Run]) -> bool:
    """Whether these runs go side by side (`runtime.batch_runs`, where batch_runs.pays): runs in process only (a
    Flower deployment's runs keep their own clients), with observers that may be called side by side."""
    runners = [getattr(r.clients, "runner", None) for r in runs]
    return (cfg.runtime.batch_runs and all(runners) and batch_runs.pays(runners)
            and all(o.side_by_side for r in runs for o in r.observers))


def _run_folders(folders: list[Folder], log: Callable[[str], None], stop_after: int | None) -> list[dict]:
    """Every folder's runs, side by side (`_batched`) or one after another, then each folder's comparison; runs that
    ended before a resume are left as they are (`Run.ended`: a finished one given more rounds goes on)."""
    todo = []  # (folder, name, run, resumes from its checkpoint)
    for f in folders:
        _open_folder(f, log)
        for name, run in zip(f.cfg.algorithms(), f.runs):
            if f.resume and run.ended():
                continue
            todo.append((f, name, run, f.resume and run.ckpt_path.is_file()))
    runs = [(run, again) for _, _, run, again in todo]
    results = _side_by_side(runs, log, stop_after) if _batched(folders[0].cfg, [r for r, _ in runs]) else None
    if results is None:
        for f in folders:
            if f.runs and hasattr(f.runs[0].clients, "runner"):  # in process: the way the clients train, said once
                log(f.runs[0].clients.runner.describe())
        results = _one_after_another(runs, stop_after)
    summaries = []
    for (f, name, run, _), result in zip(todo, results):
        if isinstance(result, UpdateError):  # e.g. a study's largest step size diverges: Run recorded it
            log(f"{name}: {result}")
        elif isinstance(result, BaseException):
            raise result
        elif result is not None:
            summaries.append(result)
            if f.cfg.plots:
                plot_run(f.out / name)
    if len(results) < len(todo) or any(r is None for r in results):
        return summaries  # stopped early on request
    for f in folders:
        _close_folder(f, log)
    return summaries


def _side_by_side(runs: list[tuple[Run, bool]], log: Callable[[str], None], stop_after: int | None) -> list | None:
    """The runs as one job (runtime/batch_runs.py), one progress bar for all; None where no thread could start."""
    runners = [run.clients.runner for run, _ in runs]
    bar = JobProgress(sum(run.cfg.rounds for run, _ in runs), runs[0][0].cfg.progress)
    own = [run.observers for run, _ in runs]
    for run, _ in runs:
        run.observers = [o for o in run.observers if not isinstance(o, ProgressBar)] + [bar]
    try:
        results = batch_runs.together([functools.partial(_one_of, run, again, stop_after) for run, again in runs],
                                      runners, lambda: log(batch_runs.describe(len(runs), runners)))
    finally:
        bar.end()
    if results is None:
        for (run, _), observers in zip(runs, own):
            run.observers = observers
    return results


def _one_after_another(runs: list[tuple[Run, bool]], stop_after: int | None) -> list:
    results = []
    for run, again in runs:
        results.append(_one_of(run, again, stop_after))
        if results[-1] is None:  # stopped early on request: the others wait for the next call
            break
    return results


def _one_of(run: Run, again: bool, stop_after: int | None) -> dict | UpdateError | None:
    """One run to its end: its summary, the error that stopped it (recorded in its folder), or None (stopped early
    on request); its training state let go once it finished."""
    try:
        summary = run.run(resume=again, stop_after=stop_after)
    except UpdateError as exc:
        return exc
    if summary is not None:
        run.release()  # a finished run's state out of memory while the others go on
    return summary


def _open_folder(f: Folder, log: Callable[[str], None]) -> None:
    f.out.mkdir(parents=True, exist_ok=True)
    if not f.resume:
        run_folder.mark(f.out)
        atomic_write(f.out / "config.yaml", dump_config(f.cfg).encode())
    log(f.data.summary())
    for warning in f.data.warnings:
        log(f"warning: {warning}")


def _close_folder(f: Folder, log: Callable[[str], None]) -> None:
    cfg, out, data = f.cfg, f.out, f.data
    run_dirs = [out / name for name in cfg.algorithms()]
    header = f"# Comparison on {data.summary()}\n\nConfig: `{out / 'config.yaml'}`; seed {cfg.seed}, " \
             f"{cfg.rounds} rounds, {cfg.clients_per_round or data.num_clients} clients per round."
    table = write_comparison(out, run_dirs, header)
    if cfg.plots:
        plot_comparison(out, run_dirs)
    log(table.read_text())
    log(f"wrote {out}/")


def resume_experiment(path: Path, log: Callable[[str], None] = print, runtime: dict | None = None,
                      allow_version_change: bool = False, observers: list[Observer] = ()) -> list[dict]:
    """`pfedkit run --resume DIR`: DIR is an experiment folder or one algorithm's run folder; a run that another
    pfedkit started is continued only with `allow_version_change`."""
    path = Path(path)
    runtime = {**(runtime or {}), "observers": list(observers), "across_versions": allow_version_change}
    if not (path / "config.yaml").is_file():
        raise PfedkitError(f"cannot resume: {path / 'config.yaml'} not found (is {path} a pfedkit run folder?)")
    one_run = (path / "algorithm.json").is_file() or (path / "metrics.jsonl").is_file()
    if one_run:  # one algorithm's folder: it continues from its own checkpoint or not at all
        if (path / FAILED_FILE).is_file():
            raise PfedkitError(f"cannot resume {path}: the run failed ({FAILED_FILE}: "
                               f"{(path / FAILED_FILE).read_text()[:200]}); start a new one with another --out")
        if not (path / "checkpoint.pt").is_file() and not (path / "summary.json").is_file():
            seeds = path.parent.name.startswith("seed") and (path.parent.parent / "config.yaml").is_file()
            raise PfedkitError(f"cannot resume {path}: it holds no checkpoint.pt (the run stopped before its first "
                               f"checkpoint); resume the experiment it belongs to, `pfedkit run --resume "
                               f"{path.parent.parent if seeds else path.parent}`, which starts this run afresh and "
                               "continues the others")
        cfg = load_config(path / "config.yaml")
        data = prepare(cfg)
        run = _one_run(cfg, data, path, runtime, log)
        if run.ended():
            raise PfedkitError(f"cannot resume {path}: the run has finished its {cfg.rounds} rounds (summary.json); to "
                               "run it on, raise `rounds` in its config.yaml")
        with run_folder.locked(run_folder.root_of(path)):
            run_folder.check_version(path, allow_version_change)
            summary = run.run(resume=True)
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
    return run_experiment(cfg, path, resume=True, log=log, runtime=runtime, allow_version_change=allow_version_change,
                          observers=runtime["observers"])
