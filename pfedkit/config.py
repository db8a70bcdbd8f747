"""Typed run configuration: dataclass defaults < YAML file < ``--set key=value`` overrides.

Every key is validated before anything is written; a bad key or value raises :class:`ConfigError` with one line
naming the key and what is allowed. Algorithms add their own sections (``fedprox.mu``, ``pfedla.hn_lr``) by
declaring a ``Params`` dataclass; those sections live at the top level of the YAML like the built-in ones.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import reprlib
import resource
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .registry import ALGORITHMS, NoParams

DATASETS = ("mnist5k", "fmnist", "synthetic", "digits", "mnist", "emnist", "cifar10", "cifar100", "leaf")
SCHEMES = ("classes", "dominant", "dirichlet", "powerlaw_labels", "chain", "iid", "natural")
MODELS = ("cnn", "cnn_bn", "lenet5", "mlr", "dnn")
BATCHNORM_MODELS = ("cnn_bn", "lenet5")  # FedBN has something to keep
INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: str.isdigit() also takes '²' and '١٢'
INT64_MAX = 2 ** 63 - 1  # numpy and torch take integers (seeds, counts) of 64 bits at most
LONG_NUMBER = re.compile(r"[0-9]{4301}")  # Python's int() refuses strings of more than 4,300 digits
MAX_YAML_VALUES = 10_000  # a config holds about a hundred; beyond this, aliases that repeat each other (an alias bomb)


def choices(*values: str, default: Any) -> Any:
    return field(default=default, metadata={"choices": values})


def at_least(low: float, default: Any, high: float | None = None, open_low: bool = False) -> Any:
    return field(default=default, metadata={"min": low, "max": high, "open_low": open_low})


@dataclass
class SyntheticConfig:
    """FedProx's Synthetic(alpha, beta) (Li et al., MLSys 2020; pFedMe's 100-user version); one natural client per
    generated user."""
    alpha: float = at_least(0.0, 0.4)
    beta: float = at_least(0.0, 0.6)
    features: int = at_least(1, 60, high=100_000)
    classes: int = at_least(2, 10, high=10_000)
    size_factor: int = at_least(1, 5)  # pFedMe's 100-user version multiplies sizes by 5; FedProx's by 1


@dataclass
class DatasetConfig:
    name: str = choices(*DATASETS, default="mnist5k")
    root: str | None = None  # folder with the dataset's standard files (fmnist: the Debian package's folder)
    emnist_split: str = choices("balanced", "byclass", "bymerge", "digits", "letters", "mnist", default="balanced")
    # `leaf`: the JSON layout LEAF, FedProx and pFedMe share; its users are the clients, its split is kept
    train_file: str | None = None
    test_file: str | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class PartitionConfig:
    scheme: str = choices(*SCHEMES, default="classes")
    num_clients: int = at_least(1, 10)
    classes_per_client: int = at_least(1, 4)  # `classes`, `chain`, `powerlaw_labels`
    test_fraction: float = at_least(0.0, 0.3, high=0.9)
    dirichlet_alpha: float = at_least(0.0, 0.5, open_low=True)
    dominant_classes: int = at_least(1, 2)
    dominant_fraction: float = at_least(0.0, 0.8, high=1.0)
    powerlaw_sigma: float = at_least(0.0, 2.0)  # lognormal sigma of the per-(client, label) shares (FedProx: 2.0)
    min_per_label: int = at_least(0, 5)  # `powerlaw_labels`: samples each client gets of each label first
    samples_per_client: int = at_least(0, 0)  # 0 = as many as the data allows (all but `classes` leftovers)
    # `validation`: carve val_fraction of each client's train split (stratified) and evaluate on it instead of the
    # test split, which is then never loaded: for choosing hyperparameters without touching test data
    eval_split: str = choices("test", "validation", default="test")
    val_fraction: float = at_least(0.0, 0.2, high=0.9, open_low=True)


@dataclass
class ModelConfig:
    name: str = choices(*MODELS, default="cnn")
    hidden: int = at_least(1, 100)  # DNN hidden width (pFedMe: 100 on MNIST, 20 on Synthetic)


@dataclass
class LocalConfig:
    # The bounds on epochs and steps are about work, not memory (batches are drawn as they are used): a round of more
    # local work than this per client takes days, so a larger value is a typo, refused before anything starts
    epochs: int = at_least(0, 1, high=10_000)
    steps: int = at_least(0, 0, high=100_000)  # > 0: this many mini-batch steps instead of `epochs` passes
    batch_size: int = at_least(1, 32)
    lr: float = at_least(0.0, 0.05, open_low=True)
    momentum: float = at_least(0.0, 0.0, high=1.0)
    weight_decay: float = at_least(0.0, 0.0)


@dataclass
class RuntimeConfig:
    """How the clients run, never what they compute: a client's arithmetic is the same whichever way it runs
    (tests/test_one_arithmetic.py), so a resumed run may change any key here."""
    # torch intra-op threads (0 = leave PyTorch's default): the default count of side-by-side clients and evaluation
    # chunks; a run's own work runs on one thread whatever it is (Run.run). Bounded: OpenMP crashes (a segfault in
    # libgomp) when asked for 100,000, and more threads than a machine has cores only slow it down
    threads: int = at_least(0, 0, high=1024)
    # clients trained side by side, each on one core (the per-client path: the CNNs on a CPU): 0 = auto (as many as
    # PyTorch's CPU threads on a CPU, else 1), 1 = one client after another
    workers: int = at_least(0, 0, high=1024)  # as `threads`: a process or thread per worker
    # where the side-by-side clients of plain local training run (Cohort.train, every algorithm but pFedMe's and
    # Per-FedAvg's solvers): forked processes on Linux CPUs (no shared GIL: pfedkit/runtime/processes.py), or threads
    workers_in: str = choices("processes", "threads", default="processes")
    # lockstep training on a GPU: each step one replay of a captured CUDA graph (cuda_graphs.py; same kernels,
    # launched at once) rather than dozens of small kernel launches from Python
    cuda_graphs: bool = True
    # the runs of an experiment (seeds x algorithms, a reproduction's columns) side by side in one process, their
    # clients' work on one pool of workers (runtime/batch_runs.py): the same results, the cores busy to the end; on
    # a CPU with two or more cores (elsewhere, and with false, one after another)
    batch_runs: bool = True
    # the memory a job of runs side by side may fill, in GB (0: 80 % of what the machine has free when it starts):
    # the runs go in as many steps as their data and training state need (runtime/batch_runs.py::steps)
    job_memory_gb: float = at_least(0.0, 0.0)


# keys of earlier pfedkit versions, read (in files and --set) under their present names
MOVED_KEYS = {"threads": "runtime.threads", "local.workers": "runtime.workers",
              "local.workers_in": "runtime.workers_in", "local.cuda_graphs": "runtime.cuda_graphs"}


@dataclass
class ClusteringConfig:
    """Options of `sampling: clustered_similarity` (Fraboni et al., ICML 2021, Algorithm 2)."""
    distance: str = choices("cosine", "l2", "l1", default="cosine")
    linkage_input: str = choices("rows", "condensed", default="rows")  # rows: Ward on the distance matrix's rows
    clusters: int = at_least(0, 0)  # 0: Fraboni's cut (subtrees of weight <= 1/m); > 0: this many clusters
    # the representative gradient G_i: the client's update w_loc - w (Fraboni et al.'s code), or `centered`: minus
    # the importance-weighted mean of all clients' (the pFedCS paper's eq. 4, grad F_i(w) - grad F(w))
    representative: str = choices("update", "centered", default="update")
    # rows of the kept clusters: heaviest first, or `reference`: lightest first, as Fraboni et al.'s code does
    kept_order: str = choices("heaviest_first", "reference", default="heaviest_first")


@dataclass
class Config:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: str = "all"  # one name, a comma list, or "all" (every registered algorithm)
    rounds: int = at_least(1, 30)
    clients_per_round: int = at_least(0, 0)  # 0 = every client every round; m draws for md/clustered sampling
    # which clients aggregate and with what weight: auto = the algorithm's own (uniform; pFedCS: clustered_similarity)
    sampling: str = choices("auto", "uniform", "md", "clustered_size", "clustered_similarity", default="auto")
    clustering: ClusteringConfig = field(default_factory=ClusteringConfig)
    importance: str = choices("size", "equal", default="size")  # p_i: n_i / n (FedAvg, Fraboni) or 1 / N
    local: LocalConfig = field(default_factory=LocalConfig)
    eval_every: int = at_least(1, 1)
    target_acc: float = at_least(0.0, 0.0, high=1.0)  # > 0: summary.json reports the first round reaching it
    eval_train: bool = False  # also log the models' loss on the clients' train splits at each evaluation
    seed: int = at_least(0, 0, high=INT64_MAX)  # torch's generators take 64-bit seeds
    seeds: str = ""  # comma list: one run per seed into DIR/seed<s>/, comparison.md gives mean ± std over them
    device: str = choices("cpu", "cuda", "auto", default="cpu")
    checkpoint_every: int = at_least(0, 10)  # rounds between checkpoints; 0 = only at the end
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # speed only
    progress: bool = True
    plots: bool = True
    # Per-algorithm sections (`fedprox: {mu: ...}`), filled from the registry; see `algorithm_sections`.
    algo: dict[str, Any] = field(default_factory=dict, metadata={"hidden": True})

    def algorithms(self) -> list[str]:
        if self.algorithm == "all":
            return list(ALGORITHMS)
        return [a.strip() for a in self.algorithm.split(",") if a.strip()]

    def seed_list(self) -> list[int]:
        return [int(x) for x in self.seeds.split(",") if x.strip()]

    def with_seed(self, seed: int) -> "Config":
        one = copy.deepcopy(self)
        one.seed, one.seeds = seed, ""
        return one

    def for_algorithm(self, spec: str) -> "Config":
        """The config of one run: `spec` is an algorithm name, optionally with its own hyperparameters
        (`heurpfedla@k=2`, `pfedla@hn_lr=0.5+sequential=true`), which override that algorithm's section, and
        its own local training (`pfedcs@local.batch_size=30`)."""
        one = copy.deepcopy(self)
        one.algorithm = spec
        name, overrides = split_spec(spec)
        local = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("local.")}
        own = {k: v for k, v in overrides.items() if not k.startswith("local.")}
        if local:  # a run's own local training (`fedavg@local.lr=0.01`); data and sampling stay shared
            one.local = build(LocalConfig, {**_to_dict(one.local), **local}, "local.")
        if own:
            section = algorithm_sections().get(name)
            if section is None:
                raise ConfigError(f"config key 'algorithm': {short_repr(name)} has no hyperparameters to set in "
                                  f"{short_repr(spec)}; allowed: local.* keys")
            one.algo[name] = build(section, {**_to_dict(one.algo[name]), **own}, f"{name}.")
        return one

    @property
    def algorithm_name(self) -> str:
        return split_spec(self.algorithm)[0]

    def to_dict(self) -> dict:
        out = _to_dict(self)
        out.update({name: _to_dict(p) for name, p in self.algo.items()})
        return out

    def params(self, name: str) -> Any:
        """The hyperparameters of algorithm `name` (an empty NoParams if it has none)."""
        return self.algo.get(name, NoParams())


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """'heurpfedla@k=2+hn_lr=0.5' -> ('heurpfedla', {'k': 2, 'hn_lr': 0.5})."""
    name, _, rest = spec.partition("@")
    overrides = {}
    for item in filter(None, rest.split("+")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"config key 'algorithm': {short_repr(spec)}: expected name@key=value[+key=value]")
        try:
            overrides[key.strip()] = load_yaml(value, f"config key 'algorithm': {short_repr(spec)}")
        except yaml.YAMLError:
            raise ConfigError(f"config key 'algorithm': {short_repr(spec)}: {_cap(key.strip(), 40)}={short_repr(value)} is not "
                              "a YAML value (e.g. 2, 0.5, true, name)") from None
    return name.strip(), overrides


def algorithm_sections() -> dict[str, type]:
    """The YAML sections of algorithms that have hyperparameters (`fedprox: {mu: 0.01}`)."""
    sections = {name: cls.Params for name, cls in ALGORITHMS.items() if dataclasses.fields(cls.Params)}
    clash = set(sections) & {f.name for f in dataclasses.fields(Config)}
    assert not clash, f"algorithm sections {clash} collide with config keys"
    return sections


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.metadata.get("hidden")}
    return obj


class _ShortRepr(reprlib.Repr):
    """repr() that stops early: an alias bomb's repr would take gigabytes, a 5,000-digit integer's would raise."""

    def repr_int(self, x, level):
        if x.bit_length() > 200:  # 60 digits: the repr would be long, and raises beyond 4,300 digits
            return f"<an integer of about {int(x.bit_length() * 0.30103) + 1} digits>"
        return repr(x)


def _cap(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SHORT = _ShortRepr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60


def short_repr(value: Any) -> str:
    """A value from a file or a command line, for an error message: its repr, at most 80 characters."""
    return _cap(_SHORT.repr(value))


def _coerce(value: Any, tp: Any, key: str, allowed: str = "") -> Any:
    """`value` as type `tp`; `allowed` is the key's range, for the message."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "")):
            return None
        return _coerce(value, args[0], key, allowed)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"config key '{key}': expected true or false, got {short_repr(value)}")
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())
                                           or (isinstance(value, str) and INTEGER.fullmatch(value.strip()))):
            raise ConfigError(f"config key '{key}': expected an integer, got {short_repr(value)}")
        try:
            number = int(value)
        except ValueError:  # a string of more than 4,300 digits, which int() refuses to convert
            number = INT64_MAX + 1
        if not -INT64_MAX - 1 <= number <= INT64_MAX:  # numpy and torch raise OverflowError on such a number
            bound = allowed if "<=" in allowed else f"{allowed + ' and ' if allowed else ''}<= {INT64_MAX} (64 bits)"
            raise ConfigError(f"config key '{key}': {short_repr(value)} is out of range; allowed: {bound}")
        return number
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an integer too large for a float
            raise ConfigError(f"config key '{key}': expected a number, got {short_repr(value)}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{key}': expected a string, got {short_repr(value)}")
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return value


_INF = float("inf")


def _range_text(meta: Any) -> str:
    """'> 0', '>= 0 and <= 0.9', or '' for a key without a range."""
    if "min" not in meta:
        return ""
    low, high = meta["min"], meta.get("max")
    low_txt = f"> {low}" if meta.get("open_low") else f">= {low}"
    return low_txt + (f" and <= {high}" if high is not None else "")


def _check_range(value: Any, f: dataclasses.Field, key: str) -> None:
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"config key '{key}': {short_repr(value)} is not allowed; allowed: {', '.join(meta['choices'])}")
    if isinstance(value, float) and not -_INF < value < _INF:  # nan passes every comparison below
        raise ConfigError(f"config key '{key}': {short_repr(value)} is not allowed; allowed: a finite number "
                          f"{_range_text(meta)}".rstrip())
    if value is None or "min" not in meta:
        return
    low, high = meta["min"], meta.get("max")
    if value < low or (meta.get("open_low") and value == low) or (high is not None and value > high):
        raise ConfigError(f"config key '{key}': {short_repr(value)} is out of range; allowed: {_range_text(meta)}")


def build(cls: type, data: dict | None, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and bad values."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.')}': expected a mapping of keys, got {short_repr(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("hidden")}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(f"unknown config key '{prefix}{_cap(str(unknown[0]))}'; allowed keys here: "
                          f"{', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key, tp = prefix + name, hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, data[name], key + ".")
        else:
            kwargs[name] = _coerce(data[name], tp, key, _range_text(f.metadata))
    obj = cls(**kwargs)
    for name, f in fields.items():
        if not dataclasses.is_dataclass(hints[name]):
            _check_range(getattr(obj, name), f, prefix + name)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set expects key=value (e.g. local.lr=0.01), got {short_repr(text)}")
    key, raw = text.split("=", 1)
    try:
        value = load_yaml(raw, f"--set {_cap(key.strip(), 40)}=...") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] = (), algorithms: str | None = None) -> Config:
    """Defaults, then the YAML file, then `--set` overrides, then `--algorithms`; validated as a whole."""
    raw: dict = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for text in overrides:
        keys, value = parse_override(text)
        keys = MOVED_KEYS.get(".".join(keys), ".".join(keys)).split(".")
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{'.'.join(keys)}': '{k}' is not a section")
        node[keys[-1]] = value
    if algorithms is not None:
        raw["algorithm"] = algorithms
    return from_dict(raw)


def _read_yaml(path: Path) -> dict:
    """The top-level mapping of a YAML config file; every way the file can be wrong is one line naming it."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give the path of a YAML file, e.g. configs/default.yaml")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                          f"{exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    try:
        raw = load_yaml(text, f"config file {path}")
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}; fix it there") from None
    if raw is None:
        raise ConfigError(f"config file {path} holds no keys; write some (see configs/default.yaml), "
                          "or leave the file out to run the defaults")
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys at the top level (key: value lines), "
                          f"not a {type(raw).__name__}")
    return raw


def load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load, with what it cannot survive as one ConfigError naming `where` (a YAMLError, which each caller
    words its own way, passes): nesting too deep for its recursive reader, a value Python cannot build (a number of
    over 4,300 digits, a 13th month), and aliases that expand to more values than any config holds."""
    if LONG_NUMBER.search(text):  # int() refuses it (ValueError), and no key takes a number of that many digits
        raise ConfigError(f"{where} holds a number of more than 4,300 digits; no config key takes one: fix it there")
    try:
        value = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{where} nests lists or mappings too deeply to read (a config nests 3 levels); "
                          "fix it there") from None
    except ValueError as exc:
        raise ConfigError(f"{where} holds a value that cannot be read: {_cap(str(exc).split(';')[0])}; "
                          "fix it there") from None
    if _expanded_size(value) > MAX_YAML_VALUES:
        raise ConfigError(f"{where} expands to more than {MAX_YAML_VALUES:,} values (YAML aliases that repeat "
                          "each other: an alias bomb?); a config holds a few dozen keys: write them out")
    return value


def _expanded_size(value: Any) -> int:
    """How many values `value` holds with every alias written out, counted up to just past MAX_YAML_VALUES (aliases
    share one object, so a 400-byte file can stand for billions of values, or a cycle for infinitely many)."""
    count, todo = 0, [value]
    while todo and count <= MAX_YAML_VALUES:
        item = todo.pop()
        count += 1
        if isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            todo += item
    return count


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """'line 3, column 5: mapping values are not allowed here' (PyYAML's marks count from 0)."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        problem = ": ".join(filter(None, (getattr(exc, "context", None), exc.problem)))
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow, e.g. a NUL byte
        return f"character {exc.position}: {exc.reason} (#x{exc.character:04x})"
    return str(exc).splitlines()[0]


def moved_keys(raw: dict) -> dict:
    """`raw` with the keys of earlier pfedkit versions (MOVED_KEYS: a run folder's config.yaml) moved to their
    present names; a present name also given keeps its value."""
    raw = dict(raw)
    for old, new in MOVED_KEYS.items():
        section, _, key = old.rpartition(".")
        holder = raw.get(section) if section else raw
        target = raw.get(new.split(".")[0], {})
        if isinstance(holder, dict) and key in holder and isinstance(target, dict):
            if section:
                holder = raw[section] = dict(holder)
            value = holder.pop(key)
            raw[new.split(".")[0]] = {new.split(".")[1]: value, **target}
    return raw


def from_dict(raw: dict) -> Config:
    sections = algorithm_sections()
    raw = moved_keys(raw)
    algo_raw = {name: raw.pop(name) for name in list(raw) if name in sections}
    try:
        cfg = build(Config, raw)
    except ConfigError as exc:
        if "unknown config key" in str(exc) and "." not in str(exc).split("'")[1]:
            raise ConfigError(f"{exc}{''.join(', ' + n for n in sections)}") from None
        raise
    cfg.algo = {name: build(cls, algo_raw.get(name), name + ".") for name, cls in sections.items()}
    names = cfg.algorithms()
    if not names:
        raise ConfigError(f"config key 'algorithm': empty; allowed: all, or a comma list of {', '.join(ALGORITHMS)}")
    for spec in names:
        name = split_spec(spec)[0]
        if name not in ALGORITHMS:
            raise ConfigError(f"config key 'algorithm': {short_repr(name)} is not allowed; allowed: all, "
                              f"{', '.join(ALGORITHMS)} (each optionally with @key=value+key=value for its own "
                              "hyperparameters)")
        cfg.for_algorithm(spec)  # validates the overrides
    if len(set(names)) != len(names):
        raise ConfigError(f"config key 'algorithm': {short_repr(cfg.algorithm)} names a run twice")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that span several keys."""
    p = cfg.partition
    if cfg.clients_per_round > p.num_clients:
        raise ConfigError(f"config key 'clients_per_round': {cfg.clients_per_round} is more than "
                          f"partition.num_clients = {p.num_clients}; allowed: 0 (all) to {p.num_clients}")
    if p.scheme == "natural" and cfg.dataset.name not in ("synthetic", "leaf"):
        raise ConfigError("config key 'partition.scheme': 'natural' needs a dataset with its own clients "
                          "(dataset.name: synthetic or leaf); allowed here: "
                          + ", ".join(s for s in SCHEMES if s != "natural"))
    if cfg.dataset.name == "leaf":
        if p.scheme != "natural":
            raise ConfigError("config key 'partition.scheme': a leaf dataset brings its own clients and split; "
                              "allowed: natural")
        if not cfg.dataset.train_file or not cfg.dataset.test_file:
            raise ConfigError("config key 'dataset.train_file': dataset leaf needs dataset.train_file and "
                              "dataset.test_file (the JSON files of LEAF, FedProx or pFedMe)")
    _check_seeds(cfg.seeds)
    if p.test_fraction == 0 and p.eval_split == "test":
        raise ConfigError("config key 'partition.test_fraction': 0 leaves nothing to evaluate on; allowed: > 0, "
                          "or 0 with partition.eval_split: validation")
    if cfg.local.epochs == 0 and cfg.local.steps == 0:
        raise ConfigError("config key 'local.epochs': 0 together with local.steps = 0 means no local training; "
                          "allowed: local.epochs >= 1 or local.steps >= 1")


def _check_seeds(seeds: str) -> None:
    """`seeds`: distinct integers 0..2**63-1 (a repeated seed is the same run again: counted as a second seed, it
    would shrink the spread reported over seeds)."""
    if not seeds.strip():
        return
    allowed = f"allowed: a comma list of distinct integers from 0 to {INT64_MAX}, e.g. 0,1,2"
    items = [x.strip() for x in seeds.split(",")]
    bad = next((x for x in items if not (INTEGER.fullmatch(x) and not x.startswith("-") and len(x) <= 25
                                         and int(x) <= INT64_MAX)), None)
    if bad is not None:
        raise ConfigError(f"config key 'seeds': {short_repr(bad)} in {short_repr(seeds)} is not allowed; {allowed}")
    seen: set[int] = set()
    twice = next((n for n in map(int, items) if n in seen or seen.add(n)), None)
    if twice is not None:
        raise ConfigError(f"config key 'seeds': {short_repr(seeds)} names seed {twice} twice (one run counted as two "
                          f"seeds); {allowed}")


def memory_budget() -> tuple[int, str]:
    """(bytes, what bounds them): the most memory this process can count on. The machine's physical memory, or less
    where a container's limit (cgroup) or the address-space limit (`ulimit -v`, less what is mapped already) allows
    less. A plan beyond it cannot succeed: it is refused before anything is allocated."""
    limits = [(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory")]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append((int(text), "the container's memory limit"))
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        limits.append((soft - _mapped_bytes(), "what the address-space limit (ulimit -v) leaves"))
    return min(limits)


def _mapped_bytes() -> int:
    """This process's virtual size (what counts against `ulimit -v`)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return 0


def gigabytes(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def check_memory(need: float, what: str, advice: str, error: type = ConfigError) -> None:
    """Refuse, in one line, what would need more memory than `memory_budget` (`what` names the key or file)."""
    budget, bound = memory_budget()
    if need > budget:
        raise error(f"{what} would need about {gigabytes(need)} of memory, more than {bound} ({gigabytes(budget)}); "
                    f"{advice}")


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
