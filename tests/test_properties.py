"""Property-based tests (hypothesis): any valid input gives a valid result or one clear error.

- partitions: any label pool and any in-range PartitionConfig give a well-formed Partition or a one-line
  PfedkitError; never an IndexError, ValueError, ZeroDivisionError...
- split_counts: exact total, non-negative, within 1 of the exact proportional share.
- samplers: every scheme is unbiased (mean row = p), draws and selections are valid and deterministic.
- config: any `--set` overrides give a Config or a one-line ConfigError naming the key; valid configs round-trip
  through dump_config.

The expected values are the invariants themselves, computed here from the raw inputs (label counts, weights), not
by calling the code under test. The bugs these properties found keep their minimal inputs as regression tests
(`@example`s and plain tests): a client held out on a class it does not train on (f > 0.5), `dominant` overshooting
`samples_per_client`, and config parsing's raw ValueError, OverflowError and YAMLError.
"""
from __future__ import annotations

import dataclasses
import math
import re
import tempfile
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import assume, event, example, given, note, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.extra import numpy as hnp

from pfedkit import config as config_mod
from pfedkit import sampling
from pfedkit.algorithms import ALGORITHMS
from pfedkit.config import ClusteringConfig, Config, PartitionConfig, build, dump_config, from_dict, load_config
from pfedkit.data.partition import Partition, make_partition, split_counts
from pfedkit.errors import ConfigError, PfedkitError
from pfedkit.sampling import (Sampler, draw_from_distributions, md_distributions, similarity_distributions,
                              size_distributions, uniform_sample)

# No example database, and hypothesis' other files (constants cache, failing-example patches) go to a temp folder:
# nothing is written into the repository (.hypothesis/).
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "pfedkit-hypothesis")
# Example counts keep the whole file near 15 s on two slow cores (pytest --durations=10 shows each test).
FAST = settings(max_examples=60, deadline=None, database=None)
MEDIUM = settings(max_examples=80, deadline=None, database=None)


def assert_one_clear_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg.strip(), f"{type(exc).__name__} with an empty message"
    assert "\n" not in msg and "\r" not in msg, f"message is not one line: {msg!r}"
    return msg


# ==== partitions ===================================================================================================

SCHEMES = ("classes", "dominant", "dirichlet", "powerlaw_labels", "chain", "iid")


def labels_from_counts(counts: list[int], shuffle_seed: int) -> np.ndarray:
    """Class c appears counts[c] times, in a seeded random order (empty classes allowed, also the last ones)."""
    y = np.repeat(np.arange(len(counts)), counts).astype(np.int64)
    return np.random.default_rng(shuffle_seed).permutation(y)


@st.composite
def class_counts(draw) -> list[int]:
    """2..20 classes, 20..3000 samples: balanced, imbalanced, with empty classes, or nearly one class."""
    num_classes = draw(st.integers(2, 20))
    cap = 3000 // num_classes
    shape = draw(st.sampled_from(["any", "balanced", "one_big"]))
    if shape == "balanced":
        counts = [draw(st.integers(1, cap))] * num_classes
    else:
        counts = draw(st.lists(st.integers(0, cap), min_size=num_classes, max_size=num_classes))
        if shape == "one_big":
            counts[draw(st.integers(0, num_classes - 1))] = cap
    if sum(counts) < 20:
        counts[0] += 20 - sum(counts)
    return counts


def fraction(high: float) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.1, 0.2, 0.3, 0.5, high]), st.floats(0.0, high, exclude_min=True))


@st.composite
def partition_cases(draw) -> dict:
    counts = draw(class_counts())
    num_classes = len(counts)
    required = {"scheme": st.sampled_from(SCHEMES), "num_clients": st.integers(1, 60)}
    optional = {
        "classes_per_client": st.integers(1, num_classes + 2),
        "test_fraction": st.one_of(st.just(0.0), fraction(0.9)),
        "dirichlet_alpha": st.one_of(st.sampled_from([0.05, 0.5, 100.0]), st.floats(0.01, 1000.0)),
        "dominant_classes": st.integers(1, num_classes + 1),
        "dominant_fraction": st.one_of(st.sampled_from([0.0, 0.5, 0.8, 1.0]), st.floats(0.0, 1.0)),
        "powerlaw_sigma": st.one_of(st.sampled_from([0.0, 2.0]), st.floats(0.0, 4.0)),
        "min_per_label": st.integers(0, 30),
        "samples_per_client": st.one_of(st.just(0), st.integers(1, 400)),
        "eval_split": st.sampled_from(["test", "validation"]),
        "val_fraction": fraction(0.9),
    }
    cfg = draw(st.fixed_dictionaries(required, optional=optional))
    return {"counts": counts, "shuffle_seed": draw(st.integers(0, 2**16)), "cfg": cfg,
            "seed": draw(st.integers(0, 2**31 - 1))}


def per_client_class_counts(idx: list[np.ndarray], y: np.ndarray, num_classes: int) -> np.ndarray:
    return np.stack([np.bincount(y[i], minlength=num_classes) for i in idx])


def partition_or_error(case: dict):
    """(y, num_classes, cfg, Partition) or (y, num_classes, cfg, the PfedkitError); any other exception escapes."""
    y = labels_from_counts(case["counts"], case["shuffle_seed"])
    num_classes = len(case["counts"])
    cfg = build(PartitionConfig, dict(case["cfg"]), "partition.")  # every value is in range: must build
    try:
        part = make_partition(y, num_classes, cfg, case["seed"])
    except PfedkitError as exc:
        return y, num_classes, cfg, exc
    return y, num_classes, cfg, part


def check_well_formed(part: Partition, y: np.ndarray, cfg: PartitionConfig) -> None:
    n = cfg.num_clients
    assert isinstance(part, Partition)
    assert len(part.train) == n and len(part.test) == n and len(part.label_sets) == n
    every = np.concatenate(part.train + part.test)
    assert every.dtype.kind in "iu", every.dtype
    assert np.all((every >= 0) & (every < len(y))), "an index outside the pool"
    assert len(np.unique(every)) == len(every), "a sample is given out twice (within or across clients)"
    held_out = cfg.val_fraction if cfg.eval_split == "validation" else cfg.test_fraction
    for i in range(n):
        assert len(part.train[i]) >= 1, f"client {i} has no train data"
        if held_out > 0:
            assert len(part.test[i]) >= 1, f"client {i} has no held-out data"
        elif cfg.eval_split == "test":
            assert len(part.test[i]) == 0, f"test_fraction 0 but client {i} has test data"


def check_stratified(part: Partition, y: np.ndarray, num_classes: int, cfg: PartitionConfig) -> None:
    """Per (client, class) round(n_c * f) held-out samples (half to even), but never all n_c of them (at most
    n_c - 1: a held-out class is also trained on); a client whose share is 0 but whose largest class has >= 2
    samples holds out exactly one, from (one of) its largest class(es)."""
    f = cfg.val_fraction if cfg.eval_split == "validation" else cfg.test_fraction
    train = per_client_class_counts(part.train, y, num_classes)
    test = per_client_class_counts(part.test, y, num_classes)
    for i, (tr, te) in enumerate(zip(train, test)):
        total = tr + te
        want = np.array([min(round(int(c) * f), max(int(c) - 1, 0)) for c in total])
        if f > 0 and want.sum() == 0 and total.max() >= 2:
            assert te.sum() == 1, f"client {i}: tiny client should hold out exactly one sample, got {te}"
            assert total[np.flatnonzero(te)[0]] == total.max(), f"client {i}: held-out sample not of its largest class"
        else:
            np.testing.assert_array_equal(te, want, err_msg=f"client {i}: totals {total}, fraction {f}")


def check_scheme_promises(part: Partition, y: np.ndarray, num_classes: int, cfg: PartitionConfig) -> None:
    """What each scheme promises about label sets and sizes. With eval_split validation the test split is set aside
    and not returned, so the count checks (equal slots, sizes) apply to eval_split test only."""
    n, k, cap = cfg.num_clients, cfg.classes_per_client, cfg.samples_per_client
    counts_visible = cfg.eval_split == "test"
    held = per_client_class_counts([np.concatenate([a, b]) for a, b in zip(part.train, part.test)], y, num_classes)
    sizes = held.sum(axis=1)
    pool = np.bincount(y, minlength=num_classes)
    if cfg.scheme in ("classes", "chain"):
        holds = np.zeros((n, num_classes), dtype=bool)
        for i, s in enumerate(part.label_sets):
            s = np.asarray(s)
            assert len(s) == k and len(np.unique(s)) == k, f"client {i}: label set {s} is not {k} distinct classes"
            assert np.all((s >= 0) & (s < num_classes))
            holds[i, s] = True
        for i in range(n):
            train_labels = set(np.unique(y[part.train[i]]).tolist())
            assert train_labels <= set(part.label_sets[i].tolist()), f"client {i} trains outside its label set"
        assert np.all(held[~holds] == 0), "a client holds a class outside its label set"
        if not counts_visible:
            return
        # equal slots: every holder of class c gets floor(count_c / holders_c) samples of it (capped at cap // k)
        for c in range(num_classes):
            holders = np.flatnonzero(holds[:, c])
            if len(holders):
                share = pool[c] // len(holders)
                if cap:
                    share = min(share, cap // k)
                np.testing.assert_array_equal(held[holders, c], share, err_msg=f"class {c}, holders {holders}")
    if cfg.scheme == "classes":  # spread evenly: holders per class differ by at most one
        per_class = np.bincount(np.concatenate(part.label_sets), minlength=num_classes)
        assert per_class.max() - per_class.min() <= 1, per_class
    if cfg.scheme == "chain":
        for i in range(n - 1):
            shared = set(part.label_sets[i].tolist()) & set(part.label_sets[i + 1].tolist())
            want = k if k == num_classes else k - 1  # neighbours share k - 1 classes (all of them when k = C)
            assert len(shared) == want, (i, part.label_sets[i], part.label_sets[i + 1])
    if cfg.scheme == "powerlaw_labels":
        for u in range(n):
            labels = sorted({(u + j) % num_classes for j in range(k)})
            assert sorted(part.label_sets[u].tolist()) == labels
            assert np.all(held[u, np.setdiff1d(np.arange(num_classes), labels)] == 0), f"client {u}: {held[u]}"
            if counts_visible:
                assert held[u, labels].min() >= cfg.min_per_label, f"client {u}: {held[u]}"
        if cap:
            assert sizes.max() <= cap, sizes
    if cfg.scheme == "dominant":
        for i, s in enumerate(part.label_sets):
            assert len(s) == cfg.dominant_classes and len(np.unique(s)) == len(s), (i, s)
    if not counts_visible:
        return
    if cfg.scheme == "iid":
        assert np.all(sizes == (cap or len(y) // n)), sizes
    if cfg.scheme == "dirichlet":
        assert sizes.min() >= min(10, cap or 10), sizes
        if cap:
            assert sizes.max() <= cap, sizes
        else:
            assert sizes.sum() == len(y), "dirichlet without a cap uses every sample"


# The tiny-client rule: 2 samples of 2 classes at test_fraction 0.1 round to 0 test samples; moving one to test
# would leave its class untrained, so this must be one clear error (or a valid partition), never a bad one.
TINY_CLIENT = {"counts": [1, 1, 18], "shuffle_seed": 0,
               "cfg": {"scheme": "powerlaw_labels", "num_clients": 1, "classes_per_client": 2, "min_per_label": 1,
                       "samples_per_client": 2, "test_fraction": 0.1}, "seed": 0}


@settings(max_examples=100, deadline=None, database=None)
@given(case=partition_cases())
@example(case=TINY_CLIENT)
def test_any_valid_partition_config_gives_a_valid_partition_or_one_clear_error(case):
    y, num_classes, cfg, result = partition_or_error(case)
    note(f"{len(y)} samples, class counts {case['counts']}; {cfg}")
    event(f"{cfg.scheme}: {type(result).__name__}")
    if isinstance(result, PfedkitError):
        assert_one_clear_line(result)
        return
    part = result
    for warning in getattr(part, "warnings", []):  # optional one-line notes about a partition that was given
        assert isinstance(warning, str) and warning.strip() and "\n" not in warning, repr(warning)
    check_well_formed(part, y, cfg)
    check_stratified(part, y, num_classes, cfg)
    check_scheme_promises(part, y, num_classes, cfg)
    again = make_partition(y, num_classes, cfg, case["seed"])  # same seed: the very same partition
    for name in ("train", "test", "label_sets"):
        for i, (a, b) in enumerate(zip(getattr(part, name), getattr(again, name))):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}[{i}] differs between two runs with one seed")


# Bug 1, minimal inputs. A (client, class) group of s samples sends round(s * f) of them to the held-out split,
# which is all of them when s * (1 - f) < 0.5 (s = 1 and f > 0.5; s = 2 and f >= 0.75; ...): the client is then
# tested on a class it has no train sample of. Only fractions above 0.5 can do it.
BUG1_EXAMPLES = [
    # found by hypothesis: dirichlet, 1 client, 19 samples of class 0 and 1 of class 1, test_fraction 0.75:
    # train = 5 of class 0, test = 14 of class 0 + the only sample of class 1
    {"counts": [19, 1], "shuffle_seed": 0, "cfg": {"scheme": "dirichlet", "num_clients": 1, "test_fraction": 0.75},
     "seed": 0},
    # the same through the validation split: iid, 1 client, 3 samples of class 0 and 1 of class 1,
    # test_fraction 0.3 (1 of class 0 set aside), val_fraction 0.6: round(2 * 0.6) = 1, round(1 * 0.6) = 1
    {"counts": [3, 1], "shuffle_seed": 0,
     "cfg": {"scheme": "iid", "num_clients": 1, "test_fraction": 0.3, "eval_split": "validation",
             "val_fraction": 0.6}, "seed": 0},
]


@FAST
@given(case=partition_cases())
@example(case=BUG1_EXAMPLES[0])
@example(case=BUG1_EXAMPLES[1])
def test_a_client_is_never_held_out_on_a_class_it_never_trains_on(case):
    y, num_classes, cfg, result = partition_or_error(case)
    note(f"{len(y)} samples, class counts {case['counts']}; {cfg}")
    if isinstance(result, PfedkitError):
        return
    for i, (tr, te) in enumerate(zip(result.train, result.test)):
        missing = set(y[te].tolist()) - set(y[tr].tolist())
        assert not missing, f"client {i} is held out on classes {sorted(missing)} it never trains on"


def test_dominant_gives_no_client_more_than_samples_per_client():
    # minimal input found by hypothesis: 11, 3, 3, 3 samples of 4 classes, 3 clients, 1 dominant class at 0.5,
    # samples_per_client 4 -> client sizes [5, 4, 2]
    y = labels_from_counts([11, 3, 3, 3], 0)
    cfg = build(PartitionConfig, {"scheme": "dominant", "num_clients": 3, "dominant_classes": 1,
                                  "dominant_fraction": 0.5, "samples_per_client": 4}, "partition.")
    try:
        part = make_partition(y, 4, cfg, 0)
    except PfedkitError as exc:  # capped at 4, a client of 1 sample per class cannot be tested: a clear refusal
        assert "client" in str(exc) and "\n" not in str(exc)
        return
    sizes = [len(a) + len(b) for a, b in zip(part.train, part.test)]
    assert max(sizes) <= 4, f"client sizes {sizes} with samples_per_client 4"


# ==== split_counts =================================================================================================

weights_strategy = st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e6)), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None, database=None)
@given(total=st.integers(0, 100_000), weights=weights_strategy)
def test_split_counts_sums_exactly_to_total_and_each_count_is_within_one_of_its_share(total, weights):
    w = np.asarray(weights, dtype=np.float64)
    assume(w.sum() > 0)
    counts = split_counts(total, w)
    assert counts.shape == w.shape and counts.dtype.kind == "i"
    assert int(counts.sum()) == total
    assert np.all(counts >= 0)
    exact = [wi * total / math.fsum(weights) for wi in weights]
    for c, e, wi in zip(counts.tolist(), exact, weights):
        assert abs(c - e) < 1 + 1e-9, (c, e)
        if wi == 0:
            assert c == 0


# ==== samplers =====================================================================================================

@st.composite
def importances(draw, n: int, allow_zero: bool = False) -> np.ndarray:
    """p > 0 (or >= 0 with at least one positive), normalised: sample counts or raw floats of wide range."""
    kind = draw(st.sampled_from(["counts", "floats", "equal"]))
    if kind == "equal":
        raw = np.ones(n)
    elif kind == "counts":
        raw = np.asarray(draw(st.lists(st.integers(1, 100_000), min_size=n, max_size=n)), dtype=np.float64)
    else:
        raw = np.asarray(draw(st.lists(st.floats(1e-12, 1e6), min_size=n, max_size=n)))
    if allow_zero and n > 1:
        zero = np.asarray(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        if not zero.all():
            raw = np.where(zero, 0.0, raw)
    return raw / raw.sum()


@st.composite
def gradients(draw, n: int) -> np.ndarray:
    """(n, d) representative gradients: arbitrary values, with repeated rows and zero rows likely."""
    d = draw(st.integers(1, 6))
    elements = st.one_of(st.just(0.0), st.floats(-100.0, 100.0, allow_nan=False, allow_infinity=False))
    return draw(hnp.arrays(np.float64, (n, d), elements=elements))


def check_row_distributions(r: np.ndarray, p: np.ndarray, m: int) -> None:
    assert r.shape == (m, len(p))
    assert np.all(np.isfinite(r)) and np.all(r >= 0)
    np.testing.assert_allclose(r.sum(axis=1), 1.0, rtol=0, atol=1e-9)
    np.testing.assert_allclose(r.mean(axis=0), p, rtol=0, atol=1e-9, err_msg="not unbiased: mean row != p")


def check_draws(draws, r: np.ndarray) -> None:
    assert len(draws) == r.shape[0]
    for k, c in enumerate(draws):
        assert isinstance(c, int) and 0 <= c < r.shape[1]
        assert r[k, c] > 0, f"row {k} drew client {c} that has probability 0 there"


@FAST
@given(data=st.data(), n=st.integers(1, 40), m=st.integers(1, 50), seed=st.integers(0, 2**32 - 1))
def test_size_and_md_distributions_are_unbiased_and_their_draws_are_valid(data, n, m, seed):
    p = data.draw(importances(n, allow_zero=True), label="p")
    for build_rows in (size_distributions, md_distributions):
        r = build_rows(p, m)
        check_row_distributions(r, p, m)
        check_draws(draw_from_distributions(r, np.random.default_rng(seed)), r)


@MEDIUM
@given(data=st.data(), n=st.integers(1, 30), m=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
       distance=st.sampled_from(["cosine", "l2", "l1"]), linkage_input=st.sampled_from(["rows", "condensed"]))
def test_similarity_distributions_are_unbiased_for_any_gradients_and_clusters(data, n, m, seed, distance,
                                                                                linkage_input):
    p = data.draw(importances(n, allow_zero=True), label="p")
    G = data.draw(gradients(n), label="G")
    options = {"distance": distance, "linkage_input": linkage_input,
               "clusters": data.draw(st.integers(0, n + 2), label="clusters")}
    if hasattr(sampling, "KEPT_ORDERS"):  # the option of the reference code's row order, where the library has it
        options["kept_order"] = data.draw(st.sampled_from(sampling.KEPT_ORDERS), label="kept_order")
    r = similarity_distributions(G, p, m, **options, rng=np.random.default_rng(seed))
    check_row_distributions(r, p, m)
    again = similarity_distributions(G, p, m, **options, rng=np.random.default_rng(seed))
    np.testing.assert_array_equal(r, again)
    check_draws(draw_from_distributions(r, np.random.default_rng(seed)), r)


@settings(max_examples=150, deadline=None, database=None)
@given(seed=st.integers(0, 2**32 - 1), rnd=st.integers(0, 10_000), num_clients=st.integers(1, 300),
       per_round=st.integers(-5, 320))
def test_uniform_sample_gives_sorted_distinct_ids_in_range(seed, rnd, num_clients, per_round):
    got = uniform_sample(seed, rnd, num_clients, per_round)
    want = num_clients if per_round <= 0 or per_round >= num_clients else per_round
    assert len(got) == want
    assert got == sorted(set(got)), "not sorted and distinct"
    assert all(isinstance(c, int) and 0 <= c < num_clients for c in got)
    assert got == uniform_sample(seed, rnd, num_clients, per_round)


@st.composite
def clustering_configs(draw, n: int) -> ClusteringConfig:
    """Every option of ClusteringConfig (whatever fields it has), built through config.build; clusters 0..n+1."""
    hints = typing.get_type_hints(ClusteringConfig)
    values = {f.name: draw(st.integers(0, n + 1) if f.name == "clusters" else valid_value(f, hints[f.name]))
              for f in dataclasses.fields(ClusteringConfig)}
    return build(ClusteringConfig, values, "clustering.")


@st.composite
def sampler_cases(draw) -> dict:
    n = draw(st.integers(1, 30))
    case = {
        "scheme": draw(st.sampled_from(["uniform", "md", "clustered_size", "clustered_similarity"])),
        "sizes": draw(st.lists(st.integers(1, 100_000), min_size=n, max_size=n)),
        "per_round": draw(st.integers(-2, n + 3)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "importance": draw(st.sampled_from(["size", "equal"])),
        "clustering": draw(clustering_configs(n)),
        "rnd": draw(st.integers(0, 1000)),
    }
    G = draw(gradients(n))
    seen = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))  # clients that have trained so far
    case["observed"] = {c: torch.tensor(G[c], dtype=torch.float32) for c in seen}
    case["dim"] = G.shape[1]
    return case


def select(case: dict) -> dict[int, float]:
    sampler = Sampler(case["scheme"], np.asarray(case["sizes"]), case["per_round"], case["seed"],
                      case["clustering"], case["importance"])
    state = sampler.init_state(case["dim"], torch.zeros(case["dim"]))
    state = sampler.observe(state, dict(case["observed"]))
    return sampler.select(state, case["rnd"])


@MEDIUM
@given(case=sampler_cases())
def test_sampler_selects_valid_clients_with_weights_summing_to_one_deterministically(case):
    n, per_round = len(case["sizes"]), case["per_round"]
    weights = select(case)
    assert weights and all(isinstance(c, int) and 0 <= c < n for c in weights), weights
    assert all(w > 0 for w in weights.values())
    assert math.fsum(weights.values()) == pytest.approx(1.0, abs=1e-9)
    m = n if per_round <= 0 or per_round >= n else per_round
    if case["scheme"] == "uniform":
        assert len(weights) == m, f"uniform should select exactly {m} distinct clients"
        importance = np.asarray(case["sizes"], dtype=np.float64) if case["importance"] == "size" else np.ones(n)
        total = math.fsum(importance[c] for c in weights)
        for c, w in weights.items():  # FedAvg's rule: proportional to importance among the selected
            assert w == pytest.approx(importance[c] / total, rel=1e-9)
    else:  # m draws, weight = draws / m
        assert len(weights) <= m
        draws = [w * m for w in weights.values()]
        assert all(abs(x - round(x)) < 1e-6 and round(x) >= 1 for x in draws), draws
        assert sum(round(x) for x in draws) == m
    assert select(case) == weights, "same (seed, round) must give the same selection"


# ==== config parsing ===============================================================================================

def flat_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + k)
        if isinstance(v, dict):
            out += flat_keys(v, f"{prefix}{k}.")
    return out


KNOWN_KEYS = flat_keys(Config().to_dict()) + flat_keys(
    {name: dataclasses.asdict(cls()) for name, cls in config_mod.algorithm_sections().items()})
assert "partition.num_clients" in KNOWN_KEYS and "local" in KNOWN_KEYS and "pfedla.hn_lr" in KNOWN_KEYS

segment = st.text("abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=10)
unknown_key = st.one_of(
    segment,  # top level
    st.builds(lambda s, x: f"{s}.{x}", st.sampled_from(["local", "partition", "dataset", "dataset.synthetic",
                                                        "model", "clustering", "pfedla", "fedprox"]), segment),
    st.builds(lambda k, x: f"{k}.{x}", st.sampled_from(KNOWN_KEYS), segment),  # a scalar key used as a section
)
override_key = st.one_of(st.sampled_from(KNOWN_KEYS), st.sampled_from(KNOWN_KEYS), unknown_key)

NONFINITE_TEXT = (".nan", ".NaN", "nan", "NaN", ".inf", "-.inf", "inf", "-inf", "Infinity", "-Infinity")
SAFE_TEXT = st.text(st.characters(codec="ascii", exclude_characters="\n\r\x0b\x0c"), max_size=12)
# sharp edges of number parsing ('--5', '²' and 10**400 once escaped as raw ValueError / OverflowError)
EDGE_TEXT = ("--5", "-", "+5", " 7 ", "5.0", "3.5", "-0", "0x1F", "1_000", "1e400", "-1e400", "1" + "0" * 400,
             "²", "١٢", "1,5", "[1]", "{a: 1}", "'3'", "!!float 1", "!!python/none x", "&a 3", "*a", "[1", "@x")


def yaml_flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()


algorithm_spec = st.builds(
    lambda names: ",".join(names),
    st.lists(st.builds(
        lambda name, kv: name + ("@" + "+".join(f"{k}={v}" for k, v in kv) if kv else ""),
        st.sampled_from(list(ALGORITHMS) + ["all", "nope"]),
        st.lists(st.tuples(st.sampled_from(["k", "hn_lr", "mu", "selfweight", "local.lr", "local.epochs",
                                            "local.nope", "nope"]),
                           st.one_of(st.integers(-3, 5).map(str), st.sampled_from(["0.5", "raw", "x", "", "-1e-3"]))),
                 max_size=2)),
        min_size=1, max_size=3))

override_value = st.one_of(
    st.integers(-10, 10).map(str),
    st.integers(-2**70, 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.floats(-2.0, 2.0).map(repr),
    st.sampled_from(NONFINITE_TEXT),
    st.sampled_from(EDGE_TEXT),
    st.sampled_from(["true", "false", "True", "no", "yes", "1", "0"]),
    st.sampled_from(["null", "~", "", "None", "none"]),
    st.sampled_from(["cosine", "classes", "dirichlet", "validation", "cpu", "cuda", "dnn", "digits", "leaf",
                     "natural", "synthetic", "raw", "size", "md", "clustered_similarity", "0,1,2", "1, x"]),
    SAFE_TEXT,
    st.lists(st.one_of(st.integers(-3, 3), st.floats(allow_nan=False), SAFE_TEXT), max_size=3).map(yaml_flow),
    st.dictionaries(segment, st.integers(-3, 3), max_size=2).map(yaml_flow),
    algorithm_spec,
)


def names_a_given_key(msg: str, keys: list[str], values: list[str]) -> bool:
    """The message names (quoted, as 'key') one of the keys given, the dotted prefix of it that is wrong (an
    unknown section, or a scalar key used as a section), or a key below it (a section given a mapping with an
    unknown key: dataset={x: 1} -> 'dataset.x'); for `algorithm`, a key set inside the spec (`heurpfedla@k=x` ->
    'heurpfedla.k', `fedavg@local.lr=x` -> 'local.lr') also counts. A check across keys may name the other key of
    its pair (dataset.name=leaf -> 'partition.scheme')."""
    quoted = set(re.findall(r"'([^']*)'", msg))

    def named(key: str) -> bool:
        return key in quoted

    for key, value in zip(keys, values):
        parts = key.split(".")
        if any(named(".".join(parts[:j])) for j in range(1, len(parts) + 1)):
            return True
        if any(q.startswith(key + ".") for q in quoted):
            return True
        if key == "algorithm":
            for spec in value.split(","):
                name, _, rest = spec.partition("@")
                for item in filter(None, rest.split("+")):
                    sub = item.partition("=")[0].strip()
                    if named(f"{name.strip()}.{sub}") or named(sub):
                        return True
    partners = {"dataset.name": ("partition.scheme", "dataset.train_file"),
                "partition.scheme": ("dataset.train_file",),
                "partition.num_clients": ("clients_per_round",),
                "partition.eval_split": ("partition.test_fraction",),
                "local.steps": ("local.epochs",)}
    return any(named(p) for key in keys for p in partners.get(key, ()))


def valid_value(f: dataclasses.Field, tp) -> st.SearchStrategy:
    """In-range values of one config field, from its declared type and metadata (choices, min, max)."""
    meta = f.metadata
    if "choices" in meta:
        return st.sampled_from(meta["choices"])
    if tp is bool:
        return st.booleans()
    if tp in (int, float):
        low, high = meta.get("min", 0), meta.get("max")
        if tp is int:
            return st.integers(int(low), int(high) if high is not None else int(low) + 1000)
        return st.floats(low, high if high is not None else 1e6, exclude_min=meta.get("open_low", False))
    return st.one_of(st.none(), SAFE_TEXT)  # free strings: dataset.root, dataset.train_file, ...


def scalar_fields(cls, prefix: str = "") -> dict[str, tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("hidden"):
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(scalar_fields(tp, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (f, tp)
    return out


SCALARS = scalar_fields(Config)
for _name, _cls in config_mod.algorithm_sections().items():
    SCALARS.update(scalar_fields(_cls, _name + "."))
# keys whose in-range values can be typed on the command line exactly: numbers, booleans, choices
TYPED = {k: (f, tp) for k, (f, tp) in SCALARS.items() if tp in (int, float, bool) or "choices" in f.metadata}


def as_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


@st.composite
def override_pairs(draw) -> list[tuple[str, str, object]]:
    """1..4 (key, value text, intended value or None): random keys with random text, or a typed key with an
    in-range value (so that some runs load, and what was set can be checked)."""
    pairs = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            key = draw(st.sampled_from(sorted(TYPED)))
            value = draw(valid_value(*TYPED[key]))
            pairs.append((key, as_text(value), value))
        else:
            pairs.append((draw(override_key), draw(override_value), None))
    return pairs


def flat_values(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_values(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


@settings(max_examples=200, deadline=None, database=None)
@given(pairs=override_pairs())
def test_any_set_overrides_give_a_config_or_one_clear_error_naming_the_key(pairs):
    overrides = [f"{k}={v}" for k, v, _ in pairs]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as exc:
        event("ConfigError")
        msg = assert_one_clear_line(exc)
        keys, values = [k for k, _, _ in pairs], [v for _, v, _ in pairs]
        assert names_a_given_key(msg, keys, values), f"{msg!r} names none of {keys}"
        return
    event("Config")
    assert isinstance(cfg, Config)
    got = flat_values(cfg.to_dict())
    for j, (key, text, intended) in enumerate(pairs):
        later = [k for k, _, _ in pairs[j + 1:]]
        if intended is not None and not any(related(key, k) for k in later):  # what you set is what you get
            assert got[key] == intended and type(got[key]) is type(intended), (key, text, got[key])


@pytest.mark.parametrize("text", [".nan", "nan", ".inf", "-.inf", "Infinity"])
def test_a_non_finite_number_for_any_float_key_is_one_clear_error_naming_the_key(text):
    float_keys = [k for k, (_, tp) in SCALARS.items() if tp is float]
    assert "local.lr" in float_keys and "pfedla.hn_lr" in float_keys
    for key in float_keys:
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"{key}={text}"])
        msg = assert_one_clear_line(info.value)
        assert f"'{key}'" in msg, msg


def valid_section(cls) -> st.SearchStrategy[dict]:
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("hidden") or f.name in ("algorithm", "seeds"):
            continue
        tp = hints[f.name]
        fields[f.name] = valid_section(tp) if dataclasses.is_dataclass(tp) else valid_value(f, tp)
    return st.fixed_dictionaries({}, optional=fields)


def consistent(raw: dict) -> dict:
    """Adjust the in-range values to the rules across keys (clients_per_round <= num_clients, natural needs
    synthetic or leaf, leaf needs natural and its two files); test_fraction 0 and epochs = steps = 0 are left to
    assume()."""
    part, data = raw.setdefault("partition", {}), raw.setdefault("dataset", {})
    n = part.get("num_clients", PartitionConfig().num_clients)
    raw["clients_per_round"] = raw.get("clients_per_round", 0) % (n + 1)
    if data.get("name") == "leaf":
        part["scheme"] = "natural"
        data["train_file"] = data.get("train_file") or "train.json"
        data["test_file"] = data.get("test_file") or "test.json"
    elif part.get("scheme") == "natural":
        data["name"] = "synthetic"
    return raw


valid_raw_config = st.builds(
    lambda top, algo, extra: consistent({**top, **algo, **extra}),
    valid_section(Config),
    st.fixed_dictionaries({}, optional={name: valid_section(cls)
                                        for name, cls in config_mod.algorithm_sections().items()}),
    st.fixed_dictionaries({}, optional={
        "seeds": st.lists(st.integers(0, 99), max_size=3).map(lambda s: ",".join(map(str, s))),
        "algorithm": st.sampled_from(["all", "fedavg", "local,fedavg", "heurpfedla@k=2", "fedavg@local.lr=0.01"])}),
)


@settings(max_examples=40, deadline=None, database=None)  # ~0.1 s each: pure-Python YAML
@given(raw=valid_raw_config)
def test_a_valid_config_round_trips_through_dump_config(raw):
    try:
        cfg = from_dict(raw)
    except ConfigError as exc:
        assert_one_clear_line(exc)
        assume(False)  # test_fraction 0 with eval_split test, or local.epochs = local.steps = 0
    again = from_dict(yaml.safe_load(dump_config(cfg)))
    assert again.to_dict() == cfg.to_dict()


# ---- config parsing bugs the properties found: their minimal inputs -----------------------------------------------------

@pytest.mark.parametrize("override", ["rounds=--5", "rounds=²"])
def test_an_integer_key_with_double_minus_or_superscript_digit_is_a_config_error(override):
    with pytest.raises(ConfigError, match="rounds"):
        load_config(None, [override])


def test_a_float_key_with_an_integer_too_large_for_a_float_is_a_config_error():
    with pytest.raises(ConfigError, match=r"local\.lr"):
        load_config(None, ["local.lr=1" + "0" * 400])


def test_an_unparsable_value_inside_an_algorithm_spec_is_a_config_error():
    with pytest.raises(ConfigError, match="algorithm|heurpfedla"):
        load_config(None, [], "heurpfedla@k=[1")
