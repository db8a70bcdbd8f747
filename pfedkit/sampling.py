"""Client sampling. The stream depends only on (seed, round, client count), so every algorithm of a comparison
sees the same clients in the same rounds, and a resumed run samples what an uninterrupted one would.

Clustered sampling (Fraboni et al., ICML 2021; pFedCS) builds per-round row distributions instead: see
`size_distributions`, `similarity_distributions`, `md_distributions` and `draw_from_distributions` below."""
from __future__ import annotations

import warnings

import numpy as np
import torch


def uniform_sample(seed: int, rnd: int, num_clients: int, per_round: int) -> list[int]:
    """`per_round` distinct clients, uniformly without replacement (0 or >= num_clients: all of them)."""
    if per_round <= 0 or per_round >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, rnd, num_clients, 0x5A3])
    return sorted(int(c) for c in rng.choice(num_clients, per_round, replace=False))


# ==== Clustered sampling (Fraboni et al., ICML 2021) and the pFedCS variant ========================================
#
# A sampling scheme here is an (m, n) matrix r: row k is a probability vector over the n clients, round t draws one
# client per row independently (`draw_from_distributions`), and the server averages the m drawn models uniformly.
# The scheme is unbiased when the mean over rows equals the importance p (p_i = n_i / sum n), which is what all the
# constructors below guarantee.
#
# Exactness. The reference scales p by epsilon = 10**10 and truncates to integers, so each weight loses up to 1e-10
# and the rows together miss their capacity by up to n units (split points shift by up to n * 1e-10). Here every float p_i is turned into the exact integer
# numerator q_i of p_i over a common power-of-two denominator (p_i = q_i / 2**E exactly, Python ints), so
# p_i / sum(p) = q_i / W with W = sum q_i, a row's capacity 1/m is W/m, and a client's weight in row units is
# m * q_i. All allocation (Algorithm 1's pouring, Fraboni's "weight <= 1/m" cut, Algorithm 2's pouring) is done on
# these integers with no rounding at all; only the final entries amount / W are rounded to float64, so the mean over
# rows equals p / sum(p) to ~1e-16. Since p is only checked to sum to 1 within 1e-9, the schemes are unbiased for
# p / sum(p), which differs from p by at most that much.

P_SUM_TOL = 1e-9
DISTANCES = ("cosine", "l2", "l1")
LINKAGE_INPUTS = ("rows", "condensed")
KEPT_ORDERS = ("heaviest_first", "reference")


def _check_p(p) -> np.ndarray:
    try:
        arr = np.asarray(p, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"p must be a 1-D array of client weights, got {type(p).__name__}") from exc
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"p must be a non-empty 1-D array of client weights, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("p contains non-finite values")
    if arr.min() < 0:
        raise ValueError(f"p must be non-negative, got min {arr.min()!r}")
    total = float(arr.sum())
    if abs(total - 1.0) > P_SUM_TOL:
        raise ValueError(f"p must sum to 1 (within {P_SUM_TOL}), got sum {total!r}; pass n_i / sum(n)")
    return arr


def _check_m(m) -> int:
    if isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)):
        raise ValueError(f"m (clients sampled per round) must be an integer >= 1, got {m!r}")
    if m < 1:
        raise ValueError(f"m (clients sampled per round) must be >= 1, got {m}")
    return int(m)


def _check_rng(rng) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {type(rng).__name__}")
    return rng


def _integer_weights(p: np.ndarray) -> tuple[list[int], int]:
    """Exact integers q with p_i = q_i * 2**-E for one common E, and their sum W (> 0)."""
    ratios = [float(x).as_integer_ratio() for x in p]  # denominators are powers of two
    den = max(d for _, d in ratios)
    q = [num * (den // d) for num, d in ratios]
    total = sum(q)
    if total <= 0:
        raise ValueError("p has no positive weight")
    return q, total


def _pour(pieces, free: list[int], alloc: dict[tuple[int, int], int]) -> None:
    """Greedy fill: put each (client, amount) into the first row with free capacity, moving to the next row when one
    fills (a client may be split over consecutive free rows). Rows are visited in order, so the rows left behind the
    cursor are full."""
    j = 0
    for i, amount in pieces:
        while amount > 0:
            while free[j] == 0:
                j += 1  # an IndexError here would mean more weight than capacity: a bug, not a user error
            u = min(free[j], amount)
            alloc[(j, i)] = alloc.get((j, i), 0) + u
            free[j] -= u
            amount -= u


def _to_matrix(alloc: dict[tuple[int, int], int], m: int, n: int, capacity: int, free: list[int]) -> np.ndarray:
    if any(free):
        raise AssertionError(f"internal error: rows left with free capacity {free}")
    r = np.zeros((m, n), dtype=np.float64)
    for (j, i), amount in alloc.items():
        r[j, i] = amount / capacity  # Python int / int: correctly rounded
    r /= r.sum(axis=1, keepdims=True)
    return r


def md_distributions(p, m: int) -> np.ndarray:
    """The "MD" baseline (multinomial sampling with replacement): m identical rows equal to p (normalised to sum 1)."""
    p = _check_p(p)
    m = _check_m(m)
    return np.tile(p / p.sum(), (m, 1))


def size_distributions(p, m: int) -> np.ndarray:
    """Algorithm 1 of Fraboni et al. (sample-size based clustered sampling), shape (m, n).

    Clients sorted by p descending (ties: lower index first) are poured into m rows of capacity 1/m each, filling
    row 0, then row 1, ...; a client whose weight does not fit in the current row is split over consecutive rows
    (so a client with p_i > 1/m spans several rows). Rows are normalised to sum 1; the mean over rows equals
    p / sum(p) exactly up to float64 rounding (integer arithmetic, see the section comment above)."""
    p = _check_p(p)
    m = _check_m(m)
    n = p.size
    q, total = _integer_weights(p)
    order = sorted(range(n), key=lambda i: (-q[i], i))
    free = [total] * m
    alloc: dict[tuple[int, int], int] = {}
    _pour(((i, m * q[i]) for i in order), free, alloc)
    return _to_matrix(alloc, m, n, total, free)


def distance_matrix(G, kind: str) -> np.ndarray:
    """(n, n) dissimilarities between the rows of G (n clients' representative gradients, flattened to (n, d)).

    kind 'cosine': angle arccos(<Gi,Gj> / (|Gi||Gj|)) in [0, pi], the cosine clipped to [-1, 1]; 0.0 when either
    vector is zero. 'l2': squared Euclidean distance sum (Gi - Gj)**2 (no square root, as the reference code).
    'l1': sum |Gi - Gj|. The diagonal is 0 and the matrix is exactly symmetric.

    'cosine' and 'l2' use one Gram matrix G @ G.T (BLAS; n=1000, d=1e5 takes seconds); 'l2' is computed as
    |Gi|^2 + |Gj|^2 - 2<Gi,Gj>, so its absolute error is ~1e-16 * max |Gi|^2 (clipped at 0). 'l1' has no
    matrix-product form and uses scipy's pdist (O(n^2 d) in C; tens of seconds at n=1000, d=1e5)."""
    kind_l = kind.lower() if isinstance(kind, str) else kind
    if kind_l not in DISTANCES:
        raise ValueError(f"distance kind must be one of {DISTANCES}, got {kind!r}")
    G = np.asarray(G, dtype=np.float64)
    if G.ndim != 2 or G.shape[0] == 0 or G.shape[1] == 0:
        raise ValueError(f"G must be a 2-D (clients, parameters) array with both sizes >= 1, got shape {G.shape}")
    if not np.all(np.isfinite(G)):
        raise ValueError("G contains non-finite values")
    n = G.shape[0]
    if kind_l == "l1":
        from scipy.spatial.distance import pdist, squareform
        return squareform(pdist(G, "cityblock"), checks=False) if n > 1 else np.zeros((1, 1))
    gram = G @ G.T
    gram += gram.T
    gram *= 0.5  # exact symmetry
    sq = np.einsum("ij,ij->i", G, G)  # squared norms, computed directly (not read off the Gram diagonal)
    if kind_l == "l2":
        out = sq[:, None] + sq[None, :] - 2.0 * gram
        np.maximum(out, 0.0, out=out)
    else:
        norms = np.sqrt(sq)
        denom = norms[:, None] * norms[None, :]
        zero = denom == 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            cos = np.where(zero, 1.0, gram / np.where(zero, 1.0, denom))
        out = np.arccos(np.clip(cos, -1.0, 1.0))
        out[zero] = 0.0
    np.fill_diagonal(out, 0.0)
    return out


def _linkage_matrix(M: np.ndarray, linkage_input: str) -> np.ndarray:
    """Ward linkage of the (n, n) distance matrix M, n >= 2. 'rows' reproduces the reference code (scipy receives
    the square matrix and treats its rows as n observations in R^n); 'condensed' gives scipy the distances."""
    from scipy.cluster.hierarchy import ClusterWarning, linkage
    from scipy.spatial.distance import squareform
    if linkage_input == "rows":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ClusterWarning)
            return linkage(M, method="ward")
    return linkage(squareform(M, checks=False), method="ward")


def _subtree_leaves(node: int, Z: np.ndarray, n: int) -> list[int]:
    out, stack = [], [node]
    while stack:
        x = stack.pop()
        if x < n:
            out.append(x)
        else:
            row = Z[x - n]
            stack.append(int(row[1]))
            stack.append(int(row[0]))
    return sorted(out)


def _weight_cut(Z: np.ndarray, q: list[int], total: int, m: int) -> list[list[int]]:
    """Fraboni's cut: maximal subtrees whose total weight is <= 1/m (exact integer comparison m*w <= W). A single
    client heavier than 1/m is its own cluster. Equivalent to fcluster(criterion='distance', t=1/m) on the tree whose
    merge heights are replaced by the merged cluster's weight (monotone, as weights only grow towards the root)."""
    n = len(q)
    weight = list(q) + [0] * (n - 1)
    for r in range(n - 1):
        weight[n + r] = weight[int(Z[r, 0])] + weight[int(Z[r, 1])]
    clusters, stack = [], [2 * n - 2]
    while stack:
        node = stack.pop()
        if node < n or m * weight[node] <= total:
            clusters.append(_subtree_leaves(node, Z, n))
        else:
            row = Z[node - n]
            stack.append(int(row[1]))
            stack.append(int(row[0]))
    return clusters


def _count_cut(Z: np.ndarray, n: int, k: int) -> list[list[int]]:
    """Exactly min(k, n) clusters: the subtrees left after the first n - k merges of Z (Z lists merges by
    increasing height, so this is fcluster(criterion='maxclust', t=k) except that ties in height never reduce the
    count below k)."""
    k = min(k, n)
    active = set(range(n))
    for r in range(n - k):
        active.discard(int(Z[r, 0]))
        active.discard(int(Z[r, 1]))
        active.add(n + r)
    return [_subtree_leaves(node, Z, n) for node in active]


def _flat_clusters(Z: np.ndarray, q: list[int], total: int, m: int, clusters: int) -> list[list[int]]:
    if clusters > 0:
        return _count_cut(Z, len(q), clusters)
    return _weight_cut(Z, q, total, m)


def similarity_distributions(G, p, m: int, *, distance: str = "cosine", linkage_input: str = "rows",
                             clusters: int = 0, kept_order: str = "heaviest_first",
                             rng: np.random.Generator) -> np.ndarray:
    """Algorithm 2 of Fraboni et al. (similarity-based clustered sampling), shape (m, n).

    G: (n, d) representative gradients (theta_i_local - theta_global, flattened); p: (n,) importances summing to 1;
    m: clients drawn per round. Steps:
      1. M = distance_matrix(G, distance); Ward linkage of M ('rows': the reference code's quirk, scipy clusters the
         rows of the square matrix; 'condensed': scipy gets the distances via squareform).
      2. Flat clusters. clusters == 0 (Fraboni): maximal subtrees of total weight <= 1/m. clusters > 0 (pFedCS,
         "alpha >= m clusters"): the Ward tree cut into exactly min(clusters, n) clusters, by undoing its last merges
         (no weight condition: clusters may be heavier than 1/m, see 3). Fewer clusters than m (clusters < m, or
         n < m) needs no special case: some cluster is then heavier than 1/m and step 3 gives it whole rows.
      3. Heavy clusters (more than 1/m of the weight; also a single client above 1/m): the reference code would
         write more than a row's capacity and then negative weights. Here such a cluster first fills
         floor(weight * m) whole rows of its own, its members taken by weight descending (Algorithm 1 inside the
         cluster, a client split at a row boundary); what is left of it (< 1/m) is treated as a cluster in step 4.
         So a client holding 3/m of the data is drawn exactly 3 times rather than a random number of times, and a
         heavy group of similar clients stays in as few rows as possible.
      4. Fraboni's assignment on the remaining rows (all clusters now fit in a row): clusters sorted by weight
         descending (ties: smallest client index first), the heaviest ones each own one row (lowest free row
         first; `kept_order="reference"`: lightest of them first, as the reference code's ascending sort leaves
         them), the others, in ascending weight order with their members shuffled by `rng`, are poured greedily
         into the rows with free capacity (row 0 first), a client split over two rows when a row fills. The order
         matters: the poured clients share rows with the kept clusters of the first rows.
    Every row ends with exactly 1/m of the weight (integer arithmetic), all entries >= 0, rows are normalised to
    sum 1 and the mean over rows equals p / sum(p) up to float64 rounding. `rng` is used only for the shuffles."""
    p = _check_p(p)
    m = _check_m(m)
    rng = _check_rng(rng)
    if linkage_input not in LINKAGE_INPUTS:
        raise ValueError(f"linkage_input must be one of {LINKAGE_INPUTS}, got {linkage_input!r}")
    if kept_order not in KEPT_ORDERS:
        raise ValueError(f"kept_order must be one of {KEPT_ORDERS}, got {kept_order!r}")
    if isinstance(clusters, (bool, np.bool_)) or not isinstance(clusters, (int, np.integer)) or clusters < 0:
        raise ValueError(f"clusters must be an integer >= 0 (0 = Fraboni's weight cut), got {clusters!r}")
    n = p.size
    G = np.asarray(G, dtype=np.float64)
    if G.ndim != 2 or G.shape[0] != n:
        raise ValueError(f"G must have shape (n, d) with n = len(p) = {n}, got {G.shape}")
    M = distance_matrix(G, distance)
    q, total = _integer_weights(p)
    if n == 1:
        flat = [[0]]
    else:
        flat = _flat_clusters(_linkage_matrix(M, linkage_input), q, total, m, int(clusters))

    return _allocate_clusters(flat, q, total, m, rng, n, kept_order)


def _allocate_clusters(flat: list[list[int]], q: list[int], total: int, m: int, rng: np.random.Generator,
                       n: int, kept_order: str = "heaviest_first") -> np.ndarray:
    """Rows from flat clusters (steps 3-4 of `similarity_distributions`), in integer units: row capacity = total,
    client i weighs m * q[i]."""
    free = [total] * m
    alloc: dict[tuple[int, int], int] = {}
    row = 0
    # Candidates are (weight, tie-break key, pieces); pieces = [(client, amount)].
    candidates: list[tuple[int, int, list[tuple[int, int]]]] = []
    for c in flat:
        pieces = [(i, m * q[i]) for i in c]
        weight = sum(a for _, a in pieces)
        if weight > total:  # heavier than one row: whole rows of its own first (Algorithm 1 inside the cluster)
            full = weight // total
            pieces.sort(key=lambda t: (-t[1], t[0]))
            rest: list[tuple[int, int]] = []
            for i, amount in pieces:
                while amount > 0 and row < m and full > 0:
                    u = min(free[row], amount)
                    alloc[(row, i)] = u
                    free[row] -= u
                    amount -= u
                    if free[row] == 0:
                        row += 1
                        full -= 1
                if amount > 0:
                    rest.append((i, amount))
            pieces = rest
            weight = sum(a for _, a in pieces)
            if not pieces:
                continue
        candidates.append((weight, c[0], pieces))
    # Fraboni on what is left: every candidate now fits in one row
    by_weight = sorted(candidates, key=lambda t: (-t[0], t[1]))
    kept, rest_c = by_weight[: m - row], sorted(by_weight[m - row:], key=lambda t: (t[0], t[1]))
    if kept_order == "reference":
        kept = kept[::-1]
    for k, (weight, _, pieces) in enumerate(kept, start=row):
        for i, amount in pieces:
            if amount:
                alloc[(k, i)] = alloc.get((k, i), 0) + amount
        free[k] -= weight
    poured: list[tuple[int, int]] = []
    for _, _, pieces in rest_c:
        poured.extend(pieces[j] for j in rng.permutation(len(pieces)))
    _pour(poured, free, alloc)
    return _to_matrix(alloc, m, n, total, free)


def draw_from_distributions(r, rng: np.random.Generator) -> list[int]:
    """One client per row, row k drawn from Categorical(r[k]); rows independent, so a client can be drawn more
    than once. Returns the m draws in row order."""
    rng = _check_rng(rng)
    r = np.asarray(r, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] == 0 or r.shape[1] == 0:
        raise ValueError(f"r must be a 2-D (m, n) array of row distributions, got shape {r.shape}")
    if not np.all(np.isfinite(r)) or r.min() < 0:
        raise ValueError("r must be finite and non-negative")
    sums = r.sum(axis=1)
    if np.any(np.abs(sums - 1.0) > P_SUM_TOL):
        raise ValueError(f"every row of r must sum to 1 (within {P_SUM_TOL}), got row sums {sums.tolist()}")
    n = r.shape[1]
    return [int(rng.choice(n, p=row / row.sum())) for row in r]


class Sampler:
    """Who aggregates each round and with what weight, for any algorithm (`sampling` in the config).

    - uniform: `per_round` distinct clients, weights proportional to their importance (sample sizes: FedAvg's rule).
    - md: `per_round` draws from Categorical(p), p_i = n_i / n (Li et al.'s multinomial sampling).
    `importance: equal` makes p uniform (every client counts the same, as in the unweighted accuracy metrics).
    - clustered_size / clustered_similarity: one draw from each of `per_round` distributions built by
      Fraboni et al.'s Algorithm 1 (sample sizes) or 2 (similarity of the clients' representative gradients).
    For the drawn schemes a client's weight is its number of draws / m: the aggregate is unbiased because the
    mean of the distributions is p. The draws depend only on (seed, round, distributions).
    """

    def __init__(self, scheme: str, sizes: np.ndarray, per_round: int, seed: int, clustering=None,
                 importance: str = "size"):
        self.scheme, self.seed = scheme, seed
        self.n = len(sizes)
        # each client's importance p_i: its share of the data (FedAvg, Fraboni et al.) or the same for all
        self.sizes = np.asarray(sizes, dtype=np.float64) if importance == "size" else np.ones(len(sizes))
        self.p = self.sizes / self.sizes.sum()
        self.m = per_round if 0 < per_round < self.n else self.n
        self.per_round = per_round
        self.clustering = clustering
        self._fixed = None
        if scheme == "md":
            self._fixed = md_distributions(self.p, self.m)
        elif scheme == "clustered_size":
            self._fixed = size_distributions(self.p, self.m)

    @property
    def needs_gradients(self) -> bool:
        return self.scheme == "clustered_similarity"

    def init_state(self, dim: int, like: "torch.Tensor") -> dict:
        """Representative gradients start at zero, as in Fraboni et al.'s clustered-sampling code."""
        return {"gradients": like.new_zeros(self.n, dim)} if self.needs_gradients else {}

    def observe(self, state: dict, gradients: dict[int, "torch.Tensor"]) -> dict:
        """Refresh the representative gradients of the clients that trained."""
        if self.needs_gradients and gradients:
            cids = list(gradients)
            state["gradients"][cids] = torch.stack([gradients[c] for c in cids])
        return state

    def distributions(self, state: dict, rnd: int) -> np.ndarray | None:
        if self.scheme == "clustered_similarity":
            c = self.clustering
            G = state["gradients"].double().cpu().numpy()
            if c.representative == "centered":  # grad F_i(w) - grad F(w), with grad F(w) = sum_i p_i grad F_i(w)
                G = G - self.p @ G
            return similarity_distributions(G, self.p, self.m, distance=c.distance, linkage_input=c.linkage_input,
                                            clusters=c.clusters, kept_order=c.kept_order,
                                            rng=np.random.default_rng([self.seed, rnd, 0xC5]))
        return self._fixed

    def select(self, state: dict, rnd: int) -> dict[int, float]:
        """{client: aggregation weight} for this round (weights sum to 1)."""
        if self.scheme == "uniform":
            cids = uniform_sample(self.seed, rnd, self.n, self.per_round)
            total = self.sizes[cids].sum()
            return {c: float(self.sizes[c] / total) for c in cids}
        draws = draw_from_distributions(self.distributions(state, rnd),
                                        np.random.default_rng([self.seed, rnd, self.n, 0xD7]))
        weights: dict[int, float] = {}
        for c in sorted(draws):
            weights[c] = weights.get(c, 0.0) + 1.0 / len(draws)
        return weights
