"""FedFomo (Zhang et al., ICLR 2021; NVlabs/FedFomo): the first-order weights favour the peer with the client's own
distribution, are computed on the held-out part of the train split only, the epsilon-greedy download picks, and a
run end to end (resumable, bytes on the wire)."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pfedkit.algorithms.fedfomo  # noqa: F401  (registers fedfomo)
from pfedkit.algorithms import build_algorithm
from pfedkit.config import RuntimeConfig, load_config
from pfedkit.engine import TIMING_KEYS
from pfedkit.errors import DataError
from pfedkit.experiment import prepare, resume_experiment, run_experiment
from pfedkit.models import FlatModel, build_model
from pfedkit.train import Cohort, seeded_generator

MNIST = ["dataset.name=mnist5k", "partition.scheme=classes", "partition.classes_per_client=2",
         "partition.num_clients=10", "partition.samples_per_client=60", "model.name=cnn", "local.batch_size=10",
         "local.lr=0.05", "progress=false", "plots=false", "checkpoint_every=0"]


def setup(*extra: str):
    cfg = load_config(None, MNIST + list(extra), "fedfomo").for_algorithm("fedfomo")
    data = prepare(cfg)
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
    return cfg, data, model, build_algorithm(cfg, model, data.num_clients)


def cohort_of(cfg, data, model, cids, rnd=2, hp=None):
    return Cohort(cids, rnd, data, model, hp or cfg.local, [seeded_generator(cfg.seed, rnd, c) for c in cids])


def peers_of_own_and_other_classes(data):
    """A client i, a peer with exactly i's classes and two peers sharing none of them."""
    sets = [set(map(int, s)) for s in data.label_sets]
    for i, own in enumerate(sets):
        same = [j for j, s in enumerate(sets) if j != i and s == own]
        other = [j for j, s in enumerate(sets) if not s & own]
        if same and len(other) >= 2:
            return i, same[0], other[:2]
    raise AssertionError(f"no client with a same-classes peer in {sets}")


def test_the_peer_with_the_clients_own_distribution_gets_the_highest_weight():
    """Client i starts from the common init b; its peers are models trained (20 SGD steps) on their own data: one
    with i's classes, two with other classes. Reference, written here: the validation split is every 5th train
    sample, w_j = (L(b) - L(theta_j)) / ||theta_j - b||_2, positive ones normalized, theta = b + sum w_j (theta_j - b).
    No local training (epochs 0 in the cohort's schedule): the client's new model is the mix itself."""
    cfg, data, model, algo = setup()
    i, same, others = peers_of_own_and_other_classes(data)
    peer_ids = [others[0], same, others[1]]
    b = model.state()
    pre = cohort_of(cfg, data, model, peer_ids, rnd=1)
    peers, _ = pre.train(b.repeat(3, 1), hp=dataclasses.replace(cfg.local, steps=20, epochs=1))

    client = data.client(i)
    x_val, y_val = client.x_train[::5], client.y_train[::5]  # val_fraction 0.2: every 5th sample, from the first

    def loss(vector):
        model.load(vector)
        model.module.eval()
        with torch.no_grad():
            return float(F.cross_entropy(model.module(x_val), y_val).double())

    raw = [(loss(b) - loss(p)) / float((p - b).norm()) for p in peers]
    positive = [max(w, 0.0) for w in raw]
    want = b + sum(w / sum(positive) * (p - b) for w, p in zip(positive, peers))

    payload = {"peers": peers, "peer_ids": torch.tensor(peer_ids, dtype=torch.float32)}
    (update,), (state,) = algo.client_update([payload], [{"weights": b.clone()}],
                                          cohort_of(cfg, data, model, [i], hp=dataclasses.replace(cfg.local, epochs=0)))
    got = update["affinity"][peer_ids]
    assert torch.allclose(got, torch.tensor(raw), rtol=1e-4, atol=1e-7)
    assert update["affinity"].sum() == pytest.approx(got.sum().item())  # zeros at the clients not downloaded
    assert got[1] > got[0] and got[1] > got[2] and got[1] > 0  # the peer with i's own classes
    mixed = got.clamp_min(0) / got.clamp_min(0).sum()
    assert (mixed >= 0).all() and mixed.sum().item() == pytest.approx(1.0)
    assert torch.allclose(state["weights"], want, atol=1e-6)
    assert torch.equal(update["weights"], state["weights"])
    assert update["num_samples"] == client.num_train - len(y_val)  # it fits on the rest only


def test_no_test_data_is_read_and_a_useless_peer_leaves_the_base():
    """The same client update with every test tensor replaced by NaN gives bit-identical results. A peer whose model
    is worse on the validation split than the client's own (w < 0) is not mixed in: training starts from b."""
    cfg, data, model, algo = setup("local.steps=3")
    b = model.state()
    i, same, others = peers_of_own_and_other_classes(data)
    peers, _ = cohort_of(cfg, data, model, [same, others[0]], rnd=1).train(b.repeat(2, 1))
    payloads = [{"peers": peers, "peer_ids": torch.tensor([same, others[0]], dtype=torch.float32)},
                {"peers": peers[1:], "peer_ids": torch.tensor([others[0]], dtype=torch.float32)}]
    cids = [i, others[1]]
    states = [{"weights": b.clone()}, {"weights": b.clone()}]
    clean = algo.client_update(payloads, states, cohort_of(cfg, data, model, cids))
    poisoned = copy.copy(data)
    poisoned.x_test = torch.full_like(data.x_test, float("nan"))
    poisoned.y_test = torch.full_like(data.y_test, -1)
    dirty = algo.client_update(payloads, states, cohort_of(cfg, poisoned, model, cids))
    for got, want in zip(dirty[0] + dirty[1], clean[0] + clean[1]):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) if isinstance(got[k], torch.Tensor) else got[k] == want[k]
                   for k in got)
    # client others[1] got only a model of other classes: w < 0, so it trained from b, like a lone client would
    assert clean[0][1]["affinity"][others[0]] < 0
    alone, _ = cohort_of(cfg, data, model, cids).holdout(0.2)[0].train(b.repeat(2, 1))
    assert torch.equal(clean[1][1]["weights"], alone[1])


def test_a_client_alone_as_in_a_flower_clientapp_computes_what_the_simulators_cohort_does():
    """A Flower ClientApp holds its own client only (at position 0, its batch stream keyed by its real id): the
    validation split and the update are the same as in the simulator's cohort of three, bit for bit (MLR: batched
    products, alone as in the cohort), and to float rounding through the model's own forward (forced)."""
    cfg, data, model, algo = setup("model.name=mlr", "local.steps=4")
    b = model.state()
    peers = torch.stack([b + 0.01 * k * torch.randn(len(b), generator=torch.Generator().manual_seed(k))
                         for k in (1, 2)])
    cids = [1, 4, 6]
    payloads = [{"peers": peers, "peer_ids": torch.tensor([0.0, 9.0])}] * 3
    states = [{"weights": b + 0.001 * c} for c in cids]

    def cohort(d, positions, ids, lockstep):  # one client after another, as a ClientApp
        return Cohort(positions, 2, d, model, cfg.local, [seeded_generator(cfg.seed, 2, c) for c in ids], lockstep,
                      RuntimeConfig(workers=1))

    in_turn, _ = algo.client_update(payloads, states, cohort(data, cids, cids, False))
    lockstep, _ = algo.client_update(payloads, states, cohort(data, cids, cids, True))
    for k, c in enumerate(cids):
        (alone,), _ = algo.client_update(payloads[k:k + 1], states[k:k + 1], cohort(data.only([c]), [0], [c], None))
        assert all(torch.equal(alone[key], lockstep[k][key]) for key in ("weights", "affinity"))
        assert alone["num_samples"] == lockstep[k]["num_samples"] and alone["train_loss"] == lockstep[k]["train_loss"]
        assert torch.allclose(lockstep[k]["weights"], in_turn[k]["weights"], atol=2e-5)
        assert (in_turn[k]["affinity"][[0, 9]] != 0).all() and (in_turn[k]["affinity"][1:9] == 0).all()


def test_a_client_too_small_to_hold_out_a_validation_sample_is_refused():
    cfg, data, model, algo = setup()
    tiny = data.train_rows([0], [torch.tensor([0])])  # one training sample
    with pytest.raises(DataError, match="client at data position 0 has 1 training sample"):
        algo.client_update([{"peers": torch.zeros(0, model.size), "peer_ids": torch.zeros(0)}],
                           [{"weights": model.state()}], cohort_of(cfg, tiny, model, [0]))


def selection_state(algo, n):
    """Affinities with distinct values in every row, clients 6 and 7 never uploaded."""
    state = algo.init_server(torch.zeros(3))
    state["affinity"] = torch.randn(n, n, generator=torch.Generator().manual_seed(5))
    state["seen"][:6] = 1.0
    return state


def test_greedy_picks_are_the_top_affinities_among_eligible_peers():
    """epsilon = 0: the picks are the M highest-affinity peers of the row, in order, never oneself, never a client
    that has not uploaded; with fewer eligible peers than M, all of them; ties broken at random; in round 1 (nobody
    uploaded) none."""
    cfg, data, model, algo = setup("partition.num_clients=8", "fedfomo.epsilon=0", "fedfomo.models=3")
    state = selection_state(algo, 8)
    cids = [0, 3, 5, 7]
    ids, valid = algo.select(state, cids, rnd=4)
    for r, c in enumerate(cids):
        ranked = sorted((j for j in range(6) if j != c), key=lambda j: -float(state["affinity"][c, j]))
        assert ids[r][valid[r]].tolist() == ranked[:3]
    algo.params.models = 6  # more than the 5 (or 6 for client 7) eligible peers
    ids, valid = algo.select(state, cids, rnd=4)
    assert valid.sum(1).tolist() == [5, 5, 5, 6]
    for r, c in enumerate(cids):
        assert sorted(ids[r][valid[r]].tolist()) == [j for j in range(6) if j != c]
    state["affinity"].zero_()  # all tied: the greedy pick is a random one of them, not always the same
    firsts = {int(algo.select(state, [0], rnd)[0][0, 0]) for rnd in range(1, 30)}
    assert len(firsts) > 1 and firsts <= {1, 2, 3, 4, 5}
    fresh = algo.init_server(torch.zeros(3))
    payloads = algo.payloads(fresh, cids, rnd=1)
    assert all(p["peers"].shape == (0, 3) and p["peer_ids"].shape == (0,) for p in payloads.values())


def test_exploring_picks_are_random_eligible_peers_reproducible_per_round():
    """epsilon = 1: every pick is a uniformly random distinct eligible peer (over 400 rounds each of client 0's five
    eligible peers is picked about 2/5 of the time), the same for the same (seed, round)."""
    cfg, data, model, algo = setup("partition.num_clients=8", "fedfomo.epsilon=1", "fedfomo.epsilon_decay=0",
                                   "fedfomo.models=2")
    state = selection_state(algo, 8)
    counts = np.zeros(8)
    for rnd in range(1, 401):
        ids, valid = algo.select(state, [0, 4], rnd)
        assert valid.all()
        for r, c in enumerate([0, 4]):
            picks = ids[r].tolist()
            assert len(set(picks)) == 2 and all(j < 6 and j != c for j in picks)
        counts[ids[0].numpy()] += 1
    assert counts[0] == 0 and counts[6:].sum() == 0
    assert np.allclose(counts[1:6] / 400, 0.4, atol=0.1)
    assert torch.equal(algo.select(state, [0, 4], 9)[0], algo.select(state, [0, 4], 9)[0])
    assert algo.epsilon(1) == 1.0
    algo.params.epsilon, algo.params.epsilon_decay = 0.3, 0.05
    assert [round(algo.epsilon(t), 10) for t in (1, 2, 6, 7, 30)] == [0.3, 0.25, 0.05, 0.0, 0.0]


def test_aggregate_stores_models_and_adds_affinity_rows():
    cfg, data, model, algo = setup("partition.num_clients=4", "fedfomo.affinity_update=normalized")
    state = algo.init_server(torch.zeros(model.size))
    up = {2: {"weights": torch.full((model.size,), 2.0), "affinity": torch.tensor([0.5, -1.5, 0.0, 0.0])},
          0: {"weights": torch.full((model.size,), 7.0), "affinity": torch.zeros(4)}}
    state = algo.aggregate(state, up, {2: 0.5, 0: 0.5}, 3)
    assert state["seen"].tolist() == [1, 0, 1, 0]
    assert (state["theta"][2] == 2).all() and (state["theta"][0] == 7).all() and (state["theta"][1] == 0).all()
    # official normalization: w / |sum w| = (0.5, -1.5) / 1
    assert state["affinity"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0.5, -1.5, 0, 0], [0, 0, 0, 0]]


def rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_run_end_to_end_resumes_identically_and_counts_the_downloaded_models(tmp_path):
    """5 clients, all in every round, M = 3: round 1 downloads nothing, rounds 2 and 3 three models each (four
    peers have uploaded): bytes down = 5 x 3 x (D + 1) x 4 (the models and their ids as float32); up = 5 x (D + N) x 4
    every round. Interrupted after round 2 (checkpoint at 1) and resumed, the run equals the uninterrupted one."""
    extra = ["partition.num_clients=5", "rounds=3", "checkpoint_every=1", "local.epochs=1", "fedfomo.models=3",
             "fedfomo.epsilon=0.5", "model.name=mlr"]  # MLR: the fit cohort trains in lockstep
    cfg = load_config(None, MNIST + extra, "fedfomo")
    run_experiment(cfg, tmp_path / "full", log=lambda s: None)
    run_experiment(cfg, tmp_path / "cut", log=lambda s: None, stop_after=2)
    assert len(rows(tmp_path / "cut" / "fedfomo")) == 2
    resume_experiment(tmp_path / "cut", log=lambda s: None)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]  # noqa: E731
    full = rows(tmp_path / "full" / "fedfomo")
    assert strip(rows(tmp_path / "cut" / "fedfomo")) == strip(full)
    a = torch.load(tmp_path / "cut" / "fedfomo" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "full" / "fedfomo" / "checkpoint.pt", weights_only=False)
    assert all(torch.equal(x["weights"], y["weights"]) for x, y in zip(a["clients"], b["clients"]))

    d = FlatModel(build_model(cfg.model, (1, 28, 28), 10, cfg.seed)).size
    assert [r["bytes_down"] for r in full] == [0, 5 * 3 * (d + 1) * 4, 5 * 3 * (d + 1) * 4]
    assert [r["bytes_up"] for r in full] == [5 * (d + 5) * 4] * 3
    affinity = np.load(tmp_path / "full" / "fedfomo" / "affinity.npz")["r00003"]
    assert affinity.shape == (5, 5) and np.all(np.diag(affinity) == 0) and np.count_nonzero(affinity) > 0
