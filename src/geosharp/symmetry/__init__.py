"""Find the GL(h) symmetry blocks of a PyTorch model and map parameters ↔ blocks (SPEC §3).

The finder returns a :class:`ParameterSpace`: one flat coordinate vector ``θ`` over the
trainable parameters, split into symmetry blocks (:mod:`geosharp.symmetry.blocks`: GL(h) heads
of attention, rotary Q/K heads, LoRA adapters, diagonal pairs ``u ⊙ v``, key-bias translations)
and the rest (adaptive geometry).
Architecture knowledge lives in small adapters (:mod:`geosharp.symmetry.adapters`; further
Hugging Face layouts in :mod:`~geosharp.symmetry.hf_adapters` and
:mod:`~geosharp.symmetry.hf_decoders`); users can add their own or declare blocks by hand with
:func:`declare_block`. The finder only claims
blocks; :func:`prove` proves the claims of a space on a batch and drops those that fail.

The modules depend one way: specs and positions ← blocks ← space ← group ← find (with the
adapters) ← reparametrize; verify (acting and proving) reads a space and never imports find.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from geosharp.symmetry import find_symmetries, reparametrize
    >>> layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16)
    >>> space = find_symmetries(layer)
    >>> [b.name for b in space.gl_blocks]
    ['self_attn[QK]', 'self_attn[VO]']
"""

from geosharp.symmetry.adapter_kit import AttentionSlices
from geosharp.symmetry.adapters import ADAPTERS, Adapter, attention_claim, register_adapter
from geosharp.symmetry.blocks import (
    DiagonalPair,
    GLBlock,
    LoRABlock,
    RotaryBlock,
    SymmetryBlock,
    TranslationBlock,
)
from geosharp.symmetry.find import find_symmetries
from geosharp.symmetry.group import GroupElement, group_action, random_group_elements
from geosharp.symmetry.hf_adapters import EXTRA_ADAPTERS
from geosharp.symmetry.reparametrize import reparametrize
from geosharp.symmetry.space import ParameterSpace
from geosharp.symmetry.specs import (
    BlockSpec,
    Claim,
    PairSpec,
    ParamSlice,
    RotarySpec,
    TranslationSpec,
    declare_block,
)
from geosharp.symmetry.verify import prove

ADAPTERS[0:0] = [a for a in EXTRA_ADAPTERS if a not in ADAPTERS]

__all__ = [
    "ADAPTERS",
    "Adapter",
    "AttentionSlices",
    "BlockSpec",
    "Claim",
    "DiagonalPair",
    "GLBlock",
    "GroupElement",
    "LoRABlock",
    "PairSpec",
    "ParamSlice",
    "ParameterSpace",
    "RotaryBlock",
    "RotarySpec",
    "SymmetryBlock",
    "TranslationBlock",
    "TranslationSpec",
    "attention_claim",
    "declare_block",
    "find_symmetries",
    "group_action",
    "prove",
    "random_group_elements",
    "register_adapter",
    "reparametrize",
]
