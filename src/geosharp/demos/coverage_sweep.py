"""The coverage check: find an architecture's blocks and re-parametrize it by their group.

* :func:`measure` — one :class:`~geosharp.demos.coverage_architectures.Architecture`: its
  blocks by kind (:func:`block_counts`), the finder's notes, and the largest relative output
  change under :func:`geosharp.symmetry.reparametrize` at the scales checked (:data:`SCALE`),
  against the tolerance of an exact claim (:data:`FLOAT64_TOL`, or :data:`FLOAT32_TOL` for a
  model that computes partly in float32), as a :class:`CoverageRow`;
* :func:`sweep` — every architecture of the sweep, or the named ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from geosharp.demos.coverage_architectures import ARCHITECTURES, Architecture

__all__ = [
    "FLOAT32_TOL",
    "FLOAT64_TOL",
    "SCALE",
    "CoverageRow",
    "block_counts",
    "measure",
    "sweep",
]

#: Group-element scale of the check (the paper sweeps ``a ∈ [1e-2, 1e2]``).
SCALE = 10.0
#: Largest relative output change of an exact float64 claim. Rounding of one solve/matmul with
#: ``cond(A) ≤ 1e3`` is ~2e-13 per layer; a false claim changes the outputs at order 1.
FLOAT64_TOL = 1e-9
#: Largest relative output change of an exact claim when the model computes part of its
#: forward in float32: ``cond(A)·eps32 ≈ 1e3 · 6e-8``.
FLOAT32_TOL = 1e-4


@dataclass
class CoverageRow:
    """The result of one architecture.

    Attributes:
        name: Architecture name.
        counts: Number of blocks per kind (see :func:`block_counts`).
        notes: The finder's notes, without the module lists.
        change: Largest relative output change over the checked scales.
        tolerance: Largest change of an exact claim for this architecture.
        float32: Why the model computes partly in float32, or ``None``.
    """

    name: str
    counts: dict[str, int]
    notes: list[str] = field(default_factory=list)
    change: float = 0.0
    tolerance: float = FLOAT64_TOL
    float32: str | None = None

    @property
    def exact(self) -> bool:
        """Whether the outputs stayed the same (every claim is true)."""
        return self.change < self.tolerance

    @property
    def blocks(self) -> int:
        """Number of symmetry blocks found (all kinds)."""
        return sum(self.counts.values())

    @property
    def verdict(self) -> str:
        """``exact``, ``exact (float32 …)`` or ``FALSE CLAIM``."""
        if not self.exact:
            return "**FALSE CLAIM**"
        if self.change < FLOAT64_TOL or self.float32 is None:
            return "exact"
        return f"exact up to float32 ({self.float32})"


# -- measuring ------------------------------------------------------------------------------------
def block_counts(space: object) -> dict[str, int]:
    """Number of symmetry blocks of a :class:`~geosharp.symmetry.ParameterSpace` per kind.

    Kinds: ``"QK"`` (full GL(h)), ``"QK rotary"`` (the rotary commutant), ``"VO"``, ``"b_k"``
    (key-bias translations), ``"LoRA"``, ``"u⊙v"`` (diagonal pairs) and any other block
    ``kind``.

    Args:
        space: The parameter space.

    Returns:
        ``{kind: count}`` in the order above, without zero counts.
    """
    blocks = getattr(space, "blocks", None)
    if blocks is None:
        blocks = [*space.gl_blocks, *space.diagonal_pairs]
    counts: dict[str, int] = {}
    for b in blocks:
        cls = type(b).__name__
        kind = str(getattr(b, "kind", cls))
        if getattr(b, "rotary", None) is not None:
            kind = "QK rotary"
        elif "LoRA" in cls or kind.lower() == "lora":
            kind = "LoRA"
        elif "Translation" in cls:
            kind = "b_k"
        elif "Diagonal" in cls:
            kind = "u⊙v"
        counts[kind] = counts.get(kind, 0) + 1
    order = ["QK", "QK rotary", "VO", "b_k", "LoRA", "u⊙v"]
    return dict(sorted(counts.items(), key=lambda kv: [*order, kv[0]].index(kv[0])))


def _short_note(note: str) -> str:
    """A finder note without its module list and explanation: ``"QK-norm"``, ``"rotary …"``."""
    head = note.split(":")[0]
    if head.endswith(")") and "(" in head and "modules" in head.rsplit("(", 1)[1]:
        head = head.rsplit("(", 1)[0]
    return head.strip()


def _rel_change(new: Tensor, ref: Tensor) -> float:
    return float((new - ref).abs().max() / ref.abs().max())


def measure(arch: Architecture, scales: Sequence[float] = (SCALE,), seed: int = 0) -> CoverageRow:
    """Build one architecture, find its blocks and check them by re-parametrization.

    Args:
        arch: The architecture.
        scales: Group-element scales to check; the largest change is reported.
        seed: Seed of the inputs and group elements.

    Returns:
        The :class:`CoverageRow`.
    """
    from geosharp.symmetry import find_symmetries, reparametrize

    model = arch.build()
    space = find_symmetries(model)
    inputs = arch.inputs(torch.Generator().manual_seed(seed))
    change = 0.0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = arch.forward(model, inputs)
        for i, scale in enumerate(scales):
            gen = torch.Generator().manual_seed(seed + 1 + i)
            twin = reparametrize(model, generator=gen, scale=scale, space=space)
            change = max(change, _rel_change(arch.forward(twin, inputs), out))
    # the key-bias note is the "b_k" count of the blocks column
    notes = [
        _short_note(n)
        for n in space.notes
        if not n.startswith(("key biases b_k", "symmetry claims"))
    ]
    notes = list(dict.fromkeys(notes))
    return CoverageRow(
        name=arch.name,
        counts=block_counts(space),
        notes=notes,
        change=change,
        tolerance=FLOAT32_TOL if arch.float32 else FLOAT64_TOL,
        float32=arch.float32,
    )


def sweep(
    names: Sequence[str] | None = None, scales: Sequence[float] = (SCALE,)
) -> list[CoverageRow]:
    """Measure every architecture of :data:`ARCHITECTURES` (or the named ones).

    Args:
        names: Architecture names to measure (default: all).
        scales: Group-element scales to check.

    Returns:
        One :class:`CoverageRow` per architecture, in table order.

    Raises:
        KeyError: If a name is not in the sweep.
    """
    by_name = {a.name: a for a in ARCHITECTURES}
    chosen = list(by_name) if names is None else list(names)
    missing = [n for n in chosen if n not in by_name]
    if missing:
        raise KeyError(f"not in the sweep: {missing}; known: {list(by_name)}")
    return [measure(by_name[n], scales) for n in chosen]
