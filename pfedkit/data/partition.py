"""Non-IID partitions of a labelled pool into clients, each split into stratified train/test parts.

A scheme assigns every sample to at most one client (`owner[i]` = client id or -1 for unused); the split then
sends round(n_c * test_fraction) samples of each (client, class) group to the client's test set, so train and
test share the client's label distribution. Everything is vectorized over samples and seeded.

Schemes (the pFedLA and pFedCS papers' settings; docs/datasets.md):
- classes          k distinct classes per client, every (client, class) slot gets an equal share of the class
                   (the pFedLA paper's non-IID 1); classes are spread evenly over clients.
- chain            client i holds classes perm[i .. i+k-1] (mod C): it shares k-1 classes with client i+1
                   (the pFedLA paper's Fig. 6 setting).
- dominant         all classes, `dominant_classes` of them holding `dominant_fraction` of the client's data
                   (the pFedLA paper's non-IID 2; the paper gives no fraction, 0.8 is our default).
- dirichlet        per class, client shares ~ Dirichlet(alpha).
- powerlaw_labels  client u holds labels (u + j) mod C, j < k, `min_per_label` of each, the rest of each class
                   split by lognormal(0, sigma) shares (FedProx's MNIST generator; pFedMe/pFedCS setting).
- iid              a uniform random split into equal parts.
- natural          the dataset's own users are the clients (Synthetic, LEAF).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import PartitionConfig
from ..errors import ConfigError, DataError


@dataclass
class Partition:
    train: list[np.ndarray]  # per client: indices into the source pool
    test: list[np.ndarray]
    label_sets: list[np.ndarray]  # per client: the classes the scheme gave it (dominant ones for `dominant`)
    warnings: list[str] = field(default_factory=list)  # what the partition could not quite give, one line each

    @property
    def num_clients(self) -> int:
        return len(self.train)


def split_counts(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers proportional to `weights` that sum exactly to `total` (largest remainder)."""
    weights = np.asarray(weights, dtype=np.float64)
    if total <= 0 or weights.sum() <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    exact = weights / weights.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - counts.sum()
    if short > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def _fill(owner: np.ndarray, pool: np.ndarray, holders: np.ndarray, counts: np.ndarray) -> None:
    """Give consecutive runs of the (shuffled) `pool` to `holders`, `counts[j]` samples to holder j."""
    n = int(counts.sum())
    owner[pool[:n]] = np.repeat(holders, counts)


def _class_pools(y: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.permutation(np.flatnonzero(y == c)) for c in range(num_classes)]


def _balanced_class_sets(n: int, num_classes: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """k distinct classes per client, always taking the least-used classes (random tie-break): every class
    ends up held by floor or ceil of n*k/C clients."""
    usage = np.zeros(num_classes, dtype=np.int64)
    sets = np.empty((n, k), dtype=np.int64)
    for i in range(n):
        order = rng.permutation(num_classes)
        pick = order[np.argsort(usage[order], kind="stable")[:k]]
        sets[i] = np.sort(pick)
        usage[pick] += 1
    return sets


def _equal_slots(y, num_classes, sets, cap, rng) -> np.ndarray:
    """Each (client, class) slot takes an equal share of the class: floor(count_c / holders_c), capped."""
    owner = np.full(len(y), -1, dtype=np.int64)
    for c, pool in enumerate(_class_pools(y, num_classes, rng)):
        holders = np.flatnonzero((sets == c).any(axis=1))
        if len(holders) == 0:
            continue
        share = len(pool) // len(holders)
        if cap:
            share = min(share, cap)
        _fill(owner, pool, holders, np.full(len(holders), share))
    return owner


def _dominant(y, num_classes, n, nd, rho, size, rng):
    if nd >= num_classes:
        raise ConfigError(f"config key 'partition.dominant_classes': {nd} must be less than the {num_classes} classes")
    perm = rng.permutation(num_classes)
    sets = perm[(np.arange(n)[:, None] * nd + np.arange(nd)[None, :]) % num_classes]
    size = size or len(y) // n
    want = np.full((n, num_classes), (1 - rho) * size / (num_classes - nd))
    np.put_along_axis(want, sets, rho * size / nd, axis=1)
    owner = np.full(len(y), -1, dtype=np.int64)
    for c, pool in enumerate(_class_pools(y, num_classes, rng)):
        column = want[:, c]
        total = min(len(pool), int(np.floor(column.sum())))  # scale down where the class runs short
        _fill(owner, pool, np.arange(n), split_counts(total, column))
    return owner, sets


def _dirichlet(y, num_classes, n, alpha, rng):
    for _ in range(100):
        owner = np.full(len(y), -1, dtype=np.int64)
        for pool in _class_pools(y, num_classes, rng):
            _fill(owner, pool, np.arange(n), split_counts(len(pool), rng.dirichlet(np.full(n, alpha))))
        if np.bincount(owner, minlength=n).min() >= 10:
            return owner
    raise DataError(f"partition 'dirichlet' (alpha={alpha}) leaves some of the {n} clients with fewer than 10 "
                    "samples after 100 draws; raise partition.dirichlet_alpha or lower partition.num_clients")


def _powerlaw_labels(y, num_classes, n, k, sigma, minimum, cap, rng):
    if cap and cap < k * minimum:
        raise ConfigError(f"config key 'partition.samples_per_client': {cap} leaves no room for min_per_label="
                          f"{minimum} of each of {k} labels; allowed: 0 or >= {k * minimum}")
    sets = (np.arange(n)[:, None] + np.arange(k)[None, :]) % num_classes
    pools = _class_pools(y, num_classes, rng)
    extra = np.zeros((n, num_classes), dtype=np.int64)  # samples beyond the minimum, per (client, label)
    for c, pool in enumerate(pools):
        holders = np.flatnonzero((sets == c).any(axis=1))
        rest = len(pool) - minimum * len(holders)
        if rest < 0:
            raise DataError(f"partition 'powerlaw_labels': class {c} has {len(pool)} samples, fewer than "
                            f"min_per_label={minimum} for each of its {len(holders)} clients; "
                            "lower partition.min_per_label or partition.num_clients")
        if len(holders):
            extra[holders, c] = split_counts(rest, rng.lognormal(0.0, sigma, len(holders)))
    if cap:  # shrink only the power-law part, so every label keeps its minimum
        room = cap - k * minimum
        for i in np.flatnonzero(extra.sum(axis=1) > room):
            extra[i] = split_counts(room, extra[i])
    owner = np.full(len(y), -1, dtype=np.int64)
    for c, pool in enumerate(pools):
        holders = np.flatnonzero((sets == c).any(axis=1))
        _fill(owner, pool, holders, minimum + extra[holders, c])
    return owner, sets


def assign(y: np.ndarray, num_classes: int, cfg: PartitionConfig, rng: np.random.Generator,
           groups: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """owner[i] = the client sample i goes to (-1: unused), and each client's label set."""
    n, k, scheme = cfg.num_clients, cfg.classes_per_client, cfg.scheme
    if scheme in ("classes", "chain", "powerlaw_labels") and k > num_classes:
        raise ConfigError(f"config key 'partition.classes_per_client': {k} is more than the dataset's "
                          f"{num_classes} classes; allowed: 1 to {num_classes}")
    if scheme in ("classes", "chain") and 0 < cfg.samples_per_client < k:
        raise ConfigError(f"config key 'partition.samples_per_client': {cfg.samples_per_client} is less than "
                          f"classes_per_client={k}; allowed: 0 (no cap) or >= {k}")
    if scheme == "classes":
        sets = _balanced_class_sets(n, num_classes, k, rng)
        owner = _equal_slots(y, num_classes, sets, cfg.samples_per_client // k, rng)
    elif scheme == "chain":
        perm = rng.permutation(num_classes)
        sets = perm[(np.arange(n)[:, None] + np.arange(k)[None, :]) % num_classes]
        owner = _equal_slots(y, num_classes, sets, cfg.samples_per_client // k, rng)
    elif scheme == "dominant":
        owner, sets = _dominant(y, num_classes, n, cfg.dominant_classes, cfg.dominant_fraction,
                                cfg.samples_per_client, rng)
    elif scheme == "dirichlet":
        owner, sets = _dirichlet(y, num_classes, n, cfg.dirichlet_alpha, rng), None
    elif scheme == "powerlaw_labels":
        owner, sets = _powerlaw_labels(y, num_classes, n, k, cfg.powerlaw_sigma, cfg.min_per_label,
                                       cfg.samples_per_client, rng)
    elif scheme == "iid":
        size = cfg.samples_per_client or len(y) // n
        if size * n > len(y):
            raise ConfigError(f"config key 'partition.samples_per_client': {size} x {n} clients is more than the "
                              f"{len(y)} samples; allowed: up to {len(y) // n}")
        owner = np.full(len(y), -1, dtype=np.int64)
        owner[rng.permutation(len(y))[: size * n]] = np.repeat(np.arange(n), size)
        sets = None
    elif scheme == "natural":
        if groups is None:
            raise ConfigError("config key 'partition.scheme': 'natural' needs a dataset with its own users")
        if groups.max() + 1 != n:
            raise ConfigError(f"config key 'partition.num_clients': the data has {groups.max() + 1} users")
        owner, sets = groups.astype(np.int64).copy(), None
    else:  # guarded by config validation
        raise ConfigError(f"config key 'partition.scheme': unknown scheme {scheme!r}")
    if cfg.samples_per_client and scheme in ("dirichlet", "natural", "dominant"):  # dominant's rounding may overshoot
        owner = _cap(owner, n, cfg.samples_per_client, rng)
    if sets is None:  # label set = the classes the client actually holds
        held = np.zeros((n, num_classes), dtype=bool)
        used = owner >= 0
        held[owner[used], y[used]] = True
        label_sets = [np.flatnonzero(row) for row in held]
    else:
        label_sets = [np.asarray(s) for s in sets]
    return owner, label_sets


def _cap(owner: np.ndarray, n: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Keep a random subset of at most `cap` samples per client."""
    idx = np.flatnonzero(owner >= 0)
    idx = idx[np.lexsort((rng.random(len(idx)), owner[idx]))]
    _, starts, sizes = np.unique(owner[idx], return_index=True, return_counts=True)
    rank = np.arange(len(idx)) - np.repeat(starts, sizes)
    capped = owner.copy()
    capped[idx[rank >= cap]] = -1
    return capped


def split_train_test(owner: np.ndarray, y: np.ndarray, n: int, test_fraction: float,
                     rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Stratified per (client, class): round(n_c * test_fraction) samples of each group go to test."""
    idx = np.flatnonzero(owner >= 0)
    idx = idx[np.lexsort((rng.random(len(idx)), y[idx], owner[idx]))]
    group = owner[idx] * (int(y.max()) + 1) + y[idx]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    sizes = np.diff(np.r_[starts, len(idx)])
    rank = np.arange(len(idx)) - np.repeat(starts, sizes)
    # round(n_c * f) of each group, but never all of it: a class a client is tested on is one it also trains on
    held = np.minimum(np.round(sizes * test_fraction), np.maximum(sizes - 1, 0))
    is_test = rank < np.repeat(held, sizes)
    if test_fraction > 0:  # a tiny client still gets one test sample, from its largest class if that keeps a
        clients = owner[idx]  # train sample of the class (never a test class the client does not train on)
        per_client_test = np.bincount(clients[is_test], minlength=n)
        per_client = np.bincount(clients, minlength=n)
        for c in np.flatnonzero((per_client_test == 0) & (per_client >= 2)):
            in_c = np.flatnonzero(clients[starts] == c)
            biggest = in_c[np.argmax(sizes[in_c])]
            if sizes[biggest] >= 2:
                is_test[starts[biggest]] = True
    bounds = np.searchsorted(owner[idx], np.arange(n + 1))
    train = [idx[a:b][~is_test[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]
    test = [idx[a:b][is_test[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]
    return train, test


def make_partition(y: np.ndarray, num_classes: int, cfg: PartitionConfig, seed: int,
                   groups: np.ndarray | None = None, is_test: np.ndarray | None = None) -> Partition:
    _check_client_count(len(y), cfg)
    rng = np.random.default_rng([seed, 0x9A27])
    owner, label_sets = assign(y, num_classes, cfg, rng, groups)
    if is_test is not None:  # the dataset's own split (LEAF files): keep it
        train = [np.flatnonzero((owner == i) & ~is_test) for i in range(cfg.num_clients)]
        test = [np.flatnonzero((owner == i) & is_test) for i in range(cfg.num_clients)]
    else:
        train, test = split_train_test(owner, y, cfg.num_clients, cfg.test_fraction, rng)
    if cfg.eval_split == "validation":  # the test split is set aside unseen; evaluate on part of train
        train_owner = np.full(len(y), -1, dtype=np.int64)
        for i, idx in enumerate(train):
            train_owner[idx] = i
        train, test = split_train_test(train_owner, y, cfg.num_clients, cfg.val_fraction,
                                       np.random.default_rng([seed, 0x7A1]))
    held_out = cfg.val_fraction if cfg.eval_split == "validation" else cfg.test_fraction
    check_partition(y, num_classes, cfg, train, test, label_sets, held_out, is_test is not None)
    warnings = partition_warnings(y, train, test, held_out) + dominant_warnings(y, cfg, train, test, label_sets)
    return Partition(train, test, label_sets, warnings)


def _check_client_count(samples: int, cfg: PartitionConfig) -> None:
    """Refuse more clients than the data can give a train and a held-out sample each, before anything is sized per
    client (10**7 clients took 396 s and 5.35 GB to be refused by `check_partition`). A natural partition's clients
    are the data's own users."""
    if cfg.scheme != "natural" and cfg.num_clients * 2 > samples:
        raise DataError(f"partition '{cfg.scheme}': partition.num_clients = {cfg.num_clients:,} clients need at "
                        f"least {cfg.num_clients * 2:,} samples (one to train on and one to evaluate on each), the "
                        f"data has {samples:,}; lower partition.num_clients (allowed here: up to {samples // 2:,})")


def check_partition(y, num_classes, cfg, train, test, label_sets, held_out, own_split) -> None:
    """Refuse, naming the numbers, a partition that cannot give what was asked: train and test data for every
    client, and (for `classes` and `chain`) the k classes of its label set in its train split."""
    n = cfg.num_clients
    if cfg.scheme in ("classes", "chain"):
        short = [i for i in range(n) if len(np.setdiff1d(label_sets[i], y[train[i]])) > 0]
        if short:
            i = short[0]
            slots = sum(int(np.isin(label_sets[j], label_sets[i][0]).any()) for j in range(n))
            have = len(np.unique(y[train[i]]))
            raise DataError(f"partition '{cfg.scheme}' gives client {i} (and {len(short) - 1} more) train samples of "
                            f"only {have} of its {len(label_sets[i])} classes: {len(y)} samples are too few for "
                            f"{n} clients x {cfg.classes_per_client} classes (class {label_sets[i][0]} has "
                            f"{int((y == label_sets[i][0]).sum())} samples for {slots} clients); lower "
                            "partition.num_clients or partition.classes_per_client")
    empty = [i for i in range(n) if len(train[i]) == 0 or (held_out > 0 and len(test[i]) == 0)]
    if empty and own_split:  # a LEAF dataset: its users and their split are the files', num_clients cannot change them
        i = empty[0]
        raise DataError(f"partition 'natural' leaves client {i} (and {len(empty) - 1} more) without train or test "
                        f"data: the LEAF files' own split gives user {i} of the train file (counting from 0) "
                        f"{len(train[i])} train and {len(test[i])} test samples; every user needs both: add that "
                        "user's missing samples to the LEAF files, or remove the user from both files")
    if empty:
        i = empty[0]
        sizes = np.bincount(y[np.r_[train[i], test[i]]], minlength=num_classes)
        held = sizes[sizes > 0]
        detail = (f"client {i} has {int(held.sum())} samples ({', '.join(map(str, held))} per class)" if held.size
                  else f"client {i} has no samples")
        raise DataError(f"partition '{cfg.scheme}' leaves client {i} (and {len(empty) - 1} more) without train or "
                        f"test data: {detail}, too few to hold out {held_out:g} of a class and still train on it; "
                        f"{len(y)} samples are too few for {n} clients; lower partition.num_clients")


def dominant_warnings(y, cfg, train, test, label_sets) -> list[str]:
    """Non-IID 2 (`dominant`): where the dominant classes hold less of the clients' data than asked, because those
    classes ran short (the pFedLA paper's 80 % at 10 clients on all of EMNIST), say by how much."""
    if cfg.scheme != "dominant":
        return []
    shares = [float(np.isin(y[np.r_[tr, te]], sets).mean()) for tr, te, sets in zip(train, test, label_sets)
              if len(tr) + len(te)]
    mean = float(np.mean(shares))
    if mean >= cfg.dominant_fraction - 0.005:
        return []
    return [f"partition 'dominant': the {cfg.dominant_classes} dominant classes hold {100 * mean:.1f} % of a "
            f"client's samples on average (min {100 * min(shares):.1f} %), not the "
            f"{100 * cfg.dominant_fraction:g} % of partition.dominant_fraction: those classes run short; lower "
            "partition.samples_per_client or partition.num_clients to reach it"]


def partition_warnings(y, train, test, held_out) -> list[str]:
    """What a researcher should know about a partition that was given (one line each)."""
    untested = [i for i in range(len(train)) if held_out > 0 and len(np.setdiff1d(y[train[i]], y[test[i]])) > 0]
    unseen = [i for i in range(len(train)) if len(np.setdiff1d(y[test[i]], y[train[i]])) > 0]
    out = []
    if unseen:
        out.append(f"partition: {len(unseen)} of {len(train)} clients (e.g. client {unseen[0]}) are tested on "
                   "classes they never train on")
    if untested:
        out.append(f"partition: {len(untested)} of {len(train)} clients (e.g. client {untested[0]}) train on "
                   f"classes with no test sample (too few samples of them to hold out {held_out:g})")
    return out
