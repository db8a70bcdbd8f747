"""`pfedkit reproduce`: the papers' tables and figures, every method on the same partitions and sampling streams,
our mean ± sample std over seeds next to the paper's number in each cell.

Each column of a table is one preset of `pfedkit/configs/` (`<name>_reduced.yaml` for `--scale reduced`, sized for 2 CPU
cores; `<name>_converged.yaml` for `--scale converged`, the paper's data per client run until the methods are flat;
`<name>.yaml` the paper's protocol) run with the table's methods and seeds into `<out>/<column>/` (an interrupted
reproduction resumes where it stopped when run again with the same --out). The table is then written from the runs'
summary.json and metrics.jsonl files: `<out>/<target>.md` and `<out>/<target>.png`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from scipy import stats

from .config import BATCHNORM_MODELS, algorithm_sections, load_config
from .engine.files import RESUMABLE_KEYS, atomic_write, flatten_config, resumable
from .errors import ConfigError, UpdateError
from .experiment import is_run_folder, prepare, run_experiments
from .report import papers

from . import PRESETS
PFEDLA_METHODS = ("local", "fedavg", "perfedavg", "pfedme", "pfedhn", "fedbn", "fedrep", "fedfomo", "pfedla",
                  "heurpfedla")
PFEDCS_METHODS = ("fedavg", "perfedavg", "fedprox", "fedtc", "pfedme", "pfedcs")
LABELS = {"emnist": "EMNIST", "fmnist": "FMNIST", "cifar10": "CIFAR10", "cifar100": "CIFAR100", "mnist": "MNIST",
          "synthetic": "Synthetic", "mlr": "MLR", "dnn": "DNN"}


@dataclass(frozen=True)
class Column:
    key: tuple  # how the paper's numbers are keyed, e.g. ("fmnist", 10) or ("synthetic", "mlr")
    preset: str  # path under pfedkit/configs/ without the _reduced/.yaml suffix

    @property
    def label(self) -> str:
        return " ".join(LABELS.get(str(k), str(k)) for k in self.key)

    @property
    def folder(self) -> str:
        return "_".join(str(k) for k in self.key)


@dataclass(frozen=True)
class Target:
    name: str
    datasets: tuple[str, ...]
    columns: Callable[[str], list[Column]]
    methods: tuple[str, ...] | None  # None: the preset's own list (Table 3's k sweep, Fig. 6)
    what: str  # the note under the table: the metric and its source


TARGETS = {t.name: t for t in (
    Target("table1", ("emnist", "fmnist", "cifar10", "cifar100"),
           lambda d: [Column((d, n), f"pfedla/table1_{d}_{n}clients") for n in (10, 100)], PFEDLA_METHODS,
           "pFedLA paper, Table 1 (non-IID 1: 4 classes per client, 12 for CIFAR-100). Metric: personalized test "
           "accuracy %, unweighted mean over clients at the final round, as the paper reports."),
    Target("table2", ("emnist", "fmnist", "cifar10", "cifar100"),
           lambda d: [Column((d, n), f"pfedla/table2_{d}_{n}clients") for n in (10, 100)], PFEDLA_METHODS,
           "pFedLA paper, Table 2 (non-IID 2: all classes, two (six) dominant). Metric: personalized test accuracy "
           "%, unweighted mean over clients at the final round, as the paper reports."),
    Target("table3", ("emnist", "fmnist", "cifar10"), lambda d: [Column((d, "k"), f"pfedla/table3_{d}_k")], None,
           "pFedLA paper, Table 3 (10 clients, all every round): HeurpFedLA's k retained layers against personalized "
           "accuracy (mean over clients) and communication. Ours: MB down / MB up+down over all rounds."),
    Target("fig6", ("fmnist",), lambda d: [Column((d, "chain"), f"pfedla/fig6_chain_{d}")], None,
           "pFedLA paper, Fig. 6 (8 clients in a chain, client i shares 3 of its 4 classes with client i+1): the "
           "paper shows the self-weight largest and the neighbours next (no numbers). Ours: pFedLA's final weights "
           "alpha_i[j] of one layer, averaged over target clients by group."),
    Target("pfedcs-synthetic", ("synthetic",), lambda d: [Column((d, m), f"pfedcs/{d}_{m}") for m in ("mlr", "dnn")],
           PFEDCS_METHODS,
           "pFedCS paper (Synthetic(0.4, 0.6), 100 clients, 5 per round). Metrics pooled over all clients' test "
           "samples, as the pFedCS and pFedMe papers report: GM = the global model, PM = the personalized models. "
           "The paper gives only pFedCS's gain over each baseline (points): ours is pFedCS − method."),
    Target("pfedcs-mnist", ("mnist",), lambda d: [Column((d, m), f"pfedcs/{d}_{m}") for m in ("mlr", "dnn")],
           PFEDCS_METHODS,
           "pFedCS paper (MNIST, 100 clients with 2 labels each, 5 per round). Metrics pooled over all clients' test "
           "samples, as the pFedCS and pFedMe papers report: GM = the global model, PM = the personalized models. "
           "The paper gives only pFedCS's gain over each baseline (points): ours is pFedCS − method."),
)}


def columns_of(target: Target, dataset: str | None, column: str | None = None) -> list[Column]:
    if dataset is not None and dataset not in target.datasets:
        raise ConfigError(f"pfedkit reproduce {target.name}: no dataset {dataset!r}; allowed: "
                          f"{', '.join(target.datasets)}")
    columns = [c for d in ([dataset] if dataset else target.datasets) for c in target.columns(d)]
    if column is not None and column not in [c.folder for c in columns]:
        raise ConfigError(f"pfedkit reproduce {target.name}: no column {column!r}; allowed: "
                          f"{', '.join(c.folder for c in columns)}")
    return [c for c in columns if column in (None, c.folder)]


# --scale: (the presets' file suffix, what the scale is)
SCALES = {"reduced": ("_reduced", "*_reduced.yaml: fewer rounds and samples than the paper, for 2 CPU cores"),
          "converged": ("_converged", "*_converged.yaml: the paper's data per client, 1 local epoch, rounds until "
                        "the methods are flat (the Converged? rows say which are), for 2 CPU cores"),
          "full": ("", "the paper's protocol")}


def preset_path(column: Column, scale: str) -> Path:
    path = PRESETS / f"{column.preset}{SCALES[scale][0]}.yaml"
    if path.is_file():
        return path
    if scale == "converged":  # measured column by column: not every column has one
        have = sorted(p.name for p in PRESETS.glob("*/*_converged.yaml"))
        raise ConfigError(f"pfedkit reproduce: {column.label} has no --scale converged preset ({path.name}); "
                          f"the columns that have one: {', '.join(have)} (docs/reproduce.md, 'A converged scale')")
    raise ConfigError(f"pfedkit reproduce: the preset {path} is missing (the presets live in the source "
                      "package's configs/ folder: reinstall pfedkit)")


def column_config(target: Target, column: Column, scale: str, seeds: str, extra: list[str]):
    cfg = load_config(preset_path(column, scale), [f"seeds={seeds}", *extra], None)
    if target.methods is not None:  # FedBN only where the model has BatchNorm: the paper's "–" cells
        cfg.algorithm = ",".join(m for m in target.methods if m != "fedbn" or cfg.model.name in BATCHNORM_MODELS)
    return cfg


# keys that change how a run is shown or where it runs, not its protocol (a resumed run may also add rounds; a
# table's column may not)
HOW_NOT_WHAT = RESUMABLE_KEYS - {"rounds"}


def resolved(target_name: str, *, dataset: str | None = None, column: str | None = None, scale: str = "reduced",
             seeds: str = "0,1,2", extra: list[str] | None = None) -> list[dict]:
    """Each column's config as its runs would write it, without running or writing anything (`--dry-run`)."""
    target = TARGETS[target_name]
    return [{"target": target.name, "column": c.label, "scale": scale, "preset": str(preset_path(c, scale).relative_to(
        PRESETS.parent)), "config": column_config(target, c, scale, seeds, extra or []).to_dict()}
        for c in columns_of(target, dataset, column)]


def check_same_config(folder: Path, cfg, some_runs: bool = False) -> None:
    """A folder is resumed with the config it was started with; a different preset, --seeds or --set would
    silently be ignored (and the table would mix two protocols), so it is refused. `some_runs` (--table-only):
    a folder that `pfedkit run` of the column's preset wrote with some of the table's methods and seeds is read too
    (the others' cells say pending), whatever the sections of the methods it did not run say: each algorithm reads
    only its own, so a preset's change to one method leaves the kept runs of the others valid."""
    started = load_config(folder / "config.yaml")
    saved, wanted = flatten_config(started.to_dict()), flatten_config(cfg.to_dict())
    if some_runs and set(started.algorithms()) <= set(cfg.algorithms()):
        saved["algorithm"] = wanted["algorithm"]
        not_run = set(algorithm_sections()) - set(started.algorithms())
        saved, wanted = ({k: v for k, v in d.items() if k.split(".")[0] not in not_run} for d in (saved, wanted))
    if some_runs and started.seed_list() and set(started.seed_list()) <= set(cfg.seed_list()):
        saved["seeds"] = wanted["seeds"]
    changed = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k)
                     and not resumable(k, HOW_NOT_WHAT))
    if changed:
        raise ConfigError(f"pfedkit reproduce: {folder} holds runs of another config ({', '.join(changed[:4])} "
                          "differ); use another --out, or delete the folder to start it again")


def reproduce(target_name: str, out: Path, *, dataset: str | None = None, column: str | None = None,
              scale: str = "reduced", seeds: str = "0,1,2", extra: list[str] | None = None, run: bool = True,
              log: Callable[[str], None] = print, allow_version_change: bool = False,
              runs: list[Path] = ()) -> Path:
    """Run (or resume) every column of a table, then write its markdown table and figure; returns the table.
    With run=False only the table, from the runs finished so far: those in `<out>/<column>`, or with `runs` those
    in these folders (one column; each written by `pfedkit run` of its preset with some of the methods and seeds,
    e.g. a column run in parts on several machines)."""
    target = TARGETS[target_name]
    out, runs = Path(out), [Path(r) for r in runs]
    command = command_line(target.name, scale, seeds, dataset, column, extra, runs)
    columns = columns_of(target, dataset, column)
    configs = [column_config(target, c, scale, seeds, extra or []) for c in columns]  # refuse bad input first
    if runs and (run or len(columns) != 1):
        raise ConfigError("pfedkit reproduce: --runs goes with --table-only and one --column (the folders hold "
                          "that column's runs)")
    for folder in runs:
        if not is_run_folder(folder):
            raise ConfigError(f"pfedkit reproduce: --runs {folder} is not a folder that pfedkit run wrote")
    for folder, cfg in [(f, configs[0]) for f in runs] or [(out / c.folder, g) for c, g in zip(columns, configs)]:
        if is_run_folder(folder):
            check_same_config(folder, cfg, some_runs=not run)
    for cfg in configs if run else []:  # missing data (EMNIST, CIFAR: where to put the files), before any column
        prepare(cfg.with_seed(cfg.seed_list()[0]) if cfg.seed_list() else cfg)
    if run:  # every column's runs as one job where runtime.batch_runs pays; a resumed column goes on with its config
        for column in columns:
            log(f"== {target.name} {column.label}: {preset_path(column, scale).name} → {out / column.folder}")
        folders = [out / c.folder for c in columns]
        try:
            run_experiments([(load_config(f / "config.yaml") if is_run_folder(f) else cfg, f, is_run_folder(f))
                             for f, cfg in zip(folders, configs)], log=log, allow_version_change=allow_version_change)
        except UpdateError as exc:  # a diverged run is a failed cell; the other methods' cells still count
            log(str(exc))
    results = {c: collect(runs or [out / c.folder], cfg) for c, cfg in zip(columns, configs)}
    text = TABLES[target.name](target, results, out, scale, seeds, command)
    path = out / f"{target.name}.md"
    out.mkdir(parents=True, exist_ok=True)  # --table-only before any run
    atomic_write(path, text.encode())
    figure(target, results, out, out / f"{target.name}.png")
    log(text)
    log(f"wrote {path}")
    return path


FAILED = "failed"  # a run that stopped on non-finite updates (its failed.txt says why); None: not run yet


def collect(folders: list[Path], cfg) -> dict[str, list[dict | str | None]]:
    """Each method's summary per seed: the summary.json dict (with `<metric>_drift` for the tables' metrics, from
    its metrics.jsonl), FAILED, or None where the run has not finished, from whichever of `folders` holds it (a
    run ended in two of them is refused: which one the table shows would be a guess)."""
    seeds = cfg.seed_list()
    return {name: [_one_of([f / f"seed{s}" / name if seeds else f / name for f in folders])
                   for s in seeds or [None]] for name in cfg.algorithms()}


def _one_of(run_dirs: list[Path]) -> dict | str | None:
    ended = [d for d in run_dirs if (d / "summary.json").is_file() or (d / "failed.txt").is_file()]
    if len(ended) > 1:
        raise ConfigError(f"pfedkit reproduce: {ended[0]} and {ended[1]} are the same run of the table; "
                          "give --runs only one of their folders")
    if not ended:
        return None
    return finished(ended[0]) if (ended[0] / "summary.json").is_file() else FAILED


# A run has converged when its metric is flat at the end, by two measures: the mean of its last FLAT_WINDOW
# evaluations within FLAT_POINTS points of the mean of the FLAT_WINDOW before them (two windows average out the
# evaluation noise of a few hundred test samples a client; a run still rising by more is cut too early, whatever its
# last value), and, since two windows pass a climb of up to FLAT_POINTS a window, the least-squares line through the
# last TREND_EVALUATIONS evaluations rising (or falling) by at most FLAT_POINTS over the rounds they span.
FLAT_WINDOW, FLAT_POINTS, TREND_EVALUATIONS = 5, 0.5, 20
CURVE_KEYS = ("personalized_acc", "personalized_acc_weighted", "global_acc_weighted")  # the tables' metrics


def drift(values: list[float], window: int = FLAT_WINDOW) -> float | None:
    """How far a metric still moved at the end of a run: the mean of its last `window` values minus the mean of the
    `window` before them (None with fewer than 2 x window values)."""
    if len(values) < 2 * window:
        return None
    return float(np.mean(values[-window:]) - np.mean(values[-2 * window:-window]))


def fit_line(x, y) -> tuple[float, float]:
    """The least-squares slope of y over x and its standard error (how far the swings about the line leave it
    uncertain)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    dx = x - x.mean()
    slope = float(dx @ (y - y.mean()) / (dx @ dx))
    residual = y - y.mean() - slope * dx
    return slope, float(np.sqrt(residual @ residual / (len(x) - 2) / (dx @ dx)))


def trend(rounds: list[int], values: list[float], evaluations: int = TREND_EVALUATIONS) -> float | None:
    """How far a metric still climbs (or falls) at the end of a run: the slope of the least-squares line through its
    last `evaluations` values times the rounds they span, `evaluations` evaluation intervals (20 evaluations every
    25 rounds: points per 500 rounds). None with fewer values."""
    if len(values) < evaluations:
        return None
    x = rounds[-evaluations:]
    return fit_line(x, values[-evaluations:])[0] * (x[-1] - x[0]) * evaluations / (evaluations - 1)


def steady(drift_points: float | None, trend_points: float | None) -> bool:
    """The criterion on one run (both in points): the drift known and within FLAT_POINTS, and the trend within it
    too where the run has the TREND_EVALUATIONS evaluations to draw it."""
    return (drift_points is not None and abs(drift_points) <= FLAT_POINTS
            and (trend_points is None or abs(trend_points) <= FLAT_POINTS))


def finished(run_dir: Path) -> dict:
    from .report.plots import read_metrics  # validates each row (one PfedkitError naming the file)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    for key in CURVE_KEYS:
        evaluated = [r for r in rows if r.get(key) is not None]
        curve = [r[key] for r in evaluated]
        summary[f"{key}_drift"] = drift(curve)
        summary[f"{key}_trend"] = trend([r["round"] for r in evaluated], curve)
        summary[f"{key}_best"] = max(curve, default=None)  # the best evaluated round, as pFedMe's code reports
        last = curve[-TREND_EVALUATIONS:] if len(curve) >= TREND_EVALUATIONS else None  # the level a run swings
        summary[f"{key}_level"] = None if last is None else float(np.mean(last))  # about (a final cell is one draw)
        summary[f"{key}_swing"] = None if last is None else float(np.std(last, ddof=1))
    return summary


def metric(run: dict | str | None, key: str) -> float | None:
    return run.get(key) if isinstance(run, dict) else None


def mean_std(runs: list, key: str, scale: float = 100.0) -> tuple[float, float, int] | None:
    vals = [v * scale for v in (metric(r, key) for r in runs) if v is not None]
    if not vals:
        return None
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0, len(vals)


def fmt(runs: list, key: str) -> str:
    """mean ± sample std over the seeds that finished ("(2 of 3 seeds)" when some have not, "1 failed" when one
    of those diverged); else failed/pending."""
    stat = mean_std(runs, key)
    if stat is None:
        return FAILED if FAILED in runs else "pending"
    mean, std, n = stat
    text = f"{mean:.2f} ± {std:.2f}" if n > 1 else f"{mean:.2f}"
    failed = f", {runs.count(FAILED)} {FAILED}" if FAILED in runs else ""
    return text if n == len(runs) else f"{text} ({n} of {len(runs)} seeds{failed})"


def _seed_table(results: dict, heading: str, cell) -> list[str]:
    """A block of one row per column and method, one cell per seed: `cell(run)` for a finished run, else the run's
    state (failed / pending)."""
    seeds = max(len(v) for r in results.values() for v in r.values())
    lines = ["", heading, "", "| column | method | " + " | ".join(f"seed {i}" for i in range(seeds)) + " |",
             "|---|---|" + "---|" * seeds]
    for column, res in results.items():
        for name, runs in res.items():
            cells = [cell(r) if isinstance(r, dict) else r or "pending" for r in runs]
            lines.append(f"| {column.label} | {name} | " + " | ".join(cells) + " |")
    return lines


def _per_seed(results: dict, key: str, scale: float = 100.0) -> list[str]:
    return _seed_table(results, f"Per seed ({key}):",
                       lambda r: f"{metric(r, key) * scale:.2f}" if metric(r, key) is not None else "pending")


def command_line(target: str, scale: str, seeds: str, dataset: str | None = None, column: str | None = None,
                 extra: list[str] | None = None, runs: list[Path] = ()) -> str:
    """The command that writes (and resumes) this table, as a reader would retype it."""
    return " ".join([f"pfedkit reproduce {target}", *([f"--dataset {dataset}"] if dataset else []),
                     *([f"--column {column}"] if column else []), f"--scale {scale} --seeds {seeds}",
                     *(f"--set {e}" for e in extra or []),
                     *(["--table-only", *(f"--runs {r}" for r in runs)] if runs else [])])


def _header(target: Target, scale: str, seeds: str, command: str | None) -> list[str]:
    return [f"# pfedkit reproduce {target.name} (--scale {scale}, seeds {seeds})", "",
            f"Command: `{command or command_line(target.name, scale, seeds)}`; presets: pfedkit/configs/ "
            f"({SCALES[scale][1]}).",
            ""]


def _flatness(results: dict, key: str) -> list[str]:
    """Per column, method and seed how far the metric still moves at the end of the run (the drift between the last
    two windows and the trend over the last TREND_EVALUATIONS evaluations, points), and whether it is flat in every
    seed: a failed (diverged) seed is not, and while seeds are pending the answer says over how many."""
    seeds = max(len(v) for r in results.values() for v in r.values())
    lines = ["", f"Converged? The mean of the last {FLAT_WINDOW} evaluations minus the mean of the {FLAT_WINDOW} "
             f"before them, then the rise of the least-squares line through the last {TREND_EVALUATIONS} "
             f"evaluations over the rounds they span ({key}, points; –: too few evaluations); flat: both within "
             f"±{FLAT_POINTS} in every seed (docs/reproduce.md):", "",
             "| column | method | " + " | ".join(f"seed {i}" for i in range(seeds)) + " | flat |",
             "|---|---|" + "---|" * (seeds + 1)]

    def points(value: float | None) -> str:
        return "–" if value is None else f"{100 * value:+.2f}"
    for column, res in results.items():
        for name, runs in res.items():
            moves = [(metric(r, f"{key}_drift"), metric(r, f"{key}_trend")) for r in runs]
            done = [(100 * d, None if t is None else 100 * t) for d, t in moves if d is not None]
            flat = ("–" if not done else "no" if not all(steady(d, t) for d, t in done) or FAILED in runs else
                    "yes" if len(done) == len(runs) else f"yes ({len(done)} of {len(runs)} seeds)")
            lines.append(f"| {column.label} | {name} | " + " | ".join(
                f"{points(d)} / {points(t)}" if d is not None else "–" if isinstance(r, dict) else r or "pending"
                for (d, t), r in zip(moves, runs)) + f" | {flat} |")
    return lines


def _levels(results: dict, key: str) -> list[str]:
    """Per column, method and seed the mean ± sample std of the last TREND_EVALUATIONS evaluations: the level a
    run ends at and its swing about it, since a final-round cell (what the papers report) is one draw from them."""
    def cell(run: dict) -> str:
        level = metric(run, f"{key}_level")
        return "–" if level is None else f"{100 * level:.2f} ± {100 * metric(run, f'{key}_swing'):.2f}"
    return _seed_table(results, f"Last {TREND_EVALUATIONS} evaluations ({key}, %): their mean ± sample std per "
                       "seed, the level a run ends at and its swing; the final-round cells above are one evaluation "
                       "each (–: too few):", cell)


def kendall_tau(ours: dict[str, float | None], paper: dict[str, float | None]) -> str:
    """Kendall's tau-b between our values and the paper's over the methods both have (1: the same order, -1: the
    reverse), with its two-sided p-value (scipy.stats.kendalltau) and the number of methods."""
    names = [n for n in ours if ours[n] is not None and paper.get(n) is not None]
    if len(names) < 3:
        return "–"
    tau, p = stats.kendalltau([ours[n] for n in names], [paper[n] for n in names])
    return "–" if np.isnan(tau) else f"τ {tau:+.2f} (p {p:.2f}, n {len(names)})"


def majority(runs_by_method: dict[str, list], key: str = "majority_label_acc") -> list[dict | None]:
    """Per seed, the first finished run's summary (the majority-label reference is the partition's, the same for
    every method of a seed), as a run list for `fmt`."""
    per_seed = zip(*runs_by_method.values()) if runs_by_method else []
    return [next((r for r in seed if isinstance(r, dict) and key in r), None) for seed in per_seed]


def _mean_of(runs: list | None, key: str) -> float | None:
    stat = mean_std(runs or [], key)
    return None if stat is None else stat[0]


def accuracy_table(target: Target, results: dict, out: Path, scale: str, seeds: str,
                   command: str | None = None) -> str:
    table = papers.TABLE1 if target.name == "table1" else papers.TABLE2
    cols = list(results)
    lines = _header(target, scale, seeds, command)
    lines.append("| method | " + " | ".join(f"{c.label}: ours | paper" for c in cols) + " |")
    lines.append("|---|" + "---|---|" * len(cols))
    methods = list(dict.fromkeys(m for r in results.values() for m in r))
    for name in methods:
        cells = []
        for c in cols:
            runs = results[c].get(name)
            ours = "–" if runs is None else fmt(runs, "personalized_acc")
            cells += [ours, table.get(name, {}).get(c.key, "–")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| *majority label (reference)* | " + " | ".join(
        f"{fmt(majority(results[c]), 'majority_label_acc')} | –" for c in cols) + " |")
    lines.append("| *rank agreement with the paper* | " + " | ".join(
        kendall_tau({m: _mean_of(results[c].get(m), "personalized_acc") for m in methods},
                    {m: _paper_value(table.get(m, {}).get(c.key)) for m in methods}) + " | –" for c in cols) + " |")
    lines += ["", target.what, "Ours: mean ± sample std (n − 1) over seeds; each seed draws its own partition, "
              "initialization and client sampling, the same for every method. –: no entry (FedBN: the model has no "
              "BatchNorm, as in the paper" + ("; Table 1's FedAvg row is not legible in the paper" if table is
                                              papers.TABLE1 else "") + "). Majority label: each "
              "client always predicts its most frequent training label (a personalized accuracy near it learned "
              "little beyond the label skew). Rank agreement: Kendall's τ-b between our means and the paper's "
              "numbers over the methods both have (+1 the same order, −1 the reverse; p: two-sided, n: methods)."]
    return "\n".join(lines + _per_seed(results, "personalized_acc") + _flatness(results, "personalized_acc")
                     + _levels(results, "personalized_acc")) + "\n"


def table3_table(target: Target, results: dict, out: Path, scale: str, seeds: str,
                 command: str | None = None) -> str:
    lines = _header(target, scale, seeds, command)
    lines += ["| dataset | method | accuracy %: ours | paper | MB down: ours | MB up+down: ours | MB: paper |",
              "|---|---|---|---|---|---|---|"]
    for c, res in results.items():
        ks = {name: 0 if name == "pfedla" else int(name.split("k=")[1]) if "k=" in name else 1 for name in res}
        for name, runs in res.items():
            k = ks[name]
            paper = papers.TABLE3.get((c.key[0], k))
            done = [r for r in runs if isinstance(r, dict)]
            down = f"{np.mean([r['mb_down_total'] for r in done]):.2f}" if done else "–"
            both = f"{np.mean([r['mb_down_total'] + r['mb_up_total'] for r in done]):.2f}" if done else "–"
            acc = fmt(runs, "personalized_acc")
            lines.append(f"| {c.label.split()[0]} | {name} (k={k}) | {acc} "
                         f"| {paper[0] if paper else '–'} | {down} | {both} | {paper[1] if paper else '–'} |")
        tau = kendall_tau({n: _mean_of(runs, "personalized_acc") for n, runs in res.items()},
                          {n: _paper_value((papers.TABLE3.get((c.key[0], k)) or [None])[0]) for n, k in ks.items()})
        lines.append(f"| {c.label.split()[0]} | *majority label (reference)* | "
                     f"{fmt(majority(res), 'majority_label_acc')} | | | | |")
        lines.append(f"| {c.label.split()[0]} | *rank agreement with the paper over k* | {tau} | | | | |")
    lines += ["", target.what, "The paper's MB are for its own model and rounds; compare the trend over k, not "
              "the values. Rank agreement: Kendall's τ-b between our accuracies and the paper's over the k values."]
    return "\n".join(lines + _per_seed(results, "personalized_acc") + _flatness(results, "personalized_acc")
                     + _levels(results, "personalized_acc")) + "\n"


def pfedcs_table(target: Target, results: dict, out: Path, scale: str, seeds: str,
                 command: str | None = None) -> str:
    lines = _header(target, scale, seeds, command)
    for c, res in results.items():
        gains = papers.PFEDCS_GAINS.get(c.key, {})
        ours_cs = res.get("pfedcs") or []
        lines += [f"## {c.label}", "",
                  "| method | GM %: ours | PM %: ours | GM gain of pFedCS: ours | paper | PM gain of pFedCS: ours "
                  "| paper |",
                  "|---|---|---|---|---|---|---|"]
        for name, runs in res.items():
            g_gain = _gain(ours_cs, runs, "global_acc_weighted")
            p_gain = _gain(ours_cs, runs, "personalized_acc_weighted")
            paper = gains.get(name, (None, None))
            gm, pm = fmt(runs, "global_acc_weighted"), fmt(runs, "personalized_acc_weighted")
            lines.append(f"| {name} | {gm} | {pm} | {g_gain} | {_signed(paper[0])} | {p_gain} "
                         f"| {_signed(paper[1])} |")
        pooled = "majority_label_acc_weighted"
        lines.append(f"| *majority label (reference)* | – | {fmt(majority(res, pooled), pooled)} | | | | |")
        taus = [kendall_tau({n: _mean_gain(ours_cs, runs, key) for n, runs in res.items() if n != "pfedcs"},
                            {n: g[i] for n, g in gains.items()})
                for i, key in enumerate(("global_acc_weighted", "personalized_acc_weighted"))]
        lines += ["", f"Rank agreement of the gains with the paper's: GM {taus[0]}; PM {taus[1]}.", "",
                  "| method | GM % pooled: last round | best round* | per client: last | PM % pooled: last round "
                  "| best round* | per client: last |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(fmt(runs, key) for key in (
            "global_acc_weighted", "global_acc_weighted_best", "global_acc", "personalized_acc_weighted",
            "personalized_acc_weighted_best", "personalized_acc")) + " |" for name, runs in res.items()]
        lines.append("")
    lines += [target.what, "Gains: per seed, pFedCS's value minus the method's on the same partition and sampling "
              "stream, mean ± sample std over seeds. The paper reports PM gains only against the methods with a "
              "personalized model (Per-FedAvg, FedTC). Majority label: each client always predicts its most frequent "
              "training label, pooled over all test samples as PM is. Rank agreement: Kendall's τ-b between our "
              "mean gains and the paper's over the baselines both have (n < 3: –). *Best round: the highest value "
              "over the run's evaluations, as the pFedMe code reports (and the pFedCS paper may): an optimistic "
              "pick, not a held-out choice. Per client: the unweighted mean over clients."]
    lines += _per_seed(results, "global_acc_weighted") + _per_seed(results, "personalized_acc_weighted")
    lines += _flatness(results, "global_acc_weighted") + _flatness(results, "personalized_acc_weighted")
    lines += _levels(results, "global_acc_weighted") + _levels(results, "personalized_acc_weighted")
    return "\n".join(lines) + "\n"


def _diffs(reference: list, runs: list, key: str) -> list[float]:
    """Per seed, the reference run's value minus the method's, in points (seeds where both finished)."""
    return [100 * (metric(a, key) - metric(b, key)) for a, b in zip(reference, runs)
            if metric(a, key) is not None and metric(b, key) is not None]


def _mean_gain(reference: list, runs: list, key: str) -> float | None:
    diffs = _diffs(reference, runs, key)
    return float(np.mean(diffs)) if diffs else None


def _gain(reference: list, runs: list, key: str) -> str:
    diffs = _diffs(reference, runs, key)
    if not diffs:
        return "–"
    return f"{np.mean(diffs):+.2f} ± {np.std(diffs, ddof=1):.2f}" if len(diffs) > 1 else f"{diffs[0]:+.2f}"


def _signed(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2f}"


def fig6_table(target: Target, results: dict, out: Path, scale: str, seeds: str,
               command: str | None = None) -> str:
    lines = _header(target, scale, seeds, command)
    lines += ["| column | seed | layer | self | same labels | similar (all but one label) | others |",
              "|---|---|---|---|---|---|---|"]
    for c in results:
        for run_dir in fig6_runs(out / c.folder):
            row = alpha_groups(run_dir)
            if row is None:
                continue
            layer, means = row
            lines.append(f"| {c.label} | {run_dir.parent.name} | {layer} | " + " | ".join(
                "–" if v is None else f"{v:.3f}" for v in means) + " |")
    lines += ["", target.what, "Figure: the heatmap of the first seed's weights."]
    return "\n".join(lines) + "\n"


def alpha_groups(run_dir: Path) -> tuple[str, list[float | None]] | None:
    """pFedLA's final weights on one layer (fc1 where it exists), averaged over the target clients by group."""
    from .report.plots import _alpha_series, client_groups
    if not (run_dir / "alpha.npz").is_file():
        return None
    layers = json.loads((run_dir / "algorithm.json").read_text())["alpha_layers"]
    layer = "fc1" if "fc1" in layers else layers[0]
    final = _alpha_series(run_dir)[1][-1][:, layers.index(layer), :]
    label_sets = json.loads((run_dir / "partition.json").read_text())["label_sets"]
    sums = {k: [] for k in ("self", "same labels", "similar (all but one label)", "others")}
    for i in range(final.shape[0]):
        sums["self"].append(final[i, i])
        for group, members in client_groups(label_sets, i).items():
            if members:
                sums[group].append(final[i, members].mean())
    return layer, [float(np.mean(v)) if v else None for v in sums.values()]


def fig6_runs(folder: Path) -> list[Path]:
    return sorted(folder.glob("seed*/pfedla")) or [folder / "pfedla"]


def _paper_value(cell: str | None) -> float | None:
    return float(cell.split("±")[0]) if cell else None


def figure(target: Target, results: dict, out: Path, path: Path) -> Path | None:
    """Ours (mean ± std over seeds) beside the paper's numbers, one panel per column."""
    from .report.plots import plot_alpha, plt, save_figure
    if target.name == "fig6":
        runs = [r for c in results for r in fig6_runs(out / c.folder) if (r / "alpha.npz").is_file()]
        if not runs:
            return None
        heatmap = plot_alpha(runs[0])[0]
        atomic_write(path, heatmap.read_bytes())
        return path
    cols = list(results)
    fig, axes = plt.subplots(1, len(cols), figsize=(1.2 + 0.75 * max(len(r) for r in results.values()) * len(cols)
                                                     + 1.5, 4.2), squeeze=False)
    for ax, c in zip(axes[0], cols):
        names = list(results[c])
        key = "global_acc_weighted" if target.name.startswith("pfedcs") else "personalized_acc"
        stats = [mean_std(results[c][n], key) for n in names]
        x = np.arange(len(names))
        ax.bar(x, [s[0] if s else 0 for s in stats], yerr=[s[1] if s else 0 for s in stats], color="tab:blue",
               alpha=0.8, label="ours (GM)" if target.name.startswith("pfedcs") else "ours")
        if target.name.startswith("pfedcs"):
            pm = [mean_std(results[c][n], "personalized_acc_weighted") for n in names]
            ax.scatter(x, [s[0] if s else np.nan for s in pm], color="tab:orange", zorder=3, label="ours (PM)")
        elif target.name in ("table1", "table2"):
            table = papers.TABLE1 if target.name == "table1" else papers.TABLE2
            paper = [_paper_value(table.get(n, {}).get(c.key)) for n in names]
            ax.scatter(x, [np.nan if v is None else v for v in paper], color="black", marker="D", zorder=3,
                       label="paper")
        else:  # table3
            paper = [papers.TABLE3.get((c.key[0], 0 if n == "pfedla" else int(n.split("k=")[1]) if "k=" in n else 1))
                     for n in names]
            ax.scatter(x, [np.nan if v is None else v[0] for v in paper], color="black", marker="D", zorder=3,
                       label="paper")
        ax.set_xticks(x, names, rotation=60, ha="right", fontsize=8)
        low = min([s[0] - s[1] for s in stats if s] or [0])
        ax.set(title=c.label, ylabel="accuracy %", ylim=(max(0, low - 10), 100))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, path)
    return path


TABLES = {"table1": accuracy_table, "table2": accuracy_table, "table3": table3_table, "fig6": fig6_table,
          "pfedcs-synthetic": pfedcs_table, "pfedcs-mnist": pfedcs_table}
