"""Local training primitives (pfedkit.train) against plain PyTorch: the seeded batch streams written out by hand,
`sgd` against torch.optim.SGD, lockstep `batched_sgd` against one torch.optim.SGD loop per client, `predict`
against a plain forward pass. Small, fast, and independent of the code under test."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pfedkit.config import LocalConfig
from pfedkit.data import ClientData
from pfedkit.models import FlatModel
from pfedkit.models.nets import DNN, MLR
from pfedkit.train import BatchedLoss, Objective, batch_indices, batch_plan, batched_sgd, predict, seeded_generator, sgd
from flat_layout import flat_params, load_params  # noqa: E402


def toy_client(n: int, seed: int, d: int = 5, classes: int = 3) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + 4, d, generator=g)
    y = torch.randint(0, classes, (n + 4,), generator=g)
    return ClientData(x[:n], y[:n], x[n:], y[n:])


def same_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_seeded_generator_seed_is_the_seed_sequence_of_the_key():
    """The generator of (seed, round, client) is seeded with numpy's SeedSequence of the key (63 bits), so its
    stream depends on the key only (DESIGN.md principle 4)."""
    for key in [(0, 1, 2), (7, 12, 99, 0xE7A1), (3,)]:
        want = int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0]) >> 1
        assert seeded_generator(*key).initial_seed() == want
    assert seeded_generator(-4, 2).initial_seed() == seeded_generator(4, 2).initial_seed()  # |k|: no negative keys


def test_batch_indices_epochs_are_passes_over_seeded_permutations():
    """epochs = 2 passes over n = 7 in batches of 3: each pass is a fresh permutation cut 3, 3, 1."""
    hp = LocalConfig(epochs=2, steps=0, batch_size=3)
    got = list(batch_indices(7, hp, same_generator(5), torch.device("cpu")))
    g = same_generator(5)
    expected = []
    for _ in range(2):
        perm = torch.randperm(7, generator=g)
        expected += [perm[0:3], perm[3:6], perm[6:7]]
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7])
def test_batch_indices_steps_cycle_through_fresh_permutations(steps):
    """steps > 0: exactly `steps` batches (epochs ignored), continuing into a new permutation when one is used up."""
    hp = LocalConfig(epochs=5, steps=steps, batch_size=3)
    got = list(batch_indices(7, hp, same_generator(11), torch.device("cpu")))
    g = same_generator(11)
    expected = []
    while len(expected) < steps:
        perm = torch.randperm(7, generator=g)
        expected += [perm[0:3], perm[3:6], perm[6:7]]
    assert [b.tolist() for b in got] == [b.tolist() for b in expected[:steps]]


def test_batch_plan_stacks_the_streams_with_offsets_and_a_mask():
    """Lockstep plan of two clients (n = 5 and 2, offsets 0 and 5, batch 2, one epoch): global indices (steps,
    clients, batch), padding masked out, and the short client's finished steps all masked."""
    hp = LocalConfig(epochs=1, steps=0, batch_size=2)
    idx, mask = batch_plan([5, 2], [0, 5], hp, [same_generator(1), same_generator(2)], torch.device("cpu"))
    p0, p1 = torch.randperm(5, generator=same_generator(1)), torch.randperm(2, generator=same_generator(2))
    assert idx.shape == (3, 2, 2) and mask.shape == (3, 2, 2)
    assert mask.tolist() == [[[1, 1], [1, 1]], [[1, 1], [0, 0]], [[1, 0], [0, 0]]]
    assert idx[:, 0].tolist() == [p0[0:2].tolist(), p0[2:4].tolist(), [int(p0[4]), 0]]
    assert idx[0, 1].tolist() == (p1 + 5).tolist()


def plain_sgd_loop(net, client, batches, lr, momentum=0.0, weight_decay=0.0, anchor=None, mu=0.0):
    """torch.optim.SGD over the given batches, with the proximal gradient mu (theta - anchor) added by hand."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    losses = []
    for idx in batches:
        opt.zero_grad()
        loss = F.cross_entropy(net(client.x_train[idx]), client.y_train[idx])
        loss.backward()
        if anchor is not None:
            for p, a in zip(net.parameters(), anchor):
                p.grad.add_(p.detach() - a, alpha=mu)
        opt.step()
        losses.append(float(loss.detach()))
    return flat_params(net), losses


@pytest.mark.parametrize("momentum, weight_decay, mu", [(0.0, 0.0, 0.0), (0.9, 0.01, 0.0), (0.5, 0.0, 0.7)])
def test_sgd_equals_torch_optim_sgd(momentum, weight_decay, mu):
    client = toy_client(23, seed=0)
    hp = LocalConfig(epochs=2, steps=0, batch_size=5, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    torch.manual_seed(0)
    model = FlatModel(DNN((5,), 3, hidden=4))
    start = model.state()
    anchor = start + 0.3  # a proximal anchor away from the start, so the term acts from the first step
    loss = sgd(model, client, hp, same_generator(3), Objective(prox_anchor=anchor if mu else None, prox_mu=mu))

    torch.manual_seed(0)
    net = DNN((5,), 3, hidden=4)
    load_params(start.clone(), net)
    anchors = [a.view_as(p) for a, p in zip(torch.split(anchor, [p.numel() for p in net.parameters()]),
                                            net.parameters())]
    g = same_generator(3)
    batches = [perm[s: s + 5] for perm in (torch.randperm(23, generator=g) for _ in range(2)) for s in range(0, 23, 5)]
    want, losses = plain_sgd_loop(net, client, batches, 0.1, momentum, weight_decay, anchors if mu else None, mu)
    assert torch.allclose(model.state(), want, atol=1e-6)
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)


def test_sgd_trainable_mask_freezes_entries():
    client = toy_client(12, seed=1)
    hp = LocalConfig(epochs=1, steps=0, batch_size=4, lr=0.05)
    torch.manual_seed(1)
    model = FlatModel(MLR((5,), 3))
    start = model.state()
    mask = torch.zeros(model.param_size)
    mask[:15] = 1.0  # the weight matrix trains, the bias stays
    sgd(model, client, hp, same_generator(4), Objective(trainable=mask))

    torch.manual_seed(1)
    net = MLR((5,), 3)
    g = same_generator(4)
    perm = torch.randperm(12, generator=g)
    opt = torch.optim.SGD([net.fc.weight], lr=0.05)
    for s in range(0, 12, 4):
        opt.zero_grad()
        F.cross_entropy(net(client.x_train[perm[s: s + 4]]), client.y_train[perm[s: s + 4]]).backward()
        opt.step()
    assert torch.equal(model.state()[15:], start[15:])
    assert torch.allclose(model.state()[:15], net.fc.weight.detach().flatten(), atol=1e-6)
    # the lockstep path takes the same objective: the same frozen entries, the same result
    idx, bmask = batch_plan([12], [0], hp, [same_generator(4)], torch.device("cpu"))
    trained, _ = batched_sgd(BatchedLoss(FlatModel(MLR((5,), 3))), start[None], client.x_train, client.y_train, idx,
                             bmask, hp, Objective(trainable=mask))
    assert torch.equal(trained[0, 15:], start[15:])
    assert torch.allclose(trained[0, :15], net.fc.weight.detach().flatten(), atol=1e-6)


@pytest.mark.parametrize("momentum, weight_decay, mu", [(0.0, 0.0, 0.0), (0.9, 0.01, 0.5)])
def test_batched_sgd_equals_one_plain_loop_per_client(momentum, weight_decay, mu):
    """Three clients of 9, 4 and 13 samples, one epoch of batches of 4 in lockstep: each client's result is its own
    torch.optim.SGD loop; a client whose stream ended (3 or 1 batches of the 4 steps) stays where it stopped, and
    its mean loss counts its own batches only."""
    sizes, b = [9, 4, 13], 4
    clients = [toy_client(n, seed=10 + i) for i, n in enumerate(sizes)]
    x_all = torch.cat([c.x_train for c in clients])
    y_all = torch.cat([c.y_train for c in clients])
    offsets = [0, 9, 13]
    hp = LocalConfig(epochs=1, steps=0, batch_size=b, lr=0.2, momentum=momentum, weight_decay=weight_decay)
    idx, mask = batch_plan(sizes, offsets, hp, [same_generator(20 + i) for i in range(3)], torch.device("cpu"))
    torch.manual_seed(2)
    model = FlatModel(DNN((5,), 3, hidden=4))
    starts = model.state() + 0.1 * torch.randn(3, model.size, generator=same_generator(9))
    anchor = starts - 0.2
    trained, losses = batched_sgd(BatchedLoss(model), starts, x_all, y_all, idx, mask, hp,
                                  Objective(prox_anchor=anchor if mu else None, prox_mu=mu))
    for i, (client, n) in enumerate(zip(clients, sizes)):
        net = DNN((5,), 3, hidden=4)
        load_params(starts[i].clone(), net)
        anchors = [a.view_as(p) for a, p in zip(torch.split(anchor[i], [p.numel() for p in net.parameters()]),
                                                net.parameters())]
        perm = torch.randperm(n, generator=same_generator(20 + i))
        want, plain_losses = plain_sgd_loop(net, client, [perm[s: s + b] for s in range(0, n, b)], 0.2, momentum,
                                            weight_decay, anchors if mu else None, mu)
        assert torch.allclose(trained[i], want, atol=1e-6), i
        assert float(losses[i]) == pytest.approx(sum(plain_losses) / len(plain_losses), rel=1e-5), i


def test_predict_is_a_plain_forward_pass_in_chunks():
    client = toy_client(10, seed=3)
    torch.manual_seed(3)
    model = FlatModel(MLR((5,), 3))
    correct, losses = predict(model, client.x_train, client.y_train, chunk=3)
    with torch.no_grad():
        out = model.module(client.x_train)
    assert correct.tolist() == (out.argmax(1) == client.y_train).tolist()
    assert torch.allclose(losses, F.cross_entropy(out, client.y_train, reduction="none"), atol=1e-6)
    empty_correct, empty_losses = predict(model, client.x_train[:0], client.y_train[:0])
    assert empty_correct.numel() == 0 and empty_losses.numel() == 0


def test_one_step_reports_its_loss_and_an_anchor_without_mu_adds_nothing():
    """sgd / batched_sgd over a single batch return that batch's loss; a proximal anchor with the default mu (0)
    leaves plain SGD."""
    client = toy_client(6, seed=4)
    hp = LocalConfig(epochs=0, steps=1, batch_size=6, lr=0.3)
    torch.manual_seed(4)
    model = FlatModel(MLR((5,), 3))
    start = model.state()
    with torch.no_grad():
        want_loss = float(F.cross_entropy(model.module(client.x_train), client.y_train))
    loss = sgd(model, client, hp, same_generator(0), Objective(prox_anchor=start + 1.0))
    net = MLR((5,), 3)
    load_params(start.clone(), net)
    want, _ = plain_sgd_loop(net, client, [torch.randperm(6, generator=same_generator(0))], 0.3)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert torch.allclose(model.state(), want, atol=1e-6)

    idx, mask = batch_plan([6], [0], hp, [same_generator(0)], torch.device("cpu"))
    trained, losses = batched_sgd(BatchedLoss(FlatModel(MLR((5,), 3))), start[None], client.x_train, client.y_train,
                                  idx, mask, hp, Objective(prox_anchor=start[None] + 1.0))
    assert float(losses[0]) == pytest.approx(want_loss, rel=1e-6)
    assert torch.allclose(trained[0], want, atol=1e-6)


def test_lockstep_pays_while_most_clients_are_busy_in_most_steps():
    """Lockstep runs as many steps as the longest stream; it is chosen while sum(steps) >= C * max(steps) / 2."""
    from pfedkit.train import Cohort
    from pfedkit.data import FederatedData
    from pfedkit.data.partition import Partition
    from pfedkit.data.sources import Source

    def pays(sizes, **hp):
        """A real federated data set of clients with these train sizes (one test sample each)."""
        total = sum(sizes) + len(sizes)
        source = Source("toy", np.zeros((total, 2), dtype=np.float32), np.zeros(total, dtype=np.int64), 2)
        cuts = np.cumsum([0] + list(sizes))
        train = [np.arange(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
        test = [np.array([cuts[-1] + i]) for i in range(len(sizes))]
        data = FederatedData(source, Partition(train, test, [np.array([0])] * len(sizes)))
        assert data.train_sizes.tolist() == list(sizes)
        return Cohort(list(range(len(sizes))), 1, data, None, LocalConfig(**hp), []).lockstep_pays()

    # one epoch of batches of 10: steps = ceil(n / 10)
    assert pays([1, 1, 40], epochs=1, steps=0, batch_size=10)  # steps 1, 1, 4: 6 >= 3 * 4 / 2 (equality)
    assert not pays([1, 1, 50], epochs=1, steps=0, batch_size=10)  # 1, 1, 5: 7 < 7.5
    assert pays([15, 25, 40], epochs=2, steps=0, batch_size=10)  # 4, 6, 8: 18 >= 12
    assert not pays([10, 10, 10, 400], epochs=1, steps=0, batch_size=10)  # 1, 1, 1, 40: 43 < 80
    assert pays([1, 1, 400], epochs=1, steps=5, batch_size=10)  # `steps`: every client takes as many
    assert pays([1, 1, 400], epochs=1, steps=1, batch_size=10)
