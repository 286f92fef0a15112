"""Threads of the ``geosharp`` commands: torch's intra-op threads and NumPy's BLAS threads.

:func:`set_threads` applies ``--threads`` (default :data:`DEFAULT_STUDY_THREADS` for the
studies); NumPy's BLAS keeps its own pool, limited by :func:`_limit_numpy_blas`.
"""

from __future__ import annotations

__all__ = ["DEFAULT_STUDY_THREADS", "set_threads"]

#: Threads of ``geosharp study`` and ``geosharp symmetry-test`` without ``--threads``: one, so
#: that two studies can run side by side on a 2-core machine without oversubscribing it.
DEFAULT_STUDY_THREADS = 1


def _limit_numpy_blas(threads: int) -> bool:
    """Limit the BLAS under NumPy to ``threads`` threads, for the rest of the process.

    NumPy's BLAS (OpenBLAS in the wheels) keeps its own thread pool, which
    :func:`torch.set_num_threads` does not touch; the diagonal study trains with NumPy matmuls.
    Uses ``threadpoolctl`` when it is installed, else OpenBLAS's own ``*set_num_threads*``
    function found among the loaded libraries (Linux).

    Returns:
        Whether a limit was applied.
    """
    import numpy  # noqa: F401  (loads the BLAS, so that it can be found)

    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(limits=threads, user_api="blas")
        return True
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower()}
    except OSError:
        return False
    names = (
        "scipy_openblas_set_num_threads64_",
        "scipy_openblas_set_num_threads",
        "openblas_set_num_threads64_",
        "openblas_set_num_threads",
    )
    done = False
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(threads))
                done = True
                break
    return done


def set_threads(threads: int | None, default: int | None = DEFAULT_STUDY_THREADS) -> int | None:
    """Apply ``--threads``: torch's intra-op threads and NumPy's BLAS threads.

    Args:
        threads: The option's value (``None``: not given).
        default: Threads when the option is not given; ``None`` leaves the libraries' own.

    Returns:
        The number of threads set, or ``None`` if nothing was changed.

    Raises:
        ValueError: If ``threads < 1``.
    """
    import torch

    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    n = threads if threads is not None else default
    if n is None:
        return None
    torch.set_num_threads(n)
    _limit_numpy_blas(n)
    return n
