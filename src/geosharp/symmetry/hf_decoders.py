"""Adapters of Hugging Face decoder attention: fused QKV projections and rotary positions.

Covered: BLOOM, GPT-NeoX, Falcon, Phi, Phi3, GPT-J. They are listed in
:data:`~geosharp.symmetry.hf_adapters.EXTRA_ADAPTERS` and so tried before the adapters of
:mod:`geosharp.symmetry.adapters`: each recognises its module by class name and structure, and
only says where Q, K, V, O and their heads live (as
:class:`~geosharp.symmetry.specs.ParamSlice` s); the finder does the gathering.

Layouts of the fused projections (``nn.Linear`` weights ``(out, in)``, heads on the outputs):

* BLOOM, GPT-NeoX, Falcon (classic): ``query_key_value`` stores per head ``[q, k, v]``
  (``h`` features each): ``ParamSlice(w, 0, parts=3, part=0|1|2)``.
* Falcon ``new_decoder_architecture``: per K/V group ``[q_1 … q_g, k, v]``:
  ``parts=g + 2``, queries ``part=(0, g)``, key ``part=g``, value ``part=g + 1``.
* Falcon ``multi_query``: ``[Q (all heads); k; v]`` with one K/V head.
* Phi3 ``qkv_proj``: ``[Q (all heads); K (kv heads); V (kv heads)]``.

Position terms: ALiBi biases (BLOOM, Falcon with ``config.alibi``) are added to the scores and
keep the full GL(h) Q/K symmetry and a free key bias; rotary embeddings (GPT-NeoX, Falcon, Phi,
Phi3, GPT-J) restrict it to the rotary commutant (:class:`~geosharp.symmetry.specs.RotarySpec`),
and the key bias is then a row of ``H_QK``.
"""

from __future__ import annotations

from torch import nn

from geosharp.symmetry.adapter_kit import (
    AttentionSlices,
    _all_linear,
    _check_width,
    _config,
    _first_int,
    _join,
    _linear_out,
    _name,
    _separate_linear_claim,
    attention_claim,
    qk_norm_note,
    rotary_spec,
)
from geosharp.symmetry.specs import Claim, ParamSlice, RotarySpec

__all__ = [
    "bloom_attention",
    "falcon_attention",
    "gpt_neox_attention",
    "gptj_attention",
    "phi3_attention",
    "phi_attention",
]


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
    cfg = _config(module)
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
    cfg = _config(module)
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
    cfg = _config(module)
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
    cfg = _config(module)
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
