"""Per-client train/test tensors, resident on the run's device.

All clients' training samples sit in one tensor, ordered by client, so client i's data is a contiguous view
(`x_train[start_i:end_i]`); mini-batches are index slices of a seeded per-client permutation.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config import Config, check_memory
from .partition import Partition, make_partition
from .sources import Source, load_source


@dataclass
class ClientData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_train(self) -> int:
        return len(self.y_train)


class FederatedData:
    def __init__(self, source: Source, partition: Partition, device: str | torch.device = "cpu"):
        self.name = source.name
        self.num_classes = source.num_classes
        self.input_shape = source.input_shape
        self.label_sets = partition.label_sets
        self.warnings = list(partition.warnings)
        self.device = torch.device(device)
        self.x_train, self.y_train, self.train_offsets = self._stack(source, partition.train)
        self.x_test, self.y_test, self.test_offsets = self._stack(source, partition.test)
        self.train_counts = self._counts(source.y, partition.train)
        self.test_counts = self._counts(source.y, partition.test)

    def _stack(self, source: Source, parts: list[np.ndarray]):
        order = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        offsets = np.r_[0, np.cumsum([len(p) for p in parts])].astype(np.int64)
        x = torch.from_numpy(np.ascontiguousarray(source.x[order])).to(self.device)
        y = torch.from_numpy(source.y[order]).to(self.device)
        return x, y, offsets

    def _counts(self, labels: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
        return np.stack([np.bincount(labels[p], minlength=self.num_classes) for p in parts])

    @property
    def num_clients(self) -> int:
        return len(self.train_offsets) - 1

    @property
    def train_sizes(self) -> np.ndarray:
        return np.diff(self.train_offsets)

    @property
    def test_sizes(self) -> np.ndarray:
        return np.diff(self.test_offsets)

    def client(self, i: int) -> ClientData:
        a, b = self.train_offsets[i], self.train_offsets[i + 1]
        c, d = self.test_offsets[i], self.test_offsets[i + 1]
        return ClientData(self.x_train[a:b], self.y_train[a:b], self.x_test[c:d], self.y_test[c:d])

    def train_only(self) -> "FederatedData":
        """The same clients without their test splits: what a client may fine-tune on before it is evaluated."""
        view = copy.copy(self)
        view.x_test, view.y_test = self.x_test[:0], self.y_test[:0]
        view.test_offsets = np.zeros_like(self.test_offsets)
        view.test_counts = np.zeros_like(self.test_counts)
        return view

    def only(self, cids: list[int]) -> "FederatedData":
        """These clients' data alone (copies, so the rest can be freed): what one Flower ClientApp holds."""
        view = copy.copy(self)
        for split in ("train", "test"):
            off = getattr(self, f"{split}_offsets")
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            setattr(view, f"x_{split}", torch.cat([x[off[c]: off[c + 1]] for c in cids]).clone())
            setattr(view, f"y_{split}", torch.cat([y[off[c]: off[c + 1]] for c in cids]).clone())
            setattr(view, f"{split}_offsets", np.r_[0, np.cumsum([off[c + 1] - off[c] for c in cids])].astype(np.int64))
            setattr(view, f"{split}_counts", getattr(self, f"{split}_counts")[cids])
        view.label_sets = [self.label_sets[c] for c in cids]
        return view

    def train_rows(self, cids: list[int], rows: list[torch.Tensor]) -> "FederatedData":
        """These clients alone, each with only the given rows (indices into its own train split) and no test split:
        e.g. the part a client fits on when it holds out the rest for validation (`Cohort.holdout`)."""
        view = copy.copy(self)
        index = torch.cat([r.to(device=self.device, dtype=torch.long) + int(self.train_offsets[c])
                           for c, r in zip(cids, rows)])
        view.x_train, view.y_train = self.x_train[index], self.y_train[index]
        view.train_offsets = np.r_[0, np.cumsum([len(r) for r in rows])].astype(np.int64)
        view.train_counts = np.stack([np.bincount(view.y_train[a:b].cpu().numpy(), minlength=self.num_classes)
                                      for a, b in zip(view.train_offsets[:-1], view.train_offsets[1:])])
        view.x_test, view.y_test = self.x_test[:0], self.y_test[:0]
        view.test_offsets = np.zeros(len(cids) + 1, dtype=np.int64)
        view.test_counts = np.zeros((len(cids), self.num_classes), dtype=self.test_counts.dtype)
        view.label_sets = [self.label_sets[c] for c in cids]
        return view

    def majority_label_accuracy(self) -> np.ndarray:
        """Per client: test accuracy of always predicting its most frequent training label, the reference row that a
        personalized accuracy is read against (docs/pfedcs.md: the official pFedMe code's series sits at it)."""
        majority = self.train_counts.argmax(axis=1)
        hits = self.test_counts[np.arange(self.num_clients), majority]
        return hits / np.maximum(self.test_sizes, 1)

    def summary(self) -> str:
        tr, te = self.train_sizes, self.test_sizes
        classes = (self.train_counts > 0).sum(axis=1)
        return (f"{self.name}: {self.num_clients} clients, {tr.sum()} train / {te.sum()} test samples, "
                f"train per client {tr.min()}..{tr.max()} (mean {tr.mean():.0f}), "
                f"classes per client {classes.min()}..{classes.max()}, input {self.input_shape}, "
                f"{self.num_classes} classes")


def build_federated(cfg: Config, device: str | torch.device = "cpu") -> FederatedData:
    """The clients' tensors; the keys that size memory beyond the data (`model.hidden`, `local.*`) are checked
    against it first, so a run that cannot fit is refused before anything is allocated for it."""
    source = load_source(cfg.dataset, cfg.seed, cfg.partition.num_clients)
    check_model_memory(cfg, source.input_shape, source.num_classes)
    partition = make_partition(source.y, source.num_classes, cfg.partition, cfg.seed, source.groups, source.is_test)
    check_local_memory(cfg, source.input_shape, source.num_classes, max(len(t) for t in partition.train))
    return FederatedData(source, partition, device)


def check_model_memory(cfg: Config, input_shape: tuple[int, ...], num_classes: int) -> None:
    """`model.hidden`, the DNN's width, is the one key that sizes a model: refuse a model whose parameters cannot be
    held four times (the model, its gradient, the server's copy, a client's update), the least any run holds."""
    if cfg.model.name != "dnn":
        return
    width = cfg.model.hidden
    params = (math.prod(input_shape) + 1) * width + (width + 1) * num_classes
    check_memory(4 * 4 * params, f"config key 'model.hidden': {width:,} makes a DNN of {params:,} parameters, which "
                 "held four times", "lower model.hidden (pFedMe's DNN: 100, 20 on Synthetic)")


# Python's own cost of one planned batch of one client (a tensor object over the permutation)
BATCH_OBJECT_BYTES = 200


def check_local_memory(cfg: Config, input_shape: tuple[int, ...], num_classes: int, largest_client: int) -> None:
    """Clients trained side by side have every batch of the round planned up front (train.batch_plan: an int64 index
    and a float32 mask per slot, padded to local.batch_size) and a batch of each in memory at once: refuse a plan
    that cannot fit (local.batch_size 10**6 took 4.6 GB on a dataset of 1,797 samples), for every run's local keys.
    A batch slot holds its float32 features and label, and its outputs (and the DNN's hidden layer) a few times
    over (forward, softmax, gradient): measured 430 bytes a slot for digits' MLR (10 clients x 10**6: 4.3 GB)."""
    clients = cfg.clients_per_round or cfg.partition.num_clients
    hidden = cfg.model.hidden if cfg.model.name == "dnn" else 0
    per_sample = 4 * (math.prod(input_shape) + 4 * num_classes + 3 * hidden) + 8
    for spec in cfg.algorithms():
        hp = cfg.for_algorithm(spec).local
        batches = hp.steps or hp.epochs * -(-largest_client // hp.batch_size)
        need = clients * (batches * (12 * hp.batch_size + BATCH_OBJECT_BYTES) + hp.batch_size * per_sample)
        length = f"local.steps={hp.steps:,}" if hp.steps else f"local.epochs={hp.epochs:,}"
        check_memory(need, f"config keys local.batch_size={hp.batch_size:,} and {length} ({spec}): {clients:,} clients "
                     f"training side by side, {batches:,} batches each,",
                     f"a batch holds at most a client's train split (the largest here: {largest_client:,} samples): "
                     "lower local.batch_size, or the local epochs or steps")
