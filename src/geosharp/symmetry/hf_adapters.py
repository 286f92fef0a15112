"""Adapters for further Hugging Face attention layouts, tried before the generic ones.

Covered here: DistilBERT, ALBERT, DeBERTa-v2, MPNet, T5; the decoders with fused QKV projections
or rotary positions (BLOOM, GPT-NeoX, Falcon, Phi, Phi3, GPT-J) are in
:mod:`~geosharp.symmetry.hf_decoders`. :data:`EXTRA_ADAPTERS` lists them all.

They are tried before the adapters of :mod:`geosharp.symmetry.adapters` (see
:data:`EXTRA_ADAPTERS`), so each recognises its module by class name and structure. As there,
an adapter only says where Q, K, V, O and their heads live (as
:class:`~geosharp.symmetry.specs.ParamSlice` s); the finder does the gathering.

Position terms: the relative-position biases of MPNet and T5 are added to the scores and keep
the full GL(h) Q/K symmetry and a free key bias; with ALBERT's relative position scores only V/O
is claimed. DeBERTa's disentangled attention is derived in :func:`deberta_v2_attention`.
"""

from __future__ import annotations

from torch import nn

from geosharp.symmetry.adapter_kit import (
    AttentionSlices,
    _all_linear,
    _check_width,
    _first_int,
    _join,
    _linear_bias,
    _linear_in,
    _linear_out,
    _linear_weight,
    _name,
    _relative_note,
    _separate_linear_claim,
    attention_claim,
)
from geosharp.symmetry.adapters import Adapter
from geosharp.symmetry.hf_decoders import (
    bloom_attention,
    falcon_attention,
    gpt_neox_attention,
    gptj_attention,
    phi3_attention,
    phi_attention,
)
from geosharp.symmetry.specs import Claim

__all__ = [
    "EXTRA_ADAPTERS",
    "albert_attention",
    "deberta_v2_attention",
    "distilbert_attention",
    "mpnet_attention",
    "t5_attention",
]


# -- encoders -------------------------------------------------------------------------------------
def distilbert_attention(path: str, module: nn.Module) -> Claim | None:
    """DistilBERT's ``DistilBertSelfAttention`` (4.x: ``MultiHeadSelfAttention``).

    Structure: ``q_lin``, ``k_lin``, ``v_lin``, ``out_lin`` (``nn.Linear``), ``n_heads``.
    Softmax attention without position terms: full GL(h) on Q/K and V/O, free key bias.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    names = ("q_lin", "k_lin", "v_lin", "out_lin")
    name = _name(module)
    if not (name.startswith("DistilBert") or name == "MultiHeadSelfAttention"):
        return None
    heads = _first_int(getattr(module, "n_heads", None))
    if heads is None or not _all_linear(module, names):
        return None
    h = _first_int(getattr(module, "attention_head_size", None))
    return _separate_linear_claim(
        path, module, names, heads, h or module.q_lin.out_features // heads
    )


def albert_attention(path: str, module: nn.Module) -> Claim | None:
    """ALBERT's ``AlbertAttention``: ``query``, ``key``, ``value``, ``dense`` on one module.

    ALBERT shares one layer (group) across depth; the shared module appears once in
    ``named_modules()`` and so gives one QK and one VO block whatever the depth. The re-used
    weights transform once, which is a symmetry of every repetition. With relative position
    scores (``position_embedding_type="relative_key"``, transformers 4.x) only V/O is claimed.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    names = ("query", "key", "value", "dense")
    if not _name(module).startswith("Albert") or not _all_linear(module, names):
        return None
    heads = _first_int(getattr(module, "num_attention_heads", None))
    if heads is None:
        return None
    h = (
        _first_int(getattr(module, "attention_head_size", None))
        or module.query.out_features // heads
    )
    return _separate_linear_claim(
        path, module, names, heads, h, num_kv_heads=heads, qk_note=_relative_note(module)
    )


def deberta_v2_attention(path: str, module: nn.Module) -> Claim | None:
    """DeBERTa-v2/v3 ``DebertaV2Attention`` (``self``: ``DisentangledSelfAttention``).

    The scores of head ``i`` are (``s`` a constant, ``δ``/``δ′`` relative-position buckets,
    ``r`` the shared relative embeddings)::

        s·S_ij = q_i·k_j  +  q_i·pk_δ(i,j)  [c2p]  +  k_j·pq_δ′(i,j)  [p2c]

    with ``q = x W_qᵀ + b_q``, ``k = x W_kᵀ + b_k``, ``pk = r W_pkᵀ + b_pk``,
    ``pq = r W_pqᵀ + b_pq``. Every term is one bilinear form, so one ``A ∈ GL(h)`` acting by
    ``q ↦ q A⁻¹``, ``k ↦ k Aᵀ`` (first term), ``pk ↦ pk Aᵀ`` (c2p) and ``pq ↦ pq A⁻¹``
    (p2c: ``k`` already moves by ``Aᵀ``) leaves all three unchanged: ``G`` stacks
    ``[W_q; b_q; W_pq; b_pq]`` and ``H`` stacks ``[W_k; b_k; W_pk; b_pk]``. With
    ``share_att_key=True`` the position terms go through ``query_proj``/``key_proj`` themselves
    and ``G``, ``H`` are just Q and K.

    Key biases: ``q_i·b_k`` and ``q_i·b_pk`` are the same for every key ``j``, so the softmax
    ignores them — but with p2c, ``b_k·pq_δ′(i,j)`` varies with ``j``: then ``b_k`` is a row of
    ``H`` and only ``b_pk`` (if any) is a free translation. ``b_q`` and ``b_pq`` are never free.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    if not _name(module).startswith("DebertaV2") or not _name(module).endswith("Attention"):
        return None
    if not _all_linear(module, ("self.query_proj", "self.key_proj", "self.value_proj")):
        return None
    if not _all_linear(module, ("output.dense",)):
        return None
    inner = module.get_submodule("self")
    heads = _first_int(getattr(inner, "num_attention_heads", None))
    h = _first_int(getattr(inner, "attention_head_size", None))
    if heads is None or h is None:
        return None
    ip = _join(path, "self")
    rel = bool(getattr(inner, "relative_attention", False))
    types = list(getattr(inner, "pos_att_type", None) or []) if rel else []
    share = bool(getattr(inner, "share_att_key", False))
    c2p, p2c = "c2p" in types, "p2c" in types
    for name, on in (("pos_key_proj", c2p and not share), ("pos_query_proj", p2c and not share)):
        if on and not _all_linear(inner, (name,)):
            return None
    q = list(_linear_in(ip, "query_proj", inner.query_proj))
    k = list(_linear_weight(ip, "key_proj"))
    k_bias = list(_linear_bias(ip, "key_proj", inner.key_proj))
    if p2c:
        k += k_bias  # b_k·pq_δ′(i,j) varies with the key: a row of H, not a translation
        k_bias = []
        if not share:
            q += _linear_in(ip, "pos_query_proj", inner.pos_query_proj)
    if c2p and not share:
        k += _linear_weight(ip, "pos_key_proj")
        k_bias += _linear_bias(ip, "pos_key_proj", inner.pos_key_proj)
    for role, lin in (("query", inner.query_proj), ("key", inner.key_proj)):
        _check_width(path, role, lin.out_features, heads, h)
    _check_width(path, "output", module.output.dense.in_features, heads, h)
    slices = AttentionSlices(
        q=q,
        k=k,
        k_bias=k_bias,
        v=_linear_in(ip, "value_proj", inner.value_proj),
        o=_linear_out(path, "output.dense"),
    )
    return attention_claim(path, slices, num_heads=heads, head_dim=h)


def mpnet_attention(path: str, module: nn.Module) -> Claim | None:
    """MPNet's ``MPNetSelfAttention``: ``q``, ``k``, ``v``, ``o`` (``nn.Linear``).

    The relative position bias (computed once in the encoder) is added to the scores: Q/K keeps
    GL(h) and the key bias is free.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    names = ("q", "k", "v", "o")
    if not (_name(module).startswith("MPNet") and _name(module).endswith("SelfAttention")):
        return None
    heads = _first_int(getattr(module, "num_attention_heads", None))
    if heads is None or not _all_linear(module, names):
        return None
    h = _first_int(getattr(module, "attention_head_size", None)) or module.q.out_features // heads
    return _separate_linear_claim(path, module, names, heads, h)


#: T5-family attention classes with the ``T5Attention`` layout.
_T5_CLASSES = ("T5Attention", "MT5Attention", "UMT5Attention", "LongT5Attention")


def t5_attention(path: str, module: nn.Module) -> Claim | None:
    """T5's ``T5Attention`` (also mT5, UMT5, LongT5's full attention).

    Structure: ``q``, ``k``, ``v``, ``o`` without biases, ``n_heads``, ``key_value_proj_dim``.
    No ``1/√d`` and an additive relative attention bias: full GL(h) on Q/K and V/O, in encoder
    and decoder self-attention and in the decoder's cross-attention (same class).

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    names = ("q", "k", "v", "o")
    if _name(module) not in _T5_CLASSES or not _all_linear(module, names):
        return None
    heads = _first_int(getattr(module, "n_heads", None))
    h = _first_int(getattr(module, "key_value_proj_dim", None))
    if heads is None or h is None:
        return None
    return _separate_linear_claim(path, module, names, heads, h)


#: Inserted at the front of :data:`geosharp.symmetry.adapters.ADAPTERS`, in this order.
EXTRA_ADAPTERS: list[Adapter] = [
    distilbert_attention,
    albert_attention,
    deberta_v2_attention,
    mpnet_attention,
    t5_attention,
    bloom_attention,
    gpt_neox_attention,
    falcon_attention,
    phi3_attention,
    phi_attention,
    gptj_attention,
]
