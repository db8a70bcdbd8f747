"""The hypernetwork optimizer pFedLA and pFedHN share (pfedkit.algorithms.hypernet) against torch.optim.Adam and
torch.optim.SGD: on client-stacked rows, one torch optimizer per client stepped in a plain loop only in the rounds
its client trains; on whole tensors, one torch optimizer. Then pFedLA's memory helpers: blocks and the payload cache."""
from __future__ import annotations

import pytest
import torch

from pfedkit.algorithms.hypernet import HypernetOptimizer, PayloadCache, blocks

N = 5
SHAPES = {"emb": (4,), "w": (3, 4), "b": (3,)}  # one client's hypernetwork: a row of each stacked tensor
ROUNDS = ([1, 3], [3, 0, 4], [4, 1], [3])  # client 3 trains in three rounds, client 2 never; cids out of order
TOL = 1e-12  # float64


def stacked(seed: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn((N, *shape), generator=gen, dtype=torch.float64).to(dtype) for k, shape in SHAPES.items()}


def torch_optimizer(kind: str, params: list[torch.nn.Parameter], lr: float, momentum: float, weight_decay: float):
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=False)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=False)


def step_rows(opt: HypernetOptimizer, state: dict, grads: dict[str, torch.Tensor], cids: list[int]) -> None:
    """What pFedLA's aggregate does: the rows of the round's clients, copied in the compute dtype, stepped."""
    idx = torch.as_tensor(cids)
    rows = {k: v[idx].to(grads[k].dtype) for k, v in state["hn"].items()}
    opt.step(state, {k: g.clone() for k, g in grads.items()}, idx, rows)


@pytest.mark.parametrize("kind, momentum, weight_decay", [
    ("adam", 0.0, 0.0), ("adam", 0.0, 1e-2), ("sgd", 0.0, 0.0), ("sgd", 0.9, 0.0), ("sgd", 0.9, 1e-2)])
def test_client_rows_step_as_one_torch_optimizer_per_client(kind, momentum, weight_decay):
    """Each client's rows move exactly as its own torch optimizer moves them, stepped in the rounds it trains
    (Adam's t counts the client's own steps; its momentum and moments are its own); the other rows stay."""
    lr = 0.05
    opt = HypernetOptimizer(kind, lr, momentum, weight_decay)
    hn = stacked(0)
    state = {"hn": {k: v.clone() for k, v in hn.items()}}
    state |= opt.init_state(state["hn"], torch.zeros(N, dtype=torch.float64))
    params = {c: {k: torch.nn.Parameter(hn[k][c].clone()) for k in SHAPES} for c in range(N)}
    refs = {c: torch_optimizer(kind, list(params[c].values()), lr, momentum, weight_decay) for c in range(N)}
    gen = torch.Generator().manual_seed(1)
    for cids in ROUNDS:
        grads = {k: torch.randn((len(cids), *shape), generator=gen, dtype=torch.float64) for k, shape in SHAPES.items()}
        step_rows(opt, state, grads, cids)
        for r, c in enumerate(cids):
            for k, p in params[c].items():
                p.grad = grads[k][r].clone()
            refs[c].step()
    for c in range(N):
        for k, p in params[c].items():
            assert (state["hn"][k][c] - p.detach()).abs().max() <= TOL, (c, k)
    assert torch.equal(state["hn"]["w"][2], hn["w"][2])  # never trained: never moved
    if kind == "adam":
        assert state["hn_steps"].tolist() == [1, 2, 0, 3, 2]
        for c in (0, 1, 3, 4):  # client 2's torch optimizer never stepped: it holds no moments
            for k, p in params[c].items():
                moments = refs[c].state[p]
                assert (state["hn_adam_m"][k][c] - moments["exp_avg"]).abs().max() <= TOL, (c, k)
                assert (state["hn_adam_v"][k][c] - moments["exp_avg_sq"]).abs().max() <= TOL, (c, k)
        assert all(not state[m][k][2].any() for m in ("hn_adam_m", "hn_adam_v") for k in SHAPES)


@pytest.mark.parametrize("kind, momentum", [("sgd", 0.9), ("sgd", 0.0), ("adam", 0.0)])
def test_whole_tensors_step_as_one_torch_optimizer(kind, momentum):
    """pFedHN's layout: every tensor steps whole, with one step count and the embedding table's own learning rate;
    SGD bit for bit as torch.optim.SGD, Adam to 1e-12 (torch updates its first moment with lerp)."""
    lr, embed_lr, weight_decay = 0.05, 0.2, 1e-3
    opt = HypernetOptimizer(kind, lr, momentum, weight_decay, {"emb": embed_lr}, velocity_key="hn_momentum")
    hn = stacked(2)
    state = {"hn": {k: v.clone() for k, v in hn.items()}}
    state |= opt.init_state(state["hn"], torch.zeros((), dtype=torch.float64))
    assert ("hn_momentum" in state) == (momentum > 0) and ("hn_adam_m" in state) == (kind == "adam")
    params = {k: torch.nn.Parameter(v.clone()) for k, v in hn.items()}
    groups = [{"params": [params["emb"]], "lr": embed_lr}, {"params": [params["w"], params["b"]]}]
    ref = torch_optimizer(kind, groups, lr, momentum, weight_decay)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        grads = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in hn.items()}
        opt.step(state, {k: g.clone() for k, g in grads.items()})
        for k, p in params.items():
            p.grad = grads[k]
        ref.step()
    for k, p in params.items():
        if kind == "sgd":
            assert torch.equal(state["hn"][k], p.detach()), k
        else:
            assert (state["hn"][k] - p.detach()).abs().max() <= TOL, k
    if kind == "adam":
        assert float(state["hn_steps"]) == 4


def test_bfloat16_rows_are_computed_in_the_compute_dtype_and_rounded_when_stored():
    """pFedLA's hn_dtype=bfloat16: a step from bfloat16-stored rows gives the float32 step of the same values, then
    rounded once to bfloat16 (parameters and both moments); the step counts stay exact."""
    opt = HypernetOptimizer("adam", 0.3)
    hn16 = stacked(4, torch.bfloat16)
    states = {}
    for dtype in (torch.bfloat16, torch.float32):
        state = {"hn": {k: v.to(dtype) for k, v in hn16.items()}}
        states[dtype] = state | opt.init_state(state["hn"], torch.zeros(N))
    gen = torch.Generator().manual_seed(5)
    for cids in ROUNDS[:2]:  # client 3 twice: its second step starts from rounded moments in both
        grads = {k: torch.randn((len(cids), *shape), generator=gen) for k, shape in SHAPES.items()}
        for dtype, state in states.items():
            step_rows(opt, state, grads, cids)
        for group in ("hn", "hn_adam_m", "hn_adam_v"):
            for k in SHAPES:
                got, full = states[torch.bfloat16][group][k], states[torch.float32][group][k]
                assert got.dtype == torch.bfloat16 and torch.equal(got, full.to(torch.bfloat16)), (group, k)
                states[torch.float32][group][k] = full.to(torch.bfloat16).float()  # the next round starts alike
    assert states[torch.bfloat16]["hn_steps"].tolist() == [1, 1, 0, 2, 1]


def test_blocks_read_a_consecutive_run_in_place_and_gather_scattered_clients():
    assert [(at, part) for at, part in blocks([4, 5, 6, 7, 8], 2, torch.device("cpu"))] == \
        [(slice(0, 2), slice(4, 6)), (slice(2, 4), slice(6, 8)), (slice(4, 5), slice(8, 9))]
    scattered = list(blocks([7, 2, 9], 2, torch.device("cpu")))
    assert [at for at, _ in scattered] == [slice(0, 2), slice(2, 3)]
    assert [part.tolist() for _, part in scattered] == [[7, 2], [9]]
    assert list(blocks([], 3, torch.device("cpu"))) == []


def test_payload_cache_gives_the_rows_once_and_only_while_nothing_changed():
    source = torch.zeros(3)
    rows = torch.arange(12.0).view(4, 3)  # one row per client of [5, 1, 7, 2]
    cache = PayloadCache()
    cache.put([5, 1, 7, 2], [source], rows)
    (got,) = cache.take([2, 5], [source])  # a subset, in another order
    assert got.tolist() == [rows[3].tolist(), rows[0].tolist()]
    assert cache.take([2, 5], [source]) is None  # taken once
    cache.put([5, 1], [source], rows[:2])
    assert cache.take([5, 3], [source]) is None  # client 3's rows were never kept
    for change in (lambda: source.add_(1), lambda: rows.mul_(2)):  # the source, or a row handed out, written
        cache.put([5, 1, 7, 2], [source], rows)
        change()
        assert cache.take([5], [source]) is None
    cache.put([5], [source], rows)
    assert cache.take([5], [torch.zeros(3)]) is None  # another tensor in the source's place
