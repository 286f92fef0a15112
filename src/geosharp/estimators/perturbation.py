"""The perturbation set of a sharpness measure at a base point (SPEC §2, §5, §6).

A :class:`Perturbation` splits the flat parameter vector ``θ`` of a
:class:`~geosharp.symmetry.ParameterSpace` into *pieces*, each with its own
:class:`~geosharp.geometry.Geometry`:

* ``measure="geodesic"``: every group of symmetry blocks with one batch key becomes one
  batched geometry built by the block class (all heads of all layers in one set of batched
  matmuls: GL(h), rotary, LoRA, diagonal pairs, key biases held fixed), and the remaining
  coordinates the adaptive :class:`~geosharp.geometry.ElementwiseGeometry` (followed along
  straight lines, as adaptive sharpness does);
* ``measure="adaptive"``: one element-wise piece over all of ``θ``;
* ``measure="euclidean"``: one Euclidean piece over all of ``θ``.

A perturbation ``ξ`` is a list with one tangent tuple per piece; its squared norm is the sum of
the pieces' squared norms (one global ball, SPEC §5). The perturbed parameters
``θ′ = endpoint(ξ)`` are a differentiable function of ``ξ``, so one forward and one backward of
the loss at ``θ′`` give the Euclidean gradient with respect to ``ξ`` (SPEC §6, step 2). All
base-point work (Gram matrices and their factorizations) happens once, in the constructor.

The pieces and the layout helpers are in :mod:`geosharp.estimators.pieces`; the ℓ∞ box
(:mod:`~geosharp.estimators.linf`), the memory accounting (:mod:`~geosharp.estimators.memory`),
the cut to the rows a batch reaches (:mod:`~geosharp.estimators.rows`) and the sums over pieces
(:mod:`~geosharp.estimators.reductions`) are functions of the pieces in their own modules, which
the methods of the one class :class:`Perturbation` call. Its tangent-vector arithmetic (the
combinations, the ball's norm and inner product, the projection, the Riemannian gradient and the
ascent direction, the Gaussian draw) is the mixin
:class:`~geosharp.estimators.tangent_arithmetic.TangentArithmetic`.

Every piece, index and buffer is made on the device of the parameters it serves (a model split
across devices, ``device_map="auto"``): a batched block geometry holds blocks of one device,
its base point read from their parameters there, and the pieces' numbers meet as scalars.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from geosharp.estimators import linf, memory, rows
from geosharp.estimators.assembly import Assembly
from geosharp.estimators.pieces import (
    BLOCK_METRICS,
    MEASURES,
    PERTURB,
    PerturbationOptions,
    Piece,
    RankSums,
    Xi,
    _base_params,
    build_pieces,
)
from geosharp.estimators.table_rows import RowsWritten
from geosharp.estimators.tangent_arithmetic import TangentArithmetic
from geosharp.symmetry import ParameterSpace

__all__ = [
    "BLOCK_METRICS",
    "MEASURES",
    "PERTURB",
    "Perturbation",
    "PerturbationOptions",
    "RankSums",
    "Xi",
]


class Perturbation(TangentArithmetic):
    """Geometry of the perturbation set of one sharpness measure at the base point ``θ₀``.

    Args:
        space: The model's parameter space (from :func:`geosharp.find_symmetries`).
        theta0: Base point, the flat trainable parameters (detached).
        options: What it is made of, checked (:class:`~geosharp.estimators.pieces.
            PerturbationOptions`); ``None``: from ``keywords``.
        ranks: What one rank of a sharded model gives it (:class:`~geosharp.estimators.pieces.
            RankSums`; ``None``: one process holds every coordinate):

            ``row_sum``: the space is one rank's shards of a sharded model, whose blocks hold
            this rank's rows of their factors (:mod:`geosharp.estimators.sharded.space`); sums
            an ``h × h`` contraction over the ranks (:attr:`GLExecution.row_sum
            <geosharp.geometry.GLExecution.row_sum>`). ``reduce``: sums a tensor of partial
            sums over the ranks holding the other shards (:attr:`reduce`). ``draws``: draws the
            rank's part of the unsharded noise (:attr:`draws`).
        **keywords: The fields of :class:`~geosharp.estimators.pieces.PerturbationOptions`
            when ``options`` is ``None``:

            measure: ``"geodesic"``, ``"adaptive"`` or ``"euclidean"``.
            metric: Block metric for ``measure="geodesic"``: ``"inv"``, ``"mix"`` or ``"adaptive"``
                (blocks keep the element-wise metric: with ``order=1`` this reproduces adaptive
                sharpness through the block machinery, SPEC §5).
            order: Geodesic order for symmetry blocks and diagonal pairs: ``1``, ``2`` or
                ``"exact"``.
            eps: Gram-matrix damping of the GL(h) blocks.
            corrected_norm: ``False`` is the paper's "no corrected norm" ablation: blocks are still
                followed along the geodesic of their invariant metric, but the ball, the Riemannian
                gradient and the projection (only of frozen coordinates: the adaptive metric has no
                quotient) use the adaptive element-wise metric. Projecting horizontally in the block
                metric instead would not be orthogonal in the ball's metric and can inflate the
                adaptive norm of a useful direction many-fold.
            exact_steps: RK4 steps for ``order="exact"``.
            perturb: ``"all"`` (default) or ``"blocks"``: only the symmetry blocks move, every other
                coordinate is held fixed (the attention-only measures, where the effect of the
                quotient is not diluted by MLP and embedding coordinates).
            work_dtype: Dtype of the block geometries' per-step products (``None``: float64, on
                tangents kept in the model's dtype; the model's dtype runs them in float32, see
                :attr:`geosharp.geometry.GLExecution.work_dtype`).
    """

    def __init__(
        self,
        space: ParameterSpace,
        theta0: Tensor | Mapping[str, Tensor],
        options: PerturbationOptions | None = None,
        *,
        ranks: RankSums | None = None,
        **keywords: Any,
    ) -> None:
        if options is None:
            options = PerturbationOptions(**keywords)  # checks them
        elif keywords:
            raise TypeError(f"Perturbation: options given, and keywords {sorted(keywords)}")
        ranks = ranks or RankSums()
        self.space = space
        #: The options it was made with (:class:`~geosharp.estimators.pieces.PerturbationOptions`).
        self.options = options
        #: Sums a tensor of partial sums over the ranks holding the other shards of the
        #: perturbation (``None``: one process holds it whole; see
        #: :mod:`geosharp.estimators.sharded`). Applied to every norm and pairing.
        self.reduce: Callable[[Tensor], Tensor] | None = ranks.reduce
        #: Draws the noise of a sharded model's rank, its part of the unsharded draw
        #: (:class:`~geosharp.estimators.sharded.draws.ShardedDraws`: ``random(pert, generator,
        #: scale)`` and ``uniform(pert, generator)``); ``None``: drawn here.
        self.draws: Any = ranks.draws
        self.measure = options.measure
        self.metric = options.metric
        self.order = options.order
        self.exact_steps = options.exact_steps
        # The base point is the model's own tensors (or views of a flat θ₀): coordinates in no
        # block are never copied; only the symmetry blocks gather their (G, H) factors.
        params = _base_params(space, theta0)
        #: Storages of the base point's own tensors (the model's: not held by the pieces).
        self._own = {t.untyped_storage().data_ptr() for t in params.values()}
        #: The rows of tables written in place during :meth:`applied` (else ``None``).
        self._rows_log: RowsWritten | None = None
        names = space.param_names
        self._itemsize = [params[n].element_size() for n in names]
        #: The device of every parameter: each piece, index and buffer is made on the device
        #: of the parameters it serves (a model split across devices, ``device_map="auto"``).
        devices = [params[n].device for n in names]
        built = build_pieces(space, params, devices, options, ranks.row_sum)
        self.pieces: list[Piece] = built.pieces
        self._rest_piece: int | None = built.rest
        self._layout = built.layout
        self._assembly = Assembly(
            space, self.pieces, self._rest_piece, self._layout, devices, built.plans
        )

    # -- the perturbed parameters -------------------------------------------------------------
    def _moved(self, xi: Xi, skip: int | None = None) -> list[tuple[Tensor, ...]]:
        """Every piece moved along its geodesic (or straight line) from the base point.

        The piece ``skip`` is taken as it is (it holds its moved value already).
        """
        out = []
        for k, (p, x) in enumerate(zip(self.pieces, xi, strict=True)):
            if k == skip:
                out.append(tuple(x))
            else:
                out.append(p.geometry.iterate_endpoint(x, order=p.order, steps=self.exact_steps))
        return out

    def endpoint(self, xi: Xi) -> Tensor:
        """Flat perturbed parameters ``θ′``, each piece moved along its geodesic."""
        return self.space.flatten(self.endpoint_params(xi))

    @contextlib.contextmanager
    def assembled_into(self, targets: Mapping[int, Tensor] | None) -> Iterator[None]:
        """Within: the parameters with block coordinates are written into ``targets``.

        ``targets`` maps parameter positions to tensors of their shape (a sharded model's own
        shards): :meth:`endpoint_params` and :meth:`base_params` write those parameters into
        them (when their dtype fits and the blocks' layout is a view of the parameters) and
        return views of them, instead of making fresh tensors that the caller would copy.
        """
        saved, self._assembly.targets = self._assembly.targets, dict(targets or {}) or None
        try:
            yield
        finally:
            self._assembly.targets = saved

    def base_params(self) -> dict[str, Tensor]:
        """The base point by name, assembled from the pieces' base points (exact copies).

        The parameters with block coordinates are fresh tensors (gathered from the pieces'
        points, bit for bit their values when the perturbation was built); the others are
        the rest piece's own tensors.
        """
        with torch.no_grad():
            return self._assembly([tuple(p.geometry.point) for p in self.pieces])

    def endpoint_params(self, xi: Xi, applied: bool = False) -> dict[str, Tensor]:
        """The perturbed parameters by name, ready for :func:`torch.func.functional_call`.

        Differentiable in ``ξ``. Parameters with no coordinate in a symmetry block are their
        moved component itself (no gather, no copy, and their gradient is the model's own);
        only the parameters that hold block coordinates are gathered (see
        :class:`~geosharp.estimators.assembly.Assembly`).

        Args:
            xi: The perturbation, or (``applied=True``) one whose straight-line piece holds
                ``θ′`` already (inside :meth:`applied`).
            applied: Take the rest piece's tensors as the perturbed values themselves.
        """
        moved = self._moved(xi, skip=self._rest_piece if applied and self.straight_rest else None)
        return self._assembly(moved, rows_log=self._rows_log if applied else None)

    def loss_and_grad(
        self,
        evaluate: Callable[[dict[str, Tensor]], Tensor],
        xi: Xi,
        need_grad: bool | Callable[[float], bool],
    ) -> tuple[Tensor, Xi | None]:
        """The loss at ``θ′(ξ)`` and (``need_grad``) its Euclidean gradient with respect to ``ξ``.

        One forward (and one backward) of ``evaluate``, a function of the perturbed parameters
        by name. ``θ′`` of the coordinates outside blocks lives in ``ξ``'s own tensors during
        the loss (:meth:`applied`: no separate copy of those weights), so on return ``ξ`` is
        the displacement the forward applied.

        Args:
            evaluate: The loss of the perturbed parameters by name.
            xi: The perturbation.
            need_grad: Whether to run the backward; a function of the loss's value decides
                after the forward (the forward keeps its graph, and drops it unused when the
                answer is no: Auto-PGD discards the gradient of an iterate it restarts from).

        Returns:
            The loss (detached) and the gradient, one tuple per piece (zeros where the loss
            does not depend on a component), or ``None``.
        """
        if need_grad is False:
            with torch.no_grad(), self.applied(xi) as moved:
                return evaluate(self.endpoint_params(moved, applied=True)).detach(), None
        with self.applied(xi) as moved:
            leaves = [tuple(t.detach().requires_grad_(True) for t in x) for x in moved]
            with torch.enable_grad():
                loss = evaluate(self.endpoint_params(leaves, applied=True))
                if callable(need_grad) and not need_grad(float(loss.detach())):
                    return loss.detach(), None
                flat = [t for x in leaves for t in x]
                grads = torch.autograd.grad(loss, flat, allow_unused=True)
        it = iter(
            g if g is not None else torch.zeros_like(t) for g, t in zip(grads, flat, strict=True)
        )
        return loss.detach(), [tuple(next(it) for _ in x) for x in leaves]

    @property
    def pulls_back(self) -> bool:
        """Whether every piece's endpoint has the identity as its derivative at ``ξ = 0``, exactly.

        Then ``∂L/∂ξ`` at ``ξ = 0`` *is* ``∂L/∂θ`` laid out as the pieces
        (:meth:`grad_at_zero`; a held piece's is zero), so the clean gradient is one plain
        forward and backward: the order-1 and order-2 endpoints ``θ₀ + ξ − ½Γ(ξ, ξ)`` of the GL,
        element-wise and Euclidean geometries (``Γ`` is quadratic, so its backward at ``ξ = 0``
        adds exact zeros) and the fixed points. RK4 (``order="exact"``) and the closed forms of
        diagonal pairs are left to autograd: their derivative at 0 is the identity only up to
        rounding.
        """
        return all(p.geometry.pulls_back(p.order) for p in self.pieces)

    @property
    def rest_index(self) -> int | None:
        """Position in :attr:`pieces` of the piece of the coordinates in no block (or None)."""
        return self._rest_piece

    @property
    def layout(self) -> list[tuple[int, Tensor | None]]:
        """Where the rest piece's components lie: one ``(parameter, local positions)`` each.

        ``parameter`` is a position in :attr:`space`'s parameters; ``local positions`` is
        ``None`` for a component that is the whole parameter (in its shape), else the flat
        positions inside the parameter of the coordinates in no block (a component of a
        parameter that also holds block coordinates: the Q, K, V, O projections' rest).
        """
        return list(self._layout)

    @property
    def assembly(self) -> Assembly:
        """How the moved pieces become the perturbed parameters (:class:`Assembly`).

        Its public members say where every symmetry piece's rows lie in the parameters
        (``plan``, ``sym_pieces``, ``gathered``, ``mixed``, ``mixed_local``); a sharded model
        makes ``θ′`` of the blocks where FSDP gathers them from it
        (:class:`~geosharp.estimators.sharded.gather.GatheredEndpoint`). Read it, never write it.
        """
        return self._assembly

    def grad_at_zero(self, grads: Sequence[Tensor]) -> Xi:
        """``∂L/∂ξ`` at ``ξ = 0`` from ``∂L/∂θ`` (one tensor per parameter of the space).

        The adjoint of :meth:`endpoint_params` at ``ξ = 0`` wherever every piece's endpoint has
        the identity as its derivative there (orders 1 and 2, held pieces): the parameter
        gradient laid out as the pieces (:meth:`Assembly.pull_back
        <geosharp.estimators.assembly.Assembly.pull_back>`), in each piece's tangent dtype; held
        pieces get zeros.
        """
        out = self._assembly.pull_back(self.pieces, grads)
        xi: Xi = []
        for p, comps in zip(self.pieces, out, strict=True):
            if p.geometry.is_trivial:
                xi.append(p.geometry.zeros())
            else:
                xi.append(tuple(t.to(p.geometry.tangent_dtype) for t in comps))
        return xi

    @property
    def straight_rest(self) -> bool:
        """Whether the coordinates outside blocks move along the straight line ``w + ξ``.

        True for adaptive and Euclidean sharpness and the adaptive rest of geodesic sharpness;
        then :meth:`applied` can hold ``θ′`` of those coordinates in ``ξ``'s own tensors.
        """
        k = self._rest_piece
        if k is None:
            return False
        piece = self.pieces[k]
        return piece.geometry.is_straight(piece.order)

    @contextlib.contextmanager
    def applied(self, xi: Xi, skip: Collection[int] = ()) -> Iterator[Xi]:
        """``ξ`` with its straight-line piece turned into ``θ′ = w + ξ`` in place, for one loss.

        The forward at a perturbed point needs ``θ′`` of every weight outside blocks, and the
        backward keeps the weights a layer saved (``F.linear`` keeps its weight): a separate
        ``θ′`` would be one parameter-sized buffer above a plain step. Here ``ξ``'s own tensors
        hold ``θ′`` for the loss (pass ``applied=True`` to :meth:`endpoint_params`; their
        gradient is the gradient with respect to ``ξ``), and on exit they hold ``θ′ − w``: the
        displacement the forward applied. That is ``ξ`` rounded to the point it reached (each
        coordinate moves by at most half an ulp of ``θ′``; exactly ``ξ`` whenever ``w + ξ`` is
        representable, e.g. ``ξ = 0``), so an ascent carries the perturbation of the point it
        evaluated. Pieces that do not move on straight lines are left as they are, and so are
        the rest piece's components ``skip`` (a caller holding their ``θ′`` elsewhere: a
        sharded model's shards, :mod:`geosharp.estimators.sharded.objective`). A table cut to
        the rows a batch reaches (:meth:`on_rows`) is perturbed in its own tensor for the loss
        (:mod:`~geosharp.estimators.table_rows`: no copy of the table) and put back on exit.
        """
        k = self._rest_piece
        if not self.straight_rest or k is None:
            yield xi
            return
        pairs = [
            pair
            for c, pair in enumerate(zip(xi[k], self.pieces[k].geometry.point, strict=True))
            if c not in skip
        ]
        for t, w in pairs:
            if t.dtype != w.dtype or t.shape != w.shape:
                raise ValueError(
                    f"the perturbation of {self.pieces[k].name} has dtype {t.dtype} and shape "
                    f"{tuple(t.shape)}, its point {w.dtype}, {tuple(w.shape)}"
                )
        ts, ws = [t for t, _ in pairs], [w for _, w in pairs]
        with torch.no_grad():
            if ts:  # one multi-tensor op: one dispatch, not one per component
                torch._foreach_add_(ts, ws)
        # a table cut to rows is perturbed in place for this loss (no copy of it), put back here
        self._rows_log = RowsWritten() if self._assembly.rows else None
        try:
            yield xi
        finally:
            with torch.no_grad():
                if self._rows_log is not None:
                    self._rows_log.restore()
                    self._rows_log = None
                if ts:
                    torch._foreach_sub_(ts, ws)

    # -- the ℓ∞ box (SPEC §2) -----------------------------------------------------------------
    def step_box(self, rho: float) -> linf.StepBox:
        """The ℓ∞ box of one ascent step (:class:`~geosharp.estimators.linf.StepBox`).

        Its sign step and in-place projections, with ``|w|`` and the bounds formed once.
        """
        return linf.StepBox(self.pieces, rho)

    def uniform_box(self, generator: torch.Generator | None, rho: float) -> Xi:
        """Uniform sample of the box ``|ξ_i| ≤ ρ|w_i|`` (adaptive) or ``|ξ_i| ≤ ρ``."""
        if self.draws is not None:  # a sharded model's rank: its part of the unsharded draw
            return linf.box_from_uniform(self.pieces, self.draws.uniform(self, generator), rho)
        return linf.uniform_box(self.pieces, generator, rho)

    # -- memory -------------------------------------------------------------------------------
    def buffer_bytes(self) -> tuple[int, int]:
        """The bytes of one perturbation ``ξ``, and those this perturbation holds beside it.

        The second figure is what an ascent holds whatever its iterates
        (:func:`geosharp.estimators.memory.held_bytes`); the model's own tensors are not
        counted (a plain forward and backward holds them too).
        """
        held = memory.held_bytes(self.pieces, self._assembly, self._own, self._itemsize)
        return memory.tangent_bytes(self.pieces), held

    @property
    def param_bytes(self) -> int:
        """The bytes of the parameters the perturbation covers (one parameter-sized buffer)."""
        return memory.param_bytes(self.space.shapes, self._itemsize)

    # -- the rows a batch reaches ---------------------------------------------------------------
    def row_tables(self) -> dict[str, int]:
        """The parameters :meth:`on_rows` can cut: name → component of the rest piece.

        Whole 2-D (or higher) parameters of a straight-line rest piece, e.g. embedding tables.
        """
        k = self._rest_piece if self.straight_rest else None
        return rows.row_tables(self.pieces, k, self._assembly)

    def on_rows(self, rows_kept: Mapping[str, Tensor]) -> Perturbation:
        """This perturbation with some tables restricted to the rows a batch reaches.

        The restricted rest piece holds only the rows given
        (:func:`geosharp.estimators.rows.cut_to_rows`); the symmetry pieces are shared.

        Args:
            rows_kept: Parameter name (one of :meth:`row_tables`) → the rows kept (indices
                along dimension 0).

        Returns:
            A new :class:`Perturbation` (or ``self`` when ``rows_kept`` is empty).
        """
        if not rows_kept:
            return self
        tables = self.row_tables()
        k = self._rest_piece
        rest = self.pieces[k] if k is not None else None
        piece, entries = rows.cut_to_rows(rest, tables, rows_kept)
        new = copy.copy(self)
        new.pieces = list(self.pieces)
        new.pieces[k] = piece  # type: ignore[index]
        new._assembly = copy.copy(self._assembly)
        new._assembly.rows = {**self._assembly.rows, **entries}
        return new
