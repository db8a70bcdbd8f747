"""Clustered client sampling (Fraboni et al., ICML 2021; pFedCS): what the papers promise about the schemes.

A scheme is an (m, n) matrix r whose rows are probability vectors; one client is drawn per row. The central
property is unbiasedness: the mean over rows equals the importance p (p_i = n_i / sum n) for every client, also when
some clients hold more than 1/m of the data (the reference code breaks there; we split such clients over rows).
"""
from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from pfedkit import sampling
from pfedkit.sampling import (distance_matrix, draw_from_distributions, md_distributions, similarity_distributions,
                              size_distributions, uniform_sample)

UNBIASED_ATOL = 1e-12  # the brief asks for 1e-9; the integer construction gives float64 rounding only


# ---- helpers -------------------------------------------------------------------------------------------------------

def make_p(kind: str, n: int, m: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, n, m])
    if kind == "equal":
        return np.full(n, 1.0 / n)
    if kind == "dirichlet":
        p = rng.dirichlet(np.full(n, 0.5))
    elif kind == "lognormal":  # FedProx-style power-law sample counts
        sizes = np.floor(rng.lognormal(4.0, 1.5, n)) + 1
        p = sizes / sizes.sum()
    elif kind == "heavy":  # one or several clients above 1/m (with m >= 3: two clients at ~1/3 and ~1/4 each)
        sizes = np.floor(rng.lognormal(3.0, 1.0, n)) + 1
        rest = sizes.sum()
        sizes[min(1, n - 1)] = rest
        sizes[0] = 1.4 * rest
        p = sizes / sizes.sum()
    else:
        raise AssertionError(kind)
    return p / p.sum()


def make_gradients(n: int, d: int, seed: int, groups: int = 4) -> np.ndarray:
    """Noisy copies of a few directions, plus a few all-zero rows (clients never sampled yet: stale G_i = 0)."""
    rng = np.random.default_rng([seed, n, d])
    centers = rng.normal(size=(groups, d))
    G = centers[rng.integers(0, groups, n)] + 0.3 * rng.normal(size=(n, d))
    G[rng.random(n) < 0.1] = 0.0
    return G


def check_scheme(r: np.ndarray, p: np.ndarray, m: int) -> None:
    assert r.shape == (m, p.size)
    assert r.dtype == np.float64
    assert np.all(r >= 0.0)
    np.testing.assert_allclose(r.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(r.mean(axis=0), p, rtol=0, atol=UNBIASED_ATOL)


def row_support(r: np.ndarray, clients) -> set[int]:
    return {int(k) for k in np.nonzero(r[:, list(clients)].sum(axis=1) > 0)[0]}


def reference_alg2(Z: np.ndarray, p: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    """The spec's Algorithm 2, step by step with the reference's epsilon-scaled truncated integers and scipy's
    fcluster on the weight-height tree. Only valid when max p <= 1/m. Row k holds the k-th heaviest cluster (the spec
    does not fix which row a kept cluster goes to) and the shuffles use `rng` like the library."""
    eps = 10 ** 10
    n = p.size
    Z = Z.copy()
    weight = list(p) + [0.0] * (n - 1)
    for r in range(n - 1):
        weight[n + r] = weight[int(Z[r, 0])] + weight[int(Z[r, 1])]
        Z[r, 2] = int(weight[n + r] * eps)
    labels = fcluster(Z, int(eps / m), criterion="distance")
    aug = [int(pi * eps * m) for pi in p]
    clusters = [sorted(np.nonzero(labels == lab)[0].tolist()) for lab in np.unique(labels)]
    pop = [sum(aug[i] for i in c) for c in clusters]
    ascending = sorted(range(len(clusters)), key=lambda c: pop[c])
    kept = ascending[::-1][:m]
    out = np.zeros((m, n), dtype=np.int64)
    for k, c in enumerate(kept):
        for i in clusters[c]:
            out[k, i] = aug[i]
    k = 0
    for c in ascending[: len(clusters) - m]:
        for i in rng.permutation(np.asarray(clusters[c])):
            left = aug[i]
            while left > 0:
                room = eps - out[k].sum()
                if room <= 0:
                    k += 1
                    continue
                u = min(room, left)
                out[k, i] += u
                left -= u
    return out / out.sum(axis=1, keepdims=True)


# ---- unbiasedness --------------------------------------------------------------------------------------------------

P_KINDS = ("equal", "dirichlet", "lognormal", "heavy")


@pytest.mark.parametrize("n", [1, 2, 7, 20, 100, 1000])
@pytest.mark.parametrize("m", [1, 3, 5, 10])
@pytest.mark.parametrize("kind", P_KINDS)
def test_size_distributions_unbiased(n, m, kind):
    p = make_p(kind, n, m, seed=0)
    r = size_distributions(p, m)
    check_scheme(r, p, m)


@pytest.mark.parametrize("n", [2, 7, 20, 100])
@pytest.mark.parametrize("m", [1, 3, 5, 10])
@pytest.mark.parametrize("kind", P_KINDS)
@pytest.mark.parametrize("distance", ["cosine", "l2", "l1"])
@pytest.mark.parametrize("linkage_input", ["rows", "condensed"])
@pytest.mark.parametrize("clusters", [0, 10])
def test_similarity_distributions_unbiased(n, m, kind, distance, linkage_input, clusters):
    p = make_p(kind, n, m, seed=1)
    G = make_gradients(n, 30, seed=2)
    r = similarity_distributions(G, p, m, distance=distance, linkage_input=linkage_input, clusters=clusters,
                                 rng=np.random.default_rng(3))
    check_scheme(r, p, m)


@pytest.mark.parametrize("kind", P_KINDS)
@pytest.mark.parametrize("linkage_input", ["rows", "condensed"])
def test_similarity_distributions_unbiased_1000_clients(kind, linkage_input):
    n, m = 1000, 10
    p = make_p(kind, n, m, seed=4)
    G = make_gradients(n, 50, seed=5, groups=12)
    r = similarity_distributions(G, p, m, linkage_input=linkage_input, rng=np.random.default_rng(6))
    check_scheme(r, p, m)


def test_single_client_and_first_round_zero_gradients():
    r = similarity_distributions(np.ones((1, 4)), np.array([1.0]), 3, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(r, np.ones((3, 1)))
    # round 0: every G_i = 0, all distances 0 -- still a valid unbiased scheme
    p = make_p("lognormal", 50, 5, seed=7)
    for linkage_input in ("rows", "condensed"):
        r = similarity_distributions(np.zeros((50, 10)), p, 5, linkage_input=linkage_input,
                                     rng=np.random.default_rng(0))
        check_scheme(r, p, 5)


def test_p_summing_to_one_within_tolerance_is_normalised():
    p = make_p("dirichlet", 30, 4, seed=8) * (1 + 5e-10)
    for r in (size_distributions(p, 4), md_distributions(p, 4),
              similarity_distributions(make_gradients(30, 5, 0), p, 4, rng=np.random.default_rng(0))):
        np.testing.assert_allclose(r.mean(axis=0), p / p.sum(), rtol=0, atol=1e-15)
        np.testing.assert_allclose(r.mean(axis=0), p, rtol=0, atol=1e-9)


# ---- clients heavier than 1/m --------------------------------------------------------------------------------------

def test_heavy_client_spans_rows_in_both_algorithms():
    m = 5
    p = np.array([0.6, 0.1, 0.1, 0.1, 0.05, 0.05])  # client 0 = 3 rows' worth exactly
    r1 = size_distributions(p, m)
    check_scheme(r1, p, m)
    np.testing.assert_allclose(r1[:3, 0], 1.0, atol=1e-15)  # sorted first: fills rows 0..2 completely
    G = np.random.default_rng(0).normal(size=(6, 8))
    for linkage_input in ("rows", "condensed"):
        r2 = similarity_distributions(G, p, m, linkage_input=linkage_input, rng=np.random.default_rng(1))
        check_scheme(r2, p, m)
        assert np.isclose(r2[:, 0].sum(), 3.0, atol=1e-12)
        assert (r2[:, 0] > 0).sum() == 3  # exactly three rows hold it, each entirely


def test_heavy_kept_clusters_overflow_into_other_rows():
    """pFedCS setting: 10 clusters, m = 5, two groups of identical clients each holding 40 % of the data. The kept
    clusters are heavier than a row; every row still gets exactly 1/m, nothing negative (the reference code goes
    negative here), and with the pFedCS cut each group owns two whole rows."""
    rng = np.random.default_rng(9)
    n, m = 100, 5
    directions = rng.normal(size=(10, 20))
    label = np.arange(n) % 10
    G = directions[label]
    sizes = np.where(label == 0, 40.0, np.where(label == 1, 40.0, 2.5))  # groups 0 and 1: 400 each, rest 200
    p = sizes / sizes.sum()
    assert p[label == 0].sum() > 1 / m
    for clusters in (0, 10):
        r = similarity_distributions(G, p, m, clusters=clusters, rng=np.random.default_rng(2))
        check_scheme(r, p, m)
        if clusters == 0:
            continue  # Fraboni's cut breaks a 0.4 group into subtrees <= 1/m, which may share rows with others
        # 0.4 of the weight = 2 rows' worth: the group fills exactly two rows, sharing them with nobody
        for g in (0, 1):
            rows = row_support(r, np.nonzero(label == g)[0])
            assert len(rows) == 2
            np.testing.assert_allclose(r[sorted(rows)][:, label == g].sum(axis=1), 1.0, atol=1e-12)


# ---- similarity structure ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("distance", ["cosine", "l2", "l1"])
@pytest.mark.parametrize("linkage_input", ["rows", "condensed"])
@pytest.mark.parametrize("clusters", [0, 3])
def test_groups_of_similar_gradients_become_rows(distance, linkage_input, clusters):
    """Three groups of 10 equal-weight clients, G = noisy copies of u, -u and v (u orthogonal to v), m = 3:
    each row holds exactly one group, uniformly."""
    rng = np.random.default_rng(10)
    d = 40
    u = np.zeros(d)
    u[0] = 1.0
    v = np.zeros(d)
    v[1] = 1.0
    centers = np.stack([u, -u, v]) * 5.0
    group = rng.permutation(np.repeat(np.arange(3), 10))
    G = centers[group] + 0.05 * rng.normal(size=(30, d))
    p = np.full(30, 1 / 30)
    r = similarity_distributions(G, p, 3, distance=distance, linkage_input=linkage_input, clusters=clusters,
                                 rng=np.random.default_rng(0))
    check_scheme(r, p, 3)
    seen = set()
    for g in range(3):
        rows = row_support(r, np.nonzero(group == g)[0])
        assert len(rows) == 1, (g, rows)
        (k,) = rows
        np.testing.assert_allclose(r[k, group == g], 0.1, atol=1e-15)
        assert np.all(r[k, group != g] == 0)
        seen |= rows
    assert seen == {0, 1, 2}


def test_identical_gradients_that_fit_in_a_row_are_never_split():
    """m groups of identical gradients, each of weight <= 1/m, plus scattered small clients: every group lands in a
    single row of its own, whatever the shuffle seed."""
    rng = np.random.default_rng(11)
    m, d = 4, 25
    group_sizes = [0.24, 0.22, 0.2, 0.18]  # rest 0.16 over 40 scattered clients
    members, sizes, G = [], [], []
    c = 0
    for g, w in enumerate(group_sizes):
        k = 3 + g
        direction = rng.normal(size=d)
        members.append(list(range(c, c + k)))
        sizes += [w / k] * k
        G += [direction] * k
        c += k
    for _ in range(40):
        sizes.append(0.16 / 40)
        G.append(rng.normal(size=d))
    p = np.asarray(sizes) / np.sum(sizes)
    G = np.asarray(G)
    for seed, linkage_input, distance in itertools.product(range(5), ("rows", "condensed"), ("cosine", "l2")):
        r = similarity_distributions(G, p, m, distance=distance, linkage_input=linkage_input,
                                     rng=np.random.default_rng(seed))
        check_scheme(r, p, m)
        rows = [row_support(r, mem) for mem in members]
        assert all(len(s) == 1 for s in rows), rows
        assert len(set.union(*rows)) == m


def test_matches_reference_algorithm_when_no_client_is_heavy():
    """When max p <= 1/m the library's integer construction gives the reference's matrix (up to its 1e-10
    truncation), using the same tree, the same flat clusters and the same shuffles."""
    for seed, (n, m) in enumerate([(20, 3), (100, 5), (100, 10), (300, 7)]):
        rng = np.random.default_rng(seed)
        p = rng.dirichlet(np.full(n, 5.0))
        assert p.max() <= 1 / m
        G = make_gradients(n, 16, seed)
        for linkage_input in ("rows", "condensed"):
            Z = sampling._linkage_matrix(distance_matrix(G, "cosine"), linkage_input)
            ref = reference_alg2(Z, p, m, np.random.default_rng(100 + seed))
            ours = similarity_distributions(G, p, m, linkage_input=linkage_input,
                                            rng=np.random.default_rng(100 + seed))
            # the reference's truncation moves its split points by up to ~n / epsilon
            np.testing.assert_allclose(ours, ref, rtol=0, atol=2 * n / 1e10)
            np.testing.assert_array_equal(ours > 0, ref > 0)


def test_weight_cut_equals_fcluster_on_weight_heights():
    for seed in range(5):
        rng = np.random.default_rng(seed)
        n, m = 60, 2 + seed  # (m = 1: the root weighs 1 exactly, float fcluster may split it, ours never does)
        p = rng.dirichlet(np.ones(n))
        Z = linkage(rng.normal(size=(n, 5)), "ward")
        q, total = sampling._integer_weights(p)
        ours = sampling._weight_cut(Z, q, total, m)
        Zw = Z.copy()
        weight = list(p) + [0.0] * (n - 1)
        for r in range(n - 1):
            weight[n + r] = weight[int(Z[r, 0])] + weight[int(Z[r, 1])]
            Zw[r, 2] = weight[n + r]
        labels = fcluster(Zw, 1 / m, criterion="distance")
        expected = {frozenset(np.nonzero(labels == lab)[0].tolist()) for lab in np.unique(labels)}
        assert {frozenset(c) for c in ours} == expected
        for c in ours:  # maximal subtrees of weight <= 1/m (or a single heavier client)
            assert len(c) == 1 or p[c].sum() <= 1 / m + 1e-15
        assert len(sampling._weight_cut(Z, q, total, 1)) == 1


def test_count_cut_gives_exactly_alpha_clusters():
    rng = np.random.default_rng(12)
    n = 100
    Z = linkage(rng.normal(size=(n, 6)), "ward")
    for alpha in (1, 5, 10, 37, 100, 150):
        flat = sampling._count_cut(Z, n, alpha)
        assert len(flat) == min(alpha, n)
        assert sorted(i for c in flat for i in c) == list(range(n))
        labels = fcluster(Z, alpha, criterion="maxclust")  # no height ties here: same partition as scipy
        expected = {frozenset(np.nonzero(labels == lab)[0].tolist()) for lab in np.unique(labels)}
        assert {frozenset(c) for c in flat} == expected
    # ties (identical gradients) do not reduce the count, unlike maxclust
    Zt = linkage(np.repeat(rng.normal(size=(5, 3)), 4, axis=0), "ward")
    assert len(sampling._count_cut(Zt, 20, 10)) == 10


def test_pfedcs_setting_ten_clusters_five_rows():
    n, m = 100, 5
    for kind in ("lognormal", "dirichlet", "heavy", "equal"):
        p = make_p(kind, n, m, seed=13)
        G = make_gradients(n, 40, seed=14, groups=10)
        q, total = sampling._integer_weights(p)
        Z = sampling._linkage_matrix(distance_matrix(G, "cosine"), "rows")
        assert len(sampling._flat_clusters(Z, q, total, m, 10)) == 10
        for linkage_input in ("rows", "condensed"):
            r = similarity_distributions(G, p, m, clusters=10, linkage_input=linkage_input,
                                         rng=np.random.default_rng(15))
            check_scheme(r, p, m)


def test_fewer_clusters_than_rows():
    """clusters < m is honoured: heavy clusters get whole rows. One cluster holding everything is Algorithm 1."""
    n, m = 40, 5
    p = make_p("lognormal", n, m, seed=16)
    G = make_gradients(n, 12, seed=17)
    one = similarity_distributions(G, p, m, clusters=1, rng=np.random.default_rng(0))
    np.testing.assert_allclose(one, size_distributions(p, m), rtol=0, atol=1e-15)
    for clusters in (2, 3, 4):
        r = similarity_distributions(G, p, m, clusters=clusters, rng=np.random.default_rng(0))
        check_scheme(r, p, m)
    # fewer clients than rows
    p = np.array([0.5, 0.25, 0.125, 0.125])  # dyadic: exactly 4, 2, 1 and 1 rows' worth with m = 8
    r = similarity_distributions(np.eye(4), p, 8, clusters=10, rng=np.random.default_rng(0))
    check_scheme(r, p, 8)
    assert (r > 0).sum(axis=0).tolist() == [4, 2, 1, 1]  # each client owns whole rows
    assert np.all((r == 0) | (r == 1))


def test_linkage_inputs_reproduce_the_quirk_and_the_condensed_form():
    rng = np.random.default_rng(18)
    M = distance_matrix(make_gradients(25, 10, 19), "cosine")
    with pytest.warns(Warning):  # what scipy says about the reference's call
        z_square = linkage(M, "ward")
    np.testing.assert_array_equal(sampling._linkage_matrix(M, "rows"), z_square)
    np.testing.assert_array_equal(sampling._linkage_matrix(M, "condensed"),
                                  linkage(squareform(M, checks=False), "ward"))
    assert not np.allclose(z_square[:, 2], sampling._linkage_matrix(M, "condensed")[:, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the library's 'rows' call stays quiet
        similarity_distributions(rng.normal(size=(25, 10)), np.full(25, 0.04), 3, rng=rng)


def test_same_seed_same_scheme_and_rng_only_shuffles():
    p = make_p("lognormal", 80, 6, seed=20)
    G = make_gradients(80, 10, seed=21)
    a = similarity_distributions(G, p, 6, rng=np.random.default_rng(5))
    b = similarity_distributions(G, p, 6, rng=np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
    schemes = {similarity_distributions(G, p, 6, rng=np.random.default_rng(s)).tobytes() for s in range(10)}
    assert len(schemes) > 1  # the within-cluster shuffles matter


# ---- Algorithm 1 and MD --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,m", [(10, 5), (30, 3), (100, 10), (12, 12), (7, 1)])
def test_equal_weights_give_disjoint_equal_rows(n, m):
    r = size_distributions(np.full(n, 1 / n), m)
    check_scheme(r, np.full(n, 1 / n), m)
    support = r > 0
    assert np.all(support.sum(axis=0) == 1)  # disjoint
    assert np.all(support.sum(axis=1) == n // m)  # equal sizes
    for k in range(m):
        np.testing.assert_allclose(r[k, support[k]], m / n, atol=1e-15)


def test_size_distributions_sorted_by_weight():
    p = np.array([0.05, 0.3, 0.15, 0.2, 0.3])
    r = size_distributions(p, 2)
    # sorted: clients 1 (0.3), 4 (0.3), 3 (0.2), 2 (0.15), 0 (0.05); rows hold 0.5 each
    np.testing.assert_allclose(r[0], [0, 0.6, 0, 0, 0.4], atol=1e-15)
    np.testing.assert_allclose(r[1], [0.1, 0, 0.3, 0.4, 0.2], atol=1e-15)


def test_md_distributions():
    p = make_p("dirichlet", 9, 4, seed=22)
    r = md_distributions(p, 4)
    check_scheme(r, p, 4)
    assert np.all(r == r[0])


# ---- distances -----------------------------------------------------------------------------------------------------

def test_cosine_special_angles():
    u = np.array([3.0, 0.0, 0.0])
    G = np.stack([u, 2 * u, -u, np.array([0.0, 1.0, 0.0]), np.zeros(3)])
    M = distance_matrix(G, "cosine")
    assert M[0, 1] == pytest.approx(0.0, abs=1e-7)  # identical direction
    assert M[0, 2] == pytest.approx(math.pi)  # opposite
    assert M[1, 2] == pytest.approx(math.pi)
    assert M[0, 3] == pytest.approx(math.pi / 2)  # orthogonal
    assert np.all(M[4] == 0.0) and np.all(M[:, 4] == 0.0)  # a zero vector is at distance 0 from everything
    assert np.all(np.diag(M) == 0.0)
    np.testing.assert_array_equal(M, M.T)


@pytest.mark.parametrize("kind", ["cosine", "l2", "l1", "L2"])
def test_distances_match_a_direct_loop(kind):
    rng = np.random.default_rng(23)
    G = rng.normal(size=(9, 13)) * rng.lognormal(0, 1, size=(9, 1))
    G[4] = 0.0
    G[6] = G[2]
    M = distance_matrix(G, kind)
    expected = np.zeros((9, 9))
    for i in range(9):
        for j in range(9):
            a, b = G[i], G[j]
            if kind == "cosine":
                na, nb = np.linalg.norm(a), np.linalg.norm(b)
                expected[i, j] = 0.0 if na == 0 or nb == 0 else math.acos(max(-1.0, min(1.0, a @ b / (na * nb))))
            elif kind.lower() == "l2":
                expected[i, j] = np.sum((a - b) ** 2)
            else:
                expected[i, j] = np.sum(np.abs(a - b))
    np.testing.assert_allclose(M, expected, rtol=1e-10, atol=1e-7 if kind == "cosine" else 1e-10)
    np.testing.assert_array_equal(M, M.T)
    assert np.all(M >= 0)


# ---- drawing -------------------------------------------------------------------------------------------------------

def test_draws_follow_the_rows_and_p():
    p = make_p("lognormal", 12, 4, seed=24)
    r = size_distributions(p, 4)
    rng = np.random.default_rng(25)
    trials = 20000
    draws = np.array([draw_from_distributions(r, rng) for _ in range(trials)])  # (trials, m)
    assert draws.shape == (trials, 4)
    for k in range(4):
        freq = np.bincount(draws[:, k], minlength=12) / trials
        sigma = np.sqrt(r[k] * (1 - r[k]) / trials)
        assert np.all(np.abs(freq - r[k]) <= 5 * sigma + 1e-3), (k, freq, r[k])
        assert np.all(freq[r[k] == 0] == 0)  # never a client outside the row
    # per-client draw frequency / m -> p
    per_client = np.stack([np.bincount(row, minlength=12) for row in draws]).mean(axis=0) / 4
    np.testing.assert_allclose(per_client, p, atol=0.01)


def test_draws_can_repeat_a_client_and_keep_row_order():
    r = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert draw_from_distributions(r, np.random.default_rng(0)) == [0, 2, 0]


# ---- validation ----------------------------------------------------------------------------------------------------

def test_invalid_inputs_raise_clear_errors():
    p = np.full(4, 0.25)
    G = np.ones((4, 3))
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="sum to 1"):
        size_distributions(np.array([0.5, 0.4]), 2)
    with pytest.raises(ValueError, match="non-negative"):
        size_distributions(np.array([1.2, -0.2]), 2)
    with pytest.raises(ValueError, match="1-D"):
        size_distributions(np.full((2, 2), 0.25), 2)
    with pytest.raises(ValueError, match="non-finite"):
        md_distributions(np.array([np.nan, 1.0]), 1)
    for bad_m in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="m "):
            size_distributions(p, bad_m)
    with pytest.raises(ValueError, match="shape"):
        similarity_distributions(np.ones((5, 3)), p, 2, rng=rng)
    with pytest.raises(ValueError, match="distance kind"):
        similarity_distributions(G, p, 2, distance="chebyshev", rng=rng)
    with pytest.raises(ValueError, match="linkage_input"):
        similarity_distributions(G, p, 2, linkage_input="square", rng=rng)
    with pytest.raises(ValueError, match="clusters"):
        similarity_distributions(G, p, 2, clusters=-1, rng=rng)
    with pytest.raises(TypeError, match="Generator"):
        similarity_distributions(G, p, 2, rng=0)
    with pytest.raises(ValueError, match="non-finite"):
        distance_matrix(np.array([[np.inf, 1.0], [0.0, 1.0]]), "l2")
    with pytest.raises(ValueError, match="2-D"):
        distance_matrix(np.ones(3), "l2")
    with pytest.raises(ValueError, match="sum to 1"):
        draw_from_distributions(np.array([[0.5, 0.4]]), rng)
    with pytest.raises(ValueError, match="non-negative"):
        draw_from_distributions(np.array([[1.5, -0.5]]), rng)
    for bad_clusters in (True, 2.0):
        with pytest.raises(ValueError, match="clusters must be an integer"):
            similarity_distributions(G, p, 2, clusters=bad_clusters, rng=rng)
    for empty in (np.zeros((0, 3)), np.zeros((3, 0))):
        with pytest.raises(ValueError, match="both sizes >= 1"):
            distance_matrix(empty, "l2")
    with pytest.raises(ValueError, match="^G contains non-finite values$"):
        distance_matrix(np.array([[np.nan, 1.0], [0.0, 1.0]]), "cosine")
    with pytest.raises(ValueError, match="distance kind"):
        distance_matrix(G, 3)


def test_distances_of_integer_and_one_dimensional_gradients():
    """Any array-like of numbers, including integers and a single coordinate per client: by hand."""
    np.testing.assert_allclose(distance_matrix([[1, 0], [0, 2], [3, 0]], "cosine"),
                               [[0, np.pi / 2, 0], [np.pi / 2, 0, np.pi / 2], [0, np.pi / 2, 0]], atol=1e-12)
    one = np.array([[1.0], [3.0], [-2.0]])
    np.testing.assert_array_equal(distance_matrix(one, "l1"), [[0, 2, 3], [2, 0, 5], [3, 5, 0]])
    np.testing.assert_allclose(distance_matrix(one, "l2"), [[0, 4, 9], [4, 0, 25], [9, 25, 0]], atol=1e-12)


def test_uniform_sample_unchanged():
    """Golden draws: the sorted `per_round` distinct clients numpy's Generator([seed, round, n, 0x5A3]).choice(n,
    per_round, replace=False) gives (numpy's stream is stable across releases), recorded once; 0 or >= n: all."""
    golden = {(1, 2, 50, 5): [16, 32, 38, 40, 46], (0, 1, 10, 3): [2, 4, 5], (3, 1, 6, 5): [1, 2, 3, 4, 5],
              (7, 100, 1000, 10): [208, 479, 521, 588, 626, 704, 764, 807, 864, 900]}
    for (seed, rnd, n, m), clients in golden.items():
        assert uniform_sample(seed, rnd, n, m) == clients
        assert clients == sorted(int(c) for c in np.random.default_rng([seed, rnd, n, 0x5A3]).choice(n, m, replace=False))
    assert uniform_sample(0, 3, 10, 0) == list(range(10))
    assert uniform_sample(0, 3, 10, 10) == uniform_sample(0, 3, 10, 11) == list(range(10))
    assert uniform_sample(0, 3, 10, -1) == list(range(10))
    assert uniform_sample(0, 3, 10, 9) == [0, 1, 3, 4, 5, 6, 7, 8, 9]  # n - 1 is still a draw


# ---- scale ---------------------------------------------------------------------------------------------------------

def test_scale_1000_clients_10000_parameters():
    rng = np.random.default_rng(26)
    n, d, m = 1000, 10000, 10
    G = np.repeat(rng.normal(size=(20, d)), 50, axis=0) + rng.normal(size=(n, d))
    p = make_p("lognormal", n, m, seed=27)
    M = distance_matrix(G, "cosine")
    assert M.shape == (n, n)
    for linkage_input, clusters in (("rows", 0), ("condensed", 20)):
        r = similarity_distributions(G, p, m, linkage_input=linkage_input, clusters=clusters, rng=rng)
        check_scheme(r, p, m)


def test_a_first_merged_pair_heavier_than_a_row_is_split():
    """Fraboni's cut keeps maximal subtrees of weight <= 1/m. Clients 0 and 1 (weights 0.45 each, almost the same
    gradient) merge first, into a subtree of weight 0.9 > 1/2: it is cut into two single clients, each owning a row,
    and client 2 (0.1) is poured over both rows. By hand, in row units m * p = (0.9, 0.9, 0.2)."""
    G = np.array([[1.0, 0.0], [1.0, 0.001], [0.0, 1.0]])
    p = np.array([0.45, 0.45, 0.1])
    for linkage_input in ("rows", "condensed"):
        r = similarity_distributions(G, p, 2, linkage_input=linkage_input, rng=np.random.default_rng(0))
        np.testing.assert_allclose(r, [[0.9, 0.0, 0.1], [0.0, 0.9, 0.1]], atol=1e-12)


def test_sampler_passes_the_clustering_options_on():
    """`clustering.distance`, `linkage_input` and `clusters` reach Algorithm 2, and the shuffles draw from
    Generator([seed, round, 0xC5]): the sampler's rows are Algorithm 2's for the same inputs."""
    from pfedkit.config import ClusteringConfig
    from pfedkit.sampling import Sampler
    import torch
    sizes = np.array([30, 10, 20, 25, 15, 40, 5, 35])
    G = make_gradients(8, 6, seed=3, groups=3)
    p = sizes / sizes.sum()
    for distance, linkage_input, clusters in (("l1", "condensed", 3), ("l2", "rows", 0), ("cosine", "condensed", 5)):
        c = ClusteringConfig(distance=distance, linkage_input=linkage_input, clusters=clusters)
        s = Sampler("clustered_similarity", sizes, 3, seed=4, clustering=c)
        state = s.observe(s.init_state(6, torch.zeros(6, dtype=torch.float64)),
                          {i: torch.as_tensor(G[i]) for i in range(8)})
        want = similarity_distributions(G, p, 3, distance=distance, linkage_input=linkage_input, clusters=clusters,
                                        rng=np.random.default_rng([4, 7, 0xC5]))
        np.testing.assert_array_equal(s.distributions(state, 7), want)
