"""docs/configuration.md, generated from the config dataclasses (pfedkit/config.py) and the algorithms' registered
`Params`, so the reference cannot drift from the code: keys, defaults and allowed values are read from the fields,
the meanings from the two tables below. A key without a meaning, or a meaning without a key, stops the generator
(tests/test_config_doc.py runs it and compares with the file).

    python -m pfedkit.report.config_doc docs/configuration.md          # write it
    python -m pfedkit.report.config_doc --check docs/configuration.md  # exit 1 if it is out of date
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

from ..config import Config, _range_text, algorithm_sections

# What each built-in key means (the default, the allowed values and the type come from the field itself).
MEANINGS: dict[str, str] = {
    "dataset.name": "the dataset, read from local files ([datasets.md](datasets.md))",
    "dataset.root": "folder with the dataset's standard files (`fmnist` defaults to the Debian package's folder)",
    "dataset.emnist_split": "the EMNIST split",
    "dataset.train_file": "`leaf`: the train JSON file (LEAF / FedProx / pFedMe layout)",
    "dataset.test_file": "`leaf`: the test JSON file",
    "dataset.synthetic.alpha": "Synthetic(α, β): how much the users' models differ",
    "dataset.synthetic.beta": "Synthetic(α, β): how much the users' inputs differ",
    "dataset.synthetic.features": "Synthetic input dimension",
    "dataset.synthetic.classes": "Synthetic classes",
    "dataset.synthetic.size_factor": "user sizes are (lognormal(4, 2) + 50) × this (pFedMe: 5, FedProx: 1)",
    "partition.scheme": "how the data is split into clients ([datasets.md](datasets.md#partitions))",
    "partition.num_clients": "number of clients N (for `synthetic` the number of generated users)",
    "partition.classes_per_client": "k for `classes`, `chain`, `powerlaw_labels`",
    "partition.test_fraction": "share of each client's data (per class) held out as its test split",
    "partition.dirichlet_alpha": "concentration of `dirichlet`",
    "partition.dominant_classes": "dominant classes per client in `dominant` (CIFAR-100 in the pFedLA paper: 6)",
    "partition.dominant_fraction": "share of a client's data in its dominant classes (`dominant`)",
    "partition.powerlaw_sigma": "lognormal σ of the per-(client, label) shares in `powerlaw_labels`",
    "partition.min_per_label": "samples of each of its labels every client gets first in `powerlaw_labels`",
    "partition.samples_per_client": "cap on a client's size (0: as much as the data allows)",
    "partition.eval_split": "`validation`: carve `val_fraction` of each client's train split (stratified) and "
                            "evaluate on it; the test split is set aside unseen, for choosing hyperparameters",
    "partition.val_fraction": "share of each client's train split held out when `eval_split: validation`",
    "model.name": "`cnn` (pFedHN's CNN), `cnn_bn` (the same with BatchNorm after each conv), `lenet5` (FL-bench's "
                  "LeNet-5: 6 and 16 channels, BatchNorm), `mlr`, `dnn`",
    "model.hidden": "hidden width of `dnn` (pFedMe: 100 on MNIST, 20 on Synthetic)",
    "algorithm": "one algorithm, a comma list, or `all`; each may carry its own values (below); `--algorithms` "
                 "sets it",
    "rounds": "communication rounds",
    "clients_per_round": "clients sampled per round (0: all); for `md` and clustered sampling the number of draws m",
    "sampling": "who aggregates and with what weight: `uniform` (distinct clients, sample-size weights), `md` (m "
                "draws from p_i), `clustered_size`, `clustered_similarity` (Fraboni et al.'s Algorithms 1 and 2; a "
                "client's weight = its draws / m); `auto` = the algorithm's own (pFedCS: `clustered_similarity`, "
                "the rest `uniform`)",
    "clustering.distance": "`clustered_similarity`: distance between representative gradients, `cosine` "
                           "(arccos), `l2` (squared), `l1`",
    "clustering.linkage_input": "Ward linkage on the distance matrix's `rows`, as Fraboni et al.'s code does, or "
                                "on the `condensed` distances",
    "clustering.clusters": "0: Fraboni's cut (subtrees holding ≤ 1/m of the data); > 0: cut the tree into this "
                           "many clusters (pFedCS: 10)",
    "clustering.representative": "the representative gradient G_i: the client's `update` w_loc − w over the "
                                 "model's parameters (Fraboni et al.'s code; BatchNorm statistics never count), or "
                                 "`centered`: G_i minus the importance-weighted mean over all clients, the pFedCS "
                                 "paper's eq. (4) ∇F_i(w) − ∇F(w) (it changes `cosine` and `l1` distances, not `l2`)",
    "clustering.kept_order": "Algorithm 2's rows of the m kept clusters: heaviest first, or `reference`: lightest "
                             "first, as Fraboni et al.'s code leaves them",
    "importance": "a client's importance p_i, which the samplers' weights and distributions follow: `size` "
                  "(n_i / n, FedAvg and Fraboni et al.) or `equal` (1 / N, as the unweighted accuracy metrics)",
    "local.epochs": "local epochs per round",
    "local.steps": "if > 0: this many mini-batch steps per round instead of epochs",
    "local.batch_size": "mini-batch size",
    "local.lr": "local SGD learning rate",
    "local.momentum": "local SGD momentum",
    "local.weight_decay": "local SGD L2 weight decay",
    "runtime.workers": "speed only: clients trained side by side, each on one core: `0` = as many as PyTorch's CPU "
                     "threads (1 on a GPU, where clients train in lockstep instead), `1` = one after another. On a CPU "
                     "every client's ops run on one thread, so its result depends neither on this nor on `threads`",
    "runtime.workers_in": "speed only: where those side-by-side clients run in plain local training (every method "
                        "but pFedMe's, pFedCS's and Per-FedAvg's own solvers): `processes` = this process and "
                        "forked children on a Linux CPU, where that is timed faster than threads (a fork's cost "
                        "grows with the process's memory), `threads` = threads of this process (always so on other "
                        "systems and devices). The results are the same either way",
    "runtime.cuda_graphs": "speed only: on a GPU each lockstep training step is one replay of a captured CUDA graph "
                         "(the same kernels, bit for bit, launched at once instead of dozens of small launches from "
                         "Python); `false`: eager steps",
    "eval_every": "evaluate every this many rounds (and always at the last round)",
    "target_acc": "> 0: `summary.json` gives the first round whose personalized (`rounds_to_target`) and global "
                  "(`rounds_to_target_global`) accuracy reached it",
    "eval_train": "also log the personalized and global models' loss on the clients' train splits (the pFedCS "
                  "paper's loss curves)",
    "seed": "one seed for data shuffling, partition, model init, client sampling and batches",
    "seeds": "comma list (`--seeds 0,1,2`): one run per seed into `DIR/seed<s>/`; `DIR/comparison.md` gives "
             "mean ± std over seeds",
    "device": "`auto`: a GPU where PyTorch sees one, else the CPU",
    "checkpoint_every": "rounds between checkpoints (0: only at the end)",
    "runtime.threads": "speed only: PyTorch's CPU threads (0: PyTorch's default), and so the default number of "
                       "side-by-side clients and evaluation chunks; a run's own work (server, sampler) and each "
                       "client's run on one thread whatever this is, so the results do not depend on it",
    "runtime.job_memory_gb": "speed only: the memory a job of runs side by side (`runtime.batch_runs`) may fill, "
                             "in GB; 0: 80 % of the memory free when it starts. Runs whose data and training state "
                             "need more go in several steps, each as one job, and the job says so in one line",
    "runtime.batch_runs": "speed only: the runs of an experiment (its seeds x algorithms, a reproduction's columns) "
                          "side by side in one process, each run's loop in a thread of its own and every run's "
                          "client work on one pool of workers, so the cores stay busy through every run's serial "
                          "parts; on a CPU with two or more cores, without observers of your own that keep one "
                          "run's state (`false`, or elsewhere: one after another). Each run's results and files "
                          "are those it gives alone",
    "progress": "progress bar",
    "plots": "PNG figures",
}

# What each algorithm's own key means, by the section that declares it (a section whose Params subclasses another
# section's, e.g. heurpfedla's pfedla's, reads the parent's meanings for the keys it inherits).
ALGORITHM_MEANINGS: dict[str, str] = {
    "pfedla.hn_optimizer": "the hypernetworks' step: `adam` (each client its own moments and step count: a step "
                           "that does not shrink with N, chosen on validation splits, [pfedla.md](pfedla.md)) or "
                           "`sgd` (the reference code's, with `hn_lr` 0.005)",
    "pfedla.hn_lr": "hypernetwork learning rate (the reference code's plain SGD: 0.005)",
    "pfedla.hn_momentum": "hypernetwork SGD momentum (SGD only; each client's buffer its own)",
    "pfedla.embedding_dim": "client embedding size",
    "pfedla.hidden_dim": "width of the hypernetworks' 3 hidden layers",
    "pfedla.k": "layers each client keeps local (HeurpFedLA when > 0)",
    "pfedla.selfweight": "rank the layers to keep by the `normalized` self-weight, or `raw` (the reference code's "
                         "un-normalized head output)",
    "pfedla.delta_sign": "Δθ = θ_sent − θ_trained (descent, pFedHN's convention); `new_minus_old` reproduces the "
                         "reference code (an ascent, [pfedla.md](pfedla.md))",
    "pfedla.sequential": "`true`: serve a round's clients one after another, each seeing the earlier ones' "
                         "updates (the reference code's order)",
    "pfedla.granularity": "one head per parameterized `module` (weight and bias together); `block` (a conv with its "
                          "BatchNorm); `tensor`",
    "pfedla.save_alpha": "log every client's aggregation weights at each evaluation (`alpha.npz`)",
    "pfedla.hn_dtype": "storage of the hypernetworks and Adam's moments: `bfloat16` halves the server state, the "
                       "same results within noise; Adam only ([pfedla.md](pfedla.md), \"Memory\")",
    "fedprox.mu": "proximal coefficient μ (the FedProx paper's grid: 0.001, 0.01, 0.1, 1)",
    "perfedavg.variant": "`fo` (first-order) or `hf` (Hessian-free)",
    "perfedavg.alpha": "inner (personalization) step α, also the evaluation's adaptation lr; 0: `local.lr` "
                       "(FL-bench's and the pFedMe code's α)",
    "perfedavg.beta": "outer (meta) step β",
    "perfedavg.delta": "the Hessian-free variant's finite-difference radius δ",
    "perfedavg.adapt_steps": "SGD steps from the global model on the client's *train* batches before it is "
                             "evaluated (the Per-FedAvg paper: one)",
    "perfedavg.adapt_epochs": "> 0: that many epochs of SGD on the train batches instead of `adapt_steps` (FL-bench, "
                              "whose evaluation fine-tunes Per-FedAvg for at least one epoch)",
    "pfedme.local_rounds": "R: mini-batches per round (batch size `local.batch_size`)",
    "pfedme.local_epochs": "> 0: R covers this many passes over the client's data instead of `local_rounds` "
                           "batches (the pFedLA tables' local epochs)",
    "pfedme.inner_steps": "K: steps on each mini-batch towards the proximal point",
    "pfedme.eta": "η, the local copy's step w_loc ← w_loc − η λ (w_loc − θ) (pFedMe's `--learning_rate`); pFedMe "
                  "and pFedCS do not read `local.lr`, `local.epochs`, `local.steps`, `local.momentum` or "
                  "`local.weight_decay` (setting those for their run is refused)",
    "pfedme.personal_lr": "the personal model's step (pFedMe: 0.01 Synthetic, 0.1 MNIST MLR, 0.09 MNIST DNN)",
    "pfedme.lamda": "λ of the Moreau envelope. The defaults of η, `personal_lr`, λ, R and K are the pFedMe README's "
                    "MNIST/MLR setting (Synthetic: `personal_lr` 0.01, λ 20)",
    "pfedme.mu": "the official optimizer's hidden L2 term on the personal model",
    "pfedme.beta": "server mixing w ← (1 − β) w + β · Σ weight_i w_loc,i",
    "pfedme.train_all": "every client trains every round (the official code); `false`: only the sampled ones",
    "pfedcs.gradient": "the representative gradient for the similarity sampler: `local` (w_loc − w) or `personal` "
                       "(θ̃ − w, uploaded as well)",
    "pfedhn.embedding_dim": "client embedding size (0: 1 + N/4)",
    "pfedhn.hidden_dim": "the hypernetwork MLP's width",
    "pfedhn.n_hidden": "the hypernetwork MLP's hidden layers",
    "pfedhn.hn_optimizer": "the hypernetwork's optimizer (the official trainer's: `sgd`)",
    "pfedhn.hn_lr": "the hypernetwork's step",
    "pfedhn.embed_lr": "the embeddings' step (0: `hn_lr`)",
    "pfedhn.hn_momentum": "hypernetwork SGD momentum",
    "pfedhn.hn_weight_decay": "hypernetwork weight decay",
    "pfedhn.hn_clip": "each client's hypernetwork-gradient norm clip (0: off)",
    "pfedhn.inner_momentum": "the client's SGD momentum on the generated model (`local.momentum` is not read)",
    "pfedhn.inner_weight_decay": "the client's weight decay (`local.weight_decay` is not read)",
    "pfedhn.inner_clip": "the client's gradient norm clip",
    "pfedhn.inner_steps": "local steps per round (0: the run's `local.epochs`/`steps`; official: 50; > 0 with "
                           "`pfedhn@local.epochs` or `steps` is refused)",
    "pfedhn.inner_lr": "the client's SGD step on the generated model: the official trainer's `--inner-lr` (0: "
                       "`local.lr`; > 0 with `pfedhn@local.lr=...` is refused)",
    "pfedhn.personal_head": "pFedHN-PC: each client keeps its own classifier head, the hypernetwork generates the "
                            "body",
    "pfedhn.sequential": "serve a round's clients one after another (the official trainer's order)",
    "fedrep.head_epochs": "local epochs on the head (body frozen); `local.epochs`/`steps` are not read",
    "fedrep.body_epochs": "then local epochs on the body (head frozen)",
    "fedfomo.models": "M: peers' models a client downloads per round",
    "fedfomo.epsilon": "ε-greedy peer choice over the client's affinity row: ε_t = max(0, ε − decay · (t − 1))",
    "fedfomo.epsilon_decay": "the decay of ε per round",
    "fedfomo.val_fraction": "share of each client's train split it weighs the peers on (never trained on)",
    "fedfomo.distance": "‖θ_j − θ_i‖ in the weights: `l2` (FL-bench) or `l1` (the official code)",
    "fedfomo.affinity_update": "the affinity gains w_j (`raw`, FL-bench) or w_j / \\|Σ w\\| (`normalized`, the "
                               "official code)",
    "fedtc.global_head_weight": "weight of the global classifier's cross-entropy in the local loss",
    "fedtc.personal_model": "the evaluated personal model: (E_g, C_i), or `local_extractor`: (E_i, C_i) as the "
                            "client ended its last round",
}

HEADER = """# Configuration reference

<!-- Generated by `python -m pfedkit.report.config_doc docs/configuration.md` from pfedkit/config.py and the
algorithms' Params; edit the meanings in pfedkit/report/config_doc.py, not here. -->

A run's config is built from the defaults below, then a YAML file, then `--set key=value` overrides (YAML values:
`--set local.lr=0.01`, `--set dataset.root=/data/cifar`), then `--algorithms`. Every key is checked before anything
is written: a bad key or value stops with one line naming the key and the allowed values. `pfedkit run` writes the
resolved config to `DIR/config.yaml`; the presets are in `pfedkit/configs/` (`default.yaml` is the default job).

Keys marked *speed only* change how fast clients train, not the algorithm (the README's "Speed levers" says which
may move float32 results by rounding).
"""

ALGORITHMS_INTRO = """## Algorithms' own keys

Each algorithm with hyperparameters has a section at the top level beside the keys above (`pfedla: {hn_lr: 0.1}`,
`--set heurpfedla.k=2`). In `algorithm` (or `--algorithms`) a run may carry its own values, so several variants share
one partition and sampling stream: `--algorithms pfedla,heurpfedla@k=2,heurpfedla@k=3+hn_lr=0.5` or
`pfedcs@local.batch_size=30` (an algorithm's keys and `local.*` keys; the run folder is named by the spec).
"""

ENVIRONMENT = """## Environment variables

Not config: they change speed, and float32 results only by rounding.

| variable | meaning |
|---|---|
| `PFEDKIT_NATIVE` | `0`: the CNNs run on PyTorch's own ops instead of pfedkit's C kernels |
| `ATEN_CPU_CAPABILITY` | PyTorch's own: lowers the CPU capability its kernels use (`default`, `avx2`, `avx512`); pfedkit's C kernels follow it (one build per capability) |
| `CC` | at install time only: the C compiler `pip install` builds the kernels with (setuptools' choice) |
"""


def _allowed(f: dataclasses.Field, tp: Any) -> str:
    """The values a key takes, as its field declares them."""
    if "choices" in f.metadata:
        return ", ".join(f"`{c}`" for c in f.metadata["choices"])
    if tp is bool:
        return "`true`, `false`"
    number = {int: "integer", float: "number"}.get(tp)
    if number:
        bound = _range_text(f.metadata)
        return f"{number} {bound}".strip()
    return "a path" if typing.get_origin(tp) is not None else "text"  # `str | None`: the file and folder keys


def _value(value: Any) -> str:
    """A default as it is written in YAML."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`" if value != "" else '`""`'


def _fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any, Any]]:
    """(dotted key, field, type, default) of every visible key of `cls`, nested sections flattened."""
    hints, default = typing.get_type_hints(cls), cls()
    for f in dataclasses.fields(cls):
        if f.metadata.get("hidden"):
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _fields(tp, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, tp, getattr(default, f.name)


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    return lines + [f"| `{key}` | {default} | {allowed} | {meaning} |" for key, default, allowed, meaning in rows]


def _builtin_rows() -> list[tuple[str, str, str, str]]:
    rows = []
    for key, f, tp, default in _fields(Config):
        if key not in MEANINGS:
            raise KeyError(f"config key {key!r} has no meaning: add it to MEANINGS in {__name__}")
        rows.append((key, _value(default), _allowed(f, tp), MEANINGS[key]))
    return rows


def _documented_sections() -> dict[str, type]:
    """pfedkit's own algorithms' sections (an algorithm a user registers at run time is not part of the docs)."""
    from ..registry import ALGORITHMS
    return {name: params for name, params in algorithm_sections().items()
            if ALGORITHMS[name].__module__.startswith("pfedkit.")}


def _algorithm_meaning(sections: dict[str, type], name: str, key: str) -> str:
    """The meaning of `name.key`, declared by `name` or by the section whose Params it inherits the key from."""
    owners = {params: section for section, params in sections.items()}
    for params in sections[name].__mro__:
        found = ALGORITHM_MEANINGS.get(f"{owners.get(params, '')}.{key}")
        if found:
            return found
    raise KeyError(f"config key '{name}.{key}' has no meaning: add it to ALGORITHM_MEANINGS in {__name__}")


def _unused_meanings(sections: dict[str, type]) -> list[str]:
    keys = {key for key, *_ in _fields(Config)}
    keys |= {f"{name}.{key}" for name, params in sections.items() for key, *_ in _fields(params)}
    return sorted(set(MEANINGS) - keys | set(ALGORITHM_MEANINGS) - keys)


def render() -> str:
    """The whole of docs/configuration.md."""
    sections = _documented_sections()
    stale = _unused_meanings(sections)
    if stale:
        raise KeyError(f"meanings of keys the config no longer has: {', '.join(stale)}; remove them from {__name__}")
    from ..engine.files import resumable as may_change
    resumable = ", ".join(f"`{key}`" for key, *_ in _fields(Config) if may_change(key))
    from ..config import MOVED_KEYS
    moved = ", ".join(f"`{old}` as `{new}`" for old, new in MOVED_KEYS.items())
    lines = [HEADER, f"A resumed run (`pfedkit run --resume DIR`) may change these keys in `DIR/config.yaml`, no "
             f"others: {resumable}. A finished run whose `rounds` is raised goes on from the checkpoint it finished "
             "with to the new count, as a run started with it would (tests/test_engine.py); `rounds` is never lowered "
             "below the rounds a run finished.", "", "The `runtime` section says how the clients run, never what they compute. "
             f"Keys of earlier versions are still read (in files and `--set`) under their present names: {moved}.",
             "", "## Keys", "", *_table(_builtin_rows()), "", ALGORITHMS_INTRO]
    for name, params in sections.items():
        rows = [(f"{name}.{key}", _value(default), _allowed(f, tp), _algorithm_meaning(sections, name, key))
                for key, f, tp, default in _fields(params)]
        lines += [f"### `{name}`", "", *_table(rows), ""]
    lines.append(ENVIRONMENT)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pfedkit.report.config_doc",
                                     description="Write the configuration reference generated from the code.")
    parser.add_argument("path", type=Path, help="the file to write, e.g. docs/configuration.md")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.is_file() else ""
        if current != text:
            print(f"{args.path} is out of date: run python -m pfedkit.report.config_doc {args.path}", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
