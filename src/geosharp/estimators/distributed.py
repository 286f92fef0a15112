"""Data-parallel sharpness under ``torchrun``: the batches are split across ranks (SPEC §6).

The inner maximization of worst-case sharpness (and the noise average of average-case
sharpness) is solved independently per batch, so batches can be measured on different
processes and the per-batch results put back together. :func:`geosharp.sharpness` does this
when ``torch.distributed`` is initialized with more than one rank (or with
``distributed=True``):

1. every rank materializes the same list of batches (``B`` of them);
2. rank ``r`` of ``W`` measures batches ``r, r + W, r + 2W, …``;
3. the per-batch values, clean and perturbed losses, ascent traces, pass counts and times are
   exchanged with ``all_gather_object`` (works with ``gloo`` on CPUs and ``nccl`` on GPUs) and
   put back in the original batch order.

Every rank returns the same :class:`~geosharp.estimators.sharpness.SharpnessResult`. Its
``per_batch`` values and ``value`` are identical to those of a single-process run on the same
batches with the same seed: the random generator of batch ``b`` is seeded by
:func:`batch_seed` from ``(seed, b)`` in both cases, never by the rank that happens to measure
it. (Bit-identical when every rank runs on the same kind of device with the same number of
threads as the single process; otherwise the usual floating-point reduction-order differences
apply.) ``time_s``, ``n_forward`` and ``n_backward`` are summed over ranks (total work, not
wall time). Before measuring, the ranks check that they hold bit-identical weights and batches;
if one rank fails while measuring (e.g. a ``FloatingPointError``), every rank raises that error
instead of waiting forever for it.

:mod:`geosharp.demos.torchrun` measures a tiny vision transformer this way, a check of a
cluster setup::

    torchrun --nproc_per_node 2 -m geosharp.demos.torchrun --out runs/dp --check

Example:
    Without an initialized process group nothing is split:

    >>> batch_seed(0, 0), batch_seed(7, 2)
    (0, 2000013)
    >>> split = BatchSplit([("x0", "y0"), ("x1", "y1")], None)
    >>> split.active, [b for b, _ in split.local()]
    (False, [0, 1])
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

#: Multiplier of the batch index in :func:`batch_seed` (a prime; batch 0 keeps ``seed``).
SEED_STRIDE = 1_000_003


def batch_seed(seed: int, b: int) -> int:
    """Seed of the random generator of batch ``b``: ``seed + 1_000_003·b`` (mod 2⁶⁴).

    The random starts and noise samples of a batch depend only on ``(seed, b)``, so a batch
    gets the same random numbers whichever rank measures it and however many ranks there are.
    Batch 0 keeps ``seed`` itself.

    Args:
        seed: The ``seed`` of :func:`geosharp.sharpness`.
        b: Index of the batch in the iterable of batches (0-based).

    Returns:
        A seed accepted by :meth:`torch.Generator.manual_seed`.
    """
    return (int(seed) + SEED_STRIDE * int(b)) % 2**64


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    if not _dist_ready():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def is_active(distributed: bool | None) -> bool:
    """Whether sharpness is split across ranks.

    Args:
        distributed: ``None``: when a process group of more than one rank is initialized;
            ``True``: always (a process group must be initialized); ``False``: never.

    Returns:
        Whether the batches are split.

    Raises:
        RuntimeError: If ``distributed=True`` but ``torch.distributed`` is not initialized.
        TypeError: If ``distributed`` is not ``None`` or a bool.
    """
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"distributed must be None, True or False, got {distributed!r}")
    if distributed is False:
        return False
    if _dist_ready():
        return distributed is True or torch.distributed.get_world_size() > 1
    if distributed is True:
        raise RuntimeError(
            "distributed=True but torch.distributed is not initialized: launch with torchrun and "
            "call geosharp.estimators.distributed.init_distributed() (or "
            "torch.distributed.init_process_group) first"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        warnings.warn(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed is not initialized: "
            "every rank measures every batch. Call "
            "geosharp.estimators.distributed.init_distributed() to split the batches.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Initialize the default process group from ``torchrun``'s environment.

    Picks ``nccl`` when CUDA is available and ``gloo`` otherwise, and on GPUs makes
    ``cuda:LOCAL_RANK`` the current device (``nccl`` exchanges objects through it). Does
    nothing if the group is already initialized.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ... (default: as above).

    Returns:
        ``(rank, world size)``.

    Raises:
        RuntimeError: If ``torch.distributed`` is unavailable or the environment lacks the
            variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).
    """
    if not torch.distributed.is_available():
        raise RuntimeError("this build of torch has no torch.distributed")
    if _dist_ready():
        return world()
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"the environment lacks {', '.join(missing)}: launch with torchrun, e.g. "
            "`torchrun --nproc_per_node 2 script.py`"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend=backend)
    return world()


def _update_digest(h: Any, obj: Any) -> None:
    if isinstance(obj, Tensor):
        t = obj.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, Mapping):
        h.update(b"M")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _update_digest(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _update_digest(h, v)
    else:
        h.update(repr(obj).encode())


def digest(obj: Any) -> str:
    """SHA-1 of the exact bytes of every tensor in a nested tuple/list/dict (and reprs).

    Args:
        obj: Tensors, possibly nested in tuples, lists and dicts.

    Returns:
        A hex digest, equal for bit-identical data.
    """
    h = hashlib.sha1()
    _update_digest(h, obj)
    return h.hexdigest()


def _packed_error(err: BaseException) -> dict[str, Any]:
    try:
        blob = pickle.dumps(err)
        pickle.loads(blob)
    except Exception:  # an exception that does not survive pickling is sent as text
        blob = None
    return {"type": type(err).__name__, "message": str(err), "pickle": blob}


def _unpacked_error(packed: dict[str, Any], rank: int, world_size: int) -> BaseException:
    err: BaseException | None = None
    if packed["pickle"] is not None:
        try:
            err = pickle.loads(packed["pickle"])
        except Exception:
            err = None
    if err is None:
        err = RuntimeError(f"{packed['type']}: {packed['message']}")
    if hasattr(err, "add_note"):
        err.add_note(f"(raised on rank {rank} of {world_size} while measuring its batches)")
    return err


class BatchSplit:
    """Which batches this rank measures, and the exchange that puts all of them together.

    Used by :func:`geosharp.sharpness`; not active without a process group (see
    :func:`is_active`), in which case it is a thin wrapper around ``enumerate(batches)``.

    Args:
        batches: The iterable of batches (materialized as a list when active).
        distributed: See :func:`is_active`.
        t0: ``time.perf_counter()`` at the start of the call (for :meth:`elapsed`).
        theta: The weights (a tensor or a list of them); when active, every rank checks that
            the others hold the same.

    Raises:
        ValueError: If the ranks disagree on the number of batches, their contents or the
            weights (raised on every rank).
    """

    def __init__(
        self,
        batches: Iterable[Any],
        distributed: bool | None,
        *,
        t0: float | None = None,
        theta: Tensor | Sequence[Tensor] | None = None,
    ) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.active = is_active(distributed)
        self.rank, self.world_size = world() if self.active else (0, 1)
        self._gathered = not self.active
        self._time_s: float | None = None
        self._indices: list[int] = []
        if not self.active:
            self._batches: Iterable[Any] = batches
            return
        self._batches = list(batches)
        mine = {
            "n": len(self._batches),
            "batches": digest(self._batches),
            "weights": digest(theta) if theta is not None else None,
        }
        everyone = self._all_gather(mine)
        for what, label in (("n", "number of batches"), ("batches", "batches"), ("weights", "")):
            values = [p[what] for p in everyone]
            if any(v != values[0] for v in values):
                ranks = [r for r, v in enumerate(values) if v != values[0]]
                label = label or "weights"
                raise ValueError(
                    f"the ranks of torch.distributed disagree on the {label} (rank(s) {ranks} "
                    f"differ from rank 0): every rank must pass the same model and the same "
                    "batches in the same order (no DistributedSampler, no unseeded shuffling, "
                    "the same checkpoint or seed on every rank)"
                )

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def local(self) -> Sequence[tuple[int, Any]] | Iterable[tuple[int, Any]]:
        """``(global index, batch)`` of the batches this rank measures."""
        if not self.active:
            return enumerate(self._batches)
        mine = list(range(self.rank, len(self._batches), self.world_size))
        self._indices = mine
        return [(b, self._batches[b]) for b in mine]

    def gather(
        self,
        per_batch: list[float],
        clean: list[float],
        perturbed: list[float],
        traces: list[list[float]],
        counter: dict[str, int],
    ) -> tuple[list[float], list[float], list[float], list[list[float]]]:
        """Exchange this rank's per-batch results and return all of them in batch order.

        ``counter`` (``{"forward": n, "backward": m}``) is replaced in place by the sum over
        ranks. Without a process group everything is returned unchanged.

        Args:
            per_batch: Sharpness of each local batch, in the order of :meth:`local`.
            clean: Clean loss of each local batch.
            perturbed: Perturbed loss of each local batch.
            traces: Ascent trace of each local batch (worst case), or empty (average case).
            counter: Forward/backward pass counts of this rank.

        Returns:
            ``(per_batch, clean, perturbed, traces)`` of all batches, in batch order.

        Raises:
            Exception: The error of another rank that failed while measuring.
        """
        if not self.active:
            return per_batch, clean, perturbed, traces
        payload = {
            "indices": self._indices[: len(per_batch)],
            "per_batch": per_batch,
            "clean": clean,
            "perturbed": perturbed,
            "traces": traces,
            "counter": dict(counter),
            "time_s": time.perf_counter() - self.t0,
            "error": None,
        }
        everyone = self._exchange(payload)
        n = len(self._batches)
        order: dict[int, tuple[float, float, float, list[float] | None]] = {}
        for p in everyone:
            has_traces = len(p["traces"]) == len(p["per_batch"])
            for i, b in enumerate(p["indices"]):
                trace = p["traces"][i] if has_traces else None
                order[b] = (p["per_batch"][i], p["clean"][i], p["perturbed"][i], trace)
        if sorted(order) != list(range(n)):  # pragma: no cover - guarded by the checks above
            raise RuntimeError(f"data-parallel sharpness lost batches: got {sorted(order)}")
        rows = [order[b] for b in range(n)]
        # Worst case: one trace per batch; average case: none.
        all_traces = [r[3] for r in rows] if all(r[3] is not None for r in rows) else []
        counter["forward"] = sum(p["counter"]["forward"] for p in everyone)
        counter["backward"] = sum(p["counter"]["backward"] for p in everyone)
        self._time_s = sum(p["time_s"] for p in everyone)
        return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], all_traces

    def largest(self, x: float | None) -> float | None:
        """The largest ``x`` over ranks (``None``s left out; ``None`` if every rank has ``None``).

        Without a process group ``x`` itself. Every rank must call it, after :meth:`gather`.
        """
        if not self.active:
            return x
        seen = [v for v in self._all_gather(x) if v is not None]
        return max(seen) if seen else None

    def _exchange(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        self._gathered = True
        everyone = self._all_gather(payload)
        for r, p in enumerate(everyone):
            if p["error"] is not None and r != self.rank:
                raise _unpacked_error(p["error"], r, self.world_size)
        return everyone

    def elapsed(self) -> float:
        """Seconds since ``t0``; summed over ranks once :meth:`gather` has run."""
        if self._time_s is not None:
            return self._time_s
        return time.perf_counter() - self.t0

    def __enter__(self) -> BatchSplit:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        # A rank that fails before the exchange still takes part in it, with its error, so that
        # the other ranks raise too instead of waiting for it forever.
        if exc is not None and isinstance(exc, Exception) and not self._gathered:
            failed = {"error": _packed_error(exc)}
            try:
                self._exchange(failed)
            except Exception:  # another rank failed too: this rank's own error wins
                pass
        return False
