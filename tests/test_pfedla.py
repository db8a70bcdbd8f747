"""pFedLA / HeurpFedLA: the batched server against a plain per-client loop, the hypernetwork update on a toy,
retained layers, bytes, BN statistics."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pfedkit.algorithms.pfedla import HeurPFedLA, PFedLA, layer_groups
from pfedkit.config import load_config
from pfedkit.engine import Run, tensor_bytes
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model

N = 6


def make_algo(cls=PFedLA, model="cnn_bn", shape=(1, 28, 28), **params):
    cfg = load_config(None, [f"model.name={model}"] + [f"{cls.name}.{k}={v}" for k, v in params.items()])
    net = build_model(cfg.model, shape, 10, 0).double()
    fm = FlatModel(net)
    algo = cls(cfg.params(cls.name), fm, N, cfg)
    gen = torch.Generator().manual_seed(1)
    state = algo.init_server(fm.state())
    state["theta"] += 0.1 * torch.randn(state["theta"].shape, generator=gen, dtype=torch.float64)  # clients differ
    state["hn"] = {k: v.double() for k, v in state["hn"].items()}
    # heads away from their near-uniform start, so the weights are distinct (some rows exactly zero after ReLU)
    state["hn"]["head_w"] = torch.randn(state["hn"]["head_w"].shape, generator=gen, dtype=torch.float64)
    return algo, state, fm


class ReferenceHN(nn.Module):
    """One client's hypernetwork written plainly, loaded from row `i` of the stacked tensors."""

    def __init__(self, hn: dict, i: int):
        super().__init__()
        self.emb = nn.Parameter(hn["emb"][i].clone())
        self.trunk = nn.ModuleList()
        for k in (1, 2, 3):
            lin = nn.Linear(hn[f"w{k}"].shape[2], hn[f"w{k}"].shape[1]).double()
            lin.weight.data, lin.bias.data = hn[f"w{k}"][i].clone(), hn[f"b{k}"][i].clone()
            self.trunk.append(lin)
        self.heads = nn.ModuleList()
        for l in range(hn["head_w"].shape[1]):
            head = nn.Linear(hn["head_w"].shape[3], hn["head_w"].shape[2]).double()
            head.weight.data, head.bias.data = hn["head_w"][i, l].clone(), hn["head_b"][i, l].clone()
            self.heads.append(head)

    def forward(self, i: int) -> list[torch.Tensor]:
        x = self.emb
        for lin in self.trunk:
            x = torch.relu(lin(x))
        weights = []
        for head in self.heads:
            a = torch.relu(head(x))
            weights.append(a / a.sum() if a.sum() > 0 else torch.eye(len(a), dtype=a.dtype)[i])
        return weights


def reference_round(algo, state, cid, trained=None, k=0):
    """Client cid's personalized vector (a loop over layers and clients) and, given its trained vector, the
    gradients of its hypernetwork by autograd.grad through theta_bar with grad_outputs = sent - trained."""
    hn = ReferenceHN(state["hn"], cid)
    alpha = hn(cid)
    theta = state["theta"]
    retained = set()
    if k:
        self_weight = torch.stack([a[cid] for a in alpha]).detach()
        retained = set(self_weight.topk(k).indices.tolist())
    layers = []
    for l, (_, s) in enumerate(algo.groups):
        if l in retained:
            layers.append(theta[cid, s])
        else:
            layers.append(sum(alpha[l][j] * theta[j, s] for j in range(N)))
    P = algo.model.param_size
    vector = torch.cat([x.detach() for x in layers] + [theta[cid, P:]])
    if trained is None:
        return vector, alpha, retained, None
    # layers kept local, or whose weights fell back to one-hot self, do not depend on the hypernetwork
    used = [l for l in range(len(layers)) if l not in retained and layers[l].requires_grad]
    outputs = [layers[l] for l in used]
    deltas = [(vector - trained)[algo.groups[l][1]] for l in used]
    params = dict(hn.named_parameters())
    grads = torch.autograd.grad(outputs, list(params.values()), grad_outputs=deltas, allow_unused=True)
    return vector, alpha, retained, dict(zip(params, grads))


def as_rows(grads: dict, r: int, num_layers: int) -> dict:
    """The batched gradient rows of one client in the reference module's parameter names."""
    out = {"emb": grads["emb"][r]}
    for k in (1, 2, 3):
        out[f"trunk.{k - 1}.weight"], out[f"trunk.{k - 1}.bias"] = grads[f"w{k}"][r], grads[f"b{k}"][r]
    for l in range(num_layers):
        out[f"heads.{l}.weight"], out[f"heads.{l}.bias"] = grads["head_w"][r, l], grads["head_b"][r, l]
    return out


@pytest.mark.parametrize("cls,k", [(PFedLA, 0), (HeurPFedLA, 1), (HeurPFedLA, 2)])
def test_batched_server_equals_a_plain_per_client_loop(cls, k):
    algo, state, fm = make_algo(cls, k=k)
    cids = [1, 3, 4]
    payloads = algo.payloads(state, cids, 1)
    personalized = algo.personalized_many(state, [{}] * N, list(range(N)))
    gen = torch.Generator().manual_seed(2)
    trained = state["theta"][cids] + 0.01 * torch.randn(len(cids), fm.size, generator=gen, dtype=torch.float64)
    grads = algo.hn_gradients(state, cids, trained)
    for r, cid in enumerate(cids):
        vector, alpha, retained, ref_grads = reference_round(algo, state, cid, trained[r], k)
        for l, (name, s) in enumerate(algo.groups):  # what was sent: exactly the non-retained layers
            if l in retained:
                assert name not in payloads[cid]
            else:
                assert torch.allclose(payloads[cid][name], vector[s], atol=1e-6)
        assert torch.allclose(personalized[cid], vector, atol=1e-6)
        _, batched_alpha, batched_retained = algo._weights_of(state, [cid])
        assert set(np.flatnonzero(batched_retained[0].numpy())) == retained
        for l, a in enumerate(alpha):
            if l not in retained:
                assert torch.allclose(batched_alpha[0, l], a, atol=1e-6)
        rows = as_rows(grads, r, len(algo.groups))
        for name, g in ref_grads.items():
            expected = torch.zeros_like(rows[name]) if g is None else g
            assert torch.allclose(rows[name], expected, atol=1e-6, rtol=1e-6), name
        for l in retained:  # a retained layer's head gets no gradient
            assert rows[f"heads.{l}.weight"].abs().max() == 0


def test_rows_of_alpha_sum_to_one_and_a_zero_row_falls_back_to_self():
    algo, state, _ = make_algo()
    state["hn"]["head_w"][2, 1] = -1.0  # client 2, layer 1: all outputs negative -> ReLU zero
    state["hn"]["head_b"][2, 1] = -1.0
    _, alpha, _ = algo._weights_of(state, list(range(N)))
    assert torch.allclose(alpha.sum(-1), torch.ones(N, len(algo.groups), dtype=alpha.dtype))
    assert (alpha >= 0).all()
    assert torch.equal(alpha[2, 1], torch.eye(N, dtype=alpha.dtype)[2])


def test_initial_weights_are_near_uniform():
    cfg = load_config(None, ["model.name=cnn"])
    fm = FlatModel(build_model(cfg.model, (1, 28, 28), 10, 0))
    algo = PFedLA(cfg.params("pfedla"), fm, 20, cfg)
    _, alpha, _ = algo._weights_of(algo.init_server(fm.state()), list(range(20)))
    assert (alpha - 1 / 20).abs().max() < 0.5 / 20  # U(0,1) heads on a positive feature: close to 1/N


def test_retained_layers_are_the_clients_own_and_downlink_shrinks_by_their_size():
    algo0, state, fm = make_algo(PFedLA)
    algo2, _, _ = make_algo(HeurPFedLA, k=2)
    cids = [0, 2, 5]
    full, heur = algo0.payloads(state, cids, 1), algo2.payloads(state, cids, 1)
    _, _, retained = algo2._weights_of(state, cids)
    for r, cid in enumerate(cids):
        kept = [l for l in range(len(algo2.groups)) if retained[r, l]]
        assert len(kept) == 2
        kept_bytes = sum(algo2.groups[l][1].stop - algo2.groups[l][1].start for l in kept) * 8  # float64 here
        assert tensor_bytes(full[cid]) - tensor_bytes(heur[cid]) == kept_bytes
        # the client fills kept layers from its own copy, which is what the server holds for it
        own = state["theta"][cid]
        personalized = algo2.personalized(state, {}, cid)
        for l in kept:
            s = algo2.groups[l][1]
            assert torch.equal(personalized[s], own[s])


def test_bn_running_statistics_stay_local():
    algo, state, fm = make_algo()
    payload = algo.payloads(state, [3], 1)[3]
    assert sum(v.numel() for v in payload.values()) == fm.param_size  # parameters only, no BN statistics
    vectors = algo.personalized_many(state, [{}] * N, list(range(N)))
    buffers = fm.buffer_slice
    for cid in range(N):
        assert torch.equal(vectors[cid][buffers], state["theta"][cid, buffers])


def test_granularities():
    fm = FlatModel(build_model(load_config(None, ["model.name=cnn_bn"]).model, (1, 28, 28), 10, 0))
    assert [n for n, _ in layer_groups(fm, "module")] == ["conv1", "bn1", "conv2", "bn2", "fc1", "fc2", "fc3"]
    assert [n for n, _ in layer_groups(fm, "block")] == ["conv1+bn1", "conv2+bn2", "fc1", "fc2", "fc3"]
    assert len(layer_groups(fm, "tensor")) == 14
    for g in ("module", "block", "tensor"):  # the groups tile the parameters exactly
        spans = sorted((s.start, s.stop) for _, s in layer_groups(fm, g))
        assert spans[0][0] == 0 and spans[-1][1] == fm.param_size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


# ---- the hypernetwork update on a quadratic toy (specs §1.6) ------------------------------------------------------

def toy(delta_sign="old_minus_new", hn_lr=0.05):
    """6 clients of two groups; client i's loss is 0.5 ||theta - opt_i||^2 with one optimum per group."""
    algo, state, fm = make_algo(PFedLA, model="mlr", shape=(1, 2, 2), hn_lr=hn_lr, delta_sign=delta_sign)
    gen = torch.Generator().manual_seed(3)
    optima = torch.randn(2, fm.size, generator=gen, dtype=torch.float64) * 3
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    opt = optima[group]
    state = algo.init_server(fm.state())  # the near-uniform start
    state["theta"] = opt + 0.3 * torch.randn(N, fm.size, generator=gen, dtype=torch.float64)
    state["hn"] = {k: v.double() for k, v in state["hn"].items()}
    return algo, state, opt, group


def toy_round(algo, state, opt):
    """Every client: theta_bar from the server, 5 gradient steps of lr 0.1, back to the server."""
    cids = list(range(N))
    theta_bar = torch.stack(algo.personalized_many(state, [{}] * N, cids))
    trained = theta_bar.clone()
    for _ in range(5):
        trained -= 0.1 * (trained - opt)
    return theta_bar, algo.aggregate(state, {c: {"weights": trained[c]} for c in cids}, {}, 1)


def losses(theta, opt):
    return 0.5 * ((theta - opt) ** 2).sum(1)


def same_group_mass(algo, state, group):
    _, alpha, _ = algo._weights_of(state, list(range(N)))
    same = (group[:, None] == group[None, :]).to(alpha.dtype)
    return float((alpha * same[:, None, :]).sum(-1).mean())


def test_one_hypernetwork_step_lowers_each_clients_loss():
    algo, state, opt, _ = toy(hn_lr=0.01)
    before, state = toy_round(algo, state, opt)
    # the personalized model each client gets next (new weights over the updated Theta) beats the one it trained
    after = torch.stack(algo.personalized_many(state, [{}] * N, list(range(N))))
    assert (losses(after, opt) < losses(before, opt)).all()
    # and the hypernetwork step itself helps: the new weights over the same Theta beat the old weights
    algo_again, state_again, opt_again, _ = toy(hn_lr=0.01)
    theta_bar, _ = toy_round(algo_again, state_again, opt_again)
    new_alpha = algo_again._weights_of(state_again, list(range(N)))[1]
    old_theta = toy(hn_lr=0.01)[1]["theta"]
    assert (losses(algo_again.mix(old_theta, new_alpha), opt) < losses(theta_bar, opt)).all()


def test_weight_mass_moves_to_clients_with_the_same_optimum():
    algo, state, opt, group = toy()
    start = same_group_mass(algo, state, group)
    for _ in range(100):
        _, state = toy_round(algo, state, opt)
    assert 0.45 < start < 0.55  # near-uniform start: half the mass on the own group
    assert same_group_mass(algo, state, group) > 0.9


def test_the_reference_codes_sign_moves_mass_the_wrong_way():
    algo, state, opt, group = toy(delta_sign="new_minus_old")
    start = same_group_mass(algo, state, group)
    for _ in range(100):
        _, state = toy_round(algo, state, opt)
    assert same_group_mass(algo, state, group) < start


# ---- through the engine --------------------------------------------------------------------------------------------

def test_sequential_round_serves_later_clients_with_earlier_updates(tmp_path):
    base = ["dataset.name=digits", "model.name=mlr", "partition.num_clients=5", "partition.classes_per_client=3",
            "rounds=2", "progress=false", "plots=false", "checkpoint_every=0"]
    sync = load_config(None, base, "pfedla")
    seq = load_config(None, base + ["pfedla.sequential=true"], "pfedla")
    data = prepare(sync)
    runs = []
    for cfg, name in ((sync, "sync"), (seq, "seq")):
        run = Run(cfg.for_algorithm("pfedla"), data, tmp_path / name)
        run.run()
        runs.append(run)
    assert runs[0].metrics[-1]["bytes_down"] == runs[1].metrics[-1]["bytes_down"]
    assert not torch.equal(runs[0].state["theta"], runs[1].state["theta"])


def test_alpha_is_logged_at_every_evaluation(tmp_path):
    cfg = load_config(None, ["dataset.name=digits", "model.name=dnn", "partition.num_clients=5", "rounds=4",
                             "eval_every=2", "progress=false", "plots=false", "partition.classes_per_client=3"],
                      "heurpfedla")
    run = Run(cfg.for_algorithm("heurpfedla"), prepare(cfg), tmp_path)
    run.run()
    alpha = np.load(tmp_path / "alpha.npz")
    assert sorted(alpha.files) == ["r00002.npy", "r00004.npy"] or sorted(alpha.files) == ["r00002", "r00004"]
    a = alpha["r00004"]
    assert a.shape == (5, 2, 5) and np.allclose(a.sum(-1), 1)
    kept = np.load(tmp_path / "alpha_retained.npz")["r00004"]
    assert kept.shape == (5, 2) and (kept.sum(1) == 1).all()
    assert not (tmp_path / "observables").exists()


FMNIST = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not __import__("os").path.isdir(FMNIST), reason="needs `apt-get install dataset-fashion-mnist`")
def test_reduced_table1_preset_on_full_fmnist(tmp_path):
    from pathlib import Path

    from pfedkit.experiment import run_experiment
    preset = Path(__file__).resolve().parents[1] / "configs" / "pfedla" / "table1_fmnist_10clients_reduced.yaml"
    cfg = load_config(preset, ["rounds=2", "seeds=", "progress=false"])
    summaries = {s["algorithm"]: s for s in run_experiment(cfg, tmp_path, log=lambda s: None)}
    assert list(summaries) == ["local", "fedavg", "pfedla", "heurpfedla"]
    assert summaries["heurpfedla"]["mb_down_total"] < summaries["pfedla"]["mb_down_total"]
    assert summaries["pfedla"]["mb_up_total"] == summaries["fedavg"]["mb_up_total"]
    for name in ("pfedla", "heurpfedla"):
        for f in ("alpha.npz", "alpha_heatmap.png", "alpha_layers.png", "alpha_evolution.png", "algorithm.json"):
            assert (tmp_path / name / f).is_file(), f
    assert all(s["personalized_acc"] > s["majority_label_acc"] for s in summaries.values())
