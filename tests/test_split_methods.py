"""FedBN, FedRep, FedTC: the methods that keep some layers on the client (algorithms/split.py). What stays personal
never crosses the network and is never overwritten; each local rule equals a plain PyTorch reference loop."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pfedkit.algorithms import build_algorithm
from pfedkit.config import load_config
from pfedkit.experiment import prepare, resume_experiment, run_experiment
from pfedkit.models import FlatModel, build_model
from pfedkit.train import Cohort, batch_indices, seeded_generator
from flat_layout import flat_params, load_params  # noqa: E402

MNIST = ["dataset.name=mnist5k", "partition.num_clients=4", "partition.classes_per_client=3",
         "partition.samples_per_client=120", "rounds=2", "clients_per_round=3", "local.epochs=1",
         "local.batch_size=32", "local.lr=0.05", "progress=false", "plots=false", "checkpoint_every=1",
         "fedrep.head_epochs=1", "fedrep.body_epochs=1"]


def rows(path):
    out = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "wall_s"} for r in out]


def setup(name, *extra, base=MNIST):
    cfg = load_config(None, base + list(extra), name).for_algorithm(name)
    data = prepare(cfg)
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
    return cfg, data, model, build_algorithm(cfg, model, data.num_clients)


def one_round(cfg, data, model, algo, cids, init_states=None, lockstep=None):
    init = model.state()
    state = algo.init_server(init)
    cstates = init_states or [algo.init_client(c, init) for c in cids]
    payloads = algo.payloads(state, cids, 1)
    cohort = Cohort(cids, 1, data, model, cfg.local, [seeded_generator(cfg.seed, 1, c) for c in cids], lockstep)
    updates, new_states = algo.client_update([payloads[c] for c in cids], cstates, cohort)
    return state, payloads, updates, new_states


def test_fedbn_never_sends_batchnorm_tensors_either_way(tmp_path):
    cfg = load_config(None, MNIST + ["model.name=cnn_bn"], "fedbn")
    run_experiment(cfg, tmp_path, log=lambda s: None)
    model = build_model(cfg.model, (1, 28, 28), 10, 0)
    non_bn = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("bn"))
    assert non_bn < sum(p.numel() for p in model.parameters())
    for r in rows(tmp_path / "fedbn"):
        assert r["bytes_up"] == r["bytes_down"] == 3 * 4 * non_bn  # 3 clients, float32, BN params and stats absent
    cfg1, data, flat, algo = setup("fedbn", "model.name=cnn_bn")
    _, payloads, updates, states = one_round(cfg1, data, flat, algo, [0, 1])
    for message in [*payloads.values(), *updates]:
        assert not any(k.startswith("bn") for k in message), message.keys()
    # each client's BN statistics are its own: trained on different data, they differ
    bn_stats = flat.mask([l for l in flat.layers if l.name == "bn1"])
    assert not torch.equal(states[0]["weights"][bn_stats], states[1]["weights"][bn_stats])


def test_fedbn_on_a_model_without_batchnorm_is_fedavg(tmp_path):
    cfg = load_config(None, MNIST + ["model.name=cnn"], "fedavg,fedbn")
    run_experiment(cfg, tmp_path, log=lambda s: None)
    keys = ("personalized_acc", "personalized_acc_std", "personalized_train_loss", "train_loss", "bytes_up",
            "bytes_down", "clients", "aggregated")
    fedavg, fedbn = rows(tmp_path / "fedavg"), rows(tmp_path / "fedbn")
    assert [{k: r.get(k) for k in keys} for r in fedbn] == [{k: r.get(k) for k in keys} for r in fedavg]
    assert fedavg[-1]["personalized_acc"] == fedavg[-1]["global_acc"]


def reference_fedrep(model, x, y, batches_head, batches_body, lr):
    """FedRep's local rule in plain PyTorch: SGD on the head only, then on the body only."""
    head = list(model.fc3.parameters())
    body = [p for n, p in model.named_parameters() if not n.startswith("fc3")]
    for params, batches in ((head, batches_head), (body, batches_body)):
        opt = torch.optim.SGD(params, lr=lr)
        for idx in batches:
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return flat_params(model)


def test_fedrep_trains_the_head_then_the_body_and_keeps_the_head_home():
    cfg, data, model, algo = setup("fedrep", "model.name=cnn", "fedrep.head_epochs=2", "fedrep.body_epochs=1")
    init = model.state()
    head = algo.split.param_mask(["fc3"]).bool()
    own_head = init.clone()
    own_head[:model.param_size][head] += 0.05  # the client's own head differs from the server's
    state, payloads, updates, states = one_round(cfg, data, model, algo, [2], [{"weights": own_head}])
    assert "fc3" not in payloads[2] and "fc3" not in updates[0]  # the head never leaves the client
    assert set(updates[0]) - {"num_samples", "train_loss"} == {"conv1", "conv2", "fc1", "fc2"}
    # reference: the client's model from its own head and the server's body, trained by torch.optim.SGD
    ref = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    load_params(own_head[:model.param_size].clone(), ref)
    gen = seeded_generator(cfg.seed, 1, 2)
    n, hp = int(data.train_sizes[2]), cfg.local
    from dataclasses import replace
    head_batches = list(batch_indices(n, replace(hp, epochs=2), gen, torch.device("cpu")))
    body_batches = list(batch_indices(n, replace(hp, epochs=1), gen, torch.device("cpu")))
    c = data.client(2)
    want = reference_fedrep(ref, c.x_train, c.y_train, head_batches, body_batches, hp.lr)
    got = states[0]["weights"][:model.param_size]
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(updates[0]["fc1"], got[algo.split.slices["fc1"]])


@pytest.mark.parametrize("phase", ["head", "body"])
def test_fedrep_frozen_part_does_not_move(phase):
    epochs = ["fedrep.head_epochs=1", "fedrep.body_epochs=0"] if phase == "head" else \
        ["fedrep.head_epochs=0", "fedrep.body_epochs=1"]
    cfg, data, model, algo = setup("fedrep", "model.name=cnn", "local.momentum=0.9", "local.weight_decay=0.01", *epochs)
    init = model.state()
    _, _, _, states = one_round(cfg, data, model, algo, [0])
    head = algo.split.param_mask(["fc3"]).bool()
    moved = states[0]["weights"][:model.param_size] != init[:model.param_size]
    frozen = ~head if phase == "head" else head
    assert not moved[frozen].any() and moved[~frozen].any()


def reference_fedtc(model_p, model_g, head, x, y, batches, lr, weight):
    """Two classifiers on one extractor in plain PyTorch: model_g's extractor is tied to model_p's, one SGD over
    the extractor and both classifiers on CE(personal) + weight * CE(global)."""
    for name, p in model_p.named_parameters():
        if not name.startswith(head):
            module, attr = name.rsplit(".", 1)
            setattr(model_g.get_submodule(module), attr, p)
    params = list(model_p.parameters()) + list(model_g.get_submodule(head).parameters())
    opt = torch.optim.SGD(params, lr=lr)
    for idx in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model_p(x[idx]), y[idx]) + weight * F.cross_entropy(model_g(x[idx]), y[idx])
        loss.backward()
        opt.step()
    personal = flat_params(model_p)
    shared = flat_params(model_g)
    return personal, shared


SYNTH = ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=6", "model.name=dnn",
         "model.hidden=20", "dataset.synthetic.size_factor=1", "local.batch_size=20", "local.steps=5",
         "local.lr=0.05", "progress=false", "plots=false"]


@pytest.mark.parametrize("base, lockstep", [(SYNTH, True), (SYNTH, False)])
def test_fedtc_local_rule_is_the_two_classifier_loss_and_keeps_the_personal_classifier(base, lockstep):
    cfg, data, model, algo = setup("fedtc", "fedtc.global_head_weight=0.5", base=base)
    head_name = model.head_layers[0].name
    init = model.state()
    head = algo.split.param_mask([head_name]).bool()
    own = init.clone()
    own[:model.param_size][head] = torch.randn(int(head.sum()), generator=torch.Generator().manual_seed(3))
    own[:model.param_size][~head] += 0.3  # a stale local extractor: overwritten by the global one on receipt
    cids = [0, 1, 2, 4]
    state, payloads, updates, states = one_round(cfg, data, model, algo, cids, [{"weights": own.clone()} for _ in cids],
                                                 lockstep=lockstep)
    assert head_name in payloads[0]  # the global classifier goes down (and comes back updated)
    for i, c in enumerate(cids):
        ref_p = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
        ref_g = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
        personal = init[:model.param_size].clone()
        personal[head] = own[:model.param_size][head]
        load_params(personal, ref_p)
        load_params(init[:model.param_size].clone(), ref_g)
        batches = list(batch_indices(int(data.train_sizes[c]), cfg.local, seeded_generator(cfg.seed, 1, c),
                                     torch.device("cpu")))
        d = data.client(c)
        want_personal, want_shared = reference_fedtc(ref_p, ref_g, head_name, d.x_train, d.y_train, batches,
                                                     cfg.local.lr, 0.5)
        assert torch.allclose(states[i]["weights"], want_personal, atol=1e-5)
        sent = torch.cat([updates[i][n] for n, _ in algo.split.shared])
        assert torch.allclose(sent, want_shared, atol=1e-5)
        # evaluated with the latest global extractor and the client's own (never overwritten) classifier
        evaluated = algo.evaluated_models([payloads[c]], [states[i]], None)[0]
        assert torch.equal(evaluated[:model.param_size][head], states[i]["weights"][head])
        assert torch.equal(evaluated[:model.param_size][~head], init[:model.param_size][~head])


def test_fedtc_server_never_overwrites_the_personal_classifier(tmp_path):
    cfg = load_config(None, MNIST + ["model.name=cnn", "rounds=3"], "fedtc")
    run_experiment(cfg, tmp_path, log=lambda s: None)
    ckpt = torch.load(tmp_path / "fedtc" / "checkpoint.pt", weights_only=True)
    model = FlatModel(build_model(cfg.model, (1, 28, 28), 10, 0))
    s = dict((n, sl) for n, sl, _ in model.names)["fc3.weight"]
    global_head = ckpt["server"]["weights"][s]
    trained = [c["weights"][s] for c in ckpt["clients"]]
    assert all(not torch.equal(h, global_head) for h in trained)
    r = rows(tmp_path / "fedtc")[-1]
    assert r["global_acc"] is not None and r["personalized_acc"] != r["global_acc"]


@pytest.mark.parametrize("model_name", ["cnn_bn"])
def test_split_methods_run_and_resume_identically(tmp_path, model_name):
    cfg = load_config(None, MNIST + [f"model.name={model_name}", "rounds=3"], "fedbn,fedrep,fedtc")
    run_experiment(cfg, tmp_path / "full", log=lambda s: None)
    run_experiment(cfg, tmp_path / "cut", log=lambda s: None, stop_after=2)
    resume_experiment(tmp_path / "cut", log=lambda s: None)
    for name in ("fedbn", "fedrep", "fedtc"):
        assert rows(tmp_path / "cut" / name) == rows(tmp_path / "full" / name), name
        assert len(rows(tmp_path / "full" / name)) == 3
