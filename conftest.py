"""The whole suite's pytest settings: one thread per pytest-xdist worker.

``make test`` runs the suite on two workers (``-n 2``); CI has 2 cores, and two workers with a
thread per core each slow one another down several times over, so each worker runs torch, OpenMP
and BLAS on one thread (the subprocesses a test starts inherit the variables). A plain
``python -m pytest`` (no xdist, no ``PYTEST_XDIST_WORKER``) keeps torch's default.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[_var] = "1"


def pytest_configure(config):
    """Torch on one thread in an xdist worker, had torch been imported before the variables."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
