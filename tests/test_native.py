"""The C kernels (runtime/native.py, kernels.c) against PyTorch's own ops: F.max_pool2d(torch.relu(x), 2)
and its gradient, bit for bit (ties, zeros, NaN, widths that leave a partial vector block), a CNN trained through
them (runtime/cnn.py's forward) against the same plain CNN, the ops' torch.library registrations (opcheck), and the
fallback when the install has none."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pfedkit.config import ModelConfig
from pfedkit.models import FlatModel, build_model
from pfedkit.runtime import cnn, native
from pfedkit.runtime.cnn import relu_pool


def test_the_kernels_build_on_this_machine():
    """CI's machine has a C compiler, so the install built them: without this, every test below would pass on the
    PyTorch fallback alone. The build loaded is the best this CPU runs, by PyTorch's own capability check."""
    assert native.library() is not None, native.why_not
    capability = torch.backends.cpu.get_cpu_capability().lower()
    assert native.variant == (capability if capability in native.CAPABILITIES else "default")


def plain_relu_pool(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(torch.relu(x), 2)


def tricky(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values on a coarse grid (many ties, exact zeros, negatives), a constant block and NaNs."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=dtype) * 2).round() / 4
    n, c, h, w = shape
    x[0, 0, : min(h, 4), : min(w, 4)] = 0.25  # a constant region: every window a four-way tie
    x[-1, -1, 0, 0] = float("nan")
    if w >= 4:
        x[-1, 0, -2:, -4:] = float("nan")  # windows with two NaNs and with one
        x[-1, 0, -1, -4] = 1.0
    return x


SHAPES = [(32, 16, 24, 24), (3, 5, 8, 8), (2, 3, 6, 10), (4, 2, 2, 2), (2, 3, 4, 34), (1, 1, 10, 40)]


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES + [(2, 8, 6, 10), (3, 32, 8, 8)])
def test_relu_pool_equals_pytorch_values_and_gradient(shape, dtype, layout):
    """In the standard layout any shape with even sides; in channels_last (the BN-free models' activations) the
    channel count must be a multiple of the vector width (8 float32, 4 float64)."""
    x = tricky(shape, dtype, 0).contiguous(memory_format=layout)
    if not x.is_contiguous() and shape[1] % native.LANES[dtype]:  # (one channel: both layouts are one)
        assert not native.covers(x)
        return
    for seed in range(3):
        x = tricky(shape, dtype, seed).contiguous(memory_format=layout)
        grad = torch.randn(shape[0], shape[1], shape[2] // 2, shape[3] // 2, dtype=dtype,
                           generator=torch.Generator().manual_seed(seed + 10))
        got_in, ref_in = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        assert native.covers(got_in)
        got, ref = native.relu_pool(got_in), plain_relu_pool(ref_in)
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
        assert got.is_contiguous(memory_format=layout)
        got.backward(grad)
        ref.backward(grad)
        torch.testing.assert_close(got_in.grad, ref_in.grad, rtol=0, atol=0, equal_nan=True)
        with torch.no_grad():  # evaluation takes the kernel too
            torch.testing.assert_close(relu_pool(x), ref.detach(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_relu_pool_equals_pytorch(shape, dtype):
    """Training-mode BatchNorm2d + ReLU + pooling against PyTorch's three modules: output, the gradients of the
    input, weight and bias, and the running statistics after two batches (float64 to 1e-12, float32 to PyTorch's
    own rounding); inputs with a large mean (the statistics must not cancel) and tied windows."""
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    gen = torch.Generator().manual_seed(1)
    bn = torch.nn.BatchNorm2d(shape[1]).to(dtype)
    with torch.no_grad():
        bn.weight.uniform_(-1.5, 1.5, generator=gen)
        bn.bias.uniform_(-0.5, 0.5, generator=gen)
    ref = copy.deepcopy(bn)
    for seed in range(2):
        x = tricky(shape, dtype, seed).nan_to_num(0.5) + 3.0 * seed  # the second batch far from zero
        got_in, ref_in = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        assert native.covers_batch_norm(got_in, bn)
        got, want = native.batch_norm_relu_pool(got_in, bn), plain_relu_pool(ref(ref_in))
        torch.testing.assert_close(got, want, **tol)
        grad = torch.randn(want.shape, dtype=dtype, generator=gen)
        got.backward(grad)
        want.backward(grad)
        torch.testing.assert_close(got_in.grad, ref_in.grad, **tol)
        for name in ("weight", "bias"):
            torch.testing.assert_close(getattr(bn, name).grad, getattr(ref, name).grad, **tol, msg=name)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(bn, name), getattr(ref, name), **tol, msg=name)
        bn.zero_grad()
        ref.zero_grad()
    assert not native.covers_batch_norm(x, bn.eval()) and not native.covers_batch_norm(x, torch.nn.Identity())


@pytest.mark.parametrize("shape", [(4, 2, 2, 2), (3, 3, 4, 6), (2, 1, 8, 34)])
def test_the_kernels_touch_nothing_outside_their_tensors(shape):
    """A row's partial last block reads and writes past the row (models/kernels.c): every tensor here is a slice of
    a larger buffer with sentinels after it, which must come out unchanged."""
    n, c, h, w = shape
    pooled = n * c * (h // 2) * (w // 2)
    sentinel = 1234.5

    def within(size, dtype=torch.float32):
        buffer = torch.full((size + 64,), sentinel if dtype.is_floating_point else 77, dtype=dtype)
        return buffer, buffer[:size]
    z_buf, z = within(n * c * h * w)
    z.copy_(torch.randn(z.numel()))
    (out_buf, out), (code_buf, code), (taken_buf, taken) = within(pooled), within(pooled, torch.uint8), within(pooled)
    (dz_buf, dz), (g_buf, g) = within(n * c * h * w), within(pooled)
    g.copy_(torch.randn(pooled))
    w_, b_, rm, rv = torch.ones(c), torch.zeros(c), torch.zeros(c), torch.ones(c)
    mean, invstd = torch.empty(c, dtype=torch.float64), torch.empty(c, dtype=torch.float64)
    dw, db = torch.empty(c), torch.empty(c)
    native._call("relu_pool", torch.float32, z, out, code, *shape)
    native._call("relu_pool_backward", torch.float32, g, code, dz, *shape)
    native._call("bn_relu_pool", torch.float32, z, w_, b_, rm, rv, 0.1, 1e-5, out, code, taken, mean, invstd, *shape)
    native._call("bn_relu_pool_backward", torch.float32, g, code, taken, z, w_, mean, invstd, dz, dw, db, *shape)
    for buf, size in ((z_buf, z.numel()), (out_buf, pooled), (taken_buf, pooled), (dz_buf, dz.numel()),
                      (g_buf, pooled)):
        assert torch.all(buf[size:] == sentinel)
    assert torch.all(code_buf[pooled:] == 77)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(32, 16, 28, 28), (3, 6, 28, 28), (2, 9, 11, 13), (1, 1, 5, 12)])
def test_first_conv_equals_pytorch(shape, dtype):
    """The one-channel 5x5 convolution: output, weight and bias gradients against F.conv2d in float64 (widths that
    leave a shifted, overlapping last block: 24 = 3 x 8, 9 = 8 + 1, 12 - 4 = 8 exactly), more than 8 output
    channels (two register groups) and fewer. In float32 each result is at least as near the float64 one as
    PyTorch's own float32 convolution (whose weight gradient sums 18,432 products in its own order)."""
    n, outs, h, w = shape
    gen = torch.Generator().manual_seed(2)
    conv = torch.nn.Conv2d(1, outs, 5).to(dtype)
    x = tricky((n, 1, h, w), dtype, 3).nan_to_num(0.25)
    if w - 4 < native.LANES[dtype]:
        assert not native.covers_first_conv(x, conv)
        return
    assert native.covers_first_conv(x, conv)
    assert_block_near_float64(native.first_conv, lambda z: z, x, conv, gen, slack=2)
    assert not native.covers_first_conv(x.clone().requires_grad_(True), conv)  # no input gradient here
    assert not native.covers_first_conv(x, torch.nn.Conv2d(1, outs, 3).to(dtype))
    assert not native.covers_first_conv(x, torch.nn.Conv2d(1, outs, 5, padding=1).to(dtype))


def assert_block_near_float64(ours, block, x: torch.Tensor, conv: torch.nn.Conv2d, gen: torch.Generator,
                              slack: float) -> torch.Tensor:
    """ours(x, conv), a first-conv kernel, against block(conv(x)) in PyTorch's float64 ops: the output and, for a
    random output gradient, the weight and bias gradients. In float64 within 1e-12 (relative to the reference's
    size, at least 1); in float32 no farther from float64 than `slack` times PyTorch's own float32 block, or 1e-6 of
    the reference's size. Returns our output."""
    exact, torch32 = copy.deepcopy(conv).double(), copy.deepcopy(conv)
    got, want = ours(x, conv), block(exact(x.double()))
    assert got.shape == want.shape
    grad = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    got.backward(grad.to(x.dtype))
    want.backward(grad)
    results = {"output": (got, want)} | {name: (getattr(conv, name).grad, getattr(exact, name).grad)
                                         for name in ("weight", "bias")}
    baseline = None
    if x.dtype == torch.float32:
        theirs = block(torch32(x))
        theirs.backward(grad.float())
        baseline = {"output": theirs, "weight": torch32.weight.grad, "bias": torch32.bias.grad}
    for name, (mine, reference) in results.items():
        error = float((mine.detach().double() - reference.detach()).abs().max())
        if baseline is None:
            assert error <= 1e-12 * max(1.0, float(reference.detach().abs().max())), name
        else:
            pytorch_error = float((baseline[name].detach().double() - reference.detach()).abs().max())
            bound = max(slack * pytorch_error, 1e-6 * float(reference.detach().abs().max()))
            assert error <= bound, (name, error, pytorch_error)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(32, 16, 28, 28), (3, 8, 28, 28), (2, 24, 12, 14), (2, 8, 8, 14), (2, 32, 12, 14)])
def test_first_conv_relu_pool_equals_pytorch(shape, dtype):
    """The BN-free CNN's first block in one kernel, F.max_pool2d(relu(conv(x)), 2) in channels_last: values and
    the weight and bias gradients against PyTorch's float64 ops (one to three channel vectors; an odd number of
    windows a row, 5, leaves a window without its pair). In float32 each result is at least as near float64 as
    PyTorch's own float32 block (smooth random inputs: a near-tie at float32 precision would route the gradient
    elsewhere in either; the inputs are fixed, so this test is deterministic)."""
    n, outs, h, w = shape
    gen = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv2d(1, outs, 5).to(dtype)
    x = torch.randn((n, 1, h, w), generator=gen, dtype=dtype)
    assert native.covers_first_conv_pool(x, conv)
    got = assert_block_near_float64(native.first_conv_relu_pool, plain_relu_pool, x, conv, gen, slack=1)
    assert got.is_contiguous(memory_format=torch.channels_last)


def test_first_conv_relu_pool_takes_the_first_of_tied_windows_and_covers_only_its_shapes():
    """A constant image gives four equal conv outputs in every window: the gradient goes to each window's top
    left position, as max_pool2d sends it, so the weight gradient is the hand sum over the windows' top-left
    patches; a negative bias kills every window (no gradient at all)."""
    x = torch.full((1, 1, 12, 12), 0.5, dtype=torch.float64)
    for bias in (1.0, -100.0):
        conv = torch.nn.Conv2d(1, 8, 5).double()
        with torch.no_grad():
            conv.weight.fill_(0.25)
            conv.bias.fill_(bias)
        out = native.first_conv_relu_pool(x, conv)
        out.backward(torch.ones_like(out))
        if bias < 0:
            assert torch.all(out == 0) and torch.all(conv.weight.grad == 0) and torch.all(conv.bias.grad == 0)
            continue
        # the four positions of every window hold 25 * 0.5 * 0.25 + 1; each window sends its gradient 1 to its
        # top-left position, whose 5x5 patch is all 0.5: dW = 16 windows * 0.5, db = 16
        assert torch.all(out == 25 * 0.5 * 0.25 + 1)
        assert torch.all(conv.weight.grad == 16 * 0.5) and torch.all(conv.bias.grad == 16)
    conv = torch.nn.Conv2d(1, 8, 5)
    assert native.covers_first_conv_pool(torch.randn(2, 1, 12, 12), conv)
    assert not native.covers_first_conv_pool(torch.randn(2, 1, 13, 12), conv)  # 9 conv rows: odd
    assert not native.covers_first_conv_pool(torch.randn(2, 1, 12, 12), torch.nn.Conv2d(1, 12, 5))  # 12 channels


@pytest.mark.parametrize("variant", ["", "_wide"])
def test_the_first_block_writes_nothing_outside_its_tensors(variant):
    n, outs, h, w = 3, 16, 12, 14
    pooled = n * outs * ((h - 4) // 2) * ((w - 4) // 2)
    sentinel = 1234.5

    def within(size, dtype=torch.float32):
        buffer = torch.full((size + 64,), sentinel if dtype.is_floating_point else 77, dtype=dtype)
        return buffer, buffer[:size]
    (out_buf, out), (code_buf, code), (g_buf, g) = within(pooled), within(pooled, torch.uint8), within(pooled)
    (dw_buf, dw), (db_buf, db) = within(outs * 25), within(outs)
    x, weight, bias = torch.randn(n, 1, h, w), torch.randn(outs, 1, 5, 5), torch.randn(outs)
    g.copy_(torch.randn(pooled))
    native._call("conv1_relu_pool_nhwc" + variant, torch.float32, x, weight, bias, out, code, n, h, w, outs)
    native._call("conv1_relu_pool_nhwc_backward" + variant, torch.float32, x, g, code, dw, db, n, h, w, outs)
    for buf, size in ((out_buf, pooled), (g_buf, pooled), (dw_buf, outs * 25), (db_buf, outs)):
        assert torch.all(buf[size:] == sentinel)
    assert torch.all(code_buf[pooled:] == 77)


def test_gradient_goes_to_the_first_maximum_of_a_window():
    """Hand-made windows (row-major in the window): the gradient lands where max_pool2d puts it."""
    x = torch.tensor([[[[1.0, 2.0, 0.0, -1.0, 3.0, 3.0, -2.0, -2.0],
                        [2.0, 0.5, 0.0, -3.0, 3.0, 3.0, -2.0, 5.0]]]], requires_grad=True)
    native.relu_pool(x).backward(torch.tensor([[[[10.0, 20.0, 30.0, 40.0]]]]))
    # windows: max 2 first at (0,1); all <= 0: no gradient; four-way tie of 3: (0,0); only positive is (1,1)
    expected = torch.tensor([[[[0.0, 10.0, 0.0, 0.0, 30.0, 0.0, 0.0, 0.0],
                               [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 40.0]]]])
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_inputs_the_kernels_do_not_cover_take_pytorch():
    x = torch.randn(2, 3, 8, 8)
    assert not native.covers(x.contiguous(memory_format=torch.channels_last))  # 3 channels: not a vector's width
    assert not native.covers_batch_norm(torch.randn(2, 16, 8, 8).contiguous(memory_format=torch.channels_last),
                                        torch.nn.BatchNorm2d(16))
    assert not native.covers(torch.randn(2, 3, 7, 8))
    assert not native.covers(x.half())
    assert not native.covers(x[:, :, :, ::2].repeat(1, 1, 1, 1)[:, :, ::2])  # not contiguous
    odd = torch.randn(2, 3, 7, 9)
    torch.testing.assert_close(relu_pool(odd), plain_relu_pool(odd), rtol=0, atol=0)


def uncovered_inputs(dtype=torch.float32):
    """Inputs the pooling kernels do not take, which the public entry points once handed to them anyway."""
    gen = torch.Generator().manual_seed(4)
    x = lambda *shape: torch.randn(shape, generator=gen, dtype=dtype)  # noqa: E731
    return {"channels_last_3_channels": x(2, 3, 8, 8).contiguous(memory_format=torch.channels_last),
            "strided_view": x(2, 4, 8, 16)[..., ::2],
            "transposed_view": x(2, 4, 8, 8).transpose(2, 3),
            "odd_sides": x(2, 4, 7, 9),
            "float16": x(2, 4, 8, 8).half(),
            "empty_batch": x(0, 4, 8, 8)}


@pytest.mark.parametrize("case", list(uncovered_inputs()))
def test_relu_pool_on_an_input_the_kernels_do_not_cover_equals_pytorch(case):
    """native.relu_pool called directly (not through nets.relu_pool, which checks `covers` first) on a layout,
    shape or dtype the kernels would misread (channels_last with 3 channels and strided views once corrupted the
    heap): PyTorch's values and gradient, bit for bit."""
    assert native.library() is not None, native.why_not  # else this would pass on PyTorch's ops alone
    x = uncovered_inputs()[case]
    assert not native.covers(x)
    got_in, ref_in = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got, want = native.relu_pool(got_in), plain_relu_pool(ref_in)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(5)).to(x.dtype)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(got_in.grad, ref_in.grad, rtol=0, atol=0)


def test_the_other_entry_points_on_inputs_their_kernels_do_not_cover_equal_pytorch():
    """batch_norm_relu_pool, first_conv and first_conv_relu_pool called directly on what their kernels do not take
    (channels_last, strided or float64 images with float32 layers, three input channels, an input that needs a
    gradient): PyTorch's modules' values, or PyTorch's own error for mixed dtypes, never the kernels' misreading."""
    assert native.library() is not None, native.why_not
    gen = torch.Generator().manual_seed(6)
    bn, ref_bn = torch.nn.BatchNorm2d(16), torch.nn.BatchNorm2d(16)
    x = torch.randn(4, 16, 8, 8, generator=gen).contiguous(memory_format=torch.channels_last)
    assert not native.covers_batch_norm(x, bn)
    torch.testing.assert_close(native.batch_norm_relu_pool(x, bn), plain_relu_pool(ref_bn(x)), rtol=0, atol=0)
    for name in ("running_mean", "running_var", "num_batches_tracked"):  # counted once, as BatchNorm2d does
        torch.testing.assert_close(getattr(bn, name), getattr(ref_bn, name), rtol=0, atol=0, msg=name)
    with pytest.raises(RuntimeError):  # as bn(x) itself raises
        native.batch_norm_relu_pool(x.double().contiguous(), bn)

    conv, conv3 = torch.nn.Conv2d(1, 8, 5), torch.nn.Conv2d(3, 8, 5)
    images = torch.randn(4, 1, 12, 24, generator=gen)
    for x, layer in ((images[..., ::2], conv), (torch.randn(4, 3, 12, 12, generator=gen), conv3),
                     (images[..., :12].clone().requires_grad_(True), conv)):
        assert not native.covers_first_conv(x, layer)
        torch.testing.assert_close(native.first_conv(x, layer), layer(x), rtol=0, atol=0)
        pooled = native.first_conv_relu_pool(x, layer)
        torch.testing.assert_close(pooled, plain_relu_pool(layer(x)), rtol=0, atol=0)
        assert pooled.is_contiguous(memory_format=torch.channels_last)
    grad_in = images[..., :12].clone().requires_grad_(True)
    native.first_conv(grad_in, conv).sum().backward()  # the input's gradient, which the kernel does not give
    want = images[..., :12].clone().requires_grad_(True)
    conv(want).sum().backward()
    torch.testing.assert_close(grad_in.grad, want.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError):  # as conv(x) itself raises
        native.first_conv(images[..., :12].double(), conv)


class Fast(torch.nn.Module):
    """The CNN as the runtime runs it (runtime/cnn.py: the kernels where they cover it)."""

    def __init__(self, cnn):
        super().__init__()
        self.cnn = cnn

    def forward(self, x):
        return cnn.cnn_forward(self.cnn, x)


class Plain(torch.nn.Module):
    """The same CNN's forward with PyTorch's pooling (the reference)."""

    def __init__(self, cnn):
        super().__init__()
        self.cnn = cnn

    def forward(self, x):
        c = self.cnn
        x = plain_relu_pool(c.bn2(c.conv2(plain_relu_pool(c.bn1(c.conv1(x))))))
        return c.fc3(torch.relu(c.fc2(torch.relu(c.fc1(x.flatten(1))))))


@pytest.mark.parametrize("name", ["cnn_bn", "lenet5"])
def test_a_cnn_trains_through_the_kernels_as_with_pytorch_pooling(name):
    """Ten SGD steps (momentum) of a BatchNorm CNN in float64 on MNIST-sized inputs, the kernels' forward against
    the reference's: parameters and running statistics equal (the pooled values and gradients are exact, so only
    the order of float64 sums elsewhere could differ)."""
    net = build_model(ModelConfig(name), (1, 28, 28), 10, 0).double()
    assert_ten_sgd_steps_equal(Fast(net), Plain(copy.deepcopy(net)))


def assert_ten_sgd_steps_equal(net: torch.nn.Module, ref: Plain) -> None:
    """Ten SGD steps (momentum) of net and of the reference on the same MNIST-sized float64 batches: equal
    parameters and running statistics."""
    torch.manual_seed(0)
    x = torch.rand(10, 16, 1, 28, 28, dtype=torch.float64)
    x[:, :, :, :6] = 0  # MNIST-like empty rows: constant windows after the first convolution
    y = torch.randint(0, 10, (10, 16))
    for model in (net, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        for t in range(10):
            opt.zero_grad()
            F.cross_entropy(model(x[t]), y[t]).backward()
            opt.step()
    got, want = net.cnn.state_dict(), ref.cnn.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_first_blocks_wide_variant_equals_the_standard_one_bit_for_bit(dtype):
    """The 64-byte-vector variant (taken where the CPU has 512-bit registers: native.wide) does each channel's
    arithmetic in the same order as the 32-byte one, so outputs, codes and gradients are equal bit for bit; it
    compiles everywhere, so this runs on any machine (2 wide vectors of channels, an odd number of windows a row)."""
    n, outs, h, w = 3, 2 * native.WIDE_LANES[dtype], 12, 14
    gen = torch.Generator().manual_seed(7)
    x, weight, bias = (torch.randn(shape, generator=gen, dtype=dtype)
                       for shape in ((n, 1, h, w), (outs, 1, 5, 5), (outs,)))
    pooled = (n, (h - 4) // 2, (w - 4) // 2, outs)
    g = torch.randn(pooled, generator=gen, dtype=dtype)
    results = []
    for variant in ("", "_wide"):
        out, code = torch.empty(pooled, dtype=dtype), torch.empty(pooled, dtype=torch.uint8)
        dw, db = torch.empty(outs, 25, dtype=dtype), torch.empty(outs, dtype=dtype)
        native._call("conv1_relu_pool_nhwc" + variant, dtype, x, weight, bias, out, code, n, h, w, outs)
        native._call("conv1_relu_pool_nhwc_backward" + variant, dtype, x, g, code, dw, db, n, h, w, outs)
        results.append((out, code, dw, db))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert (results[0][1] == 4).any() and (results[0][1] < 4).any()  # dead and live windows both


def test_a_bn_free_cnn_trains_through_its_fused_first_block_as_with_pytorch():
    """Ten SGD steps of the BN-free CNN as pfedkit holds it (a FlatModel, the standard layout) through the runtime's
    forward (the first block one kernel with a channels_last output) in float64, against the same CNN with
    PyTorch's ops: equal parameters."""
    net = FlatModel(build_model(ModelConfig("cnn"), (1, 28, 28), 10, 0).double()).module
    ref = Plain(build_model(ModelConfig("cnn"), (1, 28, 28), 10, 0).double())
    assert native.covers_first_conv_pool(torch.rand(16, 1, 28, 28, dtype=torch.float64), net.conv1)
    assert cnn.first_block(net, torch.rand(2, 1, 28, 28, dtype=torch.float64)).is_contiguous(
        memory_format=torch.channels_last)
    assert_ten_sgd_steps_equal(Fast(net), ref)


def test_torch_func_transforms_take_pytorch_ops():
    """torch.func.grad through a BatchNorm CNN (the kernels' raw pointers cannot see its wrapped tensors): the
    models fall back to PyTorch's ops and give autograd's gradient."""
    net = build_model(ModelConfig("cnn_bn"), (1, 28, 28), 10, 0).double()
    x, y = torch.rand(6, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (6,))
    params = {k: v.detach() for k, v in net.named_parameters()}
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    fast = Fast(net)
    named = lambda d: {"cnn." + k: v for k, v in d.items()}  # noqa: E731  (the runtime's forward of the CNN)
    loss = lambda p, b: F.cross_entropy(torch.func.functional_call(fast, named({**p, **b}), (x,)), y)  # noqa: E731
    grads = torch.func.grad(loss)(params, buffers)  # the buffers an input: train-mode BatchNorm updates them
    F.cross_entropy(net(x), y).backward()
    for name, p in net.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def run_python(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


CHECK = ("import torch; from pfedkit.runtime import native; from pfedkit.runtime.cnn import relu_pool; "
         "x = torch.randn(2, 3, 8, 8); import torch.nn.functional as F; "
         "assert torch.equal(relu_pool(x), F.max_pool2d(torch.relu(x), 2)); print(native.why_not)")


def test_with_pfedkit_native_0_the_runtime_takes_pytorch_ops():
    assert run_python(CHECK, PFEDKIT_NATIVE="0") == "PFEDKIT_NATIVE=0"


def test_the_kernels_are_pytorch_operators_with_fake_and_autograd_registrations():
    """torch.library.opcheck on every op: its schema, its fake implementation against the real one (shapes,
    dtypes, strides: what torch.compile traces with), its autograd registration, and AOT dispatch."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4, 16, 8, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    nhwc = torch.randn(4, 16, 8, 8, dtype=torch.float64, generator=gen).contiguous(
        memory_format=torch.channels_last).requires_grad_(True)
    images = torch.rand(3, 1, 12, 16, dtype=torch.float64, generator=gen)
    weight = torch.randn(8, 1, 5, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(8, dtype=torch.float64, generator=gen, requires_grad=True)
    gamma, beta = (torch.randn(16, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    stats = torch.zeros(16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    ops = torch.ops.pfedkit
    for op, args in ((ops.relu_pool, (z,)), (ops.relu_pool, (nhwc,)),
                     (ops.bn_relu_pool, (z, gamma, beta, *stats, 0.1, 1e-5)),
                     (ops.conv1, (images, weight, bias)), (ops.conv1_relu_pool, (images, weight, bias))):
        torch.library.opcheck(op, args)


def test_the_kernels_compile_with_torch_compile():
    """torch.compile traces the runtime's CNN forward through the ops (fake implementations) without a graph break,
    and the compiled step gives the eager kernels' loss and gradients."""
    torch._dynamo.reset()
    net = build_model(ModelConfig("cnn_bn"), (1, 28, 28), 10, 0).double()
    x, y = torch.rand(8, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (8,))
    eager_net, compiled_net = copy.deepcopy(net), copy.deepcopy(net)
    compiled = torch.compile(lambda m, x: cnn.cnn_forward(m, x), fullgraph=True, backend="aot_eager")
    F.cross_entropy(cnn.cnn_forward(eager_net, x), y).backward()
    F.cross_entropy(compiled(compiled_net, x), y).backward()
    for (name, a), b in zip(eager_net.named_parameters(), compiled_net.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-12, msg=name)


# ---- the whole training step in C (native.CNNStep, kernels.c cnn_bn_step) ------------------------------------------

def step_batch(batch: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, 1, 28, 28, generator=gen, dtype=dtype)
    x[:, :, :6] = 0  # MNIST-like empty rows: constant windows, ties in the pooling
    return x, torch.arange(batch) % 10


@pytest.mark.parametrize("name", ["lenet5", "cnn_bn"])
@pytest.mark.parametrize("batch", [32, 7])
def test_the_c_training_step_equals_pytorch_in_float64(name, batch):
    """One step: the mean cross-entropy, every parameter's gradient and the updated running statistics against
    PyTorch's own ops (conv2d, BatchNorm2d, max_pool2d, linear, cross_entropy; `Plain`) in float64. A batch of 7 is
    a short last batch (the workspace made for 32 is reused)."""
    net = build_model(ModelConfig(name), (1, 28, 28), 10, 0).double()
    ref = Plain(copy.deepcopy(net))
    model = FlatModel(net)
    model.module.train()
    step = native.cnn_step(model.module, step_batch(1, torch.float64)[0])
    assert step is not None, native.why_not
    step(*step_batch(32, torch.float64, seed=1))  # a first step of 32 (its workspace); then the step under test
    ref.train()
    F.cross_entropy(ref(step_batch(32, torch.float64, seed=1)[0]), step_batch(32, torch.float64, seed=1)[1])
    model.grad.fill_(123.0)  # overwritten, not added to
    x, y = step_batch(batch, torch.float64)
    loss = step(x, y)
    expected = F.cross_entropy(ref(x), y)
    expected.backward()
    assert abs(loss - float(expected.detach())) < 1e-12
    got = {n: p.grad for n, p in model.module.named_parameters()}
    for name_, p in ref.cnn.named_parameters():
        torch.testing.assert_close(got[name_], p.grad, rtol=0, atol=1e-12, msg=name_)
    for name_, b in ref.cnn.named_buffers():
        if b.dtype == torch.float64:
            torch.testing.assert_close(dict(model.module.named_buffers())[name_], b, rtol=0, atol=1e-12, msg=name_)


def test_the_c_training_step_in_float32_is_as_near_float64_as_pytorch():
    net = build_model(ModelConfig("lenet5"), (1, 28, 28), 10, 0)
    exact = Plain(copy.deepcopy(net).double())
    plain32 = Plain(copy.deepcopy(net))
    model = FlatModel(net)
    model.module.train()
    x, y = step_batch(32, torch.float32)
    native.cnn_step(model.module, x)(x, y)
    for ref, xs in ((exact, x.double()), (plain32, x)):
        ref.train()
        F.cross_entropy(ref(xs), y).backward()
    want = torch.cat([p.grad.flatten() for p in exact.cnn.parameters()])
    theirs = torch.cat([p.grad.flatten() for p in plain32.cnn.parameters()]).double()
    ours = torch.cat([p.grad.flatten() for p in model.module.parameters()]).double()
    scale = want.abs().max()
    assert (ours - want).abs().max() / scale <= max(2 * (theirs - want).abs().max() / scale, 1e-6)


needs_step_build = pytest.mark.skipif(native.library() is None or native.variant not in cnn.STEP_BUILDS,
                                      reason="the whole C step is taken on the AVX512 build only")


@needs_step_build
@pytest.mark.parametrize("frozen", [False, True])
def test_sgd_takes_the_c_step_for_lenet5_and_trains_as_a_plain_loop(frozen):
    """train.sgd on FL-bench's LeNet-5 (float64, momentum, a short last batch) goes through the C step and ends
    where torch.optim.SGD over the same batches does: with a plain objective (and weight decay) all its steps in
    one C call (CNNStep.sgd), with a frozen head (an objective with a trainable mask) one C call a step."""
    from pfedkit.config import LocalConfig
    from pfedkit.data.federated import ClientData
    from pfedkit.train import Objective, batch_indices, sgd

    net = build_model(ModelConfig("lenet5"), (1, 28, 28), 10, 0).double()
    ref = Plain(copy.deepcopy(net))
    model = FlatModel(net)
    x, y = step_batch(45, torch.float64)  # batches of 16: 16, 16, 13
    client = ClientData(x, y, x[:0], y[:0])
    decay = 0.0 if frozen else 1e-3  # torch.optim.SGD would decay a frozen head
    hp = LocalConfig(epochs=2, batch_size=16, lr=0.1, momentum=0.5, weight_decay=decay)
    objective = Objective()
    if frozen:
        objective.trainable = torch.ones(model.param_size, dtype=torch.float64)
        objective.trainable[model.head_layers[0].params] = 0.0
    loss = sgd(model, client, hp, torch.Generator().manual_seed(3), objective)
    assert model.module in native.STEPS  # the C step ran
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5, weight_decay=decay)
    ref.train()
    losses = []
    for idx in batch_indices(45, hp, torch.Generator().manual_seed(3), torch.device("cpu")):
        opt.zero_grad()
        batch_loss = F.cross_entropy(ref(x[idx]), y[idx])
        batch_loss.backward()
        losses.append(float(batch_loss.detach()))
        if frozen:
            ref.cnn.fc3.weight.grad.zero_()
            ref.cnn.fc3.bias.grad.zero_()
        opt.step()
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    got = model.module.state_dict()
    for key, want in ref.cnn.state_dict().items():
        if key in got:  # not num_batches_tracked, which FlatModel drops
            torch.testing.assert_close(got[key], want, rtol=0, atol=1e-11, msg=key)


def test_the_c_step_is_taken_on_the_avx512_build_only():
    """On the AVX2 and DEFAULT builds the step's 64-byte vectors split and spill (4-10 times slower than the
    autograd step with the per-op kernels: docs/performance.md): a process whose PyTorch runs at a lower CPU
    capability loads that build and trains LeNet-5 through autograd."""
    probe = ("import torch; from pfedkit.config import ModelConfig; from pfedkit.models import FlatModel, build_model;"
             " from pfedkit.runtime import cnn, native;"
             " m = FlatModel(build_model(ModelConfig('lenet5'), (1, 28, 28), 10, 0)).module;"
             " print(native.variant, cnn.training_step(m, torch.zeros(1, 1, 28, 28)) is not None)")
    for capability in ("default", "avx2", "avx512"):
        said = run_python(probe, ATEN_CPU_CAPABILITY=capability).split()
        if said[0] == capability:  # else this CPU (or build) does not have it
            assert said[1] == str(capability in cnn.STEP_BUILDS), said


@needs_step_build
def test_the_c_step_is_not_taken_where_it_does_not_cover_or_pay():
    lenet = FlatModel(build_model(ModelConfig("lenet5"), (1, 28, 28), 10, 0))
    x = torch.zeros(1, 1, 28, 28)
    assert cnn.training_step(lenet.module, x) is not None
    flat = lambda name, side=28: FlatModel(build_model(ModelConfig(name), (1, side, side), 10, 0)).module  # noqa
    assert cnn.training_step(flat("cnn_bn"), x) is not None
    assert cnn.training_step(flat("cnn"), x) is None  # no BN
    assert cnn.training_step(flat("lenet5", 32),
        torch.zeros(1, 1, 32, 32)) is None  # conv2's kernels are for 28x28 images
    assert cnn.training_step(lenet.module, x.double()) is None  # another dtype than the parameters'
    lenet.module.eval()
    assert cnn.training_step(lenet.module, x) is None
    lenet.module.train()
    handle = lenet.module.fc2.register_forward_hook(lambda *args: None)
    assert cnn.training_step(lenet.module, x) is None  # the step would skip the hook
    handle.remove()
    step = cnn.training_step(lenet.module, x)
    with pytest.raises(IndexError, match=r"labels must lie in \[0, 10\)"):
        step(torch.zeros(4, 1, 28, 28), torch.tensor([0, 3, 10, 1]))


def test_the_c_step_refuses_what_it_would_misread_and_widens_uint8_labels():
    """CNNStep called directly reads raw memory: int32 labels (read as int64: a segfault), a float64 batch in a
    float32 step (read as float32: garbage), other image sizes, label counts or devices are refused with an error
    before anything is written; uint8 labels (which F.cross_entropy takes) give PyTorch's loss and gradients."""
    net = build_model(ModelConfig("lenet5"), (1, 28, 28), 10, 0).double()
    ref = Plain(copy.deepcopy(net))
    model = FlatModel(net)
    model.module.train()
    x, y = step_batch(8, torch.float64)
    step = native.cnn_step(model.module, x)
    assert step is not None, native.why_not
    model.grad.fill_(123.0)
    before = model.vector.clone()
    refused = [(TypeError, x, y.int()), (TypeError, x, y.double()), (TypeError, x.float(), y),
               (ValueError, x[:, :, :24, :24], y), (ValueError, x.expand(8, 3, 28, 28), y), (ValueError, x, y[:5]),
               (ValueError, x[:0], y[:0]), (IndexError, x, y + 10)]
    for error, images, labels in refused:
        with pytest.raises(error):
            step(images, labels)
    assert torch.all(model.grad == 123.0) and torch.equal(model.vector, before)

    loss = step(x, y.to(torch.uint8))
    ref.train()
    expected = F.cross_entropy(ref(x), y)
    expected.backward()
    assert abs(loss - float(expected.detach())) < 1e-12
    got = dict(model.module.named_parameters())
    for name, p in ref.cnn.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=0, atol=1e-12, msg=name)


def test_the_c_local_sgd_refuses_what_it_would_misread():
    """CNNStep.sgd called directly: images or labels it would misread (as the step), index tensors that are not
    integer vectors, labels that do not match the images, or flat vectors of another size or dtype than the
    module's (the update runs over params.numel() elements of each): an error, the parameters untouched."""
    net = build_model(ModelConfig("lenet5"), (1, 28, 28), 10, 0)
    model = FlatModel(net)
    model.module.train()
    x, y = step_batch(20, torch.float32)
    step = native.cnn_step(model.module, x)
    assert step is not None, native.why_not
    params, grad = model.vector[model.param_slice], model.grad
    velocity = torch.zeros_like(params)
    before = params.clone()
    batches = [torch.arange(10), torch.arange(10, 20)]
    calls = [dict(x_all=x.double()), dict(y_all=y.int()), dict(y_all=y[:10]),
             dict(batches=[torch.arange(10.0)]), dict(batches=[torch.arange(10)[None]]), dict(batches=[]),
             dict(batches=[torch.arange(0)]), dict(params=params[:-1]), dict(grad=grad.double()),
             dict(velocity=torch.zeros(5)), dict(params=params.clone()), dict(batches=[torch.tensor([0, 20])])]
    for change in calls:
        args = dict(x_all=x, y_all=y, batches=batches, params=params, grad=grad, velocity=velocity) | change
        with pytest.raises((TypeError, ValueError, IndexError)):
            step.sgd(lr=0.1, momentum=0.5, weight_decay=0.0, **args)
    assert torch.equal(params, before) and torch.all(velocity == 0)
    losses = step.sgd(x, y, batches, params, grad, velocity, lr=0.1, momentum=0.5, weight_decay=0.0)
    assert losses.shape == (2,) and torch.isfinite(losses).all() and not torch.equal(params, before)
