r"""``geosharp measure --fsdp``: the model sharded by FSDP2 over the ranks of ``torchrun``.

::

    torchrun --standalone --nproc-per-node 8 -m geosharp measure MODEL DATA --fsdp ...

(``geosharp study MANIFEST --fsdp`` does the same to every model of a manifest:
:mod:`geosharp.studies.population_fsdp`, with :meth:`FsdpRun.load` and :meth:`FsdpRun.agree`.)

Every rank runs the same command. :func:`check_args` refuses a bad combination in one line
before anything is loaded (not under ``torchrun``, a measure a sharded model cannot be measured
with, a device other than ``auto``/``cpu``/``cuda``, a batch that the ranks cannot split
evenly). Then :class:`FsdpRun`

1. initializes the process group (:func:`geosharp.estimators.distributed.init_distributed`:
   ``nccl`` with one GPU per rank, ``cuda:LOCAL_RANK``, when CUDA is used, else ``gloo``);
2. after the pipeline has loaded the model into CPU memory on every rank (the same weights
   everywhere), applies ``fully_shard`` to every transformer layer
   (:func:`transformer_layers`: the modules of a Hugging Face model's ``_no_split_modules``
   classes in its ``nn.ModuleList``\ s, else the children of the ``nn.ModuleList``\ s of
   repeated modules) and to the root, which moves each rank's shard to its device, every call
   with the ``shard_placement_fn`` of :func:`geosharp.estimators.sharded.placement.shard_placement`
   (built on the model before sharding it): ``W_q``, ``W_k``, ``W_v`` and LoRA's ``A`` are split
   along dimension 1, so that no row of a symmetry block is split across ranks (the geodesic and
   attention-only measures need whole rows, SPEC §10.3; the element-wise ones do not care);
3. gives every rank its rows of every batch (:func:`local_rows`: rank ``r`` of ``W`` holds rows
   ``r·m/W … (r+1)·m/W − 1`` of a batch of ``m``): a sharded model measures every batch on every
   rank, each on its rows (FSDP's collectives need every rank in every forward), unlike the
   whole-batch split of :class:`~geosharp.estimators.distributed.BatchSplit` for unsharded
   models;

The loss of a batch is then the mean of the ranks' losses: the batch's loss for a mean over
rows (classification), as every rank holds as many rows. A language model's cross-entropy is a
mean over the tokens that are not padding, which the ranks hold unequally many of; for the
``causal-lm`` and ``seq2seq`` tasks with the built-in loss, :func:`token_weighted` weighs each
rank's mean by its share of the batch's tokens (one scalar all-reduce per forward), so that the
mean over ranks is the batch's mean over all its tokens, as in one process.

:func:`geosharp.measure` measures it (:mod:`geosharp.measuring.sharded`). Rank 0 alone
prints and writes the results; every rank prints its error if it fails. At the end the process
group is destroyed and the process ends without the interpreter's teardown (:func:`finish`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.measuring.core import DEFAULT_MEASURES as CORE_DEFAULT_MEASURES
from geosharp.measuring.errors import MeasureError

__all__ = [
    "DEFAULT_MEASURES",
    "TORCHRUN_VARS",
    "FsdpRun",
    "check_args",
    "finish",
    "local_rows",
    "token_weighted",
    "transformer_layers",
]

#: What ``torchrun`` sets in every rank's environment.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: ``--fsdp`` without ``--measures``: the paper's three, as without ``--fsdp``.
DEFAULT_MEASURES = CORE_DEFAULT_MEASURES


@dataclass
class FsdpRun:
    """One rank of ``geosharp measure --fsdp`` (:func:`check_args` builds it).

    Attributes:
        rank: This rank.
        world: The ranks.
        local_rank: This rank on its node (its GPU).
        device: Where the shards live: ``cuda`` (the current device, ``cuda:LOCAL_RANK``) or
            ``cpu``.
        layers: The layers sharded as their own units (:meth:`shard` sets it).
        along_dim_1: The parameters sharded along dimension 1 (:meth:`shard` sets it).
        loss_weighing: How the ranks' losses make the batch's (:meth:`loss` sets it).
    """

    rank: int
    world: int
    local_rank: int
    device: torch.device
    layers: list[str] = field(default_factory=list)
    along_dim_1: list[str] = field(default_factory=list)
    loss_weighing: str = "none: every rank holds as many rows (a mean over rows)"

    @property
    def backend(self) -> str:
        """``nccl`` for GPUs, ``gloo`` for CPUs."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    def start(self) -> None:
        """Initialize the process group from ``torchrun``'s environment."""
        from geosharp.estimators.distributed import init_distributed

        init_distributed(self.backend)

    def shard(self, model: nn.Module, say: Callable[[str], None]) -> nn.Module:
        """``fully_shard`` every transformer layer and the root, on a 1-D mesh of the ranks.

        Every call gets the ``shard_placement_fn`` of :func:`geosharp.shard_placement`, built
        on the model before it is sharded, so that no row of a symmetry block is split across
        ranks. FSDP2 splits a parameter along dimension 1 only evenly: one whose dimension 1
        the ranks do not divide keeps FSDP's default (dimension 0), and a line says so (the
        geodesic measures then find its rows split, unless the ranks divide the number of
        heads, and fail saying why; the element-wise measures do not need whole rows). So does
        a symmetry finder that fails on the model.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        layers = transformer_layers(model)
        names = {id(m): n for n, m in model.named_modules()}
        kinds = sorted({type(m).__name__ for m in layers})  # before FSDP renames the classes
        place = self._placement(model, say)
        try:
            for layer in layers:
                fully_shard(layer, mesh=mesh, shard_placement_fn=place)
            fully_shard(model, mesh=mesh, shard_placement_fn=place)
        except Exception as err:
            raise MeasureError(
                f"--fsdp: FSDP2's fully_shard cannot shard this model ({type(model).__name__}): "
                f"{type(err).__name__}: {err}"
            ) from err
        self.layers = [names[id(m)] for m in layers]
        rows = (
            f"{len(self.along_dim_1)} parameter(s) placed along dimension 1 so that the rows of "
            "the symmetry blocks stay whole (geosharp.shard_placement), the rest along 0"
        )
        if layers:
            say(
                f"fsdp: {len(layers)} layer(s) ({', '.join(kinds)}) and the root sharded over "
                f"{self.world} rank(s) ({self.backend}, {self.device.type}); {rows}"
            )
        else:
            say(
                f"fsdp: no repeated layers found, so only the root is sharded over {self.world} "
                f"rank(s): every forward gathers the whole model at once; {rows}"
            )
        return model

    def _placement(self, model: nn.Module, say: Callable[[str], None]) -> Callable | None:
        """:func:`geosharp.shard_placement` of the unsharded model, less what FSDP2 refuses.

        Sets :attr:`along_dim_1`. ``None`` (FSDP's default) if the symmetry finder fails.
        """
        from geosharp.estimators.sharded.placement import shard_placement

        try:  # on the whole model: before fully_shard
            place = shard_placement(model, world=self.world)
        except Exception as err:  # the same model on every rank: every rank falls back alike
            say(
                f"fsdp: the symmetry finder failed on {type(model).__name__} "
                f"({type(err).__name__}: {err}), so every parameter is sharded along dimension "
                "0 (FSDP's default): a geodesic or attention-only measure may find a block's "
                "rows split across ranks and fail"
            )
            return None
        named = dict(model.named_parameters())
        uneven = list(place.kept)
        self.along_dim_1 = list(place.parameters)
        if not uneven:
            return place
        say(
            f"fsdp: {len(uneven)} parameter(s) whose rows the geodesic measures need whole "
            f"({uneven[0]}{' and more' if len(uneven) > 1 else ''}: {named[uneven[0]].shape[1]} "
            f"columns) stay split along dimension 0 (FSDP's default): FSDP2 splits a dimension "
            f"other than 0 only evenly, and {self.world} ranks do not divide it; the geodesic "
            "and attention-only measures will find their rows split and fail unless the ranks "
            "divide the number of heads (use a number of ranks that divides both)"
        )
        return place

    def load(
        self, source: Any, opts: Any, say: Callable[[str], None], warn: Callable[[str], None]
    ) -> tuple[Any, nn.Module, list[tuple[Any, Any]], Any]:
        """Load a model on the CPU, shard it, take this rank's rows, weigh the loss.

        What every rank of ``geosharp measure --fsdp`` and ``geosharp study MANIFEST --fsdp``
        does to each model (the process group started).

        Args:
            source: The :class:`~geosharp.measuring.pipeline.ModelSource`.
            opts: The :class:`~geosharp.measuring.pipeline.MeasureOptions` (its device is
                replaced by the CPU: ``fully_shard`` moves each rank's shard to its device).
            say: Where the log goes.
            warn: Where warnings go.

        Returns:
            ``(ready, model, batches, loss)``: the
            :class:`~geosharp.measuring.pipeline.ReadyModel`, the sharded model, the rank's
            rows of every batch (:func:`local_rows`) and the loss (:meth:`loss`).
        """
        import dataclasses

        from geosharp.measuring.pipeline import load_for_measure

        opts = dataclasses.replace(opts, device=torch.device("cpu"))
        ready = load_for_measure(source, opts, say=say, warn=warn)
        model = self.shard(ready.model, say)
        batches = local_rows(ready.batches, self.rank, self.world)
        return ready, model, batches, self.loss(ready.loss, ready.task, warn)

    def agree(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a pickled broadcast): what rank 0 decided."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def loss(self, spec: Any, task: str, warn: Callable[[str], None]) -> Any:
        """The loss to measure: a language model's built-in one weighed by token shares.

        Args:
            spec: The pipeline's loss: a name (``"auto"``, ``"ce"``) or a callable.
            task: The task (``classification``, ``causal-lm``, ``seq2seq``).
            warn: Where a warning goes (a callable loss on a language-model task).

        Returns:
            ``spec``, or :func:`token_weighted` of it.
        """
        from geosharp.measuring.losses import resolve_loss

        if task == "classification":
            return spec
        if spec is None or isinstance(spec, str):
            fn, name = resolve_loss(spec)
            self.loss_weighing = (
                "token-weighted: each rank's mean over its tokens times its share of the "
                "batch's tokens, so that the mean over ranks is the batch's mean over tokens"
            )
            return token_weighted(fn, name, self.world)
        self.loss_weighing = "none: the mean of the ranks' losses (a callable --loss)"
        warn(
            f"--fsdp with --loss {getattr(spec, '__name__', spec)} on the {task} task: a batch's "
            "loss is the mean of the ranks' losses on their rows, which is the batch's own loss "
            "only if yours is a mean over rows (the built-in cross-entropy, a mean over tokens, "
            "is weighed by each rank's share of the tokens)"
        )
        return spec

    def describe(self) -> dict[str, Any]:
        """What the result records of the run (``settings["fsdp"]``)."""
        return {
            "world": self.world,
            "backend": self.backend,
            "device": self.device.type,
            "layers": len(self.layers),
            "layer_names": self.layers[:3] + (["..."] if len(self.layers) > 3 else []),
            "along_dim_1": len(self.along_dim_1),
            "rows": "every batch split evenly over the ranks, in contiguous blocks",
            "loss_weighing": self.loss_weighing,
        }


def check_args(
    args: argparse.Namespace,
    env: Mapping[str, str] | None = None,
    command: str = "measure MODEL DATA",
) -> FsdpRun:
    """Refuse, in one line before anything is loaded, what ``--fsdp`` cannot run.

    Args:
        args: The parsed ``geosharp measure`` (or ``geosharp study MANIFEST``) arguments, with
            ``--fsdp``: ``measures``, ``device``, ``batch_size``, ``samples`` (and
            ``trace_method``, where the command has it).
        env: The environment (default: ``os.environ``).
        command: The command, as the line refusing a launch outside ``torchrun`` names it.

    Returns:
        The rank's :class:`FsdpRun` (the process group not yet initialized).

    Raises:
        MeasureError: Not under ``torchrun``, a measure that a sharded model cannot be
            measured with, ``--device`` other than ``auto``, ``cpu`` or ``cuda``, or a
            ``--batch-size``/``--samples`` the ranks cannot split evenly.
    """
    from geosharp.measures import parse_measure
    from geosharp.measuring.resolve import resolve_device
    from geosharp.measuring.sharded import refusal

    env = os.environ if env is None else env
    missing = [k for k in TORCHRUN_VARS if k not in env]
    if missing:
        raise MeasureError(
            f"--fsdp runs one process per rank under torchrun, but {', '.join(missing)} "
            "is not set: launch with `torchrun --standalone --nproc-per-node N -m geosharp "
            f"{command} --fsdp ...` (docs/cluster.md)"
        )
    settings = {"trace_method": getattr(args, "trace_method", "hutchinson")}
    for text in args.measures or DEFAULT_MEASURES:
        why = refusal(parse_measure(text), settings)  # the measure says (its shard_refusal)
        if why is not None:
            raise MeasureError(f"--fsdp: {why}")
    if args.device not in ("auto", "cpu", "cuda"):
        raise MeasureError(
            f"--fsdp with --device {args.device}: each rank puts its shard on its own GPU "
            "(cuda:LOCAL_RANK) or on the CPU; use --device auto, cuda or cpu"
        )
    try:
        rank, world, local = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError as err:
        raise MeasureError(
            f"--fsdp: torchrun's RANK, WORLD_SIZE or LOCAL_RANK is not an integer: {err}"
        ) from err
    if args.batch_size % world:
        raise MeasureError(
            f"--fsdp: --batch-size {args.batch_size} is not a multiple of the {world} ranks: "
            "every rank measures its equal share of the rows of every batch"
        )
    if args.samples and args.samples % args.batch_size % world:
        raise MeasureError(
            f"--fsdp: the last batch of --samples {args.samples} at --batch-size "
            f"{args.batch_size} holds {args.samples % args.batch_size} rows, not a multiple of "
            f"the {world} ranks: choose --samples a multiple of {world}"
        )
    device = resolve_device(args.device)  # cuda only where CUDA is available
    return FsdpRun(rank=rank, world=world, local_rank=local, device=torch.device(device.type))


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    r"""The layers of a model that ``fully_shard`` makes units of their own.

    The children of the model's ``nn.ModuleList``\ s whose class is one of a Hugging Face
    model's ``_no_split_modules`` (its transformer blocks); where there are none, the children
    of every ``nn.ModuleList`` of at least two modules of one class. Only the outermost: a
    layer inside another is left to it.
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    classes: set[str] = set()
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set)):
            classes.update(str(n) for n in names)
    found = [c for ml in lists for c in ml if type(c).__name__ in classes]
    if not found:
        found = [c for ml in lists if len(ml) >= 2 and len({type(c) for c in ml}) == 1 for c in ml]
    inner = {id(d) for m in found for d in m.modules() if d is not m}
    return [m for m in found if id(m) not in inner]


def _split(obj: Any, rows: int, lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of every tensor of a (nested) batch whose first dimension is ``rows``."""
    if isinstance(obj, Tensor):
        return obj[lo:hi] if obj.dim() > 0 and obj.shape[0] == rows else obj
    if isinstance(obj, Mapping):
        return type(obj)({k: _split(v, rows, lo, hi) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_split(v, rows, lo, hi) for v in obj)
    return obj


def local_rows(batches: Sequence[Any], rank: int, world: int) -> list[tuple[Any, Any]]:
    """Rank ``rank``'s rows of every ``(inputs, targets)`` batch: its contiguous ``1/world``.

    Raises:
        MeasureError: If a batch's rows (the first dimension of its targets) are not known or
            not a multiple of ``world``.

    Example:
        >>> x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
        >>> [(a.tolist(), b.tolist()) for a, b in local_rows([(x, y)], 1, 3)]
        [([[4, 5], [6, 7]], [2, 3])]
    """
    out = []
    for b, batch in enumerate(batches):
        inputs, targets = batch
        rows = targets.shape[0] if isinstance(targets, Tensor) and targets.dim() > 0 else None
        if rows is None or rows % world:
            what = "no rows (its targets are not a tensor)" if rows is None else f"{rows} rows"
            raise MeasureError(
                f"--fsdp: batch {b} has {what}, which the {world} ranks cannot split evenly: "
                f"choose --batch-size and --samples multiples of {world}"
            )
        n = rows // world
        lo, hi = rank * n, (rank + 1) * n
        out.append((_split(inputs, rows, lo, hi), _split(targets, rows, lo, hi)))
    return out


def token_weighted(loss_fn: Callable, name: str, world: int) -> Callable:
    """``loss_fn``, a mean over the targets that are not ``-100``, weighed by the rank's share.

    A rank holding ``n_r`` of a batch's ``N`` tokens returns ``world · n_r / N`` times its mean:
    the mean of these over the ranks is ``Σ_r n_r·mean_r / N``, the mean over all the batch's
    tokens (what one process computes). ``N`` is summed over the ranks at every call, so every
    rank must call it as often as the others (every forward, as FSDP requires anyway).

    Args:
        loss_fn: The loss, a mean over the targets not equal to ``-100`` (cross-entropy).
        name: Its name in the results (``"auto"``, ``"ce"``).
        world: The ranks.

    Returns:
        The weighted loss; ``__wrapped__`` is ``loss_fn``.
    """
    import functools

    import torch.distributed as dist

    from geosharp.measuring.losses import IGNORE_INDEX, _logits

    @functools.wraps(loss_fn)
    def weighted(outputs: Any, targets: Tensor) -> Tensor:
        mean = loss_fn(outputs, targets)
        n = (targets != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
        total = n.clone()
        dist.all_reduce(total)
        if float(n) == 0.0:  # no token on this rank: its mean is 0/0, its share 0
            return _logits(outputs).sum() * 0.0
        return mean * (world * n / total).to(mean.dtype).reshape(())

    weighted.__name__ = name
    return weighted


def finish(rc: int) -> None:
    """End a rank: destroy the process group (if one was started), then the process.

    The interpreter's teardown is skipped (``os._exit`` after flushing): on CPU builds of
    torch a gloo process that ran FSDP2 has aborted in it now and then ("terminate called
    without an active exception") after its work was done. Without a process group (a refusal
    before anything was loaded) it returns, and the command ends as usual.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
