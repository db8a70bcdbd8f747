"""pFedLA / HeurpFedLA: the batched server against a plain per-client loop, the hypernetwork update on a toy,
its optimizers (the reference plain SGD, the default per-client Adam) and their state across a resume, retained
layers, bytes, BN statistics."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pfedkit.algorithms.pfedla import HN_KEYS, HeurPFedLA, PFedLA, layer_groups
from pfedkit.config import load_config
from pfedkit.engine import Run, tensor_bytes
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from flat_layout import flat_params, load_params  # noqa: E402

N = 6


def make_algo(cls=PFedLA, model="cnn_bn", shape=(1, 28, 28), **params):
    cfg = load_config(None, [f"model.name={model}"] + [f"{cls.name}.{k}={v}" for k, v in params.items()])
    net = build_model(cfg.model, shape, 10, 0).double()
    fm = FlatModel(net)
    algo = cls(cfg.params(cls.name), fm, N, cfg.seed)
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
def test_batched_server_equals_a_plain_per_client_loop(cls, k, monkeypatch):
    # the server works on 2 clients at a time: the consecutive run of personalized(), the scattered cids of
    # payloads() and the gradients come in several blocks
    monkeypatch.setattr(PFedLA, "block", lambda self: 2)
    algo, state, fm = make_algo(cls, k=k)
    cids = [1, 3, 4]
    payloads = algo.payloads(state, cids, 1)
    personalized = list(algo.personalized(state, list(range(N))))
    gen = torch.Generator().manual_seed(2)
    trained = state["theta"][cids] + 0.01 * torch.randn(len(cids), fm.size, generator=gen, dtype=torch.float64)
    blocks = list(algo.hn_gradients(state, cids, trained))
    assert [at for at, _, _ in blocks] == [slice(0, 2), slice(2, 3)]
    grads, rows = ({k: torch.cat([b[i][k] for b in blocks]) for k in HN_KEYS} for i in (1, 2))
    for key, row in rows.items():  # the rows the gradients were taken at: the stored ones (compute dtype)
        assert torch.equal(row, state["hn"][key][cids].to(row.dtype)), key
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
    algo = PFedLA(cfg.params("pfedla"), fm, 20, cfg.seed)
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
        personalized = algo2.personalized(state, [cid])[0]
        for l in kept:
            s = algo2.groups[l][1]
            assert torch.equal(personalized[s], own[s])


def test_bn_running_statistics_stay_local():
    algo, state, fm = make_algo()
    payload = algo.payloads(state, [3], 1)[3]
    assert sum(v.numel() for v in payload.values()) == fm.param_size  # parameters only, no BN statistics
    vectors = list(algo.personalized(state, list(range(N))))
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


# ---- the hypernetwork update on a quadratic toy -------------------------------------------------------------------

def toy(delta_sign="old_minus_new", hn_lr=0.05, hn_optimizer="sgd"):
    """6 clients of two groups; client i's loss is 0.5 ||theta - opt_i||^2 with one optimum per group."""
    algo, state, fm = make_algo(PFedLA, model="mlr", shape=(1, 2, 2), hn_lr=hn_lr, delta_sign=delta_sign,
                                hn_optimizer=hn_optimizer)
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
    theta_bar = torch.stack(list(algo.personalized(state, cids)))
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
    after = torch.stack(list(algo.personalized(state, list(range(N)))))
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

def test_sequential_round_serves_each_client_the_state_left_by_the_previous_one(tmp_path):
    """`pfedla.sequential` (the reference code's order): the sampled clients are served one after
    another, and each one's payload is mixed after the previous clients' aggregation, i.e. from Theta with the
    earlier clients' rows replaced by what they trained, through the hypernetwork's updated rows. Recomputed here
    with a plain loop over layers and clients (ReferenceHN), and the hypernetwork's SGD step by autograd."""
    base = ["dataset.name=digits", "model.name=mlr", f"partition.num_clients={N}", "partition.classes_per_client=3",
            "rounds=1", "clients_per_round=3", "progress=false", "plots=false", "checkpoint_every=0",
            "pfedla.sequential=true", "pfedla.hn_optimizer=sgd", "pfedla.hn_lr=0.5"]
    cfg = load_config(None, base, "pfedla")
    run = Run(cfg.for_algorithm("pfedla"), prepare(cfg), tmp_path)
    algo = run.algo
    start = algo.init_server(run.model.state())  # the server state before round 1
    served = []
    original = algo.client_update

    def record(payloads, cstates, cohort):
        updates, states = original(payloads, cstates, cohort)
        served.extend(zip(cohort.cids, payloads, updates))
        return updates, states

    algo.client_update = record
    run.run()
    assert len(served) == 3 and len({c for c, _, _ in served}) == 3

    initial = {"theta": start["theta"].double(), "hn": {k: v.double() for k, v in start["hn"].items()}}
    state = initial
    for cid, payload, update in served:
        trained = update["weights"].double()
        vector, _, _, grads = reference_round(algo, state, cid, trained)
        for name, s in algo.groups:
            assert torch.allclose(payload[name].double(), vector[s], atol=1e-5), (cid, name)
        # this client's aggregation, by hand: its hypernetwork takes one SGD step, its row of Theta is replaced
        hn = {k: v.clone() for k, v in state["hn"].items()}
        rows = as_rows({k: v[cid][None] for k, v in hn.items()}, 0, len(algo.groups))  # views into the clones
        for key, g in grads.items():
            if g is not None:
                rows[key] -= cfg.params("pfedla").hn_lr * g
        theta = state["theta"].clone()
        theta[cid] = trained
        state = {"theta": theta, "hn": hn}
    for key, value in state["hn"].items():
        assert torch.allclose(run.state["hn"][key].double(), value, atol=1e-5), key
    assert torch.allclose(run.state["theta"].double(), state["theta"], atol=1e-6)
    assert (tmp_path / "alpha.npz").is_file() and not (tmp_path / "alpha_retained.npz").exists()  # k = 0: none kept
    # the check above tells the orders apart: mixed from the round's initial state, the second payload is far off
    second, payload, _ = served[1]
    stale, _, _, _ = reference_round(algo, initial, second)
    assert max(float((stale[s] - payload[name].double()).abs().max()) for name, s in algo.groups) > 1e-3


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
    info = __import__("json").loads((tmp_path / "algorithm.json").read_text())
    assert info["alpha_layers"] == ["fc1", "fc2"]  # the names of alpha's layer axis
    assert info["alpha_axes"] == ["target client", "layer", "source client"]
    assert not (tmp_path / "observables").exists()


FMNIST = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not __import__("os").path.isdir(FMNIST), reason="needs `apt-get install dataset-fashion-mnist`")
def test_reduced_table1_preset_on_full_fmnist(tmp_path):
    from pfedkit import PRESETS
    from pfedkit.experiment import run_experiment
    preset = PRESETS / "pfedla" / "table1_fmnist_10clients_reduced.yaml"
    cfg = load_config(preset, ["rounds=4", "seeds=", "progress=false"])  # 400 samples a client: FedAvg needs 4
    summaries = {s["algorithm"]: s for s in run_experiment(cfg, tmp_path, log=lambda s: None)}
    assert list(summaries) == ["local", "fedavg", "pfedla", "heurpfedla"]
    assert summaries["heurpfedla"]["mb_down_total"] < summaries["pfedla"]["mb_down_total"]
    assert summaries["pfedla"]["mb_up_total"] == summaries["fedavg"]["mb_up_total"]
    for name in ("pfedla", "heurpfedla"):
        for f in ("alpha.npz", "alpha_heatmap.png", "alpha_layers.png", "alpha_evolution.png", "algorithm.json"):
            assert (tmp_path / name / f).is_file(), f
    assert all(s["personalized_acc"] > s["majority_label_acc"] for s in summaries.values())


# ---- initialisation, options ------------------------------------------------------------------------------------

def test_hypernetworks_start_as_specified():
    """The hypernetwork's initialisation: embedding N(0, 1); trunk Linear layers PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for
    weights and biases; heads U(0, 1) with zero bias; stored in the model's dtype."""
    cfg = load_config(None, ["model.name=mlr"])
    fm = FlatModel(build_model(cfg.model, (1, 2, 2), 10, 0).double())
    algo = PFedLA(cfg.params("pfedla"), fm, 20, cfg.seed)
    hn = algo.init_server(fm.state())["hn"]
    assert all(v.dtype == torch.float64 for v in hn.values())
    assert hn["emb"].shape == (20, 100) and abs(float(hn["emb"].std()) - 1) < 0.05 and abs(float(hn["emb"].mean())) < 0.05
    for k in (1, 2, 3):  # fan_in 100 everywhere (embedding 100, hidden 100): bound 0.1
        for name in (f"w{k}", f"b{k}"):
            v = hn[name]
            assert float(v.abs().max()) <= 0.1 and float(v.abs().max()) > 0.099, name
    assert hn["head_w"].shape == (20, 1, 20, 100) and 0 <= float(hn["head_w"].min()) and float(hn["head_w"].max()) < 1
    assert float(hn["head_w"].max()) > 0.999 and torch.equal(hn["head_b"], torch.zeros(20, 1, 20, dtype=torch.float64))


def test_granularity_and_k_reach_the_algorithm():
    algo, _, fm = make_algo(PFedLA, granularity="tensor")
    assert [n for n, _ in algo.groups] == [n for n, s, _ in fm.names if s.stop <= fm.param_size]
    assert algo.init_server(fm.state())["hn"]["head_w"].shape[1] == 14  # one head per parameter tensor
    kept_all, state, _ = make_algo(HeurPFedLA, k=7)  # every module layer kept: allowed
    assert kept_all.payloads(state, [0], 1) == {0: {}}
    from pfedkit.errors import ConfigError
    with pytest.raises(ConfigError, match=r"heurpfedla\.k.*8 is more than the model's 7 layers"):
        make_algo(HeurPFedLA, k=8)


def test_raw_selfweight_ranks_the_unnormalised_outputs():
    """heurpfedla.selfweight=raw (the reference code): the kept layer is the one with the largest raw ReLU output at
    the client's own index; `normalized` ranks alpha itself. Checked by hand on every client."""
    algo_raw, state, _ = make_algo(HeurPFedLA, k=1, selfweight="raw")
    algo_norm, _, _ = make_algo(HeurPFedLA, k=1, selfweight="normalized")
    differ = 0
    for cid in range(N):
        hn = ReferenceHN(state["hn"], cid)
        x = hn.emb
        for lin in hn.trunk:
            x = torch.relu(lin(x))
        raw = torch.stack([torch.relu(head(x))[cid] for head in hn.heads]).detach()
        normalized = torch.stack([a[cid] for a in hn(cid)]).detach()
        got_raw = algo_raw._weights_of(state, [cid])[2][0]
        got_norm = algo_norm._weights_of(state, [cid])[2][0]
        assert int(got_raw.nonzero()) == int(raw.argmax()), cid
        assert int(got_norm.nonzero()) == int(normalized.argmax()), cid
        differ += int(raw.argmax()) != int(normalized.argmax())
    assert differ > 0  # the two rankings disagree on some client here


def test_hypernetwork_momentum_is_each_clients_own():
    """hn_momentum m: per client v <- m v + g, psi <- psi - lr v (SGD with momentum, one velocity per client's
    hypernetwork). Two rounds on the toy with different clients: client 1 trains in both, so its second step
    carries its first gradient; client 4 only in the second, so its step is its gradient alone."""
    lr, m = 0.05, 0.9
    algo, state, opt, _ = toy(hn_lr=lr)
    algo.params.hn_momentum = m
    state = algo.init_server(state["theta"][0].clone()) | {"theta": state["theta"], "hn": state["hn"]}
    assert set(state["hn_velocity"]) == set(HN_KEYS)
    expected = {k: v.clone() for k, v in state["hn"].items()}
    velocity = {k: torch.zeros_like(v) for k, v in state["hn"].items()}
    for cids in ([1, 2], [1, 4]):
        trained = {c: state["theta"][c] - 0.1 * (state["theta"][c] - opt[c]) for c in cids}
        for c in cids:  # reference gradients at the state the round starts from
            _, _, _, grads = reference_round(algo, {"theta": state["theta"], "hn": expected}, c, trained[c])
            v_rows = as_rows({k: v[c][None] for k, v in velocity.items()}, 0, 1)
            p_rows = as_rows({k: v[c][None] for k, v in expected.items()}, 0, 1)
            for key, g in grads.items():
                g = torch.zeros_like(v_rows[key]) if g is None else g
                v_rows[key].mul_(m).add_(g)
                p_rows[key].sub_(lr * v_rows[key])
        state = algo.aggregate(state, {c: {"weights": trained[c]} for c in cids}, {}, 1)
    for key in HN_KEYS:
        assert torch.allclose(state["hn"][key], expected[key], atol=1e-10), key
        assert torch.allclose(state["hn_velocity"][key], velocity[key], atol=1e-10), key


def test_client_trains_its_payload_with_kept_layers_from_its_own_copy():
    """HeurPFedLA (k = 1) on a DNN: the client fills the layer it keeps from its own copy, the other from the
    payload, then runs plain local SGD (one epoch, the seeded stream); it reports its sample count and mean loss."""
    cfg = load_config(None, ["dataset.name=digits", "model.name=dnn", "model.hidden=16", f"partition.num_clients={N}",
                             "partition.classes_per_client=3", "local.batch_size=50", "local.lr=0.2",
                             "heurpfedla.k=1"], "heurpfedla")
    data = prepare(cfg)
    fm = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
    algo = HeurPFedLA(cfg.params("heurpfedla"), fm, N, cfg.seed)
    state = algo.init_server(fm.state())
    state["theta"] += 0.05 * torch.randn(state["theta"].shape, generator=torch.Generator().manual_seed(0))
    cid = 2
    payload = algo.payloads(state, [cid], 1)[cid]
    own = fm.state() - 0.5  # the client's copy differs from the server's row, so its use is visible
    assert len(payload) == 1
    from pfedkit.train import seeded_generator
    from pfedkit.train import Cohort
    cohort = Cohort([cid], 1, data, fm, cfg.local, [seeded_generator(cfg.seed, 1, cid)])
    (update,), (cstate,) = algo.client_update([payload], [{"weights": own.clone()}], cohort)

    start = own.clone()
    (name,) = payload
    start[algo.slices[name]] = payload[name]
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    load_params(start, net)
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    client = data.client(cid)
    perm = torch.randperm(client.num_train, generator=seeded_generator(cfg.seed, 1, cid))
    losses = []
    for s in range(0, client.num_train, 50):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(client.x_train[perm[s: s + 50]]), client.y_train[perm[s: s + 50]])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    want = flat_params(net)
    assert torch.allclose(update["weights"], want, atol=1e-6) and torch.equal(cstate["weights"], update["weights"])
    assert update["num_samples"] == client.num_train
    assert update["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


# ---- the hypernetwork optimizer (docs/pfedla.md, "The default hypernetwork step") ------------------------------

def reference_sgd_step(algo, state, trained: dict, lr: float) -> dict:
    """The hypernetworks after plain SGD on each trained client's rows: -lr times the gradient of its own
    hypernetwork, by autograd through the plain ReferenceHN; the other rows stay."""
    expected = {k: v.clone() for k, v in state["hn"].items()}
    for c in trained:
        _, _, _, grads = reference_round(algo, state, c, trained[c])
        rows = as_rows({k: v[c][None] for k, v in expected.items()}, 0, 1)
        for key, g in grads.items():
            if g is not None:
                rows[key] -= lr * g
    return expected


def test_reference_option_takes_the_plain_sgd_step():
    """hn_optimizer: sgd (the reference code's, hn_lr 5e-3): each trained client's rows move by -hn_lr times the
    gradient of its own hypernetwork (by autograd through the plain ReferenceHN); the other rows stay."""
    lr = 5e-3
    algo, state, opt, _ = toy(hn_lr=lr, hn_optimizer="sgd")
    cids = [0, 4]
    trained = {c: state["theta"][c] - 0.1 * (state["theta"][c] - opt[c]) for c in cids}
    expected = reference_sgd_step(algo, state, trained, lr)
    state = algo.aggregate(state, {c: {"weights": trained[c]} for c in cids}, {}, 1)
    assert not any(k.startswith("hn_adam") for k in state)
    for key in HN_KEYS:
        assert torch.allclose(state["hn"][key], expected[key], atol=1e-12), key


@pytest.mark.parametrize("between", ["nothing", "theta changed", "payload written", "other clients", "no payloads"])
def test_aggregate_reuses_the_payloads_only_while_they_hold(between):
    """aggregate takes the weights and mixture the round's payloads were built from (not computed again) for any
    subset of those clients, in any order; where the server state or the payloads were changed in place since, or
    the clients were not among them, it computes them afresh. Every case gives the plain-SGD step of the reference
    hypernetwork on the state aggregate sees."""
    lr = 5e-3
    algo, state, opt, _ = toy(hn_lr=lr, hn_optimizer="sgd")
    payloads = {} if between == "no payloads" else algo.payloads(state, [0, 2, 4] if between != "other clients"
                                                                 else [1, 3], 1)
    if between == "theta changed":
        state["theta"][4] += 0.2
    if between == "payload written":  # a client wrote into the view it was sent
        payloads[0]["fc"] += 0.2
    cids = [4, 0]
    trained = {c: state["theta"][c] - 0.1 * (state["theta"][c] - opt[c]) for c in cids}
    expected = reference_sgd_step(algo, state, trained, lr)
    mixes = []
    algo.mix = lambda theta, alpha: mixes.append(1) or PFedLA.mix(algo, theta, alpha)
    state = algo.aggregate(state, {c: {"weights": trained[c]} for c in cids}, {}, 1)
    for key in HN_KEYS:
        assert torch.allclose(state["hn"][key], expected[key], atol=1e-12), key
    assert len(mixes) == (0 if between == "nothing" else 1)  # reused, or computed once


def test_adam_is_the_default_and_each_client_counts_its_own_steps():
    """hn_optimizer: adam (the default): per client m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2,
    psi <- psi - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), t the client's own step count; at t = 1 the
    step is lr g / (|g| + eps), i.e. lr sign(g). Round 1 trains clients 1, 2; round 2 clients 1, 4: client 1 takes
    its second step (t = 2, with round 1's moments), client 4 its first."""
    assert load_config(None, []).params("pfedla").hn_optimizer == "adam"
    lr, (b1, b2), eps = 1e-3, (0.9, 0.999), 1e-8
    algo, state, opt, _ = toy(hn_lr=lr, hn_optimizer="adam")
    state = algo.init_server(state["theta"][0].clone()) | {"theta": state["theta"], "hn": state["hn"]}
    assert set(state["hn_adam_m"]) == set(state["hn_adam_v"]) == set(HN_KEYS)
    expected = {k: v.clone() for k, v in state["hn"].items()}
    m = {k: torch.zeros_like(v) for k, v in expected.items()}
    v2 = {k: torch.zeros_like(v) for k, v in expected.items()}
    steps = [0] * N
    for rnd, cids in enumerate(([1, 2], [1, 4])):
        trained = {c: state["theta"][c] - 0.1 * (state["theta"][c] - opt[c]) for c in cids}
        for c in cids:
            _, _, _, grads = reference_round(algo, {"theta": state["theta"], "hn": expected}, c, trained[c])
            steps[c] += 1
            t = steps[c]
            p_rows, m_rows, v_rows = (as_rows({k: x[c][None] for k, x in d.items()}, 0, 1) for d in (expected, m, v2))
            for key, g in grads.items():
                g = torch.zeros_like(p_rows[key]) if g is None else g
                m_rows[key].mul_(b1).add_((1 - b1) * g)
                v_rows[key].mul_(b2).add_((1 - b2) * g * g)
                step = lr * (m_rows[key] / (1 - b1 ** t)) / ((v_rows[key] / (1 - b2 ** t)).sqrt() + eps)
                if t == 1:  # the first step is lr sign(g) wherever |g| >> eps
                    big = g.abs() > 1e-4
                    assert torch.allclose(step[big], lr * g[big].sign(), rtol=1e-4)
                p_rows[key].sub_(step)
        state = algo.aggregate(state, {c: {"weights": trained[c]} for c in cids}, {}, rnd + 1)
    assert state["hn_steps"].tolist() == [0, 2, 1, 0, 1, 0]
    for key in HN_KEYS:
        assert torch.allclose(state["hn"][key], expected[key], atol=1e-10, rtol=0), key
        assert torch.allclose(state["hn_adam_m"][key], m[key], atol=1e-12), key
        assert torch.allclose(state["hn_adam_v"][key], v2[key], atol=1e-14), key


def first_alpha_change(n: int, optimizer: str, lr: float) -> float:
    """Mean relative change |alpha' - alpha| / alpha of 4 trained clients' weights after one hypernetwork step,
    with n clients of two optima (the toy's quadratic loss, half a gradient step of local training)."""
    cfg = load_config(None, ["model.name=mlr", f"pfedla.hn_optimizer={optimizer}", f"pfedla.hn_lr={lr}"])
    fm = FlatModel(build_model(cfg.model, (1, 2, 2), 10, 0).double())
    algo = PFedLA(cfg.params("pfedla"), fm, n, 0)
    state = algo.init_server(fm.state())
    state["hn"] = {k: v.double() for k, v in state["hn"].items()}
    gen = torch.Generator().manual_seed(0)
    opt = torch.randn(2, fm.size, generator=gen, dtype=torch.float64)[torch.arange(n) % 2]
    state["theta"] = opt + 0.3 * torch.randn(n, fm.size, generator=gen, dtype=torch.float64)
    cids = [0, 1, 2, 3]
    before = algo._weights_of(state, cids)[1]
    sent = algo.personalized(state, cids)
    trained = sent - 0.5 * (sent - opt[cids])
    state = algo.aggregate(state, {c: {"weights": trained[i]} for i, c in enumerate(cids)}, {}, 1)
    return float(((algo._weights_of(state, cids)[1] - before).abs() / before).mean())


def test_the_default_step_on_alpha_does_not_shrink_with_n():
    """The normalization over N clients scales alpha's gradient by ~1/N^2, so plain SGD's relative step on alpha
    falls ~12x from 10 to 300 clients; Adam's step does not depend on the gradient's scale (within 2.5x here)."""
    sgd = [first_alpha_change(n, "sgd", 5e-3) for n in (10, 300)]
    adam = [first_alpha_change(n, "adam", 1e-3) for n in (10, 300)]
    assert sgd[0] / sgd[1] > 8
    assert adam[0] / adam[1] < 2.5 and adam[1] > 3 * sgd[1]


def test_momentum_is_for_sgd_only():
    from pfedkit.errors import ConfigError
    with pytest.raises(ConfigError, match=r"pfedla\.hn_momentum.*hn_optimizer: sgd only"):
        make_algo(PFedLA, hn_momentum=0.9)
    make_algo(PFedLA, hn_momentum=0.9, hn_optimizer="sgd")


@pytest.mark.parametrize("name", ["pfedla", "heurpfedla"])
def test_resume_keeps_each_clients_adam_state(tmp_path, name):
    """Interrupted after round 4 (last checkpoint at round 3) and resumed: the same metrics, hypernetworks, Adam
    moments and per-client step counts as the uninterrupted run."""
    from pfedkit.experiment import resume_experiment, run_experiment
    cfg = load_config(None, ["dataset.name=digits", "model.name=dnn", "model.hidden=16", "partition.num_clients=6",
                             "partition.classes_per_client=3", "rounds=7", "clients_per_round=3", "local.lr=0.1",
                             "local.batch_size=16", "progress=false", "plots=false", "checkpoint_every=3",
                             f"{name}.hn_lr=0.01"], name)
    run_experiment(cfg, tmp_path / "full", log=lambda s: None)
    run_experiment(cfg, tmp_path / "cut", log=lambda s: None, stop_after=4)
    resume_experiment(tmp_path / "cut", log=lambda s: None)
    rows = [(tmp_path / d / name / "metrics.jsonl").read_text().splitlines() for d in ("full", "cut")]
    strip = lambda r: {k: v for k, v in __import__("json").loads(r).items() if not k.endswith("_s")}
    assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]
    a, b = (torch.load(tmp_path / d / name / "checkpoint.pt", weights_only=False)["server"] for d in ("full", "cut"))
    assert 0 < int(a["hn_steps"].min()) and int(a["hn_steps"].sum()) == 7 * 3  # every client stepped, own counts
    for group in ("hn", "hn_adam_m", "hn_adam_v"):
        for key in HN_KEYS:
            assert torch.equal(a[group][key], b[group][key]), (group, key)
    assert torch.equal(a["hn_steps"], b["hn_steps"]) and torch.equal(a["theta"], b["theta"])


def test_bfloat16_hypernetworks_halve_the_server_state_and_keep_the_results(tmp_path):
    """pfedla.hn_dtype=bfloat16 stores the hypernetworks and Adam's moments in 2 bytes an entry (the N x layers x N x
    hidden heads dominate at large N) and keeps the results: the same run in float32 and bfloat16 ends with
    personalized accuracies within 2 points, mixing weights 0.02 apart on average and mean self-weights within
    0.05, both far from the uniform start (so the weights did learn). Plain SGD with bfloat16 is refused (its steps would round away)."""
    from pfedkit.errors import ConfigError
    from pfedkit.experiment import run_experiment
    base = ["dataset.name=digits", "model.name=dnn", "model.hidden=16", "partition.num_clients=8",
            "partition.classes_per_client=2", "rounds=12", "local.lr=0.1", "local.batch_size=16",
            "progress=false", "plots=false"]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(None, base + [f"pfedla.hn_dtype={dtype}"], "pfedla")
        run_experiment(cfg, tmp_path / dtype, log=lambda s: None)
        ck = torch.load(tmp_path / dtype / "pfedla" / "checkpoint.pt", weights_only=True)["server"]
        rows = [__import__("json").loads(r) for r in
                (tmp_path / dtype / "pfedla" / "metrics.jsonl").read_text().splitlines()]
        runs[dtype] = ck, rows[-1]["personalized_acc"], np.load(tmp_path / dtype / "pfedla" / "alpha.npz")["r00012"]
    (f32, acc32, a32), (b16, acc16, a16) = runs["float32"], runs["bfloat16"]
    for group in ("hn", "hn_adam_m", "hn_adam_v"):
        assert all(v.dtype == torch.bfloat16 for v in b16[group].values())
        assert sum(v.numel() * v.element_size() for v in b16[group].values()) * 2 == \
            sum(v.numel() * v.element_size() for v in f32[group].values())
    assert abs(acc32 - acc16) <= 0.02
    # measured: 99.61 % both, mean |alpha difference| 0.006 (one entry 0.13), mean self-weight 0.871 / 0.855
    assert np.abs(a32 - a16).mean() <= 0.02
    self32, self16 = np.einsum("ili->il", a32).mean(), np.einsum("ili->il", a16).mean()  # uniform: 1/8
    assert self32 > 0.125 + 0.1 and self16 > 0.125 + 0.1 and abs(self32 - self16) <= 0.05
    with pytest.raises(ConfigError, match=r"pfedla\.hn_dtype.*adam"):
        make_algo(PFedLA, hn_dtype="bfloat16", hn_optimizer="sgd")
