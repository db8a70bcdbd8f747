"""How clients train on this machine, in one place: the algorithms write their client math once against a Cohort
(pfedkit/train.py) and never see any of this.

The executors, one module each:
- one_client.py  a client alone: the reference arithmetic (plain SGD on the flat vectors, gradients, evaluation)
- threads.py     clients side by side in threads, each on one intra-op thread
- processes.py   clients side by side in forked worker processes, results in shared memory (Linux CPUs)
- lockstep.py    a round's clients in lockstep through the model's batched form (dense models; every model on a GPU)
- cuda_graphs.py each lockstep step one replay of a captured CUDA graph
- cnn.py, native.py  a CNN's forward and whole training step on pfedkit's C kernels (kernels.c, built per CPU
                 capability by the package's build, registered as torch.library ops)

runner.py's ClientRunner chooses among them once a run from the `runtime:` settings, the model and the device,
says its choice in one line, and owns what they keep between rounds (replicas, the batched loss, CUDA graphs, the
measured fork-or-threads placement). Every way gives a client the same bits (tests/test_one_arithmetic.py,
tests/test_executors.py).
"""
from .runner import ClientRunner

__all__ = ["ClientRunner"]
