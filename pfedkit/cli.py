"""`pfedkit run | plot | list`: parse, build, call."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import PfedkitError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pfedkit", description="Personalized federated learning: pFedLA, pFedCS and "
                                "their baselines, simulated fast on one machine.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one or several algorithms on the same data and compare them")
    run.add_argument("config", nargs="?", help="YAML config (default: the embedded mnist5k comparison, "
                     "pfedkit/default.yaml = configs/default.yaml)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set local.lr=0.01 (repeatable)")
    run.add_argument("--algorithms", help="comma list of algorithms to compare, or 'all'")
    run.add_argument("--seeds", help="comma list of seeds: one run each, comparison gives mean ± std (e.g. 0,1,2)")
    run.add_argument("--out", type=Path, help="output folder (default runs/<dataset>-<time>)")
    run.add_argument("--resume", type=Path, metavar="DIR", help="continue an interrupted run from its checkpoint")
    run.add_argument("--overwrite", action="store_true", help="replace the run already in --out (its files, "
                     "checkpoint included, are deleted once the new config has been checked)")
    plot = sub.add_parser("plot", help="redraw the figures of a run or experiment folder")
    plot.add_argument("dir", type=Path)
    plot.add_argument("--layer", help="pFedLA: the layer of the N x N weight heatmap (default fc1)")
    plot.add_argument("--client", type=int, default=0, help="pFedLA: the target client of the per-layer and "
                      "over-training weight figures (default 0)")
    sub.add_parser("list", help="list algorithms, datasets, partition schemes and models")
    return p


def _interrupted(out: Path | None) -> str:
    """What Ctrl-C leaves: a folder to resume (named as it is), or nothing to resume."""
    if out is not None and out.is_dir() and any(out.rglob("checkpoint.pt")):
        return f"pfedkit: interrupted; continue with `pfedkit run --resume {out}`"
    if out is not None and out.is_dir() and any(out.iterdir()):
        return (f"pfedkit: interrupted before the first checkpoint; nothing to resume in {out} "
                "(run it again with --overwrite)")
    return "pfedkit: interrupted before anything was written; nothing to resume"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
                resume_experiment(args.resume)
            else:
                seeds = [f"seeds={args.seeds}"] if args.seeds else []
                config = args.config or Path(__file__).with_name("default.yaml")  # the embedded default job
                cfg = load_config(config, args.overrides + seeds, args.algorithms)
                out = args.out or default_out(cfg)
                run_experiment(cfg, out, overwrite=args.overwrite)
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
        elif args.command == "list":
            from .algorithms import ALGORITHMS
            from .config import DATASETS, MODELS, SCHEMES
            print("algorithms:", ", ".join(ALGORITHMS))
            print("datasets:  ", ", ".join(DATASETS))
            print("partitions:", ", ".join(SCHEMES))
            print("models:    ", ", ".join(MODELS))
    except PfedkitError as exc:
        print(f"pfedkit: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file pfedkit had to write or read; the message names it
        print(f"pfedkit: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_interrupted(out), file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
