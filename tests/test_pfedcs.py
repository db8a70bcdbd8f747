"""Samplers inside the round loop, and pFedCS end to end against its baselines on Synthetic(0.4, 0.6)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pfedkit.config import load_config
from pfedkit.engine import Run
from pfedkit.errors import ConfigError, UpdateError
from pfedkit.experiment import prepare, run_experiment
from pfedkit.models import build_model
from pfedkit.sampling import Sampler
from flat_layout import load_params  # noqa: E402

SYNTH = ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=12", "model.name=mlr",
         "dataset.synthetic.size_factor=1", "local.batch_size=20", "local.steps=10", "local.lr=0.05",
         "progress=false", "plots=false", "checkpoint_every=0", "clients_per_round=4"]


def test_uniform_sampling_weights_are_sample_size_shares():
    sizes = np.array([10, 30, 60, 100])
    s = Sampler("uniform", sizes, 2, seed=0)
    for rnd in range(1, 6):
        w = s.select({}, rnd)
        assert len(w) == 2 and sum(w.values()) == pytest.approx(1)
        a, b = w
        assert w[a] / w[b] == pytest.approx(sizes[a] / sizes[b])


@pytest.mark.parametrize("scheme", ["md", "clustered_size"])
def test_drawn_schemes_weigh_a_client_by_its_draws(scheme):
    sizes = np.random.default_rng(0).integers(10, 500, 30)
    s = Sampler(scheme, sizes, 5, seed=1)
    totals = np.zeros(30)
    for rnd in range(1, 3001):
        for c, w in s.select({}, rnd).items():
            assert w * 5 == pytest.approx(round(w * 5))  # draws / m
            totals[c] += w
    # unbiased: in expectation each client's weight is its share p_i
    assert np.allclose(totals / 3000, sizes / sizes.sum(), atol=0.012)


def test_similarity_sampling_refreshes_the_gradients_of_the_clients_that_trained(tmp_path):
    cfg = load_config(None, SYNTH + ["rounds=1", "sampling=clustered_similarity"], "fedavg")
    run = Run(cfg.for_algorithm("fedavg"), prepare(cfg), tmp_path)
    init = run.model.state()
    run.run()
    G = run.sampler_state["gradients"]
    trained = [c for c in range(12) if G[c].abs().sum() > 0]
    assert 1 <= len(trained) <= 4  # the drawn clients (a client drawn twice trains once)
    assert all(G[c].abs().sum() == 0 for c in range(12) if c not in trained)  # the rest start at zero
    assert not torch.equal(run.state["weights"], init)


def test_pfedcs_refreshes_every_clients_gradient_when_all_train(tmp_path):
    cfg = load_config(None, SYNTH + ["rounds=2", "pfedcs.local_rounds=3"], "pfedcs")
    run = Run(cfg.for_algorithm("pfedcs"), prepare(cfg), tmp_path)
    run.run()
    assert run.sampler.scheme == "clustered_similarity"  # `sampling: auto` is pFedCS's own sampler
    G = run.sampler_state["gradients"]
    assert (G.abs().sum(1) > 0).all()
    assert all(r["aggregated"] <= 4 for r in run.metrics)


def test_clustered_similarity_needs_a_global_model(tmp_path):
    cfg = load_config(None, SYNTH + ["rounds=1", "sampling=clustered_similarity"], "pfedla")
    with pytest.raises(ConfigError, match="sampling"):
        Run(cfg.for_algorithm("pfedla"), prepare(cfg), tmp_path)


@pytest.mark.parametrize("model", ["mlr", "dnn"])
def test_pfedcs_comparison_on_synthetic_writes_the_papers_figures(tmp_path, model):
    cfg = load_config(None, SYNTH + ["rounds=4", "plots=true", "eval_train=true", "target_acc=0.5",
                                     "pfedcs.local_rounds=5", "pfedme.local_rounds=5", "clustering.clusters=6",
                                     f"model.name={model}", "model.hidden=20"],
                      "pfedcs,pfedme,fedavg,fedprox,perfedavg")
    data = prepare(cfg)
    summaries = {s["algorithm"]: s for s in run_experiment(cfg, tmp_path, data=data, log=lambda s: None)}
    assert set(summaries) == {"pfedcs", "pfedme", "fedavg", "fedprox", "perfedavg"}
    for name, s in summaries.items():
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 4
        assert rows[-1]["global_acc"] is not None and rows[-1]["personalized_acc"] is not None
        assert rows[-1]["global_train_loss"] > 0 and rows[-1]["personalized_train_loss"] > 0
        assert "rounds_to_target" in s
    table = (tmp_path / "comparison.md").read_text()
    assert "majority label" in table
    assert (tmp_path / "comparison.png").is_file()
    # pFedMe-style methods are evaluated with each client's personal model theta~ (the client state), the global
    # accuracy with w: both recomputed from the checkpoint with a plain forward pass on every client's test split
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)

    def accuracy(vector, cid):
        load_params(vector, net)
        c = data.client(cid)
        with torch.no_grad():
            return float((net(c.x_test).argmax(1) == c.y_test).double().mean())

    for name in ("pfedcs", "pfedme"):
        ck = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
        personal = [accuracy(ck["clients"][c]["personal"], c) for c in range(12)]
        assert summaries[name]["personalized_acc_per_client"] == pytest.approx(personal, abs=1e-12), name
        assert summaries[name]["global_acc"] == pytest.approx(
            np.mean([accuracy(ck["server"]["weights"], c) for c in range(12)]), abs=1e-12), name


def test_equal_importance_weighs_clients_alike():
    sizes = np.array([10, 30, 60, 100])
    w = Sampler("uniform", sizes, 2, seed=0, importance="equal").select({}, 1)
    assert list(w.values()) == [0.5, 0.5]
    s = Sampler("clustered_size", sizes, 2, seed=0, importance="equal")
    assert np.allclose(s.distributions({}, 1).mean(0), 0.25)


def test_resumed_pfedcs_run_equals_uninterrupted(tmp_path):
    """The sampler's representative gradients are part of the checkpoint."""
    from pfedkit.engine import TIMING_KEYS
    from pfedkit.experiment import resume_experiment
    cfg = load_config(None, SYNTH + ["rounds=5", "checkpoint_every=2", "pfedcs.local_rounds=3"], "pfedcs")
    run_experiment(cfg, tmp_path / "full", log=lambda s: None)
    run_experiment(cfg, tmp_path / "cut", log=lambda s: None, stop_after=3)
    resume_experiment(tmp_path / "cut", log=lambda s: None)

    def rows(d):
        return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
                for x in (d / "pfedcs" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows(tmp_path / "cut")) == 5 and rows(tmp_path / "cut") == rows(tmp_path / "full")


def test_a_too_large_lambda_diverges_and_the_error_says_which_knobs_to_turn(tmp_path):
    # personal_lr * lamda = 3: every inner step multiplies theta's distance to w_loc by -2 (the paper: "too large a
    # lambda diverges")
    cfg = load_config(None, ["dataset.name=digits", "model.name=mlr", "rounds=3", "progress=false", "plots=false",
                             "pfedme.personal_lr=0.1", "pfedme.lamda=30"], "pfedme")
    with pytest.raises(UpdateError, match=r"non-finite.*personal_lr or lamda"):
        Run(cfg.for_algorithm("pfedme"), prepare(cfg), tmp_path).run()
