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
:func:`register_adapter` or pass ``adapters=[...]`` to ``find_symmetries``. The adapters are
built from :mod:`~geosharp.symmetry.adapter_kit` (:func:`attention_claim`, the slices of heads in
linear layers, the detection of rotary embeddings and QK-norm), whose public names are
importable from here too.

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

from collections.abc import Callable

from torch import nn

from geosharp.symmetry.adapter_kit import (
    QK_NORM_NOTE,
    AttentionSlices,
    _all_linear,
    _check_width,
    _config,
    _first_int,
    _hf_heads,
    _is_conv1d,
    _join,
    _relative_note,
    _separate_linear_claim,
    attention_claim,
    qk_norm_note,
    rotary_note,
    rotary_spec,
)
from geosharp.symmetry.specs import (
    BlockSpec,
    Claim,
    PairSpec,
    ParamSlice,
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
    slices = AttentionSlices(q=q, k=k, v=v, o=o, k_bias=k_bias)
    return attention_claim(path, slices, num_heads=B, head_dim=h, key_bias_free=free)


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
    return _separate_linear_claim(
        path, module, ("q", "k", "v", "o"), heads, h, num_kv_heads=kv, rotary=rotary
    )


# -- Hugging Face ---------------------------------------------------------------------------------
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
        path,
        module,
        names,
        heads,
        h,
        num_kv_heads=heads,
        rotary=rotary_spec(inner, h),
        qk_note=_relative_note(inner),
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
    return _separate_linear_claim(
        path, module, names, heads, h, num_kv_heads=kv, rotary=rotary_spec(module, h)
    )


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
    slices = AttentionSlices(q=q, k=k, v=v, o=o, k_bias=k_bias)
    return attention_claim(path, slices, num_heads=heads, head_dim=h)


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
        path,
        module,
        names,
        heads,
        h,
        num_kv_heads=kv,
        rotary=rotary_spec(module, h),
        qk_note=qk_norm_note(module),
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
        lora = f"{label}[LoRA:{name}]"
        claim.blocks.append(
            BlockSpec(name=lora, kind="LoRA", module=path, heads=1, head_dim=r, g=g, h=h)
        )
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
