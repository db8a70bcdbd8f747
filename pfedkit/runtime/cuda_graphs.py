"""CUDA graphs for training steps whose shapes repeat: a step is captured once and then replayed, one launch for
all of its kernels. A small CNN's step at batch 32 is dozens of kernels of a few microseconds each: run eagerly
the GPU waits on Python and the launches, replayed it does not (benchmarks/bench_gpu.py measures both, with the
GPU's utilization; docs/performance.md).

A captured step reads and writes fixed ("static") tensors: its caller copies each step's inputs into them before
a replay and reads the results out after the last (train.graphed_lockstep). Capture follows PyTorch's whole-network
recipe (torch.cuda.graphs docs): a few warm-up runs on a side stream, then the capture; the step must update its
state in place and never wait for the device.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Callable, Hashable

import torch

WARMUP_RUNS = 2  # before capture, on a side stream: lazy initializations (cuBLAS/cuDNN handles) happen there


def capture(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`step` captured as a graph (run WARMUP_RUNS times first: it must be harmless to run on its static inputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


class GraphCache:
    """The last few captured steps with their static tensors, by a key of everything the capture baked in
    (shapes, dtypes, hyperparameters). Bounded: each graph holds a private memory pool. A key whose capture failed
    maps to None, and the caller runs that step eagerly from then on (warned once)."""

    def __init__(self, size: int = 4):
        self.size, self.entries = size, OrderedDict()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        try:
            entry = make()
        except RuntimeError as err:  # an op that cannot be captured: eager it is, same results
            warnings.warn(f"CUDA graph capture failed, training this step shape eagerly: {err}", RuntimeWarning)
            entry = None
        self.entries[key] = entry
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return entry
