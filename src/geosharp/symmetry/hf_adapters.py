"""Adapters for further Hugging Face attention layouts, tried before the generic ones.

Covered: DistilBERT, ALBERT, DeBERTa-v2, MPNet, T5, BLOOM, GPT-NeoX, Falcon, Phi, Phi3, GPT-J.

They are tried before the adapters of :mod:`geosharp.symmetry.adapters` (see
:data:`EXTRA_ADAPTERS`), so each recognises its module by class name and structure. As there,
an adapter only says where Q, K, V, O and their heads live (as
:class:`~geosharp.symmetry.specs.ParamSlice` s); the finder does the gathering.

Layouts of the fused projections (``nn.Linear`` weights ``(out, in)``, heads on the outputs):

* BLOOM, GPT-NeoX, Falcon (classic): ``query_key_value`` stores per head ``[q, k, v]``
  (``h`` features each): ``ParamSlice(w, 0, parts=3, part=0|1|2)``.
* Falcon ``new_decoder_architecture``: per K/V group ``[q_1 … q_g, k, v]``:
  ``parts=g + 2``, queries ``part=(0, g)``, key ``part=g``, value ``part=g + 1``.
* Falcon ``multi_query``: ``[Q (all heads); k; v]`` with one K/V head.
* Phi3 ``qkv_proj``: ``[Q (all heads); K (kv heads); V (kv heads)]``.

Position terms: relative-position and ALiBi biases are added to the scores and keep the full
GL(h) Q/K symmetry and a free key bias; rotary embeddings (GPT-NeoX, Falcon, Phi, Phi3, GPT-J)
restrict it to the rotary commutant (:class:`~geosharp.symmetry.specs.RotarySpec`), and the key
bias is then a row of ``H_QK``. DeBERTa's disentangled attention is derived in
:func:`deberta_v2_attention`.
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
    _relative_note,
    _separate_linear_claim,
    attention_claim,
    qk_norm_note,
    rotary_spec,
)
from geosharp.symmetry.adapters import Adapter
from geosharp.symmetry.specs import Claim, ParamSlice, RotarySpec

__all__ = [
    "EXTRA_ADAPTERS",
    "albert_attention",
    "bloom_attention",
    "deberta_v2_attention",
    "distilbert_attention",
    "falcon_attention",
    "gpt_neox_attention",
    "gptj_attention",
    "mpnet_attention",
    "phi3_attention",
    "phi_attention",
    "t5_attention",
]


def _name(module: nn.Module) -> str:
    return type(module).__name__


def _cfg(module: nn.Module) -> object:
    return getattr(module, "config", None)


def _fused_claim(
    path: str,
    module: nn.Module,
    layout: str,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    *,
    qkv: str = "query_key_value",
    out: str = "dense",
    rotary: RotarySpec | None = None,
) -> Claim | None:
    """The claim of one fused ``nn.Linear`` QKV projection plus an output ``nn.Linear``.

    ``layout`` says how the fused output is ordered (see the module docstring):

    * ``"grouped"``: per K/V group ``[q_1 … q_g, k, v]``, ``g = num_heads / num_kv_heads``
      query heads per group (``g = 1``: per head ``[q, k, v]``, as in BLOOM);
    * ``"stacked"``: ``[Q (all heads); K (kv heads); V (kv heads)]``.

    ``None`` when the projection's width is not ``(num_heads + 2·num_kv_heads)·head_dim`` (or,
    grouped, the query heads do not split evenly into the groups).
    """
    lin = module.get_submodule(qkv)
    if lin.out_features != (num_heads + 2 * num_kv_heads) * head_dim:
        return None
    if layout == "grouped":
        if num_heads % num_kv_heads:
            return None
        # The output is cut into units of ``parts × head_dim`` features, one per group;
        # ``q``/``k``/``v`` are ``[p0, p1)`` part ranges within every unit.
        g = num_heads // num_kv_heads
        parts, q, k, v = g + 2, (0, g), (g, g + 1), (g + 1, g + 2)
    else:
        # ``q``/``k``/``v`` are ``[start, stop)`` feature ranges of the output.
        Q, K = num_heads * head_dim, num_kv_heads * head_dim
        parts, q, k, v = 1, (0, Q), (Q, Q + K), (Q + K, Q + 2 * K)
    w = _join(path, f"{qkv}.weight")
    b = _join(path, f"{qkv}.bias") if getattr(lin, "bias", None) is not None else None

    def piece(name: str, rng: tuple[int, int]) -> ParamSlice:
        if parts == 1:
            return ParamSlice(name, 0, rng[0], rng[1])
        return ParamSlice(name, 0, parts=parts, part=rng if rng[1] - rng[0] > 1 else rng[0])

    def rows(rng: tuple[int, int]) -> tuple[ParamSlice, ...]:
        return (piece(w, rng),) + ((piece(b, rng),) if b is not None else ())

    _check_width(path, "output", module.get_submodule(out).in_features, num_heads, head_dim)
    slices = AttentionSlices(
        q=rows(q),
        k=(piece(w, k),),
        k_bias=(piece(b, k),) if b is not None else (),
        v=rows(v),
        o=_linear_out(path, out),
    )
    return attention_claim(
        path,
        slices,
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        rotary=rotary,
    )


def _rotary(dims: object, head_dim: int, layout: str) -> RotarySpec | None:
    """``RotarySpec(dims, layout)`` for a rotary width read from a module (``None`` if < 2)."""
    if not isinstance(dims, int) or isinstance(dims, bool):
        return None
    dims = min(dims, head_dim)
    dims -= dims % 2
    return RotarySpec(dims, layout) if dims >= 2 else None


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


# -- fused decoders -------------------------------------------------------------------------------
def bloom_attention(path: str, module: nn.Module) -> Claim | None:
    """BLOOM's ``BloomAttention``: head-interleaved ``query_key_value`` and ``dense``.

    ``query_key_value`` stores per head ``[q, k, v]``; ALiBi is added to the scores, so Q/K
    keeps GL(h) and the key bias is free.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    if not _name(module).startswith("Bloom") or not _all_linear(
        module, ("query_key_value", "dense")
    ):
        return None
    heads = _first_int(getattr(module, "num_heads", None))
    h = _first_int(getattr(module, "head_dim", None))
    if heads is None or h is None:
        return None
    return _fused_claim(path, module, "grouped", heads, h, heads)


def gpt_neox_attention(path: str, module: nn.Module) -> Claim | None:
    """GPT-NeoX's ``GPTNeoXAttention``: head-interleaved ``query_key_value``, ``dense``.

    Per head ``[q, k, v]`` (the forward views the output as ``(heads, 3h)`` and chunks it);
    rotary embeddings (``rotate_half``) on the first ``rotary_ndims`` features of each head.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    name = _name(module)
    if not name.startswith("GPTNeoX") or "Japanese" in name:
        return None
    if not _all_linear(module, ("query_key_value", "dense")):
        return None
    cfg = _cfg(module)
    heads = _first_int(
        getattr(module, "num_attention_heads", None), getattr(cfg, "num_attention_heads", None)
    )
    h = _first_int(getattr(module, "head_size", None))
    if heads is None or h is None:
        return None
    rotary = _rotary(getattr(module, "rotary_ndims", None), h, "half")
    return _fused_claim(path, module, "grouped", heads, h, heads, rotary=rotary)


def falcon_attention(path: str, module: nn.Module) -> Claim | None:
    """Falcon's ``FalconAttention`` in its three ``query_key_value`` layouts.

    * ``new_decoder_architecture``: per K/V group ``[q_1 … q_g, k, v]`` (``g`` query heads
      per K/V head, ``num_kv_heads`` groups): grouped-query blocks, one per group;
    * ``multi_query``: ``[Q (all heads); k; v]``, one K/V head shared by all queries;
    * otherwise per head ``[q, k, v]`` as in BLOOM.

    Positions: ALiBi (``config.alibi``) is added to the scores (full GL(h), free key bias);
    otherwise rotary embeddings (``rotate_half``) on the whole head.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    if not _name(module).startswith("Falcon") or not _all_linear(
        module, ("query_key_value", "dense")
    ):
        return None
    if not hasattr(module, "new_decoder_architecture") or not hasattr(module, "multi_query"):
        return None
    heads = _first_int(getattr(module, "num_heads", None))
    h = _first_int(getattr(module, "head_dim", None))
    if heads is None or h is None:
        return None
    cfg = _cfg(module)
    rotary = None
    if not getattr(cfg, "alibi", False):
        rotary = RotarySpec(h, "half")  # FalconRotaryEmbedding rotates the whole head
    if module.new_decoder_architecture:
        kv = _first_int(getattr(module, "num_kv_heads", None), getattr(cfg, "num_kv_heads", None))
        if kv is None:
            return None
        return _fused_claim(path, module, "grouped", heads, h, kv, rotary=rotary)
    if module.multi_query:
        return _fused_claim(path, module, "stacked", heads, h, 1, rotary=rotary)
    return _fused_claim(path, module, "grouped", heads, h, heads, rotary=rotary)


def phi_attention(path: str, module: nn.Module) -> Claim | None:
    """Phi's ``PhiAttention``: ``q_proj``, ``k_proj``, ``v_proj``, ``dense``.

    Grouped-query heads from the config, partial rotary embeddings (``rotary_ndims``,
    ``rotate_half``); with ``qk_layernorm`` Q/K has no continuous symmetry and only V/O is
    claimed.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    names = ("q_proj", "k_proj", "v_proj", "dense")
    if not _name(module).startswith("Phi") or not _all_linear(module, names):
        return None
    cfg = _cfg(module)
    heads = _first_int(
        getattr(module, "num_heads", None), getattr(cfg, "num_attention_heads", None)
    )
    h = _first_int(getattr(module, "head_dim", None))
    if heads is None or h is None:
        return None
    kv = _first_int(
        getattr(module, "num_key_value_heads", None),
        getattr(cfg, "num_key_value_heads", None),
        heads,
    )
    rotary = _rotary(getattr(module, "rotary_ndims", None), h, "half")
    return _separate_linear_claim(
        path,
        module,
        names,
        heads,
        h,
        num_kv_heads=kv,
        rotary=rotary,
        qk_note=qk_norm_note(module),
    )


def phi3_attention(path: str, module: nn.Module) -> Claim | None:
    """Phi-3's ``Phi3Attention``: fused ``qkv_proj`` = ``[Q; K; V]`` and ``o_proj``.

    ``Q`` has ``num_attention_heads`` heads, ``K`` and ``V`` ``num_key_value_heads`` each
    (grouped-query); rotary embeddings (``rotate_half``, ``partial_rotary_factor``).

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    if not _name(module).startswith("Phi3") or not _all_linear(module, ("qkv_proj", "o_proj")):
        return None
    cfg = _cfg(module)
    heads = _first_int(getattr(cfg, "num_attention_heads", None))
    h = _first_int(getattr(module, "head_dim", None))
    kv = _first_int(
        getattr(module, "num_key_value_heads", None), getattr(cfg, "num_key_value_heads", None)
    )
    if heads is None or h is None or kv is None:
        return None
    rotary = rotary_spec(module, h, "half") or RotarySpec(h, "half")
    return _fused_claim(
        path, module, "stacked", heads, h, kv, qkv="qkv_proj", out="o_proj", rotary=rotary
    )


def gptj_attention(path: str, module: nn.Module) -> Claim | None:
    """GPT-J's ``GPTJAttention``: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, no biases.

    Rotary embeddings in the interleaved layout (``rotate_every_two``: planes ``(2i, 2i+1)``)
    on the first ``rotary_dim`` features of each head (all of them when ``rotary_dim`` is
    ``None``). Recognised before the CLIP layout, which has the same projection names.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    names = ("q_proj", "k_proj", "v_proj", "out_proj")
    if not _name(module).startswith("GPTJ") or not _all_linear(module, names):
        return None
    heads = _first_int(getattr(module, "num_attention_heads", None))
    h = _first_int(getattr(module, "head_dim", None))
    if heads is None or h is None:
        return None
    dims = getattr(module, "rotary_dim", None)
    rotary = _rotary(h if dims is None else dims, h, "interleaved")
    return _separate_linear_claim(path, module, names, heads, h, num_kv_heads=heads, rotary=rotary)


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
