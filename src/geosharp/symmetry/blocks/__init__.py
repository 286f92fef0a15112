"""Symmetry blocks: one class per symmetry group, all behind one protocol (SPEC §3, §8).

:mod:`~geosharp.symmetry.blocks.base` holds the protocol :class:`SymmetryBlock` and the
registry that turns a spec into its block (:func:`block_from_spec`); each group has a module:

* :class:`GLBlock` → GL(h) per head (attention) → :class:`~geosharp.geometry.GLGeometry`
* :class:`RotaryBlock` → the rotary commutant ⊂ GL(h) →
  :class:`~geosharp.geometry.GLSubgroupGeometry`
* :class:`LoRABlock` → GL(r) of ``W + B A`` → :class:`~geosharp.geometry.GLGeometry`
  (these three: :mod:`~geosharp.symmetry.blocks.gl`)
* :class:`DiagonalPair` → GL(1) per coordinate → :class:`~geosharp.geometry.DiagonalGeometry`
  (:mod:`~geosharp.symmetry.blocks.diagonal`)
* :class:`TranslationBlock` → translations of a key bias →
  :class:`~geosharp.geometry.FixedGeometry` (:mod:`~geosharp.symmetry.blocks.translation`)

A new symmetry group is one block class (a module here, naming the spec type it builds), one
geometry in :mod:`geosharp.geometry` (unless an existing one fits), and one adapter that
returns its specs; nothing else lists the block kinds.
"""

from geosharp.symmetry.blocks.base import (
    Coordinates,
    SymmetryBlock,
    block_from_spec,
    spec_types,
)
from geosharp.symmetry.blocks.diagonal import DiagonalPair
from geosharp.symmetry.blocks.gl import GLBlock, LoRABlock, RotaryBlock
from geosharp.symmetry.blocks.translation import TranslationBlock

__all__ = [
    "Coordinates",
    "DiagonalPair",
    "GLBlock",
    "LoRABlock",
    "RotaryBlock",
    "SymmetryBlock",
    "TranslationBlock",
    "block_from_spec",
    "spec_types",
]
