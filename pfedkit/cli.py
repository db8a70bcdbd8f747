"""`pfedkit run | plot | list | reproduce`: parse, build, call."""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from . import PRESETS
from .errors import ConfigError, PfedkitError
from .stopping import stop_on


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pfedkit", description="Personalized federated learning: pFedLA, pFedCS and "
                                "their baselines, simulated fast on one machine.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one or several algorithms on the same data and compare them")
    run.add_argument("config", nargs="?", help="YAML config (default: the embedded mnist5k comparison, "
                     "pfedkit/configs/default.yaml; the papers' presets are beside it: `pfedkit list` names the folder)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set local.lr=0.01 (repeatable)")
    run.add_argument("--algorithms", help="comma list of algorithms to compare, or 'all'")
    run.add_argument("--seeds", help="comma list of seeds: one run each, comparison gives mean ± std (e.g. 0,1,2)")
    run.add_argument("--out", type=Path, help="output folder (default runs/<dataset>-<time>)")
    run.add_argument("--resume", type=Path, metavar="DIR", help="continue an interrupted run from its checkpoint, "
                     "or a finished one to the rounds its DIR/config.yaml now asks for")
    run.add_argument("--overwrite", action="store_true", help="replace the pfedkit run already in --out (the files "
                     "pfedkit wrote there, checkpoint included, are deleted once the new config has been checked; a "
                     "folder holding anything else is refused)")
    run.add_argument("--allow-version-change", action="store_true", help="with --resume: continue a run that "
                     "another pfedkit version (or an edited source) started, mixing the two versions' results (a "
                     "key added since is taken at its default, what the earlier versions did)")
    run.add_argument("--tensorboard", action="store_true", help="also log every metric to TensorBoard, in each "
                     "run's folder (tensorboard --logdir OUT; pip install -e '.[tensorboard]'; in-process runs)")
    run.add_argument("--runtime", choices=("inprocess", "flower", "loopback"), default="inprocess",
                     help="inprocess: the fast simulator (default); flower: Flower's simulation runtime (Ray), one "
                     "virtual SuperNode per client; loopback: a real Flower deployment on 127.0.0.1 (flower-superlink, "
                     "one flower-supernode per client, flwr run), stopped at the end. Both need pip install -e "
                     "'.[flower]'")
    run.add_argument("--round-timeout", type=float, default=600.0, metavar="S", help="Flower: seconds a round "
                     "waits for replies; the missing clients are logged and left out (default 600)")
    run.add_argument("--min-replies", type=int, default=1, metavar="K", help="Flower: a round with fewer usable "
                     "updates stops the run (default 1)")
    plot = sub.add_parser("plot", help="redraw the figures of a run or experiment folder")
    plot.add_argument("dir", type=Path)
    plot.add_argument("--layer", help="pFedLA: the layer of the N x N weight heatmap (default fc1)")
    plot.add_argument("--client", type=int, default=0, help="pFedLA: the target client of the per-layer and "
                      "over-training weight figures (default 0)")
    sub.add_parser("list", help="list algorithms, datasets, partition schemes and models")
    rep = sub.add_parser("reproduce", help="run a table or figure of the papers and write it with the papers' "
                         "numbers beside ours")
    rep.add_argument("target", choices=("table1", "table2", "table3", "fig6", "pfedcs-synthetic", "pfedcs-mnist"))
    rep.add_argument("--dataset", help="one dataset column group of the table (default: all of them; EMNIST and "
                     "CIFAR are read from dataset.root)")
    rep.add_argument("--column", help="one column of the table, named as its folder under --out (e.g. fmnist_10, "
                     "synthetic_mlr); its table has that column alone")
    rep.add_argument("--scale", choices=("reduced", "converged", "full"), default="reduced", help="reduced: 10-20 "
                     "minutes per column and seed on 2 CPU cores (pfedkit/configs/*/*_reduced.yaml); converged: the "
                     "paper's data per client, run until the methods are flat (*_converged.yaml: Tables 1 and 2, "
                     "FMNIST 10 and 100 clients); full: the paper's protocol")
    rep.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default 0,1,2)")
    rep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key in every column, e.g. --set dataset.root=/data (repeatable)")
    rep.add_argument("--out", type=Path, help="output folder (run again with the same --out to resume an "
                     "interrupted reproduction); required unless --dry-run")
    rep.add_argument("--allow-version-change", action="store_true", help="resume runs in --out that another "
                     "pfedkit version (or an edited source) started, mixing the two versions' results")
    rep.add_argument("--table-only", action="store_true", help="run nothing: write the table and figure from the "
                     "runs finished so far in --out (the others' cells say pending)")
    rep.add_argument("--runs", type=Path, action="append", default=[], metavar="FOLDER", help="with --table-only "
                     "and --column: read the column's runs from these folders (repeatable), each written by `pfedkit "
                     "run` of the column's preset with some of the methods and seeds (a column run in parts), "
                     "instead of <out>/<column>")
    rep.add_argument("--dry-run", action="store_true", help="run and write nothing: print each column's resolved "
                     "config (what its runs' config.yaml would hold) as one JSON object a line")
    return p


def _interrupted(out: Path | None) -> str:
    """What Ctrl-C leaves: a folder to resume (named as it is), or nothing to resume."""
    if out is not None and out.is_dir() and any(out.rglob("checkpoint.pt")):
        return f"pfedkit: interrupted; continue with `pfedkit run --resume {out}`"
    if out is not None and out.is_dir() and any(out.iterdir()):
        return (f"pfedkit: interrupted before the first checkpoint; nothing to resume in {out} "
                "(run it again with --overwrite)")
    return "pfedkit: interrupted before anything was written; nothing to resume"


def _observers(args) -> list:
    """What the command line adds around the runs: a TensorBoard log with --tensorboard."""
    if not args.tensorboard:
        return []
    from .report.tensorboard import TensorBoard
    return [TensorBoard()]


def _flower(args, cfg, out: Path, resume: bool) -> None:
    """The experiment on Flower: its simulation runtime, or a deployment on loopback started for it (its files in
    --out's own folder .flower, nothing beside it). SIGINT and SIGTERM stop either (stopping.Stopped, as main
    handles it), every process they started stopped first."""
    from .flower import require_flower
    require_flower()
    if args.tensorboard:
        raise PfedkitError("--tensorboard logs in-process runs; on Flower, read the run's metrics.jsonl")
    if args.runtime == "flower":
        from .flower.simulation import run_simulation
        run_simulation(cfg, out, resume=resume, overwrite=args.overwrite, timeout=args.round_timeout,
                       min_replies=args.min_replies, allow_version_change=args.allow_version_change)
        return
    from .config import dump_config, load_config
    from .experiment import check_out
    from .flower.loopback import run_loopback
    if resume:
        cfg = load_config(Path(out) / "config.yaml")
    else:
        check_out(out, args.overwrite)
    run_loopback(dump_config(cfg), out, cfg.partition.num_clients, resume=resume, overwrite=args.overwrite,
                 timeout=args.round_timeout, min_replies=args.min_replies,
                 allow_version_change=args.allow_version_change)


def main(argv: list[str] | None = None) -> int:
    """The command line. Ctrl-C (SIGINT) and SIGTERM stop any command with one line saying what there is to
    resume, and exit 128 + the signal's number (130, 143); checkpoints are written whole, so the last one stands."""
    args = _parser().parse_args(argv)
    with stop_on(signal.SIGTERM):
        return _command(args)


def _command(args) -> int:
    out = None
    try:
        if args.command == "run":
            from .config import load_config
            from .experiment import default_out, resume_experiment, run_experiment
            if args.resume:
                if args.config or args.overrides or args.algorithms or args.out or args.seeds or args.overwrite:
                    raise PfedkitError("--resume DIR takes no config, --set, --algorithms, --out or --overwrite: "
                                       "it continues with the folder's own config.yaml")
                out = args.resume
                if args.runtime == "inprocess":
                    resume_experiment(args.resume, allow_version_change=args.allow_version_change,
                                      observers=_observers(args))
                else:
                    _flower(args, None, out, resume=True)
            else:
                seeds = [f"seeds={args.seeds}"] if args.seeds else []
                config = args.config or PRESETS / "default.yaml"  # the packaged default job
                cfg = load_config(config, args.overrides + seeds, args.algorithms)
                out = args.out or default_out(cfg)
                if args.allow_version_change:
                    raise PfedkitError("--allow-version-change goes with --resume DIR only")
                if args.runtime == "inprocess":
                    run_experiment(cfg, out, overwrite=args.overwrite, config_file=args.config and Path(args.config),
                                   observers=_observers(args))
                else:
                    _flower(args, cfg, out, resume=False)
        elif args.command == "plot":
            from .report.plots import plot_comparison, plot_run, plot_seed_comparison
            d = args.dir
            if not d.is_dir():
                raise PfedkitError(f"{d} is not a folder")
            seed_dirs = sorted(p for p in d.glob("seed*") if p.is_dir())  # a multi-seed experiment
            paths = []
            try:
                for folder in [d] + seed_dirs:
                    runs = sorted(p for p in folder.iterdir() if (p / "metrics.jsonl").is_file())
                    if (folder / "metrics.jsonl").is_file():
                        paths += plot_run(folder, args.layer, args.client)
                    for r in runs:
                        paths += plot_run(r, args.layer, args.client)
                    if runs:
                        paths.append(plot_comparison(folder, runs))
            except ValueError as exc:
                raise PfedkitError(str(exc)) from None
            if seed_dirs:
                names = sorted({p.name for s in seed_dirs for p in s.iterdir() if (p / "metrics.jsonl").is_file()})
                paths.append(plot_seed_comparison(d, seed_dirs, names))
            if not paths:
                raise PfedkitError(f"{d} holds no metrics.jsonl (not a pfedkit run folder)")
            print("\n".join(map(str, paths)))
        elif args.command == "reproduce":
            from .reproduce import reproduce, resolved
            if args.dry_run:
                for line in resolved(args.target, dataset=args.dataset, column=args.column, scale=args.scale,
                                     seeds=args.seeds, extra=args.overrides):
                    print(json.dumps(line))
                return 0
            if args.out is None:
                raise ConfigError("pfedkit reproduce: --out is required (the folder of the runs and the table), "
                                  "unless --dry-run")
            out = args.out
            reproduce(args.target, args.out, dataset=args.dataset, column=args.column, scale=args.scale,
                      seeds=args.seeds, extra=args.overrides, run=not args.table_only,
                      allow_version_change=args.allow_version_change, runs=args.runs)
        elif args.command == "list":
            from .algorithms import ALGORITHMS
            from .config import DATASETS, MODELS, SCHEMES
            print("algorithms:", ", ".join(ALGORITHMS))
            print("datasets:  ", ", ".join(DATASETS))
            print("partitions:", ", ".join(SCHEMES))
            print("models:    ", ", ".join(MODELS))
            print("runtimes:  ", "inprocess, flower (Flower's simulation), loopback (a Flower deployment on 127.0.0.1)")
            print("presets:   ", PRESETS)
    except PfedkitError as exc:
        print(f"pfedkit: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file pfedkit had to write or read; the message names it where the error does
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"pfedkit: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or stopping.Stopped (SIGTERM; a Flower run's SIGINT)
        print(_interrupted(out), file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
