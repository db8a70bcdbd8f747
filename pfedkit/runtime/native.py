"""pfedkit's C kernels (kernels.c) for a small CNN's hot spots on a CPU, as PyTorch custom operators
(`torch.ops.pfedkit.*`, registered with torch.library: fake implementations for torch.compile, autograd
formulas for training): ReLU + 2x2 max pooling, training-mode BatchNorm + ReLU + pooling, the 5x5 convolution of
one-channel images, and that convolution fused with ReLU + pooling in channels_last (the BN-free CNN's first
block); and the BatchNorm CNNs' whole training step as one call (CNNStep, runtime/cnn.py decides where).

The package's build compiles kernels.c once per CPU capability, as PyTorch does its own CPU kernels (setup.py:
DEFAULT, AVX2, AVX512, portable baselines, never -march=native), into shared libraries beside this file; the one
PyTorch's own capability check picks (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY
overrides) is loaded, through ctypes (calls release the GIL, so clients side by side use their cores). Nothing is
compiled at run time and nothing is loaded from outside the installed package.

The kernels are optional. Where the install has none (built without a C compiler), on another device, for a
layout or shape they do not cover, under a torch.func transform (the ops' autograd formulas do not reach functorch),
or with PFEDKIT_NATIVE=0 in the environment, the runtime (runtime/cnn.py) runs the same arithmetic on PyTorch's
ops: the pooling equal bit for bit, BatchNorm and the convolution to rounding (tests/test_native.py); `why_not`
says in one line why, and the run's "clients: ..." line repeats it.
"""
from __future__ import annotations

import ctypes
import os
import sysconfig
import threading
import weakref
from pathlib import Path

import torch
from torch import Tensor

try:
    from torch._C._functorch import peek_interpreter_stack
except ImportError:  # a torch without torch.func
    def peek_interpreter_stack():
        return None

SOURCE = Path(__file__).with_name("kernels.c")
SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
# the build's variants (setup.py) by PyTorch's CPU capability names, the best first
CAPABILITIES = ("avx512", "avx2", "default")

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {  # the kernels' arguments: pointers, then (N, C, H, W)
    "relu_pool": [_P] * 3 + [_I] * 4,
    "relu_pool_backward": [_P] * 3 + [_I] * 4,
    "relu_pool_nhwc": [_P] * 3 + [_I] * 4,
    "relu_pool_nhwc_backward": [_P] * 3 + [_I] * 4,
    "bn_relu_pool": [_P] * 5 + [_D, _D] + [_P] * 5 + [_I] * 4,
    "bn_relu_pool_backward": [_P] * 10 + [_I] * 4,
    "conv1": [_P] * 4 + [_I] * 4,
    "conv1_weight_grad": [_P] * 4 + [_I] * 4,
    "conv1_relu_pool_nhwc": [_P] * 5 + [_I] * 4,
    "conv1_relu_pool_nhwc_backward": [_P] * 5 + [_I] * 4,
    "cnn_bn_step": [_P] * 6 + [_I] * 7 + [_P],
    "cnn_bn_sgd": [_P] * 9 + [_I] * 6 + [_P] * 5 + [_I] + [_P] * 2,
}
LANES = {torch.float32: 8, torch.float64: 4}  # the kernels' vector width (kernels.c: 32 bytes)
# the first block's wide variant (64 bytes), taken where the build has 512-bit registers and the channels fill them
WIDE_KERNELS = ("conv1_relu_pool_nhwc", "conv1_relu_pool_nhwc_backward")
WIDE_LANES = {torch.float32: 16, torch.float64: 8}
wide = False  # whether the loaded build runs the wide variant natively (set when the library loads)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_kernels: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}  # (name, dtype): the typed function
_tried = False
why_not = ""  # why the kernels are not in use, when they are not
variant = ""  # the build in use: one of CAPABILITIES


def built(name: str) -> Path:
    """Where the build puts the variant `name` (setup.py)."""
    return Path(__file__).with_name(f"_kernels_{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}")


def _variants() -> list[str]:
    """The builds this CPU runs, the best first, by PyTorch's own capability check."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return list(CAPABILITIES[CAPABILITIES.index(capability):]) if capability in CAPABILITIES else ["default"]


def _whole(path: Path) -> None:
    """OSError where an ELF library ends before its section headers do: a truncated file (a damaged install) maps
    past its end when loaded and kills the process (SIGBUS) instead of failing."""
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
    if head[:4] != b"\x7fELF" or head[4] != 2:  # not a 64-bit ELF (another platform's format): the loader decides
        return
    order = "little" if head[5] == 1 else "big"
    end = int.from_bytes(head[0x28:0x30], order) + int.from_bytes(head[0x3A:0x3C], order) * int.from_bytes(
        head[0x3C:0x3E], order)
    if end > size:
        raise OSError(f"truncated ({size} of at least {end} bytes)")


def _bind(lib: ctypes.CDLL) -> dict[tuple[str, torch.dtype], ctypes._CFuncPtr]:
    """The kernels' typed functions; AttributeError where a symbol is missing (not this source's library)."""
    kernels = {}
    for dtype, suffix in SUFFIX.items():
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
            kernels[name, dtype] = fn
        for name in WIDE_KERNELS:
            fn = getattr(lib, f"{name}_wide_{suffix}")
            fn.argtypes, fn.restype = SIGNATURES[name], None
            kernels[name + "_wide", dtype] = fn
    lib.wide_vectors_native  # noqa: B018 (raises AttributeError where it is missing)
    return kernels


def library() -> ctypes.CDLL | None:
    """The kernels' library, loaded on first use; None (and `why_not` says why) where there is none to load."""
    global _library, _tried, why_not, wide, variant
    if _tried:
        return _library
    with _lock:
        if _tried:
            return _library
        if os.environ.get("PFEDKIT_NATIVE", "1") == "0":
            why_not = "PFEDKIT_NATIVE=0"
        else:
            present = [v for v in _variants() if built(v).is_file()]
            if not present:
                why_not = (f"this install has no build of {SOURCE.name} (it was built without a C compiler; "
                           f"`pip install -e .` or a wheel built where one is rebuilds them)")
            else:
                try:
                    _whole(built(present[0]))
                    lib = ctypes.CDLL(str(built(present[0])))
                    _kernels.update(_bind(lib))
                    wide, variant, _library = bool(lib.wide_vectors_native()), present[0], lib
                except (OSError, AttributeError) as e:
                    why_not = f"{built(present[0]).name} does not load as this source's kernels: {e}"
        _tried = True
    return _library


def _ready() -> bool:
    """The kernels are loaded and no torch.func transform is active (its wrapped tensors have no data pointers)."""
    return library() is not None and peek_interpreter_stack() is None


def covers(x: torch.Tensor) -> bool:
    """Whether the pooling kernels take x: a (N, C, H, W) float32/float64 CPU tensor with even H and W, contiguous
    in the standard layout, or in channels_last with C a multiple of the vector width."""
    if not (x.device.type == "cpu" and x.dim() == 4 and x.dtype in SUFFIX and x.shape[2] % 2 == 0
            and x.shape[3] % 2 == 0 and x.numel() > 0 and _ready()):
        return False
    return x.is_contiguous() or (x.is_contiguous(memory_format=torch.channels_last)
                                 and x.shape[1] % LANES[x.dtype] == 0)


def _call(name: str, dtype: torch.dtype, *args) -> None:
    _kernels[name, dtype](*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])


# ---- the kernels as PyTorch operators ---------------------------------------------------------------------------
# Each forward op returns what its backward needs beside its output (the window codes, BatchNorm's batch
# statistics); those extra outputs take no gradient. The fake implementations give the real ones' shapes, dtypes
# and layouts, so torch.compile traces through the ops without running them.

def _layout(z: Tensor) -> torch.memory_format:
    # the standard layout, or channels_last (N, H, W, C in memory; where C is 1, the two are the same)
    return torch.contiguous_format if z.is_contiguous() else torch.channels_last


def _pooled(z: Tensor, layout: torch.memory_format) -> tuple[Tensor, Tensor]:
    out = torch.empty(*z.shape[:2], z.shape[2] // 2, z.shape[3] // 2, dtype=z.dtype, device=z.device,
                      memory_format=layout)
    return out, torch.empty_like(out, dtype=torch.uint8)  # code: which window position takes the gradient (4: none)


@torch.library.custom_op("pfedkit::relu_pool", mutates_args=())
def _relu_pool_op(z: Tensor) -> tuple[Tensor, Tensor]:
    layout = _layout(z)
    out, code = _pooled(z, layout)
    _call("relu_pool" if layout == torch.contiguous_format else "relu_pool_nhwc", z.dtype, z, out, code, *z.shape)
    return out, code


@_relu_pool_op.register_fake
def _(z):
    return _pooled(z, _layout(z))


def _unpooled(grad: Tensor, code: Tensor) -> Tensor:
    n, c, h, w = code.shape
    return torch.empty(n, c, 2 * h, 2 * w, dtype=grad.dtype, device=grad.device, memory_format=_layout(code))


@torch.library.custom_op("pfedkit::relu_pool_backward", mutates_args=())
def _relu_pool_backward_op(grad: Tensor, code: Tensor) -> Tensor:
    layout = _layout(code)
    grad_in = _unpooled(grad, code)  # every element written
    name = "relu_pool_backward" if layout == torch.contiguous_format else "relu_pool_nhwc_backward"
    _call(name, grad.dtype, grad.contiguous(memory_format=layout), code, grad_in, *grad_in.shape)
    return grad_in


_relu_pool_backward_op.register_fake(_unpooled)


def _save_code(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


_relu_pool_op.register_autograd(lambda ctx, grad, _code: _relu_pool_backward_op(grad, ctx.saved_tensors[0]),
                                setup_context=_save_code)


def relu_pool(x: torch.Tensor) -> torch.Tensor:
    """F.max_pool2d(torch.relu(x), 2) through the C kernels, for an x they cover (`covers`): the same values and
    the same gradient. Any other x (a layout, shape or dtype the kernels would misread) takes PyTorch's ops."""
    if not covers(x):
        return torch.nn.functional.max_pool2d(torch.relu(x), 2)
    return _relu_pool_op(x)[0]


def _statistics(z: Tensor) -> tuple[Tensor, Tensor]:
    return (torch.empty(z.shape[1], dtype=torch.float64, device=z.device) for _ in range(2))


@torch.library.custom_op("pfedkit::bn_relu_pool", mutates_args=())
def _bn_relu_pool_op(z: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor,
                     momentum: float, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Functional (an op with an autograd formula may not write its inputs): the running statistics updated come
    back as new tensors, which `batch_norm_relu_pool` copies into the module's."""
    out, code = _pooled(z, torch.contiguous_format)
    taken = torch.empty_like(out)
    mean, invstd = _statistics(z)
    running_mean, running_var = running_mean.clone(), running_var.clone()
    _call("bn_relu_pool", z.dtype, z, weight, bias, running_mean, running_var, momentum, eps, out, code, taken,
          mean, invstd, *z.shape)
    return out, code, taken, mean, invstd, running_mean, running_var


@_bn_relu_pool_op.register_fake
def _(z, weight, bias, running_mean, running_var, momentum, eps):
    out, code = _pooled(z, torch.contiguous_format)
    return (out, code, torch.empty_like(out), *_statistics(z), torch.empty_like(running_mean),
            torch.empty_like(running_var))


@torch.library.custom_op("pfedkit::bn_relu_pool_backward", mutates_args=())
def _bn_relu_pool_backward_op(grad: Tensor, code: Tensor, taken: Tensor, z: Tensor, weight: Tensor, mean: Tensor,
                              invstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    grad_in, grad_weight, grad_bias = torch.empty_like(z), torch.empty_like(weight), torch.empty_like(weight)
    _call("bn_relu_pool_backward", z.dtype, grad.contiguous(), code, taken, z, weight, mean, invstd, grad_in,
          grad_weight, grad_bias, *z.shape)
    return grad_in, grad_weight, grad_bias


@_bn_relu_pool_backward_op.register_fake
def _(grad, code, taken, z, weight, mean, invstd):
    return torch.empty_like(z), torch.empty_like(weight), torch.empty_like(weight)


def _save_bn(ctx, inputs, output) -> None:
    z, weight = inputs[:2]
    _, code, taken, mean, invstd, _, _ = output
    ctx.save_for_backward(z, weight, code, taken, mean, invstd)


def _bn_backward(ctx, grad, *_unused):
    z, weight, code, taken, mean, invstd = ctx.saved_tensors
    return (*_bn_relu_pool_backward_op(grad, code, taken, z, weight, mean, invstd), None, None, None, None)


_bn_relu_pool_op.register_autograd(_bn_backward, setup_context=_save_bn)


def _conv_out(x: Tensor, weight: Tensor) -> Tensor:
    n, _, h, w = x.shape
    return x.new_empty(n, weight.shape[0], h - 4, w - 4)


@torch.library.custom_op("pfedkit::conv1", mutates_args=())
def _conv1_op(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    out = _conv_out(x, weight)
    _call("conv1", x.dtype, x, weight, bias, out, x.shape[0], x.shape[2], x.shape[3], weight.shape[0])
    return out


@_conv1_op.register_fake
def _(x, weight, bias):
    return _conv_out(x, weight)


def _weight_grads(x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    outs = grad.shape[1]
    return grad.new_empty(outs, x.shape[1], 5, 5), grad.new_empty(outs)


@torch.library.custom_op("pfedkit::conv1_backward", mutates_args=())
def _conv1_backward_op(x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    grad_weight, grad_bias = _weight_grads(x, grad)
    _call("conv1_weight_grad", x.dtype, x, grad.contiguous(), grad_weight, grad_bias, x.shape[0], x.shape[2],
          x.shape[3], grad.shape[1])
    return grad_weight, grad_bias


@_conv1_backward_op.register_fake
def _(x, grad):
    return _weight_grads(x, grad)


def _save_images(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


_conv1_op.register_autograd(lambda ctx, grad: (None, *_conv1_backward_op(ctx.saved_tensors[0], grad)),
                            setup_context=_save_images)


def _first_block_out(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    n, _, h, w = x.shape
    out = torch.empty(n, weight.shape[0], (h - 4) // 2, (w - 4) // 2, dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last)
    return out, torch.empty_like(out, dtype=torch.uint8)


def _first_block_kernel(dtype: torch.dtype, outs: int, backward: bool = False) -> str:
    return ("conv1_relu_pool_nhwc" + ("_backward" if backward else "")
            + ("_wide" if wide and outs % WIDE_LANES[dtype] == 0 else ""))


@torch.library.custom_op("pfedkit::conv1_relu_pool", mutates_args=())
def _conv1_relu_pool_op(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    out, code = _first_block_out(x, weight)
    n, _, h, w = x.shape
    _call(_first_block_kernel(x.dtype, weight.shape[0]), x.dtype, x, weight, bias, out, code, n, h, w,
          weight.shape[0])
    return out, code


@_conv1_relu_pool_op.register_fake
def _(x, weight, bias):
    return _first_block_out(x, weight)


@torch.library.custom_op("pfedkit::conv1_relu_pool_backward", mutates_args=())
def _conv1_relu_pool_backward_op(x: Tensor, grad: Tensor, code: Tensor) -> tuple[Tensor, Tensor]:
    grad_weight, grad_bias = _weight_grads(x, grad)
    n, _, h, w = x.shape
    _call(_first_block_kernel(x.dtype, grad.shape[1], backward=True), x.dtype, x,
          grad.contiguous(memory_format=torch.channels_last), code, grad_weight, grad_bias, n, h, w, grad.shape[1])
    return grad_weight, grad_bias


@_conv1_relu_pool_backward_op.register_fake
def _(x, grad, code):
    return _weight_grads(x, grad)


def _save_images_and_code(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], output[1])


_conv1_relu_pool_op.register_autograd(
    lambda ctx, grad, _code: (None, *_conv1_relu_pool_backward_op(*ctx.saved_tensors[:1], grad, ctx.saved_tensors[1])),
    setup_context=_save_images_and_code)


def covers_first_conv(x: torch.Tensor, conv: torch.nn.Module) -> bool:
    """Whether `first_conv` takes x and conv: one-channel contiguous CPU images that need no gradient, a 5x5
    Conv2d with bias, stride 1, no padding, whose weight's (out, 5, 5) elements lie row-major, and outputs at
    least a vector wide."""
    if not (isinstance(conv, torch.nn.Conv2d) and conv.in_channels == 1 and conv.kernel_size == (5, 5)
            and conv.stride == (1, 1) and conv.padding == (0, 0) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.bias is not None and conv.padding_mode == "zeros"):
        return False
    weight = conv.weight
    return (x.device.type == "cpu" and x.dim() == 4 and x.shape[1] == 1 and x.dtype in SUFFIX
            and x.is_contiguous() and not x.requires_grad and x.shape[2] >= 5 and x.shape[3] - 4 >= LANES[x.dtype]
            and weight.dtype == x.dtype and conv.bias.dtype == x.dtype and weight.device == x.device
            and weight.stride()[0] == 25 and weight.stride()[2:] == (5, 1) and conv.bias.is_contiguous()
            and _ready())


def first_conv(x: torch.Tensor, conv: torch.nn.Conv2d) -> torch.Tensor:
    """conv(x) for one-channel images (`covers_first_conv`), with the weight and bias gradients; conv(x) itself
    for anything else."""
    if not covers_first_conv(x, conv):
        return conv(x)
    return _conv1_op(x, conv.weight, conv.bias)


def covers_first_conv_pool(x: torch.Tensor, conv: torch.nn.Module) -> bool:
    """Whether `first_conv_relu_pool` takes x and conv: as `covers_first_conv`, with even output sides and a
    multiple of the vector width of output channels."""
    return (covers_first_conv(x, conv) and (x.shape[2] - 4) % 2 == 0 and (x.shape[3] - 4) % 2 == 0
            and conv.out_channels % LANES[x.dtype] == 0)


def first_conv_relu_pool(x: torch.Tensor, conv: torch.nn.Conv2d) -> torch.Tensor:
    """F.max_pool2d(torch.relu(conv(x)), 2) as a channels_last tensor, for one-channel images
    (`covers_first_conv_pool`), in one kernel: the convolution's outputs are pooled in registers. PyTorch's ops
    (with the same channels_last output) for anything else."""
    if not covers_first_conv_pool(x, conv):
        return torch.nn.functional.max_pool2d(torch.relu(conv(x)), 2).contiguous(memory_format=torch.channels_last)
    return _conv1_relu_pool_op(x, conv.weight, conv.bias)[0]


def covers_batch_norm(x: torch.Tensor, bn: torch.nn.Module) -> bool:
    """Whether `batch_norm_relu_pool` takes x and bn: x as in `covers`, in the standard layout, bn a BatchNorm2d
    in training mode with an affine transform, running statistics and a fixed momentum, all contiguous in x's
    dtype."""
    return (isinstance(bn, torch.nn.BatchNorm2d) and bn.training and bn.affine and bn.track_running_stats
            and bn.momentum is not None and covers(x) and x.is_contiguous()
            and all(t.dtype == x.dtype and t.is_contiguous() and t.device == x.device
                    for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var)))


def batch_norm_relu_pool(x: torch.Tensor, bn: torch.nn.BatchNorm2d) -> torch.Tensor:
    """F.max_pool2d(torch.relu(bn(x)), 2) for a training-mode bn (`covers_batch_norm`): batch statistics (in
    double), bn's running statistics updated in place as BatchNorm2d does, gradients for x, weight and bias.
    PyTorch's modules for anything else."""
    if not covers_batch_norm(x, bn):
        return torch.nn.functional.max_pool2d(torch.relu(bn(x)), 2)
    if bn.num_batches_tracked is not None:  # pfedkit's FlatModel drops it; a plain module counts as BatchNorm2d does
        bn.num_batches_tracked.add_(1)
    out, *_, running_mean, running_var = _bn_relu_pool_op(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                                          bn.momentum, bn.eps)
    with torch.no_grad():
        bn.running_mean.copy_(running_mean)
        bn.running_var.copy_(running_var)
    return out


STEP_PARAMS = ("conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias", "conv2.weight", "conv2.bias", "bn2.weight",
               "bn2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias")
STEP_BUFFERS = ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var")
STEP_SIDE = 28  # conv2's kernels are written for its 12x12 inputs and 8x8 outputs


def covers_cnn_step(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `CNNStep` takes a training step of `module` on images like x: a BatchNorm CNN (nets.CNN's layers:
    conv1 -> bn1 -> conv2 -> bn2 -> fc1..3) in training mode, on 28x28 one-channel images the first
    convolution's kernel takes (`covers_first_conv`), both BatchNorms as `covers_batch_norm` asks, conv2 5x5 with
    bias, stride 1, no padding, every parameter contiguous in x's dtype on the CPU with a contiguous gradient
    tensor, and no hooks (the step would skip them)."""
    names = dict(module.named_modules())
    if not (module.training and all(n in names for n in ("conv1", "bn1", "conv2", "bn2", "fc1", "fc2", "fc3"))
            and x.dim() == 4 and x.shape[2] == x.shape[3] and covers_first_conv(x, names["conv1"])):
        return False
    bn1, bn2, conv2 = names["bn1"], names["bn2"], names["conv2"]
    if x.shape[2] != STEP_SIDE:
        return False
    features = conv2.out_channels * 16 if isinstance(conv2, torch.nn.Conv2d) else -1
    layers_fit = (isinstance(conv2, torch.nn.Conv2d) and conv2.in_channels == names["conv1"].out_channels
                  and conv2.kernel_size == (5, 5) and conv2.stride == (1, 1) and conv2.padding == (0, 0)
                  and conv2.dilation == (1, 1) and conv2.groups == 1 and conv2.bias is not None
                  and all(isinstance(bn, torch.nn.BatchNorm2d) and bn.training and bn.affine
                          and bn.track_running_stats and bn.momentum is not None for bn in (bn1, bn2))
                  and all(isinstance(names[f], torch.nn.Linear) and names[f].bias is not None
                          for f in ("fc1", "fc2", "fc3"))
                  and names["fc1"].in_features == features
                  and names["fc2"].in_features == names["fc1"].out_features
                  and names["fc3"].in_features == names["fc2"].out_features)
    if not layers_fit or any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                             for m in module.modules()):
        return False
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    return (set(params) == set(STEP_PARAMS)
            and all(t.dtype == x.dtype and t.device.type == "cpu" and t.is_contiguous()
                    for t in [*params.values(), *(buffers[b] for b in STEP_BUFFERS)])
            and all(p.grad is not None and p.grad.is_contiguous() and p.grad.dtype == x.dtype for p in params.values()))


class CNNStep:
    """A BatchNorm CNN's whole training step (forward, mean cross-entropy, every gradient, BatchNorm's running
    statistics) as one C call (kernels.c `cnn_bn_step`), for a module `covers_cnn_step` takes: no autograd graph and
    no per-op dispatch. The gradients are written into the parameters' .grad tensors (a FlatModel's flat gradient),
    replacing what was there. Its workspace is allocated once and grows with the largest batch."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
        pointers = [params[n].data_ptr() for n in STEP_PARAMS] + [buffers[n].data_ptr() for n in STEP_BUFFERS]
        self.key = tuple(pointers + [params[n].grad.data_ptr() for n in STEP_PARAMS])
        self.params = (ctypes.c_void_p * len(pointers))(*pointers)
        self.grads = (ctypes.c_void_p * len(STEP_PARAMS))(*[params[n].grad.data_ptr() for n in STEP_PARAMS])
        # the tensors pointed to, kept alive: a module whose tensors are replaced leaves no dangling pointer here
        self.tensors = [params[n] for n in STEP_PARAMS] + [buffers[n] for n in STEP_BUFFERS] + \
            [params[n].grad for n in STEP_PARAMS]
        m = dict(module.named_modules())
        self.hyper = torch.tensor([m["bn1"].momentum, m["bn1"].eps, m["bn2"].momentum, m["bn2"].eps],
                                  dtype=torch.float64)
        self.sizes = (m["conv1"].out_channels, m["conv2"].out_channels, m["fc1"].out_features,
                      m["fc2"].out_features, m["fc3"].out_features)
        self.bns = (m["bn1"], m["bn2"])
        self.capacity, self.side = 0, 0

    def still_valid(self, module: torch.nn.Module) -> bool:
        """The tensors it points to are still the module's (not moved or replaced)."""
        params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
        return self.key == tuple([params[n].data_ptr() for n in STEP_PARAMS]
                                 + [buffers[n].data_ptr() for n in STEP_BUFFERS]
                                 + [params[n].grad.data_ptr() if params[n].grad is not None else 0
                                    for n in STEP_PARAMS])

    def _workspace(self, n: int, side: int) -> None:
        c1, c2, f1, f2, k = self.sizes
        s1 = side - 4
        q1, s2 = s1 // 2, s1 // 2 - 4
        q2 = s2 // 2
        t = lambda *shape: torch.empty(shape, dtype=self.dtype)  # noqa: E731
        u8 = lambda *shape: torch.empty(shape, dtype=torch.uint8)  # noqa: E731
        f64 = lambda *shape: torch.empty(shape, dtype=torch.float64)  # noqa: E731
        self.buffers = [t(n, c1, s1, s1), t(n, c1, q1, q1), u8(n, c1, q1, q1), t(n, c1, q1, q1), f64(c1), f64(c1),
                        t(n, c2, s2, s2), t(n, c2, q2, q2), u8(n, c2, q2, q2), t(n, c2, q2, q2), f64(c2), f64(c2),
                        t(n, f1), t(n, f2), t(n, k), t(n, k), t(n, f2), t(n, f1), t(n, c2 * q2 * q2),
                        t(n, c2, s2, s2), t(n, c1, q1, q1), t(n, c1, s1, s1),
                        torch.zeros(5 * c2 * 128, dtype=self.dtype),  # one image's dy rows, shifted (zeros around)
                        t(n, c1, 5, 12, 8)]  # conv2's input planes in shifted copies (kernels.c shift_rows)
        self.workspace = (ctypes.c_void_p * len(self.buffers))(*[b.data_ptr() for b in self.buffers])
        self.capacity, self.side = n, side

    def _checked(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x and y as the kernel reads them, or an error: the kernel reads raw memory, so a float64 batch in a
        float32 step, int32 labels, another device or image size would be misread (garbage, or a crash)."""
        if x.dtype != self.dtype:
            raise TypeError(f"the C training step's parameters are {self.dtype}, the images {x.dtype}")
        if x.device.type != "cpu" or x.dim() != 4 or tuple(x.shape[1:]) != (1, STEP_SIDE, STEP_SIDE) or not len(x):
            raise ValueError(f"the C training step takes (n, 1, {STEP_SIDE}, {STEP_SIDE}) CPU images, n > 0; got "
                             f"{tuple(x.shape)} on {x.device}")
        if y.dtype == torch.uint8:  # as F.cross_entropy takes them
            y = y.long()
        if y.dtype != torch.int64:
            raise TypeError(f"the C training step takes int64 (or uint8) labels, got {y.dtype}")
        if y.device.type != "cpu" or tuple(y.shape) != (len(x),):
            raise ValueError(f"the C training step takes one label an image ({len(x)}) on the CPU; got "
                             f"{tuple(y.shape)} on {y.device}")
        return x.contiguous(), y.contiguous()

    def _prepare(self, labels: torch.Tensor, batch: int, side: int, steps: int) -> None:
        """Before a call: the labels checked (the kernel indexes the logits by them), the workspace large enough
        for `batch` images of `side`, and BatchNorm's step counters advanced by `steps` (pfedkit's FlatModel
        drops them; a plain module counts as BatchNorm2d does)."""
        low, high = torch.aminmax(labels)
        if low < 0 or high >= self.sizes[-1]:
            raise IndexError(f"labels must lie in [0, {self.sizes[-1]}), got {int(low)}..{int(high)}")
        if batch > self.capacity or side != self.side:
            self._workspace(batch, side)
        for bn in self.bns:
            if bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(steps)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The mean cross-entropy of the batch (x (n, 1, S, S), y (n,) int64 labels in range); gradients into .grad."""
        x, y = self._checked(x, y)
        n, side = len(x), x.shape[-1]
        self._prepare(y, n, side, steps=1)
        loss = ctypes.c_double()
        _kernels["cnn_bn_step", self.dtype](x.data_ptr(), y.data_ptr(), self.params, self.grads, self.workspace,
                                            self.hyper.data_ptr(), n, side, *self.sizes, ctypes.addressof(loss))
        return loss.value

    def _check_flat(self, params: torch.Tensor, grad: torch.Tensor, velocity: torch.Tensor | None) -> None:
        """The update runs over params.numel() elements of params, grad and velocity: they must be of one size, in
        the step's dtype, and hold the module's parameters and gradients (else the steps would not see it)."""
        flats = (params, grad) + ((velocity,) if velocity is not None else ())
        if any(t.dtype != self.dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != params.numel()
               for t in flats):
            raise ValueError(f"the C local SGD takes params, grad and velocity as contiguous CPU {self.dtype} "
                             f"tensors of one size")
        for flat, pointers in ((params, list(self.params)[:len(STEP_PARAMS)]), (grad, list(self.grads))):
            start = flat.data_ptr()
            if not all(start <= p < start + flat.numel() * flat.element_size() for p in pointers):
                raise ValueError("the C local SGD's params and grad must hold the module's parameters and gradients")

    def sgd(self, x_all: torch.Tensor, y_all: torch.Tensor, batches: list[torch.Tensor], params: torch.Tensor,
            grad: torch.Tensor, velocity: torch.Tensor | None, lr: float, momentum: float,
            weight_decay: float) -> torch.Tensor:
        """Local SGD over `batches` (index tensors into x_all / y_all) in one C call: each step as `__call__`, then
        train.sgd's update for a plain objective (weight decay into the gradient, momentum into `velocity`,
        params -= lr * step), in place on params (the flat parameters these steps' gradients go with), grad and
        velocity. Returns each batch's mean cross-entropy (float64)."""
        x_all, y_all = self._checked(x_all, y_all)
        self._check_flat(params, grad, velocity)
        if not batches or any(b.dtype not in (torch.int32, torch.int64) or b.device.type != "cpu" or b.dim() != 1
                              or not len(b) for b in batches):
            raise ValueError("the C local SGD takes one or more non-empty int64 (or int32) CPU index vectors")
        idx = torch.cat(batches).to(torch.int64).contiguous()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(x_all)):
            raise IndexError(f"batch rows must lie in [0, {len(x_all)})")
        starts = torch.tensor([0] + [len(b) for b in batches], dtype=torch.int64).cumsum(0)
        most, side = max(len(b) for b in batches), x_all.shape[-1]
        self._prepare(y_all, most, side, steps=len(batches))
        xb, yb = x_all.new_empty(most, *x_all.shape[1:]), torch.empty(most, dtype=torch.int64)
        rates = torch.tensor([lr, momentum, weight_decay], dtype=torch.float64)
        losses = torch.empty(len(batches), dtype=torch.float64)
        _kernels["cnn_bn_sgd", self.dtype](
            x_all.data_ptr(), y_all.data_ptr(), idx.data_ptr(), starts.data_ptr(), len(batches), self.params,
            self.grads, self.workspace, self.hyper.data_ptr(), side, *self.sizes, xb.data_ptr(), yb.data_ptr(),
            params.data_ptr(), grad.data_ptr(), velocity.data_ptr() if velocity is not None else None,
            params.numel(), rates.data_ptr(), losses.data_ptr())
        return losses


# each module's CNNStep, made on first use; beside the module rather than on it, so that a deep copy of the module
# (side-by-side workers' replicas) gets a step of its own instead of one pointing into the original's tensors
STEPS: "weakref.WeakKeyDictionary[torch.nn.Module, CNNStep]" = weakref.WeakKeyDictionary()


def cnn_step(module: torch.nn.Module, x: torch.Tensor) -> CNNStep | None:
    """The module's `CNNStep` for batches like x, or None where `covers_cnn_step` does not take them."""
    if not covers_cnn_step(module, x):
        return None
    step = STEPS.get(module)
    if step is None or step.dtype != x.dtype or not step.still_valid(module):
        step = STEPS[module] = CNNStep(module, x.dtype)
    return step
