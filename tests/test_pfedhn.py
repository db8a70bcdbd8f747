"""pFedHN: the batched server against a plain per-client hypernetwork loop and torch's optimizers, one round lowering
a client's loss at its newly generated model, the clipped inner SGD against torch, and end-to-end runs on mnist5k
(resume, pFedHN-PC with BN statistics kept on the client)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pfedkit.algorithms.pfedhn  # noqa: F401  registers pfedhn
from pfedkit.algorithms.base import make_update
from pfedkit.algorithms.pfedhn import PFedHN
from pfedkit.config import LocalConfig, load_config
from pfedkit.engine import TIMING_KEYS, Run
from pfedkit.experiment import prepare, resume_experiment, run_experiment
from pfedkit.models import FlatModel, build_model
from pfedkit.train import Objective, predict, seeded_generator, sgd
from test_baselines import cohort_of, setup
from flat_layout import flat_params, load_params  # noqa: E402

N = 6


def make_algo(model="cnn", **params):
    cfg = load_config(None, [f"model.name={model}"] + [f"pfedhn.{k}={v}" for k, v in params.items()], "pfedhn")
    fm = FlatModel(build_model(cfg.model, (1, 28, 28), 10, 0).double())
    algo = PFedHN(cfg.params("pfedhn"), fm, N, cfg.seed)
    return algo, algo.init_server(fm.state()), fm


class ReferenceHN(nn.Module):
    """The official CNNHyper written plainly: nn.Embedding, the MLP, one nn.Linear per generated tensor; loaded
    from the stacked tensors (the heads' rows in the model's parameter order, personal tensors skipped)."""

    def __init__(self, hn: dict, targets: list[tuple[slice, torch.Size]], n_hidden: int):
        super().__init__()
        self.emb = nn.Embedding(*hn["emb"].shape).double()
        self.emb.weight.data = hn["emb"].clone()
        layers = []
        for i in range(n_hidden + 1):
            if i > 0:
                layers.append(nn.ReLU())
            lin = nn.Linear(hn[f"w{i}"].shape[1], hn[f"w{i}"].shape[0]).double()
            lin.weight.data, lin.bias.data = hn[f"w{i}"].clone(), hn[f"b{i}"].clone()
            layers.append(lin)
        self.mlp = nn.Sequential(*layers)
        self.targets = targets
        self.heads = nn.ModuleList()
        row = 0
        for s, _ in targets:
            size = s.stop - s.start
            head = nn.Linear(hn["head_w"].shape[1], size).double()
            head.weight.data = hn["head_w"][row: row + size].clone()
            head.bias.data = hn["head_b"][row: row + size].clone()
            self.heads.append(head)
            row += size

    def forward(self, i: int) -> list[torch.Tensor]:
        features = self.mlp(self.emb(torch.tensor(i)))
        return [head(features) for head in self.heads]

    def as_stacked(self) -> dict[str, torch.Tensor]:
        out = {"emb": self.emb.weight}
        for i, lin in enumerate(m for m in self.mlp if isinstance(m, nn.Linear)):
            out[f"w{i}"], out[f"b{i}"] = lin.weight, lin.bias
        out["head_w"] = torch.cat([h.weight for h in self.heads])
        out["head_b"] = torch.cat([h.bias for h in self.heads])
        return {k: v.detach() for k, v in out.items()}


def per_client_gradients(ref: ReferenceHN, deltas: dict[int, torch.Tensor]) -> list[list[torch.Tensor]]:
    """The official trainer's gradient, one client at a time: autograd's vector-Jacobian product with delta."""
    params = list(ref.parameters())
    return [list(torch.autograd.grad(ref(cid), params, grad_outputs=[delta[s].view(-1) for s, _ in ref.targets]))
            for cid, delta in deltas.items()]


def clipped(per_client: list[list[torch.Tensor]], clip: float) -> list[list[torch.Tensor]]:
    """Each client's gradient scaled as torch.nn.utils.clip_grad_norm_(params, clip) scales it."""
    out = []
    for grads in per_client:
        holders = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for h, g in zip(holders, grads):
            h.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(holders, clip)
        out.append([h.grad for h in holders])
    return out


@pytest.mark.parametrize("model, optimizer, personal_head", [
    ("cnn", "sgd", False), ("cnn", "adam", False), ("cnn_bn", "sgd", True)])
def test_batched_server_equals_a_per_client_loop_and_torch_optimizers(model, optimizer, personal_head):
    algo, state, fm = make_algo(model, hn_optimizer=optimizer, personal_head=str(personal_head).lower(),
                                embed_lr=0.05, embedding_dim=4)
    shared = algo.split.shared_mask
    targets = [(s, shape) for _, s, shape in fm.names if s.stop <= fm.param_size and shared[s.start]]
    assert all(not shared[s.start] for _, s, _ in fm.names if s.stop > fm.param_size)  # BN statistics: not generated
    ref = ReferenceHN(state["hn"], targets, algo.params.n_hidden)
    params = list(ref.parameters())
    groups = [{"params": [ref.emb.weight], "lr": 0.05},
              {"params": [p for p in params if p is not ref.emb.weight], "lr": algo.params.hn_lr}]
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=algo.params.hn_lr, momentum=0.9, weight_decay=1e-3)
    else:
        opt = torch.optim.Adam(groups, lr=algo.params.hn_lr, weight_decay=1e-3)
    first_emb = state["hn"]["emb"].clone()
    gen = torch.Generator().manual_seed(3)
    clipped_some = False
    for rnd, cids in enumerate(([0, 2, 3], [1, 3]), start=1):  # client 3 twice, rows 4, 5 never: momentum moves them
        # the generated parameters match the reference's forward
        payloads = algo.payloads(state, cids, rnd)
        for cid in cids:
            want = torch.cat([t.detach() for t in ref(cid)])
            assert torch.allclose(torch.cat(list(payloads[cid].values())), want, atol=1e-12)
        deltas = {c: 0.01 * (1 + c) * torch.randn(fm.param_size, generator=gen, dtype=torch.float64) for c in cids}
        per_client = per_client_gradients(ref, deltas)
        norms = [float(torch.sqrt(sum((g * g).sum() for g in grads))) for grads in per_client]
        clip = sorted(norms)[len(norms) // 2] if rnd == 1 else 0.5 * min(norms)  # clips some, then all
        algo.params = dataclasses.replace(algo.params, hn_clip=clip)
        each = clipped(per_client, clip)
        want = [sum(parts) for parts in zip(*each)]  # the hand-written backward sums the clipped gradients
        clipped_some |= any(n > clip for n in norms)
        idx = torch.as_tensor(cids)
        stacked_delta = torch.stack([deltas[c][shared[: fm.param_size]] for c in cids])
        got = algo.hn_gradient(state["hn"], idx, stacked_delta)
        keys = list(ref.as_stacked())
        want_stacked = {"emb": want[0]}
        for i, k in enumerate(keys[1:-2], start=1):
            want_stacked[k] = want[i]
        heads = want[len(keys) - 2:]
        want_stacked["head_w"] = torch.cat(heads[0::2])
        want_stacked["head_b"] = torch.cat(heads[1::2])
        for k in keys:
            assert torch.allclose(got[k], want_stacked[k], atol=1e-10, rtol=1e-9), k
        # the round through the protocol: updates by name, then the official trainer's optimizer step once per
        # client, each with that client's clipped gradient at the round's hypernetwork (the one its model came from)
        updates = {c: make_update(10, 1.0, **{name: deltas[c][s] for name, s in algo.split.shared}) for c in cids}
        state = algo.aggregate(state, updates, {c: 1 / len(cids) for c in cids}, rnd)
        for grads in each:
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        for k, v in ref.as_stacked().items():
            assert torch.allclose(state["hn"][k], v, atol=1e-10, rtol=1e-9), (rnd, k)
    assert clipped_some
    assert not torch.equal(state["hn"]["emb"][5], first_emb[5])  # never sampled, yet weight decay moved it


def test_one_round_lowers_each_clients_loss_at_its_newly_generated_model():
    cfg, data, model, algo = setup("pfedhn", "pfedhn.hn_lr=0.05", "pfedhn.inner_clip=5")
    state = algo.init_server(model.state())
    cids = [0, 2, 5]
    cstates = [algo.init_client(c, model.state()) for c in cids]

    def train_losses(state):
        payloads = algo.payloads(state, cids, 1)
        losses = []
        for c, s in zip(cids, cstates):
            model.load(algo.split.fill(s["weights"], payloads[c]))
            client = data.client(c)
            losses.append(float(predict(model, client.x_train, client.y_train)[1].mean()))
        return losses

    before = train_losses(state)
    payloads = algo.payloads(state, cids, 1)
    updates, _ = algo.client_update([payloads[c] for c in cids], cstates, cohort_of(cfg, data, model, cids))
    state = algo.aggregate(state, dict(zip(cids, updates)), {c: 1 / 3 for c in cids}, 1)
    after = train_losses(state)
    assert all(a < b for a, b in zip(after, before)), (before, after)


def test_lockstep_client_training_with_clipping_equals_the_per_client_path():
    cfg, data, model, algo = setup("pfedhn", "pfedhn.inner_clip=0.3")
    state = algo.init_server(model.state())
    cids = [0, 2, 3, 5]
    cstates = [algo.init_client(c, model.state()) for c in cids]
    payloads = [algo.payloads(state, cids, 1)[c] for c in cids]
    lockstep, _ = algo.client_update(payloads, cstates, cohort_of(cfg, data, model, cids, lockstep=True))
    in_turn, _ = algo.client_update(payloads, cstates, cohort_of(cfg, data, model, cids, lockstep=False))
    for a, b in zip(lockstep, in_turn):
        for k in algo.update_shapes():
            assert torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-4), k
            assert a[k].abs().max() > 0


def test_clipped_sgd_equals_torch_clip_grad_norm_and_sgd():
    cfg, data, model, _ = setup("fedavg")
    client = data.client(1)
    hp = LocalConfig(epochs=2, batch_size=20, lr=0.1, momentum=0.9, weight_decay=0.01)
    clip = 0.5
    start = model.state()
    model.load(start)
    sgd(model, client, hp, seeded_generator(7), Objective(clip_norm=clip))

    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    opt = torch.optim.SGD(net.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
    gen, norms = seeded_generator(7), []
    for _ in range(hp.epochs):
        perm = torch.randperm(client.num_train, generator=gen)
        for i in range(0, client.num_train, hp.batch_size):
            idx = perm[i: i + hp.batch_size]
            opt.zero_grad()
            F.cross_entropy(net(client.x_train[idx]), client.y_train[idx]).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            opt.step()
    assert any(n > clip for n in norms)
    want = flat_params(net)
    assert torch.allclose(model.vector[: model.param_size], want, atol=1e-5)
    # the same run without clipping goes elsewhere: the clip was active
    model.load(start)
    sgd(model, client, hp, seeded_generator(7))
    assert not torch.allclose(model.vector[: model.param_size], want, atol=1e-3)


def test_a_clients_update_is_the_official_inner_loop_and_its_evaluated_model_the_generated_one():
    """The client with the official trainer's inner settings by default (SGD lr 5e-3, momentum 0.9, weight decay
    5e-5, the loss gradient clipped as clip_grad_norm_ does): a plain torch.optim.SGD loop on an nn.Module holding
    the generated parameters, over the client's batch stream, ends at the client's trained model; the update is
    sent - trained; the model evaluated is the generated one itself."""
    cfg, data, model, algo = setup("pfedhn", "pfedhn.inner_clip=0.5", "local.steps=0", "local.epochs=2",
                                   "local.batch_size=16")
    p = algo.params
    assert (p.inner_lr, p.inner_momentum, p.inner_weight_decay, p.hn_clip) == (5e-3, 0.9, 5e-5, 50.0)
    state = algo.init_server(model.state())
    cid, rnd, clip = 3, 2, 0.5
    payload = algo.payloads(state, [cid], rnd)[cid]
    cstate = algo.init_client(cid, model.state())
    generated = algo.split.fill(cstate["weights"], payload)
    (evaluated,) = algo.evaluated_models([payload], [cstate], cohort_of(cfg, data, model, [cid], rnd))
    assert torch.equal(evaluated, generated) and not torch.equal(generated, model.state())
    (update,), (after,) = algo.client_update([payload], [cstate], cohort_of(cfg, data, model, [cid], rnd))

    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    load_params(generated[: model.param_size], net)
    opt = torch.optim.SGD(net.parameters(), lr=5e-3, momentum=0.9, weight_decay=5e-5)
    gen, client, norms = seeded_generator(cfg.seed, rnd, cid), data.client(cid), []
    for _ in range(2):
        perm = torch.randperm(client.num_train, generator=gen)
        for i in range(0, client.num_train, 16):
            idx = perm[i: i + 16]
            opt.zero_grad()
            F.cross_entropy(net(client.x_train[idx]), client.y_train[idx]).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            opt.step()
    assert any(n > clip for n in norms) and len(norms) > 4
    trained = after["weights"][: model.param_size]
    assert torch.allclose(trained, flat_params(net), atol=1e-6, rtol=1e-5)
    moved = (trained - generated[: model.param_size]).abs().max()
    assert moved > 1e-3  # it trained: the comparison means something
    for name, s in algo.split.shared:
        assert torch.allclose(update[name], generated[s] - after["weights"][s], atol=1e-7), name


def mnist_cfg(*extra):
    base = ["dataset.name=mnist5k", "model.name=cnn", "partition.num_clients=4", "partition.classes_per_client=2",
            "partition.samples_per_client=120", "clients_per_round=2", "rounds=3", "checkpoint_every=2",
            "local.steps=4", "local.batch_size=16", "local.lr=0.005", "pfedhn.inner_steps=5",
            "progress=false", "plots=false"]
    return load_config(None, base + list(extra), "pfedhn")


def rows(path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_mnist5k_end_to_end_and_resumed_run_equals_uninterrupted(tmp_path):
    cfg = mnist_cfg()
    run_experiment(cfg, tmp_path / "full", log=lambda s: None)
    run_experiment(cfg, tmp_path / "cut", log=lambda s: None, stop_after=2)
    resume_experiment(tmp_path / "cut", log=lambda s: None)
    full, cut = rows(tmp_path / "full" / "pfedhn"), rows(tmp_path / "cut" / "pfedhn")
    assert len(full) == 3 and cut == full
    a = torch.load(tmp_path / "cut" / "pfedhn" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "full" / "pfedhn" / "checkpoint.pt", weights_only=False)
    assert all(torch.equal(a["server"]["hn"][k], b["server"]["hn"][k]) for k in b["server"]["hn"])
    assert all(torch.equal(x["weights"], y["weights"]) for x, y in zip(a["clients"], b["clients"]))
    # the whole model goes down and comes back up (float32), two clients a round
    size = FlatModel(build_model(cfg.model, (1, 28, 28), 10, 0)).param_size
    assert all(r["bytes_up"] == r["bytes_down"] == 2 * size * 4 for r in full)
    assert 0.0 <= full[-1]["personalized_acc"] <= 1.0


def test_personal_head_and_bn_statistics_never_leave_the_client(tmp_path):
    cfg = mnist_cfg("model.name=cnn_bn", "pfedhn.personal_head=true", "rounds=2")
    data = prepare(cfg)
    run = Run(cfg.for_algorithm("pfedhn"), data, tmp_path)
    run.run()
    fm = run.model
    init = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)).state()
    head = {layer.name for layer in fm.head_layers}
    sent = run.algo.update_shapes()
    assert not any(name in head or name.endswith(".stats") for name in sent)
    body_params = sum(layer.num_params for layer in fm.layers if layer.name not in head)
    assert run.state["hn"]["head_w"].shape[0] == body_params < fm.param_size
    for r in rows(tmp_path):
        assert r["bytes_up"] == r["bytes_down"] == 2 * body_params * 4
    # the clients that trained keep heads and BN statistics of their own
    trained = [s["weights"] for s in run.cstates if not torch.equal(s["weights"], init)]
    assert len(trained) >= 2
    head_slice = fm.head_layers[0].params
    assert not torch.equal(trained[0][head_slice], trained[1][head_slice])
    assert not torch.equal(trained[0][fm.buffer_slice], trained[1][fm.buffer_slice])
