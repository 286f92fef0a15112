"""Adapters: where the GL(h) blocks of known attention modules live (SPEC §3).

An adapter is a function ``adapter(path, module) -> Claim | None``. It looks at one module
(``path`` is its dotted name in the model, ``""`` for the root) and either returns ``None``
("not mine") or a :class:`~geosharp.symmetry.specs.Claim` listing the module's blocks as
parameter slices. It never gathers anything itself: :func:`geosharp.symmetry.find_symmetries`
turns the slices into flat indices with one generic code path, and does not descend into a
claimed module.

Hugging Face modules are recognised by their structure and attribute names, never by importing
``transformers``, so the adapters work with transformers 4.x and 5.x alike (and with the many
model families that reuse these layouts).

The registry :data:`ADAPTERS` is a plain list, tried in order; extend it with
:func:`register_adapter` or pass ``adapters=[...]`` to ``find_symmetries``.

Example:
    A user adapter for a module with one fused ``qk`` linear layer (heads stacked as
    ``[Q; K]``) and no value path:

    >>> import torch
    >>> from torch import nn
    >>> from geosharp.symmetry import Claim, BlockSpec, ParamSlice, find_symmetries
    >>> class QKScore(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.qk = nn.Linear(8, 2 * 4)  # one head, h = 4
    >>> def qk_adapter(path, module):
    ...     if not isinstance(module, QKScore):
    ...         return None
    ...     w = f"{path}.qk.weight" if path else "qk.weight"
    ...     spec = BlockSpec(f"{path}[QK]", "QK", path, heads=1, head_dim=4,
    ...                      g=(ParamSlice(w, 0, 0, 4),), h=(ParamSlice(w, 0, 4, 8),))
    ...     return Claim(blocks=[spec])
    >>> space = find_symmetries(nn.Sequential(QKScore()), adapters=[qk_adapter, *ADAPTERS])
    >>> [(b.name, b.n, b.m) for b in space.gl_blocks]
    [('0[QK]', 8, 8)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from geosharp.symmetry.specs import (
    BlockSpec,
    Claim,
    PairSpec,
    ParamSlice,
    RotarySpec,
    TranslationSpec,
)

__all__ = [
    "ADAPTERS",
    "QK_NORM_NOTE",
    "Adapter",
    "attention_claim",
    "bert_attention",
    "clip_attention",
    "diagonal_net",
    "geosharp_attention",
    "gpt2_attention",
    "llama_attention",
    "peft_lora",
    "register_adapter",
    "rotary_note",
    "rotary_spec",
    "torch_multihead_attention",
    "vit_attention",
]

Adapter = Callable[[str, nn.Module], "Claim | None"]


# -- the one generic constructor ------------------------------------------------------------------
def _join(path: str, local: str) -> str:
    return f"{path}.{local}" if path else local


def attention_claim(
    path: str,
    *,
    q: Sequence[ParamSlice],
    k: Sequence[ParamSlice],
    v: Sequence[ParamSlice],
    o: Sequence[ParamSlice],
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    rotary: RotarySpec | bool | None = None,
    qk_note: str | None = None,
    k_bias: Sequence[ParamSlice] = (),
    key_bias_free: bool = True,
) -> Claim:
    """The QK and VO blocks of one multi-head attention module (SPEC §3, §8).

    Under grouped-query attention (``num_kv_heads < num_heads``) the query heads sharing one
    K/V head are stacked row-wise into one ``G_QK``, and the matching output-projection slices
    into one ``H_VO``; the batch size is then ``B = num_kv_heads``. This assumes the usual
    layout in which K/V head ``j`` serves query heads ``j·g … (j+1)·g − 1``, ``g`` the group size.

    The key bias: ``q·b_k`` is the same for every key, so a softmax over keys ignores ``b_k``
    (SPEC §8). When ``key_bias_free`` (no key appended after the projection, no sink logit, no
    rotary embedding — RoPE rotates ``b_k`` differently for every key) the ``k_bias`` slices
    become a translation block (the finder folds them back into ``H_QK`` with
    ``key_bias="keep"``); otherwise they are the last rows of ``H_QK``.

    Args:
        path: Dotted module path (used for block names).
        q: Slices of the query projection with heads on the sliced axis (weight, then bias).
        k: Slices of the key projection, without its bias (pass that as ``k_bias``).
        v: Slices of the value projection.
        o: Slices of the output projection with heads on the sliced axis (no bias).
        num_heads: Number of query heads.
        head_dim: Head dimension ``h``.
        num_kv_heads: Number of key/value heads (default ``num_heads``).
        rotary: Rotary position embeddings on Q/K: a :class:`RotarySpec` (``True`` means all
            ``h`` features in the ``rotate_half`` layout). The QK block's group is then the
            rotary commutant (SPEC §8).
        qk_note: Any reason why Q/K has no continuous symmetry at all (e.g. a learned QK-norm,
            relative position terms ``q·r``); then only the VO block is returned, with this
            note.
        k_bias: Slices of the key bias.
        key_bias_free: Whether the attention scores ignore a common shift of all keys.

    Returns:
        A :class:`Claim` with the blocks ``"{path}[QK]"`` and ``"{path}[VO]"`` (and
        ``"{path}[b_k]"``).

    Raises:
        ValueError: If ``num_heads`` is not a multiple of ``num_kv_heads``.
    """
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if kv < 1 or num_heads % kv:
        raise ValueError(
            f"attention at {path!r}: num_heads={num_heads} is not a multiple of num_kv_heads={kv}"
        )
    if rotary is True:
        rotary = RotarySpec(head_dim, "half")
    rotary = rotary or None
    label = path or "<model>"
    claim = Claim()
    qk_name = f"{label}[QK]"
    if qk_note:
        claim.notes.append(qk_note)
    elif rotary is not None or not key_bias_free or not k_bias:
        h_rows = (*k, *k_bias)
        claim.blocks.append(
            BlockSpec(qk_name, "QK", path, kv, head_dim, tuple(q), h_rows, rotary=rotary)
        )
        if rotary is not None:
            claim.notes.append(rotary_note(rotary, head_dim))
    else:
        claim.blocks.append(BlockSpec(qk_name, "QK", path, kv, head_dim, tuple(q), tuple(k)))
        claim.translations.append(
            TranslationSpec(f"{label}[b_k]", path, kv, head_dim, tuple(k_bias), fold_into=qk_name)
        )
    claim.blocks.append(BlockSpec(f"{label}[VO]", "VO", path, kv, head_dim, tuple(v), tuple(o)))
    return claim


def rotary_note(rotary: RotarySpec, head_dim: int) -> str:
    """The summary note of a rotary Q/K block."""
    rest = head_dim - rotary.dims
    group = f"(ℂ*)^{rotary.dims // 2}" + (f" × GL({rest})" if rest else "")
    return (
        f"rotary position embeddings ({rotary.layout} layout, {rotary.dims} of {head_dim} "
        f"features rotated): Q/K group is the rotary commutant {group}, V/O keeps GL(h)"
    )


def _linear_in(path: str, local: str, lin: nn.Module) -> tuple[ParamSlice, ...]:
    """Heads on the output features of an ``nn.Linear`` (``W[r_i, :]ᵀ`` plus bias row)."""
    return _linear_weight(path, local) + _linear_bias(path, local, lin)


def _linear_weight(path: str, local: str) -> tuple[ParamSlice, ...]:
    """Heads on the output features of an ``nn.Linear`` weight (``W[r_i, :]ᵀ``)."""
    return (ParamSlice(_join(path, f"{local}.weight"), 0),)


def _linear_bias(path: str, local: str, lin: nn.Module) -> tuple[ParamSlice, ...]:
    """The bias row of an ``nn.Linear`` with heads on its outputs (empty without a bias)."""
    if getattr(lin, "bias", None) is None:
        return ()
    return (ParamSlice(_join(path, f"{local}.bias"), 0),)


def _linear_out(path: str, local: str) -> tuple[ParamSlice, ...]:
    """Heads on the input features of an output ``nn.Linear`` (``W_o[:, r_i]``)."""
    return (ParamSlice(_join(path, f"{local}.weight"), 1),)


def _is_linear(m: object) -> bool:
    return isinstance(m, nn.Linear)


def _is_conv1d(m: object) -> bool:
    """GPT-2's ``Conv1D``: weight of shape ``(in, out)``, ``y = x W + b``."""
    return (
        isinstance(m, nn.Module)
        and type(m).__name__ == "Conv1D"
        and getattr(m, "weight", None) is not None
        and m.weight.dim() == 2
    )


def _children(m: nn.Module, *names: str) -> list[nn.Module] | None:
    """The named (possibly dotted) submodules, or None if one is missing."""
    out = []
    for name in names:
        try:
            out.append(m.get_submodule(name))
        except AttributeError:
            return None
    return out


def _first_int(*candidates: object) -> int | None:
    for c in candidates:
        if isinstance(c, int) and not isinstance(c, bool) and c > 0:
            return c
    return None


def _config(m: nn.Module) -> object:
    return getattr(m, "config", None)


#: Attribute names under which attention modules or configs store their rotary set-up.
_ROTARY_MODULE_ATTRS = ("rotary_ndims", "rotary_dim", "rotary_emb", "rotary", "pos_embd_dim")
_ROTARY_CONFIG_ATTRS = (
    "rotary_dim",
    "rotary_pct",
    "partial_rotary_factor",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "rotary_emb_base",
    "rotary_percentage",
)


def rotary_spec(m: nn.Module, head_dim: int, layout: str | None = None) -> RotarySpec | None:
    """The rotary embedding of a (Hugging Face style) attention module, or ``None``.

    Knows every field HF uses: module attributes ``rotary_ndims`` (GPT-NeoX, Phi, StableLM,
    Persimmon), ``rotary_dim`` (GPT-J, CodeGen: interleaved pairs), ``rotary_emb``; config
    fields ``rotary_dim``, ``rotary_pct``, ``partial_rotary_factor`` (also inside
    ``rope_parameters``), ``rope_theta``/``rope_scaling``/``rope_parameters`` and
    ``position_embedding_type="rotary"``.

    Args:
        m: The attention module.
        head_dim: Its head dimension ``h``.
        layout: Force ``"half"`` or ``"interleaved"`` (default: interleaved for GPT-J-style
            modules with a ``rotary_dim`` attribute, else ``rotate_half``).

    Returns:
        The :class:`RotarySpec`, or ``None`` if the module has no rotary embedding.
    """
    cfg = _config(m)
    name = type(m).__name__
    gptj_style = any(tag in name for tag in ("GPTJ", "CodeGen")) or (
        "rotary_dim" in vars(m) and getattr(cfg, "model_type", "") in ("gptj", "codegen")
    )
    found = gptj_style or any(getattr(m, a, None) is not None for a in _ROTARY_MODULE_ATTRS)
    found = found or getattr(m, "position_embedding_type", None) in ("rotary", "rope")
    if cfg is not None:
        found = found or getattr(cfg, "position_embedding_type", None) in ("rotary", "rope")
        found = found or any(getattr(cfg, a, None) is not None for a in _ROTARY_CONFIG_ATTRS)
    if not found or getattr(m, "rotary", True) is False:
        return None
    dims = _first_int(getattr(m, "rotary_ndims", None), getattr(m, "rotary_dim", None))
    if dims is None and cfg is not None:
        rope = getattr(cfg, "rope_parameters", None)
        rope = rope if isinstance(rope, dict) else {}
        factor = next(
            (
                f
                for f in (
                    rope.get("partial_rotary_factor"),
                    getattr(cfg, "partial_rotary_factor", None),
                    getattr(cfg, "rotary_pct", None),
                    getattr(cfg, "rotary_percentage", None),
                )
                if isinstance(f, (int, float)) and not isinstance(f, bool)
            ),
            None,
        )
        dims = _first_int(getattr(cfg, "rotary_dim", None))
        if dims is None and factor is not None:
            dims = int(head_dim * factor)
    dims = min(dims or head_dim, head_dim)
    dims -= dims % 2
    if dims < 2:
        return None
    return RotarySpec(dims, layout or ("interleaved" if gptj_style else "half"))


#: Note for attention with a normalization of q and k (QK-norm).
QK_NORM_NOTE = (
    "QK-norm (a learned normalization of q and k): of the Q/K symmetry only a rescaling of q "
    "against k survives, and only up to the norm's ε (the adaptive metric is invariant under "
    "it); a rotation does not commute with the learned gains (SPEC §8.3). So Q/K is treated "
    "adaptively; V/O keeps GL(h)"
)

_QK_NORM_ATTRS = (
    ("q_norm", "k_norm"),
    ("q_layernorm", "k_layernorm"),
    ("query_layernorm", "key_layernorm"),
    ("q_ln", "k_ln"),
)


def qk_norm_note(m: nn.Module) -> str | None:
    """:data:`QK_NORM_NOTE` if the module normalizes its queries or keys, else ``None``."""
    for names in _QK_NORM_ATTRS:
        if any(isinstance(getattr(m, a, None), nn.Module) for a in names):
            return QK_NORM_NOTE
    cfg = _config(m)
    if any(getattr(cfg, a, False) is True for a in ("qk_layernorm", "use_qk_norm", "qk_norm")):
        return QK_NORM_NOTE
    return None


def _check_width(path: str, role: str, width: int, heads: int, head_dim: int) -> None:
    if width != heads * head_dim:
        raise ValueError(
            f"attention at {path!r}: the {role} projection has {width} features but "
            f"heads·head_dim = {heads}·{head_dim} = {heads * head_dim}; the module's head "
            "attributes do not match its weights, declare the blocks by hand with declare_block"
        )


def _separate_linear_claim(
    path: str,
    m: nn.Module,
    names: tuple[str, str, str, str],
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    rotary: RotarySpec | None = None,
    qk_note: str | None = None,
    key_bias_free: bool = True,
) -> Claim:
    qn, kn, vn, on = names
    q, k, v, o = _children(m, *names)  # type: ignore[misc]
    kv = num_heads if num_kv_heads is None else num_kv_heads
    _check_width(path, "query", q.out_features, num_heads, head_dim)
    _check_width(path, "key", k.out_features, kv, head_dim)
    _check_width(path, "value", v.out_features, kv, head_dim)
    _check_width(path, "output", o.in_features, num_heads, head_dim)
    return attention_claim(
        path,
        q=_linear_in(path, qn, q),
        k=_linear_weight(path, kn),
        k_bias=_linear_bias(path, kn, k),
        v=_linear_in(path, vn, v),
        o=_linear_out(path, on),
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv_heads=kv,
        rotary=rotary,
        qk_note=qk_note,
        key_bias_free=key_bias_free,
    )


def _relative_note(m: nn.Module) -> str | None:
    """Note for BERT-style relative position scores ``q·r`` (transformers 4.x), else None."""
    kind = getattr(m, "position_embedding_type", None)
    if kind in ("relative_key", "relative_key_query"):
        return f"relative position embeddings ({kind}): Q/K treated adaptively, V/O keeps GL(h)"
    return None


def _all_linear(m: nn.Module, names: Sequence[str]) -> bool:
    found = _children(m, *names)
    return found is not None and all(_is_linear(c) for c in found)


# -- PyTorch --------------------------------------------------------------------------------------
def torch_multihead_attention(path: str, module: nn.Module) -> Claim | None:
    """``torch.nn.MultiheadAttention`` (and hence ``nn.TransformerEncoderLayer`` / decoder).

    Handles the fused ``in_proj_weight`` (split into Q, K, V by rows), the separate
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` used when ``kdim``/``vdim`` differ,
    ``in_proj_bias``, and ``add_bias_kv`` (``bias_k`` is an extra key row of ``H_QK``,
    ``bias_v`` an extra value row of ``G_VO``: they are raw keys/values that transform with the
    projected ones). ``batch_first`` does not change the parameters.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim` with the QK and VO blocks, or ``None`` if not an MHA.
    """
    if not isinstance(module, nn.MultiheadAttention):
        return None
    E, B, h = module.embed_dim, module.num_heads, module.head_dim
    p = lambda local: _join(path, local)  # noqa: E731
    if module.in_proj_weight is not None:
        w = p("in_proj_weight")
        q = [ParamSlice(w, 0, 0, E)]
        k = [ParamSlice(w, 0, E, 2 * E)]
        v = [ParamSlice(w, 0, 2 * E, 3 * E)]
    else:
        q = [ParamSlice(p("q_proj_weight"), 0)]
        k = [ParamSlice(p("k_proj_weight"), 0)]
        v = [ParamSlice(p("v_proj_weight"), 0)]
    k_bias: list[ParamSlice] = []
    if module.in_proj_bias is not None:
        b = p("in_proj_bias")
        q.append(ParamSlice(b, 0, 0, E))
        k_bias.append(ParamSlice(b, 0, E, 2 * E))
        v.append(ParamSlice(b, 0, 2 * E, 3 * E))
    # A key appended after the projection (bias_k, or the zero key of add_zero_attn) is not
    # shifted by b_k, so b_k then changes the scores: it is part of H_QK, not a symmetry.
    free = module.bias_k is None and not module.add_zero_attn
    if module.bias_k is not None:
        k_bias.append(ParamSlice(p("bias_k"), -1))
    if module.bias_v is not None:
        v.append(ParamSlice(p("bias_v"), -1))
    o = [ParamSlice(p("out_proj.weight"), 1)]
    return attention_claim(
        path, q=q, k=k, v=v, o=o, num_heads=B, head_dim=h, k_bias=k_bias, key_bias_free=free
    )


# -- geosharp's own models ------------------------------------------------------------------------
def geosharp_attention(path: str, module: nn.Module) -> Claim | None:
    """Attention with ``nn.Linear`` children ``q, k, v, o`` and ``num_heads``/``head_dim`` ints.

    This is :class:`geosharp.models.MultiHeadAttention` (optionally grouped-query via
    ``num_kv_heads``); recognised by structure, so symmetry never imports the models.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim` with the QK and VO blocks, or ``None``.
    """
    heads = _first_int(getattr(module, "num_heads", None))
    h = _first_int(getattr(module, "head_dim", None))
    if heads is None or h is None or not _all_linear(module, ("q", "k", "v", "o")):
        return None
    kv = _first_int(getattr(module, "num_kv_heads", None), heads)
    rotary = rotary_spec(module, h) if getattr(module, "rotary", False) else None
    return _separate_linear_claim(path, module, ("q", "k", "v", "o"), heads, h, kv, rotary)


# -- Hugging Face ---------------------------------------------------------------------------------
def _hf_heads(m: nn.Module, *extra: object) -> int | None:
    cfg = _config(m)
    return _first_int(
        *extra,
        getattr(m, "num_heads", None),
        getattr(m, "num_attention_heads", None),
        getattr(cfg, "num_attention_heads", None),
    )


def bert_attention(path: str, module: nn.Module) -> Claim | None:
    """Hugging Face ``BertAttention`` layout (also RoBERTa, ELECTRA, MiniLM, …).

    Structure: ``self.query``, ``self.key``, ``self.value`` (``nn.Linear``) and
    ``output.dense``; head counts from ``self.num_attention_heads`` and
    ``self.attention_head_size``. Works for self- and cross-attention. With relative position
    scores (``position_embedding_type="relative_key"``, transformers 4.x) Q/K is not a GL(h)
    symmetry and only the VO block is returned, with a note.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim` with the QK and VO blocks, or ``None``.
    """
    names = ("self.query", "self.key", "self.value", "output.dense")
    if not _all_linear(module, names):
        return None
    inner = module.get_submodule("self")
    heads = _hf_heads(inner)
    h = _first_int(getattr(inner, "attention_head_size", None), getattr(inner, "head_dim", None))
    if heads is None:
        return None
    h = h or inner.query.out_features // heads
    return _separate_linear_claim(
        path, module, names, heads, h, heads, rotary_spec(inner, h), _relative_note(inner)
    )


def vit_attention(path: str, module: nn.Module) -> Claim | None:
    """Hugging Face ``ViTAttention`` in both layouts.

    transformers 4.x: ``attention.query``/``key``/``value`` + ``output.dense``;
    transformers 5.x: ``q_proj``/``k_proj``/``v_proj``/``o_proj`` on a ``ViT…Attention`` class.
    Head counts from ``num_attention_heads`` and ``attention_head_size``/``head_dim``.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim` with the QK and VO blocks, or ``None``.
    """
    legacy = ("attention.query", "attention.key", "attention.value", "output.dense")
    modern = ("q_proj", "k_proj", "v_proj", "o_proj")
    if _all_linear(module, legacy):
        inner, names = module.get_submodule("attention"), legacy
        q_out = inner.query.out_features
    elif "ViT" in type(module).__name__ and _all_linear(module, modern):
        inner, names = module, modern
        q_out = inner.q_proj.out_features
    else:
        return None
    heads = _hf_heads(inner)
    if heads is None:
        return None
    h = _first_int(getattr(inner, "attention_head_size", None), getattr(inner, "head_dim", None))
    return _separate_linear_claim(path, module, names, heads, h or q_out // heads)


def clip_attention(path: str, module: nn.Module) -> Claim | None:
    """Hugging Face ``CLIPAttention`` (vision and text towers; also SigLIP, BART, Whisper, …).

    Structure: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (``nn.Linear``); head counts
    from ``num_heads`` and ``head_dim``.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim` with the QK and VO blocks, or ``None``.
    """
    names = ("q_proj", "k_proj", "v_proj", "out_proj")
    if not _all_linear(module, names):
        return None
    heads = _hf_heads(module)
    if heads is None:
        return None
    h = _first_int(getattr(module, "head_dim", None)) or module.q_proj.out_features // heads
    kv = _first_int(getattr(module, "num_key_value_heads", None), heads)
    return _separate_linear_claim(path, module, names, heads, h, kv, rotary_spec(module, h))


def gpt2_attention(path: str, module: nn.Module) -> Claim | None:
    """Hugging Face ``GPT2Attention``: fused ``Conv1D`` ``c_attn`` and ``c_proj``.

    ``Conv1D`` stores the weight as ``(in, out)`` with ``y = x W + b``, so the heads sit on
    axis 1 of ``c_attn.weight`` (columns ``[0, E)`` are Q, ``[E, 2E)`` K, ``[2E, 3E)`` V) and on
    axis 0 of ``c_proj.weight``. Cross-attention (``q_attn`` for Q, ``c_attn`` = [K, V]) is
    handled too.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim` with the QK and VO blocks, or ``None``.
    """
    c_attn = getattr(module, "c_attn", None)
    c_proj = getattr(module, "c_proj", None)
    if not (_is_conv1d(c_attn) and _is_conv1d(c_proj)):
        return None
    heads = _hf_heads(module)
    if heads is None:
        return None
    E = c_proj.weight.shape[0]
    h = _first_int(getattr(module, "head_dim", None)) or E // heads
    _check_width(path, "output", E, heads, h)
    w, b = _join(path, "c_attn.weight"), _join(path, "c_attn.bias")
    has_b = getattr(c_attn, "bias", None) is not None
    q_attn = getattr(module, "q_attn", None)
    if _is_conv1d(q_attn) and c_attn.weight.shape[1] == 2 * E:
        qw, qb = _join(path, "q_attn.weight"), _join(path, "q_attn.bias")
        q = [ParamSlice(qw, 1)] + ([ParamSlice(qb, 0)] if q_attn.bias is not None else [])
        k_start = 0
    elif c_attn.weight.shape[1] == 3 * E:
        q = [ParamSlice(w, 1, 0, E)] + ([ParamSlice(b, 0, 0, E)] if has_b else [])
        k_start = E
    else:
        return None
    k = [ParamSlice(w, 1, k_start, k_start + E)]
    v = [ParamSlice(w, 1, k_start + E, k_start + 2 * E)]
    k_bias = []
    if has_b:
        k_bias.append(ParamSlice(b, 0, k_start, k_start + E))
        v.append(ParamSlice(b, 0, k_start + E, k_start + 2 * E))
    o = [ParamSlice(_join(path, "c_proj.weight"), 0)]
    return attention_claim(path, q=q, k=k, v=v, o=o, num_heads=heads, head_dim=h, k_bias=k_bias)


def llama_attention(path: str, module: nn.Module) -> Claim | None:
    """Hugging Face ``LlamaAttention`` layout with grouped-query attention and rotary embeddings.

    Structure: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (``nn.Linear``). Head counts are
    read from ``num_heads``/``num_key_value_heads`` on the module (transformers 4.x) or its
    ``config`` (``num_attention_heads``, ``num_key_value_heads``; 5.x), the head dimension from
    ``head_dim``. Rotary embeddings (detected by :func:`rotary_spec`) restrict the Q/K
    symmetry to the matrices commuting with the rotations: the QK block's group is the rotary
    commutant (SPEC §8), and the key bias (Qwen2) is rotated with the keys, so it stays a row
    of ``H_QK``. A QK-norm (``q_norm``/``k_norm``: Qwen3, OLMo 2, Gemma 3) leaves Q/K no
    continuous symmetry (see :data:`QK_NORM_NOTE`): only V/O is returned. Covers Mistral,
    Mixtral, Qwen2/3, Gemma and other families with the same layout.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim`, or ``None``.
    """
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not _all_linear(module, names):
        return None
    cfg = _config(module)
    heads = _hf_heads(module)
    if heads is None:
        return None
    h = _first_int(getattr(module, "head_dim", None), getattr(cfg, "head_dim", None))
    h = h or module.q_proj.out_features // heads
    groups = _first_int(getattr(module, "num_key_value_groups", None))
    kv = _first_int(
        getattr(module, "num_key_value_heads", None),
        getattr(cfg, "num_key_value_heads", None),
        heads // groups if groups else None,
        heads,
    )
    return _separate_linear_claim(
        path, module, names, heads, h, kv, rotary_spec(module, h), qk_norm_note(module)
    )


# -- LoRA (PEFT) ----------------------------------------------------------------------------------
#: LoRA variants whose output depends on ``B`` and ``A`` only through ``B A`` (DoRA normalizes
#: ``W + s·B A``); others (e.g. variants with their own activations) are left adaptive.
_PRODUCT_VARIANTS = ("DoraLinearVariant", "DoraEmbeddingVariant", "DoraConv2dVariant")


def peft_lora(path: str, module: nn.Module) -> Claim | None:
    """A PEFT ``LoraLayer`` (``lora.Linear``, ``lora.Embedding``, ``lora.Conv2d``; SPEC §8).

    The update ``s·B A`` of every active adapter is a GL(r) block ``G = B`` (``out × r``),
    ``H = Aᵀ`` (``in × r``), acted on by ``(B, A) ↦ (B M⁻¹, M A)``; its scaling, dropout, a
    LoRA bias and DoRA's magnitude (which normalizes ``W + s·B A``) do not break it. Merged or
    disabled adapters do not enter the forward pass (their factors are left adaptive, with a
    note), and the frozen base layer is not perturbed: sharpness of a LoRA fine-tune is over
    its trainable adapter parameters. Recognised by structure, without importing ``peft``.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim` with one ``"LoRA"`` block per active adapter, or ``None``.
    """
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    emb_a = getattr(module, "lora_embedding_A", None)
    emb_b = getattr(module, "lora_embedding_B", None)
    if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        return None
    if getattr(module, "base_layer", None) is None:
        return None
    claim = Claim()
    label = path or "<model>"
    active = getattr(module, "active_adapters", None) or []
    if isinstance(active, str):
        active = [active]
    if bool(getattr(module, "disable_adapters", False)) or bool(getattr(module, "merged", False)):
        claim.notes.append(
            "LoRA adapters merged into the base weight or disabled: they do not enter the "
            "forward pass, no LoRA block"
        )
        return claim
    variants = getattr(module, "lora_variant", {}) or {}
    names = [n for n in lora_a.keys() if n in lora_b.keys()]
    if isinstance(emb_a, nn.ParameterDict) and isinstance(emb_b, nn.ParameterDict):
        names += [n for n in emb_a.keys() if n in emb_b.keys() and n not in names]
    for name in names:
        if name not in active:
            claim.notes.append(f"LoRA adapter {name!r} is not active: no block")
            continue
        variant = variants.get(name)
        if variant is not None and type(variant).__name__ not in _PRODUCT_VARIANTS:
            claim.notes.append(
                f"LoRA adapter {name!r} uses the variant {type(variant).__name__}: "
                "treated adaptively"
            )
            continue
        if name in lora_a.keys():
            a_w, b_w = lora_a[name].weight, lora_b[name].weight
            h = (ParamSlice(_join(path, f"lora_A.{name}.weight"), 0),)
            g = (ParamSlice(_join(path, f"lora_B.{name}.weight"), 1),)
        else:  # lora.Embedding: A (r × vocab) is looked up, B is (dim × r)
            a_w, b_w = emb_a[name], emb_b[name]
            h = (ParamSlice(_join(path, f"lora_embedding_A.{name}"), 0),)
            g = (ParamSlice(_join(path, f"lora_embedding_B.{name}"), 1),)
        r = int(a_w.shape[0])
        if b_w.dim() < 2 or int(b_w.shape[1]) != r:
            claim.notes.append(f"LoRA adapter {name!r}: unexpected factor shapes, no block")
            continue
        claim.blocks.append(BlockSpec(f"{label}[LoRA:{name}]", "LoRA", path, 1, r, g, h))
    if claim.blocks:
        claim.notes.append(
            "LoRA adapters: one GL(r) block per adapter (B A is unchanged by (B M⁻¹, M A)); "
            "sharpness is over the adapters' trainable parameters, the frozen base is not "
            "perturbed"
        )
    return claim


# -- diagonal networks ----------------------------------------------------------------------------
def diagonal_net(path: str, module: nn.Module) -> Claim | None:
    """Modules declaring ``symmetry_pairs = (("u", "v"), ...)``: diagonal nets ``β = u ⊙ v``.

    Args:
        path: Dotted module path.
        module: Candidate module.

    Returns:
        A :class:`Claim` with one pair per declared ``(u, v)``, or ``None``.
    """
    pairs = getattr(module, "symmetry_pairs", None)
    if not pairs:
        return None
    label = path or "<model>"
    return Claim(
        pairs=[
            PairSpec(f"{label}[{u}*{v}]", _join(path, u), _join(path, v), path) for u, v in pairs
        ]
    )


#: The default adapter registry, tried in order for every module.
ADAPTERS: list[Adapter] = [
    peft_lora,
    torch_multihead_attention,
    geosharp_attention,
    bert_attention,
    vit_attention,
    clip_attention,
    gpt2_attention,
    llama_attention,
    diagonal_net,
]


def register_adapter(adapter: Adapter, *, first: bool = True) -> Adapter:
    """Add an adapter to the default registry :data:`ADAPTERS`.

    Args:
        adapter: Function ``(path, module) -> Claim | None``.
        first: Try it before the built-in adapters (default) or after them.

    Returns:
        The adapter, so this can be used as a decorator.
    """
    if adapter not in ADAPTERS:
        if first:
            ADAPTERS.insert(0, adapter)
        else:
            ADAPTERS.append(adapter)
    return adapter
