"""FedProx, Per-FedAvg, pFedMe: their local rules, lockstep training equal to the per-client path, and the
evaluation rules (Per-FedAvg adapts on train data only)."""
from __future__ import annotations

import pytest
import torch

from pfedkit.algorithms import ALGORITHMS, Algorithm, Cohort
from pfedkit.config import load_config
from pfedkit.engine import Run
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.train import seeded_generator

SYNTH = ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=8", "model.name=dnn",
         "model.hidden=20", "dataset.synthetic.size_factor=1", "local.batch_size=20", "local.steps=6",
         "local.lr=0.05", "progress=false", "plots=false", "checkpoint_every=0"]


def setup(name: str, *extra: str):
    cfg = load_config(None, SYNTH + list(extra), name).for_algorithm(name)
    data = prepare(cfg)
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
    algo = ALGORITHMS[cfg.algorithm_name](cfg.params(cfg.algorithm_name), model, data.num_clients, cfg)
    return cfg, data, model, algo


def cohort_of(cfg, data, model, cids, rnd=1):
    return Cohort(cids, rnd, data, model, cfg.local, [seeded_generator(cfg.seed, rnd, c) for c in cids])


@pytest.mark.parametrize("name, extra", [
    ("fedavg", []), ("fedprox", ["fedprox.mu=0.5"]), ("local", []), ("pfedme", []), ("perfedavg", []),
    ("perfedavg", ["perfedavg.variant=hf", "perfedavg.beta=0.05"]),
    ("fedavg", ["local.steps=0", "local.epochs=1", "local.momentum=0.9", "local.weight_decay=0.01"]),
])
def test_lockstep_training_equals_the_per_client_path(name, extra):
    cfg, data, model, algo = setup(name, *extra)
    init = model.state()
    state = algo.init_server(init)
    cids = [0, 2, 3, 5, 7]
    cstates = [algo.init_client(c, init + 0.01 * c) for c in cids]
    payloads = algo.payloads(state, cids, 1)
    together, states_t = algo.client_update_many([payloads[c] for c in cids], cstates, cohort_of(cfg, data, model, cids))
    alone, states_a = Algorithm.client_update_many(algo, [payloads[c] for c in cids], cstates,
                                                   cohort_of(cfg, data, model, cids))
    for t, a in zip(together + states_t, alone + states_a):
        assert t.keys() == a.keys()
        for k in t:
            if isinstance(t[k], torch.Tensor):
                assert torch.allclose(t[k], a[k], atol=2e-5, rtol=1e-4), k
            elif isinstance(t[k], float):
                assert t[k] == pytest.approx(a[k], rel=1e-4), k


def test_fedprox_proximal_term_keeps_the_model_closer_to_the_global_one():
    cfg, data, model, fedavg = setup("fedavg")
    _, _, _, fedprox = setup("fedprox", "fedprox.mu=5.0")
    init = model.state()
    cids = [1, 4]
    moved = {}
    for algo in (fedavg, fedprox):
        out, _ = Algorithm.client_update_many(algo, [{"weights": init}] * 2, [{}] * 2,
                                              cohort_of(cfg, data, model, cids))
        moved[algo.name] = [float((u["weights"] - init).norm()) for u in out]
    assert all(p < a for p, a in zip(moved["fedprox"], moved["fedavg"]))


def test_pfedme_inner_solver_reaches_the_proximal_point_of_a_quadratic():
    _, _, _, algo = setup("pfedme", "pfedme.inner_steps=400", "pfedme.personal_lr=0.02", "pfedme.lamda=3",
                          "pfedme.mu=0.001")
    gen = torch.Generator().manual_seed(0)
    d = 6
    q = torch.randn(d, d, generator=gen, dtype=torch.float64)
    A = q @ q.T + torch.eye(d, dtype=torch.float64)  # f(theta) = 1/2 (theta - a)^T A (theta - a)
    a = torch.randn(d, generator=gen, dtype=torch.float64)
    w = torch.randn(d, generator=gen, dtype=torch.float64)
    theta, _ = algo.personal_steps(w.clone(), w, lambda th: (A @ (th - a), 0.0))
    p = algo.params
    # argmin f(theta) + lambda/2 |theta - w|^2 + mu/2 |theta|^2  solves (A + (lambda + mu) I) theta = A a + lambda w
    expected = torch.linalg.solve(A + (p.lamda + p.mu) * torch.eye(d, dtype=torch.float64), A @ a + p.lamda * w)
    assert torch.allclose(theta, expected, atol=1e-8)


def test_pfedme_all_clients_train_and_keep_their_personal_models(tmp_path):
    cfg = load_config(None, SYNTH + ["rounds=2", "clients_per_round=3"], "pfedme")
    run = Run(cfg.for_algorithm("pfedme"), prepare(cfg), tmp_path)
    init = run.model.state()
    run.run()
    assert all(not torch.equal(s["personal"], init) for s in run.cstates)  # every client trained
    rows = run.metrics
    assert all(r["clients"] == 8 and r["aggregated"] <= 3 for r in rows)
    assert rows[0]["bytes_up"] == 8 * run.model.size * 4  # every trained client uploads w_loc
    personal = torch.stack([s["personal"] for s in run.cstates])
    assert not torch.allclose(personal, run.state["weights"].expand_as(personal))


def test_pfedme_beta_mixes_the_old_global_model():
    _, _, model, algo = setup("pfedme", "pfedme.beta=0.25")
    w = torch.zeros(model.size)
    updates = {0: {"weights": torch.ones(model.size)}, 1: {"weights": 3 * torch.ones(model.size)}}
    new = algo.aggregate({"weights": w}, updates, {0: 0.5, 1: 0.5}, 1)["weights"]
    assert torch.allclose(new, torch.full((model.size,), 0.25 * 2.0))


def test_perfedavg_first_order_step_by_hand():
    cfg, data, model, algo = setup("perfedavg", "perfedavg.beta=0.1", "local.steps=1")
    init = model.state()
    cohort = cohort_of(cfg, data, model, [3])
    update, _ = algo.client_update({"weights": init}, {}, cohort.client(0))
    # by hand: theta' = theta - alpha grad f(theta; D1), theta <- theta - beta grad f(theta'; D2)
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    client = data.client(3)
    gen = seeded_generator(cfg.seed, 1, 3)
    perm = torch.randperm(client.num_train, generator=gen)
    b1, b2 = perm[:20], perm[20:40]

    def grad_at(params, idx):
        torch.nn.utils.vector_to_parameters(params, net.parameters())
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(client.x_train[idx]), client.y_train[idx]).backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    theta = init.clone()
    inner = theta - cfg.local.lr * grad_at(theta, b1)
    expected = theta - 0.1 * grad_at(inner, b2)
    assert torch.allclose(update["weights"], expected, atol=1e-6)


def test_perfedavg_hessian_free_differs_from_first_order():
    cfg, data, model, fo = setup("perfedavg", "perfedavg.beta=0.1", "local.steps=1")
    _, _, _, hf = setup("perfedavg", "perfedavg.beta=0.1", "local.steps=1", "perfedavg.variant=hf")
    init = model.state()
    a = fo.client_update({"weights": init}, {}, cohort_of(cfg, data, model, [2]).client(0))[0]["weights"]
    b = hf.client_update({"weights": init}, {}, cohort_of(cfg, data, model, [2]).client(0))[0]["weights"]
    assert not torch.allclose(a, b) and (a - b).norm() < (a - init).norm()  # a correction, not another step


def test_perfedavg_evaluation_adapts_on_train_data_only(tmp_path):
    cfg = load_config(None, SYNTH + ["rounds=1"], "perfedavg")
    data = prepare(cfg)
    run = Run(cfg.for_algorithm("perfedavg"), data, tmp_path)
    seen = []
    original = run.algo.adapt_many

    def spy(vectors, cohort):
        seen.append((cohort.data.x_test.numel(), len(cohort.cids), cohort.data.train_sizes[cohort.cids].min()))
        for i in range(len(cohort.cids)):
            assert cohort.client(i).data.x_test.numel() == 0 and cohort.client(i).data.num_train > 0
        return original(vectors, cohort)

    run.algo.adapt_many = spy
    run.run()
    assert seen and all(test == 0 and train > 0 for test, _, train in seen)  # the test split is out of reach
    assert sum(n for _, n, _ in seen) == 8  # every client adapts before it is evaluated
    # the adapted model is what is evaluated: it differs from the global model
    row = run.metrics[-1]
    assert row["personalized_acc"] != row["global_acc"]
    # and replacing every test sample leaves the adaptation unchanged
    before = original([run.state["weights"]] * 3, run._adapt_cohort(1, [2, 4, 6]))
    data.x_test.normal_()
    after = original([run.state["weights"]] * 3, Run(cfg.for_algorithm("perfedavg"), data, tmp_path / "b")
                     ._adapt_cohort(1, [2, 4, 6]))
    assert all(torch.equal(b, a) for b, a in zip(before, after))


@pytest.mark.parametrize("extra", [["perfedavg.adapt_steps=3"], ["local.steps=0", "local.epochs=1"]])
def test_lockstep_adaptation_equals_one_client_at_a_time(tmp_path, monkeypatch, extra):
    """Dense models let Per-FedAvg adapt a chunk of clients in lockstep before evaluation: the same metrics as
    adapting each client's model in turn."""
    from pfedkit.engine import evaluate
    from pfedkit.models import nets
    cfg = load_config(None, SYNTH + ["rounds=2", "eval_train=true", *extra], "perfedavg")
    data = prepare(cfg)
    run = Run(cfg.for_algorithm("perfedavg"), data, tmp_path)
    run.run()

    def score():
        return evaluate(run.algo, run.state, run.cstates, data, run.model, train_loss=True,
                        adapt_cohort=lambda cids: run._adapt_cohort(2, cids))

    lockstep = score()
    monkeypatch.delattr(nets.DNN, "forward_many")  # no batched path: one client at a time
    one_by_one = score()
    assert lockstep["per_client"] == pytest.approx(one_by_one["per_client"], abs=1e-12)
    for key, value in lockstep["row"].items():
        assert value == pytest.approx(one_by_one["row"][key], rel=1e-5, abs=1e-7), key
    assert lockstep["row"]["personalized_acc"] != lockstep["row"]["global_acc"]  # adaptation did something


def test_every_comparison_table_has_the_majority_label_row(tmp_path):
    from pfedkit.experiment import run_experiment
    cfg = load_config(None, SYNTH + ["rounds=1"], "fedavg")
    run_experiment(cfg, tmp_path, log=lambda s: None)
    table = (tmp_path / "comparison.md").read_text()
    assert "majority label (reference)" in table
