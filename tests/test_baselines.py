"""FedProx, Per-FedAvg, pFedMe: their local rules, lockstep training equal to the per-client path, and the
evaluation rules (Per-FedAvg adapts on train data only)."""
from __future__ import annotations


import pytest
import torch

from pfedkit.algorithms import build_algorithm
from pfedkit.train import Cohort
from pfedkit.config import RuntimeConfig, load_config
from pfedkit.engine import Run
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.train import seeded_generator
from flat_layout import flat_params, flat_state, load_params  # noqa: E402

SYNTH = ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=8", "model.name=dnn",
         "model.hidden=20", "dataset.synthetic.size_factor=1", "local.batch_size=20", "local.steps=6",
         "local.lr=0.05", "progress=false", "plots=false", "checkpoint_every=0"]


def setup(name: str, *extra: str):
    cfg = load_config(None, SYNTH + list(extra), name).for_algorithm(name)
    data = prepare(cfg)
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
    return cfg, data, model, build_algorithm(cfg, model, data.num_clients)


def cohort_of(cfg, data, model, cids, rnd=1, lockstep=None, workers=1):
    """workers=1: one client after another, as a Flower ClientApp trains its client."""
    return Cohort(cids, rnd, data, model, cfg.local, [seeded_generator(cfg.seed, rnd, c) for c in cids], lockstep,
                  RuntimeConfig(workers=workers))


def assert_same_messages(got, want, exact):
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            if exact:
                assert torch.equal(g[k], w[k]) if isinstance(g[k], torch.Tensor) else g[k] == w[k], k
            elif isinstance(g[k], torch.Tensor):
                assert torch.allclose(g[k], w[k], atol=2e-5, rtol=1e-4), k
            else:
                assert g[k] == pytest.approx(w[k], rel=1e-4), k


@pytest.mark.parametrize("name, extra", [
    ("fedavg", []), ("fedprox", ["fedprox.mu=0.5"]), ("local", []),
    ("pfedme", ["pfedme.personal_lr=0.01", "pfedme.lamda=20"]), ("perfedavg", []),  # pFedMe's Synthetic setting
    ("perfedavg", ["perfedavg.variant=hf", "perfedavg.beta=0.05"]),
    ("fedavg", ["local.steps=0", "local.epochs=1", "local.momentum=0.9", "local.weight_decay=0.01"]),
])
def test_lockstep_training_equals_the_per_client_path(name, extra):
    """One client path per algorithm, four ways to run it: the cohort in lockstep (batched products: a dense model's
    arithmetic, whatever the cohort), each client alone in a cohort of one (a Flower ClientApp), and, forced, the
    cohort one client after another through the model's own forward, and side by side (two clients at a time, one
    thread each). In lockstep and alone are the same arithmetic: bit-identical; the forced per-client path
    reorders the products and side by side runs them on fewer threads: equal to float tolerance."""
    cfg, data, model, algo = setup(name, *extra)
    init = model.state()
    state = algo.init_server(init)
    cids = [0, 2, 3, 5, 7]
    cstates = [algo.init_client(c, init + 0.01 * c) for c in cids]
    payloads = [algo.payloads(state, cids, 1)[c] for c in cids]
    lockstep = algo.client_update(payloads, cstates, cohort_of(cfg, data, model, cids, lockstep=True))
    in_turn = algo.client_update(payloads, cstates, cohort_of(cfg, data, model, cids, lockstep=False))
    alone = [algo.client_update([p], [s], cohort_of(cfg, data, model, [c])) for c, p, s in zip(cids, payloads, cstates)]
    alone_updates, alone_states = [u for (u,), _ in alone], [s for _, (s,) in alone]
    assert_same_messages(lockstep[0] + lockstep[1], alone_updates + alone_states, exact=True)
    assert_same_messages(lockstep[0] + lockstep[1], in_turn[0] + in_turn[1], exact=False)
    side = algo.client_update(payloads, cstates, cohort_of(cfg, data, model, cids, lockstep=False, workers=2))
    assert_same_messages(side[0] + side[1], in_turn[0] + in_turn[1], exact=False)
    moved = [u["weights"] for u in in_turn[0]] if "weights" in in_turn[0][0] else [s["weights"] for s in in_turn[1]]
    assert all(not torch.equal(m, init) for m in moved)  # training did something to compare


def test_fedprox_proximal_term_keeps_the_model_closer_to_the_global_one():
    cfg, data, model, fedavg = setup("fedavg")
    _, _, _, fedprox = setup("fedprox", "fedprox.mu=5.0")
    init = model.state()
    cids = [1, 4]
    moved = {}
    for algo in (fedavg, fedprox):
        out, _ = algo.client_update([{"weights": init}] * 2, [{}] * 2, cohort_of(cfg, data, model, cids))
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
    w = torch.full((model.size,), 4.0)
    updates = {0: {"weights": torch.ones(model.size)}, 1: {"weights": 3 * torch.ones(model.size)},
               2: {"weights": 100 * torch.ones(model.size)}}  # trained, not sampled: no part in the mix
    new = algo.aggregate({"weights": w}, updates, {0: 0.25, 1: 0.75}, 1)["weights"]
    # (1 - beta) w + beta (0.25 * 1 + 0.75 * 3) = 0.75 * 4 + 0.25 * 2.5
    assert torch.allclose(new, torch.full((model.size,), 0.75 * 4.0 + 0.25 * 2.5))


def test_perfedavg_first_order_step_by_hand():
    cfg, data, model, algo = setup("perfedavg", "perfedavg.beta=0.1", "local.steps=1")
    init = model.state()
    cohort = cohort_of(cfg, data, model, [3])
    (update,), _ = algo.client_update([{"weights": init}], [{}], cohort)
    # by hand: theta' = theta - alpha grad f(theta; D1), theta <- theta - beta grad f(theta'; D2)
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    client = data.client(3)
    gen = seeded_generator(cfg.seed, 1, 3)
    perm = torch.randperm(client.num_train, generator=gen)
    b1, b2 = perm[:20], perm[20:40]

    def grad_at(params, idx):
        load_params(params, net)
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(client.x_train[idx]), client.y_train[idx]).backward()
        return flat_params(net, grads=True)

    theta = init.clone()
    inner = theta - cfg.local.lr * grad_at(theta, b1)
    expected = theta - 0.1 * grad_at(inner, b2)
    assert torch.allclose(update["weights"], expected, atol=1e-6)


def plain_loss(cfg, data, dtype=torch.float64):
    """f(params; batch) of the run's model as a function of one flat parameter vector (torch.func, no FlatModel):
    the mean cross-entropy on a batch, in `dtype`."""
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed).to(dtype)
    shapes = [(name, p.shape, p.numel()) for name, p in net.named_parameters()]

    def f(params, x, y):
        tensors, at = {}, 0
        for name, shape, k in shapes:
            tensors[name] = params[at: at + k].reshape(shape)
            at += k
        return torch.nn.functional.cross_entropy(torch.func.functional_call(net, tensors, (x.to(dtype),)), y)
    return f


def reference_stream(n: int, b: int, steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    """A client's mini-batch stream as specified: successive seeded permutations of its n samples, each cut into
    batches of b (the last one of a pass shorter), `steps` batches in all."""
    out: list[torch.Tensor] = []
    while len(out) < steps:
        perm = torch.randperm(n, generator=gen)
        out += [perm[s: s + b] for s in range(0, n, b)]
    return out[:steps]


# alpha from local.lr (FL-bench's and the pFedMe code's), or its own key beside another local.lr
ALPHA_FROM = [["local.lr={}"], ["perfedavg.alpha={}", "local.lr=0.3"]]


@pytest.mark.parametrize("alpha_from", ALPHA_FROM, ids=["local.lr", "perfedavg.alpha"])
def test_perfedavg_hessian_free_steps_by_hand(alpha_from):
    """Two HF meta-steps: theta' = theta0 - alpha grad f(theta0; D1), g = grad f(theta'; D2),
    h = Hessian f(theta0; D3) g (here exact, by autograd's hvp: the library's finite difference converges to it),
    theta = theta0 - beta (g - alpha h). Each step takes three fresh batches of the client's stream."""
    alpha, beta = 0.05, 0.5
    cfg, data, model, algo = setup("perfedavg", "model.name=mlr", "perfedavg.variant=hf", f"perfedavg.beta={beta}",
                                   *(s.format(alpha) for s in alpha_from), "local.steps=2")
    cid, rnd = 6, 1
    init = model.state()
    (update,), _ = algo.client_update([{"weights": init}], [{}], cohort_of(cfg, data, model, [cid], rnd))

    f = plain_loss(cfg, data)
    client = data.client(cid)
    batches = reference_stream(client.num_train, cfg.local.batch_size, 6, seeded_generator(cfg.seed, rnd, cid))

    def on(idx):
        return lambda params: f(params, client.x_train[idx], client.y_train[idx])

    theta = init.double()
    first_losses, corrections = [], []
    for s in range(2):
        d1, d2, d3 = batches[3 * s: 3 * s + 3]
        first_losses.append(float(on(d1)(theta)))
        inner = theta - alpha * torch.func.grad(on(d1))(theta)
        g = torch.func.grad(on(d2))(inner)
        _, h = torch.autograd.functional.hvp(on(d3), theta, g)
        corrections.append(beta * alpha * h)
        theta = theta - beta * (g - alpha * h)
    assert torch.allclose(update["weights"].double(), theta, atol=2e-5)
    # the Hessian term is far above that tolerance, so a step without it or with its sign flipped cannot pass
    assert min(float(c.abs().max()) for c in corrections) > 100 * 2e-5
    # the second loss is taken at the float32 theta after one meta-step, which sits up to the 2e-5 above from the
    # float64 one: 1.2e-5 relative measured on one CPU; a loss of another batch or point is ~1e-2 off
    assert update["train_loss"] == pytest.approx(sum(first_losses) / 2, rel=5e-5)
    assert update["num_samples"] == client.num_train


@pytest.mark.parametrize("variant, k", [("fo", 2), ("hf", 3)])
def test_perfedavg_epochs_give_ceil_of_the_epochs_batches_over_batches_per_step(variant, k):
    """With `local.epochs`, the meta-step count is ceil(epochs * ceil(n / b) / k): client 4 has n = 48, b = 20,
    so one epoch is 3 batches, i.e. 2 FO steps (4 batches, the 4th from the next permutation) or 1 HF step."""
    cfg, data, model, algo = setup("perfedavg", "model.name=mlr", f"perfedavg.variant={variant}",
                                   "perfedavg.beta=0.05", "local.lr=0.05", "local.steps=0", "local.epochs=1")
    cid = 4
    client = data.client(cid)
    assert client.num_train == 48 and cfg.local.batch_size == 20
    steps = -(-3 // k)
    init = model.state()
    (update,), _ = algo.client_update([{"weights": init}], [{}], cohort_of(cfg, data, model, [cid]))

    f = plain_loss(cfg, data)
    batches = reference_stream(48, 20, steps * k, seeded_generator(cfg.seed, 1, cid))

    def on(idx):
        return lambda params: f(params, client.x_train[idx], client.y_train[idx])

    theta = init.double()
    for s in range(steps):
        d = batches[k * s: k * s + k]
        g = torch.func.grad(on(d[1]))(theta - 0.05 * torch.func.grad(on(d[0]))(theta))
        if variant == "hf":
            g = g - 0.05 * torch.autograd.functional.hvp(on(d[2]), theta, g)[1]
        assert float((0.05 * g).abs().max()) > 100 * 2e-5  # every step moves theta: one step less cannot pass
        theta = theta - 0.05 * g
    assert torch.allclose(update["weights"].double(), theta, atol=2e-5)


@pytest.mark.parametrize("R, K", [(4, 3), (1, 1)])
@pytest.mark.parametrize("cids", [[4], [0, 2, 4, 5]], ids=["one client", "lockstep"])
def test_pfedme_local_update_is_the_official_solver(cids, R, K):
    """pFedMe's local solver written out for R batches x K steps, with eta != personal_lr:
    theta and w_loc start at w; per batch, K times theta <- theta - plr (grad f(theta) + lambda (theta - w_loc)
    + mu theta), then w_loc <- w_loc - eta lambda (w_loc - theta). The client uploads w_loc and keeps theta.
    Client 4 has 48 samples in batches of 20: its 4th batch comes from the next permutation."""
    eta, plr, lam, mu = 0.03, 0.01, 20.0, 0.001
    cfg, data, model, algo = setup("pfedme", f"pfedme.eta={eta}", f"pfedme.personal_lr={plr}", f"pfedme.lamda={lam}",
                                   f"pfedme.mu={mu}", f"pfedme.local_rounds={R}", f"pfedme.inner_steps={K}")
    init = model.state()
    updates, states = algo.client_update([{"weights": init}] * len(cids),
                                              [algo.init_client(c, init) for c in cids],
                                              cohort_of(cfg, data, model, cids))
    f = plain_loss(cfg, data)
    for cid, update, cstate in zip(cids, updates, states):
        client = data.client(cid)
        theta, w_loc = init.double(), init.double()
        losses = []
        for idx in reference_stream(client.num_train, cfg.local.batch_size, R, seeded_generator(cfg.seed, 1, cid)):
            x, y = client.x_train[idx], client.y_train[idx]
            for _ in range(K):
                losses.append(float(f(theta, x, y)))
                g = torch.func.grad(f)(theta, x, y)
                theta = theta - plr * (g + lam * (theta - w_loc) + mu * theta)
            w_loc = w_loc - eta * lam * (w_loc - theta)
        assert torch.allclose(update["weights"].double(), w_loc, atol=1e-5), cid
        assert torch.allclose(cstate["personal"].double(), theta, atol=1e-5), cid
        assert update["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
        assert update["num_samples"] == client.num_train


@pytest.mark.parametrize("cids", [[4], [0, 2, 4, 5]], ids=["one client", "lockstep"])
def test_fedprox_local_update_is_sgd_with_the_proximal_term(cids):
    """FedProx's local step: theta <- theta - lr (grad f(theta) + mu (theta - w)) on each of the
    client's 6 batches, w the global model it was sent."""
    mu, lr, steps = 1.0, 0.05, 6
    cfg, data, model, algo = setup("fedprox", f"fedprox.mu={mu}", f"local.lr={lr}", f"local.steps={steps}")
    w = model.state()
    updates, _ = algo.client_update([{"weights": w}] * len(cids), [{} for _ in cids],
                                         cohort_of(cfg, data, model, cids))
    f = plain_loss(cfg, data)
    for cid, update in zip(cids, updates):
        client = data.client(cid)
        theta, w64, losses = w.double(), w.double(), []
        for idx in reference_stream(client.num_train, 20, steps, seeded_generator(cfg.seed, 1, cid)):
            x, y = client.x_train[idx], client.y_train[idx]
            losses.append(float(f(theta, x, y)))
            theta = theta - lr * (torch.func.grad(f)(theta, x, y) + mu * (theta - w64))
        assert torch.allclose(update["weights"].double(), theta, atol=1e-6), cid
        assert update["train_loss"] == pytest.approx(sum(losses) / steps, rel=1e-5)
        assert update["num_samples"] == client.num_train


def test_perfedavg_evaluation_adapts_on_train_data_only(tmp_path):
    from pfedkit.engine.clients import eval_vectors
    cfg = load_config(None, SYNTH + ["rounds=1"], "perfedavg")
    data = prepare(cfg)
    run = Run(cfg.for_algorithm("perfedavg"), data, tmp_path)
    seen = []
    original = run.algo.evaluated_models

    def spy(payloads, cstates, cohort):
        seen.append((cohort.data.x_test.numel(), len(cohort.cids), cohort.data.train_sizes[cohort.cids].min()))
        for i in range(len(cohort.cids)):
            assert cohort.client(i).x_test.numel() == 0 and cohort.client(i).num_train > 0
        return original(payloads, cstates, cohort)

    run.algo.evaluated_models = spy
    run.run()
    assert seen and all(test == 0 and train > 0 for test, _, train in seen)  # the test split is out of reach
    assert sum(n for _, n, _ in seen) == 8  # every client adapts before it is evaluated
    # the adapted model is what is evaluated: it differs from the global model
    row = run.metrics[-1]
    assert row["personalized_acc"] != row["global_acc"]
    # and replacing every test sample leaves the adaptation unchanged
    w = run.state["weights"]

    def adapted(d):
        return eval_vectors(run.algo, d.train_only(), run.model, cfg.local, cfg.seed, 1, [2, 4, 6],
                            [{"weights": w}] * 3, [{}] * 3)
    before = adapted(data)
    data.x_test.normal_()
    after = adapted(data)
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    assert not any(torch.equal(b, w) for b in before)


@pytest.mark.parametrize("extra", [["perfedavg.adapt_steps=3"], ["local.steps=0", "local.epochs=1"]])
def test_lockstep_adaptation_equals_one_client_at_a_time(tmp_path, monkeypatch, extra):
    """Dense models let Per-FedAvg adapt a chunk of clients in lockstep before evaluation: the same metrics as
    adapting each client's model in turn."""
    from pfedkit.models import nets
    cfg = load_config(None, SYNTH + ["rounds=2", "eval_train=true", *extra], "perfedavg")
    data = prepare(cfg)
    run = Run(cfg.for_algorithm("perfedavg"), data, tmp_path)
    run.run()
    lockstep = run._scores(2, True)
    monkeypatch.delattr(nets.DNN, "forward_many")  # no batched path: one client at a time
    one_by_one = run._scores(2, True)
    assert lockstep[1] == pytest.approx(one_by_one[1], abs=1e-12)
    for key, value in lockstep[0].items():
        assert value == pytest.approx(one_by_one[0][key], rel=1e-5, abs=1e-7), key
    assert lockstep[0]["personalized_acc"] != lockstep[0]["global_acc"]  # adaptation did something


def test_every_comparison_table_has_the_majority_label_row(tmp_path):
    from pfedkit.experiment import run_experiment
    cfg = load_config(None, SYNTH + ["rounds=1"], "fedavg")
    run_experiment(cfg, tmp_path, log=lambda s: None)
    table = (tmp_path / "comparison.md").read_text()
    assert "majority label (reference)" in table


IMAGES = ["dataset.name=mnist5k", "partition.scheme=iid", "partition.num_clients=2", "partition.samples_per_client=60",
          "model.name=cnn_bn", "local.batch_size=20", "progress=false", "plots=false", "checkpoint_every=0"]


def image_setup(name: str, *extra: str):
    cfg = load_config(None, IMAGES + list(extra), name).for_algorithm(name)
    data = prepare(cfg)
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
    return cfg, data, model, build_algorithm(cfg, model, data.num_clients)


@pytest.mark.parametrize("gradient", ["personal", "local"])
def test_pfedcs_representative_gradient_is_the_personal_models_move(gradient):
    """pfedcs.gradient=personal: the update carries theta~ - w over the parameters only (BatchNorm statistics are no
    gradient); `local` sends none (the engine then takes w_loc - w). On a BatchNorm CNN (the per-client path), one
    batch and one step: the reported loss is the loss of w on that batch."""
    cfg, data, model, algo = image_setup("pfedcs", f"pfedcs.gradient={gradient}", "pfedcs.local_rounds=1",
                                         "pfedcs.inner_steps=1")
    w = model.state()
    P = model.param_size
    assert P < model.size  # the vector also holds BN statistics
    (update,), (cstate,) = algo.client_update([{"weights": w}], [algo.init_client(0, w)],
                                                   cohort_of(cfg, data, model, [0]))
    if gradient == "personal":
        assert update["gradient"].shape == (P,)
        assert torch.allclose(update["gradient"], cstate["personal"][:P] - w[:P])
    else:
        assert "gradient" not in update
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    net.train()
    client = data.client(0)
    idx = reference_stream(client.num_train, 20, 1, seeded_generator(cfg.seed, 1, 0))[0]
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(net(client.x_train[idx]), client.y_train[idx]))
    assert update["train_loss"] == pytest.approx(loss, rel=1e-5)


def test_local_on_a_batchnorm_cnn_is_plain_sgd_on_the_clients_own_model():
    """Local trains each client's own model: here two steps of SGD on client 1's stream, on a model
    that cannot train in lockstep (BatchNorm), equal to torch.optim.SGD on the same batches."""
    cfg, data, model, algo = image_setup("local", "local.steps=2", "local.lr=0.1")
    init = model.state()
    states = [algo.init_client(c, init) for c in (0, 1)]
    updates, new_states = algo.client_update([{}, {}], states, cohort_of(cfg, data, model, [0, 1]))
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    client = data.client(1)
    losses = []
    for idx in reference_stream(client.num_train, 20, 2, seeded_generator(cfg.seed, 1, 1)):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(client.x_train[idx]), client.y_train[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    want = flat_state(net)
    assert torch.allclose(new_states[1]["weights"], want, atol=1e-5)
    assert updates[1] == {"num_samples": client.num_train, "train_loss": pytest.approx(sum(losses) / 2, rel=1e-5)}


@pytest.mark.parametrize("alpha_from", ALPHA_FROM, ids=["local.lr", "perfedavg.alpha"])
@pytest.mark.parametrize("epochs", [0, 1], ids=["adapt_steps", "adapt_epochs"])
@pytest.mark.parametrize("cids", [[3], [0, 2, 3, 5]], ids=["one client", "lockstep"])
def test_perfedavg_adaptation_is_adapt_steps_of_sgd_on_the_train_stream(cids, epochs, alpha_from):
    """Before evaluation Per-FedAvg adapts the global model with `adapt_steps` plain SGD steps of alpha (its own
    key, else local.lr) on batches of local.batch_size from the client's evaluation stream, seeded (seed, round,
    client, 0xE7A1); with `adapt_epochs` = 1, one pass: ceil(n / b) steps, the last batch shorter."""
    lr, b, steps, rnd = 0.1, 15, 2, 3
    cfg, data, model, algo = setup("perfedavg", *(s.format(lr) for s in alpha_from), f"local.batch_size={b}",
                                   f"perfedavg.adapt_steps={steps}", f"perfedavg.adapt_epochs={epochs}")
    w = model.state()
    train_only = data.train_only()
    cohort = Cohort(cids, rnd, train_only, model, cfg.local, [seeded_generator(cfg.seed, rnd, c, 0xE7A1) for c in cids])
    adapted = algo.evaluated_models([{"weights": w}] * len(cids), [{}] * len(cids), cohort)
    f = plain_loss(cfg, data)
    for cid, got in zip(cids, adapted):
        client = data.client(cid)
        theta = w.double()
        n = -(-client.num_train // b) if epochs else steps
        assert n > steps or not epochs  # the epoch is more than adapt_steps: the option is seen
        for idx in reference_stream(client.num_train, b, n, seeded_generator(cfg.seed, rnd, cid, 0xE7A1)):
            theta = theta - lr * torch.func.grad(f)(theta, client.x_train[idx], client.y_train[idx])
        assert torch.allclose(got.double(), theta, atol=1e-6), cid


def test_perfedavg_meta_step_count():
    """local.steps > 0: that many meta-steps; local.epochs: ceil(epochs * ceil(n / b) / k), k = 2 (FO) or 3 (HF)."""
    from pfedkit.config import LocalConfig
    _, _, _, fo = setup("perfedavg")
    _, _, _, hf = setup("perfedavg", "perfedavg.variant=hf")
    epochs3 = LocalConfig(epochs=3, steps=0, batch_size=20)
    assert fo.meta_steps(21, epochs3) == 3 and hf.meta_steps(21, epochs3) == 2  # 3 epochs x 2 batches = 6 batches
    assert fo.meta_steps(40, epochs3) == 3 and hf.meta_steps(40, epochs3) == 2
    assert fo.meta_steps(5, LocalConfig(epochs=1, steps=0, batch_size=20)) == 1  # fewer batches than a step needs
    assert fo.meta_steps(500, LocalConfig(epochs=1, steps=4, batch_size=20)) == 4


def test_pfedcs_personal_gradient_in_lockstep():
    """The same message from the lockstep path (a dense model, four clients): gradient = theta~ - w per client."""
    cfg, data, model, algo = setup("pfedcs", "pfedcs.gradient=personal", "pfedcs.local_rounds=2",
                                   "pfedcs.inner_steps=2")
    w = model.state()
    cids = [0, 2, 4, 5]
    updates, states = algo.client_update([{"weights": w}] * 4, [algo.init_client(c, w) for c in cids],
                                              cohort_of(cfg, data, model, cids))
    for update, cstate in zip(updates, states):
        assert torch.allclose(update["gradient"], cstate["personal"] - w)
        assert float(update["gradient"].abs().max()) > 1e-4


def test_pfedme_local_epochs_make_r_cover_passes_over_each_clients_data():
    """`pfedme.local_epochs` E: R = E x ceil(n_i / B) batches for client i (the pFedLA tables' local epochs), in
    place of the fixed `local_rounds`."""
    cfg, data, model, algo = setup("pfedme", "pfedme.local_epochs=3")
    cids = [0, 5]
    stream = cohort_of(cfg, data, model, cids).stream(algo.plan(cfg.local))
    sizes = [int(data.train_sizes[c]) for c in cids]
    want = [3 * -(-n // cfg.local.batch_size) for n in sizes]
    assert sizes[0] != sizes[1] and stream.steps == max(want)
    assert [int(stream.mask[:, k].sum(1).gt(0).sum()) for k in range(len(cids))] == want
