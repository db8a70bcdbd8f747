"""Partition invariants: what each scheme promises about the clients' label sets, sizes and train/test splits.

Label arrays are synthetic (shuffled, C classes x m samples) unless a test says otherwise; `digits` is the real
sklearn set with slightly unequal class counts (174..183 per class).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pfedkit.config import DatasetConfig, PartitionConfig
from pfedkit.data.partition import Partition, make_partition, split_counts
from pfedkit.data.sources import load_source
from pfedkit.errors import ConfigError, DataError


# ---- helpers -------------------------------------------------------------------------------------------------------

def shuffled_labels(per_class: int = 600, classes: int = 10, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), per_class)).astype(np.int64)


def client_indices(part: Partition, i: int) -> np.ndarray:
    return np.concatenate([part.train[i], part.test[i]])


def class_counts(part: Partition, y: np.ndarray, num_classes: int, which: str = "all") -> np.ndarray:
    """(clients, classes) sample counts of the train part, the test part or both."""
    pick = {"train": lambda i: part.train[i], "test": lambda i: part.test[i], "all": lambda i: client_indices(part, i)}
    return np.stack([np.bincount(y[pick[which](i)], minlength=num_classes) for i in range(part.num_clients)])


def assert_well_formed(part: Partition, n_samples: int, num_clients: int) -> None:
    """Every sample used at most once, train and test disjoint, every client with train and test data."""
    assert part.num_clients == num_clients
    assert len(part.test) == num_clients and len(part.label_sets) == num_clients
    every = np.concatenate(part.train + part.test)
    assert every.dtype.kind == "i"
    assert len(np.unique(every)) == len(every), "a sample was given out twice"
    assert every.min() >= 0 and every.max() < n_samples
    for i in range(num_clients):
        assert len(part.train[i]) > 0, f"client {i} has no train data"
        assert len(part.test[i]) > 0, f"client {i} has no test data"
        assert len(np.intersect1d(part.train[i], part.test[i])) == 0


def assert_stratified(part: Partition, y: np.ndarray, num_classes: int, test_fraction: float) -> None:
    """Per (client, class): round(n_c * test_fraction) test samples; a client whose rounded test share is zero
    but whose largest class has >= 2 samples gets exactly one test sample, taken from that class (so it still
    trains on every class it is tested on)."""
    total = class_counts(part, y, num_classes, "all")
    test = class_counts(part, y, num_classes, "test")
    for i in range(part.num_clients):
        want = np.array([round(n * test_fraction) for n in total[i]])
        if test_fraction > 0 and want.sum() == 0 and total[i].max() >= 2:
            assert test[i].sum() == 1, f"tiny client {i} should get exactly one test sample"
            assert total[i][np.flatnonzero(test[i])[0]] == total[i].max(), "the test sample is not from its largest class"
        else:
            np.testing.assert_array_equal(test[i], want, err_msg=f"client {i}")


SCHEME_CONFIGS = {
    "classes": PartitionConfig(scheme="classes", num_clients=20, classes_per_client=3),
    "chain": PartitionConfig(scheme="chain", num_clients=8, classes_per_client=4),
    "dominant": PartitionConfig(scheme="dominant", num_clients=10, dominant_classes=2, dominant_fraction=0.8),
    "dirichlet": PartitionConfig(scheme="dirichlet", num_clients=20, dirichlet_alpha=0.5),
    "powerlaw_labels": PartitionConfig(scheme="powerlaw_labels", num_clients=30, classes_per_client=2),
    "iid": PartitionConfig(scheme="iid", num_clients=12),
    "natural": PartitionConfig(scheme="natural", num_clients=15),
}


def natural_groups(n_samples: int, num_users: int, seed: int = 5) -> np.ndarray:
    """Every user present, unequal sizes."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_users + 1, dtype=np.float64)
    groups = np.r_[np.arange(num_users), rng.choice(num_users, n_samples - num_users, p=weights / weights.sum())]
    return rng.permutation(groups)


def partition_for(scheme: str, y: np.ndarray, seed: int = 0, **changes) -> Partition:
    cfg = dataclasses.replace(SCHEME_CONFIGS[scheme], **changes)
    groups = natural_groups(len(y), cfg.num_clients) if scheme == "natural" else None
    return make_partition(y, 10, cfg, seed, groups=groups)


@pytest.fixture(scope="module")
def digits_y() -> np.ndarray:
    return load_source(DatasetConfig(name="digits"), seed=0, num_clients=10).y


# ---- every scheme --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", list(SCHEME_CONFIGS))
def test_every_scheme_uses_each_sample_at_most_once_and_gives_every_client_train_and_test(scheme):
    y = shuffled_labels()
    part = partition_for(scheme, y)
    assert_well_formed(part, len(y), SCHEME_CONFIGS[scheme].num_clients)


@pytest.mark.parametrize("scheme", list(SCHEME_CONFIGS))
@pytest.mark.parametrize("test_fraction", [0.3, 0.2, 0.5])
def test_every_scheme_splits_each_client_class_group_by_rounded_test_fraction(scheme, test_fraction):
    y = shuffled_labels()
    part = partition_for(scheme, y, test_fraction=test_fraction)
    assert_stratified(part, y, 10, test_fraction)


def test_default_test_fraction_is_0_3():
    assert PartitionConfig().test_fraction == 0.3
    y = shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="iid", num_clients=10), seed=0)
    assert_stratified(part, y, 10, 0.3)
    assert sum(map(len, part.test)) == pytest.approx(0.3 * 6000, abs=10 * 10)


def test_test_fraction_zero_keeps_every_assigned_sample_for_training():
    y = shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="iid", num_clients=10, test_fraction=0.0), seed=0)
    assert all(len(t) == 0 for t in part.test)
    assert [len(t) for t in part.train] == [600] * 10


@pytest.mark.parametrize("scheme", list(SCHEME_CONFIGS))
def test_same_seed_gives_identical_partition_and_another_seed_a_different_one(scheme):
    y = shuffled_labels()
    a, b, c = partition_for(scheme, y, seed=3), partition_for(scheme, y, seed=3), partition_for(scheme, y, seed=4)
    for i in range(a.num_clients):
        np.testing.assert_array_equal(a.train[i], b.train[i])
        np.testing.assert_array_equal(a.test[i], b.test[i])
        np.testing.assert_array_equal(a.label_sets[i], b.label_sets[i])
    assert any(not np.array_equal(a.train[i], c.train[i]) for i in range(a.num_clients))


def test_tiny_client_still_gets_one_test_sample_from_its_largest_class():
    # client 0: four samples of class 2 and one of class 4; at test_fraction 0.1 both groups round to 0 test samples
    y = np.r_[np.full(4, 2), 4, np.repeat(np.arange(10), 30)].astype(np.int64)
    groups = np.r_[np.zeros(5, dtype=np.int64), np.repeat([1, 2], 150)]
    part = make_partition(y, 10, PartitionConfig(scheme="natural", num_clients=3, test_fraction=0.1), 0, groups=groups)
    assert len(part.test[0]) == 1 and y[part.test[0][0]] == 2
    assert sorted(np.r_[part.train[0], part.test[0]]) == [0, 1, 2, 3, 4]
    assert_stratified(part, y, 10, 0.1)


# ---- classes -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,k", [(10, 4), (20, 3), (7, 5), (50, 2), (3, 10), (13, 1)])
def test_classes_every_client_has_exactly_k_distinct_classes_in_train_and_the_same_in_test(num_clients, k):
    y = shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="classes", num_clients=num_clients, classes_per_client=k), 0)
    train, test = class_counts(part, y, 10, "train"), class_counts(part, y, 10, "test")
    for i in range(num_clients):
        held = np.flatnonzero(train[i])
        assert len(held) == k
        np.testing.assert_array_equal(held, np.flatnonzero(test[i]))
        np.testing.assert_array_equal(held, np.sort(part.label_sets[i]))


def check_equal_slots(part: Partition, y: np.ndarray, num_classes: int, cap: int = 0) -> None:
    counts = class_counts(part, y, num_classes, "all")
    holds = np.zeros_like(counts, dtype=bool)
    for i, s in enumerate(part.label_sets):
        holds[i, s] = True
    pool = np.bincount(y, minlength=num_classes)
    for c in range(num_classes):
        holders = np.flatnonzero(holds[:, c])
        if len(holders) == 0:
            assert counts[:, c].sum() == 0
            continue
        share = pool[c] // len(holders)
        if cap:
            share = min(share, cap)
        np.testing.assert_array_equal(counts[holders, c], share, err_msg=f"class {c}")
        assert counts[~holds[:, c], c].sum() == 0


@pytest.mark.parametrize("num_clients,k", [(10, 4), (20, 3), (7, 5), (33, 2)])
def test_classes_every_slot_of_a_class_gets_floor_of_count_over_holders(num_clients, k):
    y = shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="classes", num_clients=num_clients, classes_per_client=k), 0)
    check_equal_slots(part, y, 10)


def test_classes_equal_slots_on_real_digits_with_unequal_class_counts(digits_y):
    assert len(set(np.bincount(digits_y))) > 1  # the point: classes differ in size
    cfg = PartitionConfig(scheme="classes", num_clients=25, classes_per_client=3)
    part = make_partition(digits_y, 10, cfg, 0)
    assert_well_formed(part, len(digits_y), 25)
    check_equal_slots(part, digits_y, 10)
    assert_stratified(part, digits_y, 10, 0.3)


@pytest.mark.parametrize("num_clients,k", [(10, 4), (7, 3), (23, 4), (1000, 3)])
def test_classes_are_spread_evenly_holders_per_class_differ_by_at_most_one(num_clients, k):
    y = shuffled_labels(per_class=6000) if num_clients > 100 else shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="classes", num_clients=num_clients, classes_per_client=k), 0)
    holders = np.bincount(np.concatenate(part.label_sets), minlength=10)
    assert holders.sum() == num_clients * k
    assert holders.max() - holders.min() <= 1


@pytest.mark.parametrize("cap,k", [(40, 4), (50, 4), (30, 3)])
def test_classes_samples_per_client_caps_each_slot_at_cap_over_k(cap, k):
    y = shuffled_labels()
    cfg = PartitionConfig(scheme="classes", num_clients=10, classes_per_client=k, samples_per_client=cap)
    part = make_partition(y, 10, cfg, 0)
    check_equal_slots(part, y, 10, cap=cap // k)
    sizes = [len(client_indices(part, i)) for i in range(10)]
    assert sizes == [k * (cap // k)] * 10
    assert max(sizes) <= cap


def test_classes_samples_per_client_below_k_is_refused_or_honoured():
    y = shuffled_labels()
    cfg = PartitionConfig(scheme="classes", num_clients=10, classes_per_client=4, samples_per_client=2)
    try:
        part = make_partition(y, 10, cfg, 0)
    except (ConfigError, DataError):
        return  # refusing the impossible cap is fine
    assert max(len(client_indices(part, i)) for i in range(10)) <= 2


# ---- chain ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,k", [(8, 4), (10, 3), (5, 2)])
def test_chain_neighbouring_clients_share_exactly_k_minus_1_classes(num_clients, k):
    y = shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="chain", num_clients=num_clients, classes_per_client=k), 0)
    held = [set(np.flatnonzero(row)) for row in class_counts(part, y, 10, "train")]
    for i in range(num_clients):
        assert len(held[i]) == k
        assert held[i] == set(part.label_sets[i].tolist())
    for i in range(num_clients - 1):
        assert len(held[i] & held[i + 1]) == k - 1, f"clients {i} and {i + 1}"
    check_equal_slots(part, y, 10)


# ---- dominant ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients", [10, 20])
def test_dominant_two_classes_hold_about_0_8_of_each_clients_data_and_every_class_is_present(num_clients):
    y = shuffled_labels()
    cfg = PartitionConfig(scheme="dominant", num_clients=num_clients, dominant_classes=2, dominant_fraction=0.8)
    part = make_partition(y, 10, cfg, 0)
    counts = class_counts(part, y, 10, "all")
    for i in range(num_clients):
        dom = part.label_sets[i]
        assert len(dom) == 2 and len(set(dom.tolist())) == 2
        assert counts[i, dom].sum() / counts[i].sum() == pytest.approx(0.8, abs=0.02)
        assert (counts[i] > 0).all(), f"client {i} lacks a class"
        assert (class_counts(part, y, 10, "train")[i] > 0).all()


def test_dominant_fraction_holds_on_real_digits(digits_y):
    cfg = PartitionConfig(scheme="dominant", num_clients=10, dominant_classes=3, dominant_fraction=0.6)
    part = make_partition(digits_y, 10, cfg, 0)
    assert_well_formed(part, len(digits_y), 10)
    counts = class_counts(part, digits_y, 10, "all")
    for i in range(10):
        assert len(part.label_sets[i]) == 3
        assert counts[i, part.label_sets[i]].sum() / counts[i].sum() == pytest.approx(0.6, abs=0.02)
        assert (counts[i] > 0).all()


def test_dominant_classes_that_run_short_are_said_with_the_share_reached(digits_y):
    """Two clients that each want 80 % of their ~900 digits from 2 dominant classes of ~180 samples: the classes run
    short, and the partition says how far the share fell (computed here from the clients' own indices); where it
    is reached, nothing is said."""
    cfg = PartitionConfig(scheme="dominant", num_clients=2, dominant_classes=2, dominant_fraction=0.8)
    part = make_partition(digits_y, 10, cfg, 0)
    counts = class_counts(part, digits_y, 10, "all")
    shares = [counts[i, part.label_sets[i]].sum() / counts[i].sum() for i in range(2)]
    assert max(shares) < 0.75
    said = [w for w in part.warnings if w.startswith("partition 'dominant'")]
    assert said == [f"partition 'dominant': the 2 dominant classes hold {100 * np.mean(shares):.1f} % of a client's "
                    f"samples on average (min {100 * min(shares):.1f} %), not the 80 % of "
                    "partition.dominant_fraction: those classes run short; lower partition.samples_per_client or "
                    "partition.num_clients to reach it"]
    reached = make_partition(digits_y, 10, dataclasses.replace(cfg, num_clients=10, dominant_fraction=0.6), 0)
    assert not any(w.startswith("partition 'dominant'") for w in reached.warnings)


# ---- dirichlet -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.05, 0.5, 100.0])
def test_dirichlet_every_client_has_at_least_10_samples(alpha):
    y = shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="dirichlet", num_clients=30, dirichlet_alpha=alpha), 0)
    assert min(len(client_indices(part, i)) for i in range(30)) >= 10
    assert sum(len(client_indices(part, i)) for i in range(30)) == len(y)  # dirichlet uses every sample
    assert_well_formed(part, len(y), 30)


def test_dirichlet_smaller_alpha_gives_more_label_skew():
    y = shuffled_labels()

    def skew(alpha):
        part = make_partition(y, 10, PartitionConfig(scheme="dirichlet", num_clients=20, dirichlet_alpha=alpha), 0)
        counts = class_counts(part, y, 10, "all")
        classes_held = (counts > 0).sum(axis=1).mean()
        top_share = (counts.max(axis=1) / counts.sum(axis=1)).mean()
        # label_sets for dirichlet are the classes the client actually holds
        assert [len(s) for s in part.label_sets] == list((counts > 0).sum(axis=1))
        return classes_held, top_share

    few, flat = skew(0.05), skew(100.0)
    assert few[0] < flat[0] and flat[0] == 10
    assert few[1] > 0.5 > flat[1]


def test_dirichlet_samples_per_client_caps_sizes():
    y = shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="dirichlet", num_clients=20, samples_per_client=100), 0)
    sizes = [len(client_indices(part, i)) for i in range(20)]
    assert max(sizes) <= 100 and min(sizes) >= 10


# ---- powerlaw_labels -----------------------------------------------------------------------------------------------

def test_powerlaw_labels_client_u_holds_labels_u_plus_j_mod_c_with_at_least_min_per_label():
    y = shuffled_labels(per_class=500)
    cfg = PartitionConfig(scheme="powerlaw_labels", num_clients=100, classes_per_client=2, min_per_label=5)
    part = make_partition(y, 10, cfg, 0)
    assert_well_formed(part, len(y), 100)
    counts = class_counts(part, y, 10, "all")
    for u in range(100):
        want = sorted({(u + j) % 10 for j in range(2)})
        assert list(np.flatnonzero(counts[u])) == want
        assert sorted(part.label_sets[u].tolist()) == want
        assert counts[u, want].min() >= 5
    sizes = counts.sum(axis=1)
    assert sizes.max() / np.median(sizes) > 3, "sizes should be heavy-tailed"
    assert sizes.sum() == len(y)  # everything beyond the minimum is shared out


def test_powerlaw_labels_larger_sigma_gives_more_unequal_sizes():
    y = shuffled_labels(per_class=500)

    def spread(sigma):
        cfg = PartitionConfig(scheme="powerlaw_labels", num_clients=100, classes_per_client=2, powerlaw_sigma=sigma)
        sizes = class_counts(make_partition(y, 10, cfg, 0), y, 10, "all").sum(axis=1)
        return sizes.std() / sizes.mean()

    assert spread(0.0) < 0.1 < spread(2.0)


def test_powerlaw_labels_cap_keeps_min_per_label_of_each_label():
    y = shuffled_labels(per_class=500)
    cfg = PartitionConfig(scheme="powerlaw_labels", num_clients=50, classes_per_client=2, min_per_label=5,
                          samples_per_client=20)
    part = make_partition(y, 10, cfg, 0)
    counts = class_counts(part, y, 10, "all")
    assert counts.sum(axis=1).max() <= 20
    for u in range(50):
        assert counts[u, part.label_sets[u]].min() >= 5, f"client {u}: {counts[u]}"


# ---- iid and natural -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,cap,size", [(12, 0, 500), (7, 0, 857), (10, 300, 300)])
def test_iid_clients_have_equal_sizes(num_clients, cap, size):
    y = shuffled_labels()
    part = make_partition(y, 10, PartitionConfig(scheme="iid", num_clients=num_clients, samples_per_client=cap), 0)
    assert [len(client_indices(part, i)) for i in range(num_clients)] == [size] * num_clients
    assert_well_formed(part, len(y), num_clients)


def test_natural_clients_are_exactly_the_datasets_own_groups():
    y = shuffled_labels()
    groups = natural_groups(len(y), 15)
    part = make_partition(y, 10, PartitionConfig(scheme="natural", num_clients=15), 0, groups=groups)
    for i in range(15):
        np.testing.assert_array_equal(np.sort(client_indices(part, i)), np.flatnonzero(groups == i))
        assert sorted(part.label_sets[i].tolist()) == sorted(set(y[groups == i].tolist()))


# ---- scale ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["classes", "dirichlet"])
def test_thousand_clients_on_seventy_thousand_samples(scheme):
    y = shuffled_labels(per_class=7000)
    cfg = PartitionConfig(scheme=scheme, num_clients=1000, classes_per_client=4)
    part = make_partition(y, 10, cfg, 0)
    every = np.concatenate(part.train + part.test)
    assert len(np.unique(every)) == len(every)
    assert min(map(len, part.train)) > 0 and min(map(len, part.test)) > 0
    owner = np.repeat(np.arange(1000), [len(client_indices(part, i)) for i in range(1000)])
    counts = np.zeros((1000, 10), dtype=np.int64)
    np.add.at(counts, (owner, y[np.concatenate([client_indices(part, i) for i in range(1000)])]), 1)
    if scheme == "classes":
        assert ((counts > 0).sum(axis=1) == 4).all()
        holders = (counts > 0).sum(axis=0)
        assert holders.max() - holders.min() <= 1
        for c in range(10):  # equal slots: floor(7000 / holders)
            assert set(counts[counts[:, c] > 0, c].tolist()) == {7000 // holders[c]}
    else:
        assert counts.sum(axis=1).min() >= 10 and counts.sum() == len(y)


# ---- errors --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["classes", "chain", "powerlaw_labels"])
def test_more_classes_per_client_than_classes_is_a_config_error_naming_the_key(scheme):
    with pytest.raises(ConfigError, match=r"partition\.classes_per_client"):
        make_partition(shuffled_labels(), 10, PartitionConfig(scheme=scheme, classes_per_client=11), 0)


def test_dominant_classes_not_below_num_classes_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"partition\.dominant_classes"):
        make_partition(shuffled_labels(), 10, PartitionConfig(scheme="dominant", dominant_classes=10), 0)


@pytest.mark.parametrize("scheme,num_clients,extra", [
    ("classes", 2000, {}),
    ("chain", 2000, {}),
    ("iid", 7000, {}),
    ("dirichlet", 1000, {}),
    ("powerlaw_labels", 200, {"min_per_label": 20}),
])
def test_too_many_clients_for_the_data_is_a_data_error(scheme, num_clients, extra):
    y = shuffled_labels(per_class=60)  # 600 samples
    cfg = PartitionConfig(scheme=scheme, num_clients=num_clients, classes_per_client=2, **extra)
    with pytest.raises(DataError, match=r"partition\.(num_clients|min_per_label)"):
        make_partition(y, 10, cfg, 0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0/0 inside split_counts
def test_dominant_with_more_clients_than_samples_is_a_data_error():
    y = shuffled_labels(per_class=60)
    with pytest.raises(DataError, match=r"partition\.num_clients"):
        make_partition(y, 10, PartitionConfig(scheme="dominant", num_clients=2000), 0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0/0 inside split_counts
def test_dominant_fraction_one_gives_each_client_only_its_dominant_classes():
    y = shuffled_labels()
    cfg = PartitionConfig(scheme="dominant", num_clients=2, dominant_classes=2, dominant_fraction=1.0)
    part = make_partition(y, 10, cfg, 0)
    assert_well_formed(part, len(y), 2)
    counts = class_counts(part, y, 10, "all")
    for i in range(2):
        assert list(np.flatnonzero(counts[i])) == sorted(part.label_sets[i].tolist())


def test_iid_samples_per_client_beyond_the_data_is_a_config_error():
    with pytest.raises(ConfigError, match=r"partition\.samples_per_client"):
        make_partition(shuffled_labels(), 10, PartitionConfig(scheme="iid", num_clients=10, samples_per_client=601), 0)


def test_natural_needs_groups_and_the_matching_number_of_clients():
    y = shuffled_labels()
    with pytest.raises(ConfigError, match=r"partition\.scheme"):
        make_partition(y, 10, PartitionConfig(scheme="natural", num_clients=15), 0)
    with pytest.raises(ConfigError, match=r"partition\.num_clients.*15"):
        make_partition(y, 10, PartitionConfig(scheme="natural", num_clients=14), 0, groups=natural_groups(len(y), 15))


# ---- split_counts --------------------------------------------------------------------------------------------------

def test_split_counts_sums_exactly_to_total_and_is_proportional():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        weights = rng.dirichlet(np.full(n, float(rng.choice([0.05, 1.0, 20.0]))))
        weights[rng.random(n) < 0.2] = 0.0
        if weights.sum() == 0:
            weights[0] = 1.0
        total = int(rng.integers(0, 5000))
        counts = split_counts(total, weights)
        exact = weights / weights.sum() * total
        assert counts.dtype.kind == "i"
        assert counts.sum() == total
        assert (counts >= 0).all()
        assert np.all(np.abs(counts - exact) < 1), "each count is the floor or the ceiling of its exact share"
        assert (counts[weights == 0] == 0).all()


def test_split_counts_examples():
    np.testing.assert_array_equal(split_counts(10, np.array([1, 1, 1])), [4, 3, 3])
    np.testing.assert_array_equal(split_counts(100, np.array([0.5, 0.25, 0.25])), [50, 25, 25])
    np.testing.assert_array_equal(split_counts(7, np.array([3.0, 0.0, 1.0])), [5, 0, 2])
    np.testing.assert_array_equal(split_counts(0, np.array([1.0, 2.0])), [0, 0])
