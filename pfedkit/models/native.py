"""Fused CPU kernels in C (kernels.c), compiled once per machine with the host's C compiler and called through
ctypes: ReLU + 2x2 max pooling, training-mode BatchNorm + ReLU + pooling, the 5x5 convolution of one-channel
images, and that convolution fused with ReLU + pooling in channels_last (the BN-free CNN's first block), the hot
spots of a small CNN's training step on a CPU; and the BatchNorm CNNs' whole training step in one call (CNNStep).

The kernels are optional. Without a C compiler, on another device, for a layout or shape they do not cover, under
a torch.func transform (grad, vmap: the kernels are autograd Functions of raw pointers), or with PFEDKIT_NATIVE=0
in the environment, the models (nets.relu_pool) run the same arithmetic in PyTorch: the pooling is equal bit for
bit, BatchNorm and the convolution to rounding (tests/test_native.py).

The shared library is built with `-O3 -march=native` into $PFEDKIT_CACHE (default ~/.cache/pfedkit)/native,
under a name that hashes the source, the compiler's version and the CPU's model and flags, so a cache shared
between machines never loads another CPU's build. It is written to a temporary name and renamed, so processes
building it at once do not see half a file.

Loading a library runs its code, so only a library this user built for this source is loaded: the cache folders
are created private (0o700) and refused, with one line on stderr and the kernels unused, where another user owns
them or others may write to them; the library must be a regular file of this user's (a symbolic link is never
followed) that no one else may write to, whose bytes have the SHA-256 its builder recorded beside it
(`<name>.sha256`). A library that fails those checks (truncated, replaced, foreign) is rebuilt in its place, with
one line saying why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from torch._C._functorch import peek_interpreter_stack
except ImportError:  # a torch without torch.func
    def peek_interpreter_stack():
        return None

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC", "-Wno-psabi"]
SUFFIX = {torch.float32: "f32", torch.float64: "f64"}

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
# the first block's wide variant (64 bytes), taken where the CPU has 512-bit registers and the channels fill them
WIDE_KERNELS = ("conv1_relu_pool_nhwc", "conv1_relu_pool_nhwc_backward")
WIDE_LANES = {torch.float32: 16, torch.float64: 8}
wide = False  # whether this machine's build runs the wide variant natively (set when the library loads)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_kernels: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}  # (name, dtype): the typed function
_tried = False
why_not = ""  # why the kernels are not in use, when they are not (README "Speed"; pfedkit's own tests print it)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name.split()[0]
    return None


def _cpu() -> str:
    """What makes a -march=native build this machine's own: the CPU's model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({l for l in lines if l.split(":")[0].strip() in keep}))


class Untrusted(Exception):
    """A cache folder or library that this user did not make for this source: the message says why."""


def _key(cc: str) -> str:
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu().encode()]))
    return key.hexdigest()[:20]


def _cache_folder() -> Path:
    """$PFEDKIT_CACHE (default ~/.cache/pfedkit)/native, the missing folders made private; refused where it or
    the cache folder above it belongs to another user or others may write to it (they could plant a library in it,
    or put a folder of theirs in its place)."""
    root = Path(os.environ.get("PFEDKIT_CACHE") or Path.home() / ".cache" / "pfedkit")
    for path in (root, root / "native"):  # the root checked before anything is made in it
        for missing in reversed([p for p in (path, *path.parents) if not os.path.lexists(p)]):
            try:
                os.mkdir(missing, 0o700)
            except FileExistsError:  # made by another process at once: checked below like any other
                continue
            os.chmod(missing, 0o700)  # a umask can only narrow mkdir's mode: make it usable whatever the umask
        info = os.stat(path)
        if info.st_uid != os.geteuid():
            raise Untrusted(f"{path}: owned by another user (uid {info.st_uid}); set PFEDKIT_CACHE to a folder "
                            f"of your own")
        if info.st_mode & 0o022:
            raise Untrusted(f"{path}: writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
                            f"`chmod go-w {path}` or set PFEDKIT_CACHE to a private folder")
    return root / "native"


def _record(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")  # the hash of the library's bytes, written by its builder


def _open_own(path: Path) -> int:
    """A descriptor of path if it is a regular file of this user's that no one else may write to. A symbolic link
    is never followed and a FIFO never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise Untrusted("a symbolic link") from e
        raise
    info = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(info.st_mode)
           else f"owned by another user (uid {info.st_uid})" if info.st_uid != os.geteuid()
           else "writable by group or others" if info.st_mode & 0o022 else "")
    if why:
        os.close(fd)
        raise Untrusted(why)
    return fd


def _digest(fd: int) -> str:
    sha = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        sha.update(chunk)
    return sha.hexdigest()


def _trusted(library: Path) -> int:
    """A descriptor of the cached library if this user built it: a file of theirs (`_open_own`) whose bytes hash to
    what its builder recorded beside it. FileNotFoundError where none was built, or no hash was recorded (an
    earlier pfedkit's build: never loaded, rebuilt without a word); Untrusted otherwise."""
    fd = _open_own(library)
    try:
        try:
            record = _open_own(_record(library))
        except Untrusted as e:
            raise Untrusted(f"its hash record {_record(library).name}: {e}") from None
        try:
            recorded = os.read(record, 100).decode("ascii", "replace").strip()
        finally:
            os.close(record)
        if _digest(fd) != recorded:
            raise Untrusted("its bytes differ from the hash recorded when it was built (truncated or replaced)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _build(cc: str, target: Path) -> int:
    """Compile kernels.c to a temporary file beside target, record its hash, rename both into place; returns a
    descriptor of the bytes this process built and hashed (whatever another process renames there meanwhile)."""
    made, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(made)
    made, record = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
    os.close(made)
    fd = -1
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()
            raise OSError(f"{cc} failed: {said[-1] if said else done.returncode}")
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or not stat.S_ISREG(info.st_mode):  # the folder swapped while compiling
            raise Untrusted(f"{tmp}: not the file the compiler wrote")
        os.fchmod(fd, 0o700)  # the linker's mode follows the umask: no one else may write to it
        Path(record).write_text(_digest(fd) + "\n")
        os.replace(record, _record(target))  # the record first: a library in place always has one
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        for path in (tmp, record):
            if os.path.exists(path):
                os.unlink(path)
    return fd


def _dlopen(fd: int, path: Path) -> ctypes.CDLL:
    """The library open at fd: through /proc the very file checked, not whatever path names by then. The
    descriptor stays open: the loader knows the library by this name, and would hand it back for a later library
    opened under the same descriptor number."""
    return ctypes.CDLL(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path))


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


def _open_library(cc: str) -> tuple[ctypes.CDLL, dict]:
    """The cached library and its kernels, built where there is none and rebuilt in place (with one line saying
    why) where the cached one is not this user's own build of this source."""
    target = _cache_folder() / f"kernels-{_key(cc)}.so"
    rebuilt = ""
    try:
        lib = _dlopen(_trusted(target), target)
        return lib, _bind(lib)
    except FileNotFoundError:  # not built yet (or built without a record)
        pass
    except AttributeError:  # this user's file, loaded, but a kernel is missing: not this source's library
        rebuilt = f"{target}: a library without pfedkit's kernels"
    except (Untrusted, OSError) as e:  # truncated, replaced, not this user's: never loaded
        rebuilt = f"{target}: {e}"
    try:
        fd = _build(cc, target)
    except (OSError, subprocess.SubprocessError) as e:
        if rebuilt:
            raise Untrusted(f"{rebuilt}; rebuilding it failed: {e}") from e
        raise
    lib = _dlopen(fd, target)
    try:
        kernels = _bind(lib)
    except AttributeError as e:
        raise Untrusted(f"{target}: the fresh build lacks a kernel: {e}") from e
    if rebuilt:
        _say(f"rebuilt the C kernels: {rebuilt}")
    return lib, kernels


def _say(line: str) -> None:
    print(f"pfedkit: warning: {line}", file=sys.stderr)


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (and `why_not` says why) where they cannot be had."""
    global _library, _tried, why_not, wide
    if _tried:
        return _library
    with _lock:
        if _tried:
            return _library
        if os.environ.get("PFEDKIT_NATIVE", "1") == "0":
            why_not = "PFEDKIT_NATIVE=0"
        elif (cc := _compiler()) is None:
            why_not = "no C compiler (cc, gcc or clang) on PATH"
        else:
            try:
                lib, kernels = _open_library(cc)
                _kernels.update(kernels)
                wide = bool(lib.wide_vectors_native())
                _library = lib
            except Untrusted as e:
                why_not = str(e)
                _say(f"not using the C kernels: {e}")
            except (OSError, subprocess.SubprocessError) as e:
                why_not = f"building {SOURCE.name} failed: {e}"
        _tried = True
    return _library


def _ready() -> bool:
    """The kernels are built and no torch.func transform is active (its wrapped tensors have no data pointers)."""
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


class _ReluPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:
        # the standard layout, or channels_last (N, H, W, C in memory; where C is 1, the two are the same)
        layout = torch.contiguous_format if z.is_contiguous() else torch.channels_last
        name = "relu_pool" if layout == torch.contiguous_format else "relu_pool_nhwc"
        out = torch.empty(*z.shape[:2], z.shape[2] // 2, z.shape[3] // 2, dtype=z.dtype, memory_format=layout)
        code = torch.empty_like(out, dtype=torch.uint8)  # which window position takes the gradient (4: none)
        _call(name, z.dtype, z, out, code, *z.shape)
        ctx.save_for_backward(code)
        ctx.input_shape, ctx.layout, ctx.name = z.shape, layout, name
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (code,) = ctx.saved_tensors
        grad = grad.contiguous(memory_format=ctx.layout)
        grad_in = torch.empty(ctx.input_shape, dtype=grad.dtype, memory_format=ctx.layout)  # every element written
        _call(ctx.name + "_backward", grad.dtype, grad, code, grad_in, *ctx.input_shape)
        return grad_in


class _BatchNormReluPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, weight, bias, running_mean, running_var, momentum, eps):
        out = z.new_empty(*z.shape[:2], z.shape[2] // 2, z.shape[3] // 2)
        code, taken = torch.empty(out.shape, dtype=torch.uint8), torch.empty_like(out)
        mean, invstd = (torch.empty(z.shape[1], dtype=torch.float64) for _ in range(2))
        _call("bn_relu_pool", z.dtype, z, weight, bias, running_mean, running_var, momentum, eps, out, code, taken,
              mean, invstd, *z.shape)
        ctx.save_for_backward(z, weight, code, taken, mean, invstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        z, weight, code, taken, mean, invstd = ctx.saved_tensors
        grad = grad.contiguous()
        grad_in, grad_weight, grad_bias = torch.empty_like(z), torch.empty_like(weight), torch.empty_like(weight)
        _call("bn_relu_pool_backward", z.dtype, grad, code, taken, z, weight, mean, invstd, grad_in, grad_weight,
              grad_bias, *z.shape)
        return grad_in, grad_weight, grad_bias, None, None, None, None


def relu_pool(x: torch.Tensor) -> torch.Tensor:
    """F.max_pool2d(torch.relu(x), 2) through the C kernels, for an x they cover (`covers`): the same values and
    the same gradient. Any other x (a layout, shape or dtype the kernels would misread) takes PyTorch's ops."""
    if not covers(x):
        return F.max_pool2d(torch.relu(x), 2)
    return _ReluPool.apply(x)


class _FirstConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        n, _, h, w = x.shape
        out = x.new_empty(n, weight.shape[0], h - 4, w - 4)
        _call("conv1", x.dtype, x, weight, bias, out, n, h, w, weight.shape[0])
        ctx.save_for_backward(x)
        ctx.weight_shape = weight.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grad = grad.contiguous()
        n, _, h, w = x.shape
        grad_weight = grad.new_empty(ctx.weight_shape)
        grad_bias = grad.new_empty(ctx.weight_shape[0])
        _call("conv1_weight_grad", x.dtype, x, grad, grad_weight, grad_bias, n, h, w, ctx.weight_shape[0])
        return None, grad_weight, grad_bias


def covers_first_conv(x: torch.Tensor, conv: torch.nn.Module) -> bool:
    """Whether `first_conv` takes x and conv: one-channel contiguous CPU images that need no gradient, a 5x5
    Conv2d with bias, stride 1, no padding, whose weight's (out, 5, 5) elements lie row-major (the standard and the
    channels_last layout alike, with one input channel), and outputs at least a vector wide."""
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
    return _FirstConv.apply(x, conv.weight, conv.bias)


class _FirstConvReluPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        n, _, h, w = x.shape
        outs = weight.shape[0]
        out = torch.empty(n, outs, (h - 4) // 2, (w - 4) // 2, dtype=x.dtype, memory_format=torch.channels_last)
        code = torch.empty_like(out, dtype=torch.uint8)
        ctx.kernel = "conv1_relu_pool_nhwc" + ("_wide" if wide and outs % WIDE_LANES[x.dtype] == 0 else "")
        _call(ctx.kernel, x.dtype, x, weight, bias, out, code, n, h, w, outs)
        ctx.save_for_backward(x, code)
        ctx.weight_shape = weight.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x, code = ctx.saved_tensors
        grad = grad.contiguous(memory_format=torch.channels_last)
        n, _, h, w = x.shape
        grad_weight = grad.new_empty(ctx.weight_shape)
        grad_bias = grad.new_empty(ctx.weight_shape[0])
        name = "conv1_relu_pool_nhwc_backward" + ("_wide" if ctx.kernel.endswith("_wide") else "")
        _call(name, x.dtype, x, grad, code, grad_weight, grad_bias, n, h, w, ctx.weight_shape[0])
        return None, grad_weight, grad_bias


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
        return F.max_pool2d(torch.relu(conv(x)), 2).contiguous(memory_format=torch.channels_last)
    return _FirstConvReluPool.apply(x, conv.weight, conv.bias)


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
        return F.max_pool2d(torch.relu(bn(x)), 2)
    if bn.num_batches_tracked is not None:  # pfedkit's FlatModel drops it; a plain module counts as BatchNorm2d does
        bn.num_batches_tracked.add_(1)
    return _BatchNormReluPool.apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.momentum, bn.eps)


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
