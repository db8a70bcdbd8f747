"""Models and their flat-vector view: named layers, body/head, BN buffers, in-place gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pfedkit.config import ModelConfig
from pfedkit.errors import ConfigError
from pfedkit.models import FlatModel, build_model
from flat_layout import flat_state  # noqa: E402


@pytest.mark.parametrize("shape, features", [((1, 28, 28), 512), ((3, 32, 32), 800)])
def test_pfedhn_cnn_shapes(shape, features):
    net = build_model(ModelConfig("cnn"), shape, 10, 0)
    assert net.fc1.in_features == features
    assert net(torch.zeros(2, *shape)).shape == (2, 10)


def test_lenet5_is_fl_benchs_layout_with_its_parameter_count():
    """FL-bench's LeNet5 written out here as a plain nn.Sequential (conv 1->6, 5 + BN, ReLU, pool; conv 6->16, 5 + BN,
    ReLU, pool; fc 256->120, ReLU, fc 120->84, ReLU, classifier 84->10): the same outputs with the same weights, and
    the hand count 156 + 12 + 2416 + 32 + 30840 + 10164 + 850 = 44470 parameters (+ 2 * (6 + 16) BN statistics)."""
    net = build_model(ModelConfig("lenet5"), (1, 28, 28), 10, 0)
    nn = torch.nn
    ref = nn.Sequential(nn.Conv2d(1, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))
    assert sum(p.numel() for p in net.parameters()) == 44470 == sum(p.numel() for p in ref.parameters())
    for mine, theirs in zip([net.conv1, net.bn1, net.conv2, net.bn2, net.fc1, net.fc2, net.fc3],
                            [ref[0], ref[1], ref[4], ref[5], ref[9], ref[11], ref[13]]):
        theirs.load_state_dict(mine.state_dict())
    x = torch.randn(5, 1, 28, 28)
    torch.testing.assert_close(net(x), ref(x))  # train mode: batch statistics, running ones updated alike
    torch.testing.assert_close(net.bn2.running_mean, ref[5].running_mean)
    assert FlatModel(net).size - FlatModel(net).param_size == 2 * (6 + 16)
    assert build_model(ModelConfig("lenet5"), (3, 32, 32), 100, 0).fc1.in_features == 400


def test_layers_are_parameterized_modules_with_bn_buffers_marked():
    fm = FlatModel(build_model(ModelConfig("cnn_bn"), (3, 32, 32), 100, 0))
    assert [l.name for l in fm.layers] == ["conv1", "bn1", "conv2", "bn2", "fc1", "fc2", "fc3"]
    assert sum(l.num_params for l in fm.layers) == fm.param_size
    assert [l.name for l in fm.layers if l.buffers is not None] == ["bn1", "bn2"]
    assert fm.size - fm.param_size == 2 * (16 + 32)  # running mean and var, nothing else
    assert [l.name for l in fm.head_layers] == ["fc3"]
    assert fm.mask(fm.head_layers).sum() == 84 * 100 + 100


def test_parameters_and_gradients_live_in_the_flat_vectors():
    fm = FlatModel(build_model(ModelConfig("cnn_bn"), (1, 28, 28), 10, 0))
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    F.cross_entropy(fm.module(x), y).backward()
    F.cross_entropy(fm.module(x), y).backward()  # accumulates into the same flat gradient
    for _, p in fm.module.named_parameters():
        assert p.grad.untyped_storage().data_ptr() == fm.grad.untyped_storage().data_ptr()
    fm.vector.zero_()
    assert all((p == 0).all() for p in fm.module.parameters())
    assert (fm.module.bn1.running_var == 0).all()  # buffers too


def test_same_seed_same_init_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = FlatModel(build_model(ModelConfig("cnn"), (1, 28, 28), 10, 5)).state()
    after = torch.rand(1)
    b = FlatModel(build_model(ModelConfig("cnn"), (1, 28, 28), 10, 5)).state()
    assert torch.equal(a, b) and torch.equal(before, after)


def test_cnn_on_8x8_digits_is_a_clear_config_error():
    with pytest.raises(ConfigError, match="model.name.*mlr, dnn"):
        build_model(ModelConfig("cnn"), (1, 8, 8), 10, 0)


@pytest.mark.parametrize("name, shape", [("mlr", (60,)), ("dnn", (1, 8, 8))])
def test_batched_loss_gives_every_client_its_own_gradient_and_loss(name, shape):
    """The lockstep path's gradients (batched products, one autograd pass) equal one backward per client."""
    from pfedkit.train import model_gradient
    from pfedkit.train import BatchedLoss
    fm = FlatModel(build_model(ModelConfig(name, hidden=16), shape, 10, 0))
    gen = torch.Generator().manual_seed(0)
    params = fm.state()[None] + 0.1 * torch.randn(4, fm.size, generator=gen)
    x = torch.randn(4, 7, *shape, generator=gen)
    y = torch.randint(0, 10, (4, 7), generator=gen)
    mask = torch.ones(4, 7)
    mask[1, 5:] = 0  # a short last batch
    mask[3] = 0  # a client whose stream has ended: no loss, no gradient
    grads, losses = BatchedLoss(fm)(params, x, y, mask)
    for c in range(3):
        keep = mask[c] > 0
        g, loss = model_gradient(fm, params[c], x[c][keep], y[c][keep])
        assert torch.allclose(grads[c], g, atol=1e-6) and losses[c].item() == pytest.approx(loss, rel=1e-5)
    assert torch.all(grads[3] == 0) and losses[3] == 0


def test_batched_loss_refuses_models_it_cannot_batch():
    from pfedkit.train import BatchedLoss
    with pytest.raises(ValueError, match="per-client path"):
        BatchedLoss(FlatModel(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))))  # no forward_many


@pytest.mark.parametrize("name", ["cnn", "cnn_bn", "mlr"])
def test_every_model_lies_in_the_vector_row_major_and_trains_as_the_plain_module(name):
    """One layout for every model: each tensor row-major in its own shape, in the module's order (a conv weight
    entry [o, i, h, x] at ((o * in + i) * 5 + h) * 5 + x past its start), named views in the standard shapes; and
    SGD steps of the FlatModel's module equal a plain module's bit for bit (the same ops on the same layout)."""
    net = build_model(ModelConfig(name), (1, 28, 28), 10, 0)
    ref = build_model(ModelConfig(name), (1, 28, 28), 10, 0)
    fm = FlatModel(net)
    assert fm.layout == "standard" and all(p.is_contiguous() for p in net.parameters())
    if name != "mlr":
        (start, w), = [(s.start, ref.state_dict()[n]) for n, s, _ in fm.names if n == "conv2.weight"]
        o, i, h, x = 3, 7, 1, 4
        assert fm.vector[start + ((o * 16 + i) * 5 + h) * 5 + x] == w[o, i, h, x]
    for n, t in fm.state_dict(fm.vector).items():
        torch.testing.assert_close(t, ref.state_dict()[n], rtol=0, atol=0)
    gen = torch.Generator().manual_seed(0)
    xs, ys = torch.rand(64, 1, 28, 28, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in range(0, 64, 16):
        fm.grad.zero_()
        F.cross_entropy(net(xs[b: b + 16]), ys[b: b + 16]).backward()
        fm.vector[: fm.param_size].add_(fm.grad, alpha=-0.1)
        opt.zero_grad()
        F.cross_entropy(ref(xs[b: b + 16]), ys[b: b + 16]).backward()
        opt.step()
    torch.testing.assert_close(fm.vector, flat_state(ref), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(3, 4, 24, 24), (2, 5, 9, 7), (1, 2, 3, 4)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_evaluation_max_pool_is_the_windows_maximum(shape, channels_last):
    """The no-grad pooling of the CNNs against a plain loop over every 2x2 window (the odd last row/column left
    out): exact values, ties (ReLU zeros), a NaN propagated; in both memory layouts; and F.max_pool2d with autograd."""
    from pfedkit.runtime.cnn import max_pool2x2
    gen = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(shape, generator=gen)).round(decimals=1)  # many ties: zeros and repeated values
    x[0, 0, 0, 0] = float("nan")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    n, c, h, w = shape
    expected = torch.empty(n, c, h // 2, w // 2)
    for i in range(h // 2):
        for j in range(w // 2):
            window = x[:, :, 2 * i: 2 * i + 2, 2 * j: 2 * j + 2].reshape(n, c, 4)
            expected[:, :, i, j] = torch.where(window.isnan().any(-1), float("nan"), window.amax(-1))
    with torch.no_grad():
        got = max_pool2x2(x)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
    assert got[0, 0, 0, 0].isnan()
    leaf = x.clone().requires_grad_(True)
    torch.testing.assert_close(max_pool2x2(leaf), F.max_pool2d(x, 2), equal_nan=True, rtol=0, atol=0)
