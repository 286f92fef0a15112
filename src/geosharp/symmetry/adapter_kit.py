"""The building blocks of attention adapters: claims, parameter slices and rotary detection.

What every adapter of :mod:`geosharp.symmetry.adapters`, :mod:`geosharp.symmetry.hf_adapters`
and :mod:`geosharp.symmetry.hf_decoders` shares: :func:`attention_claim`, the one generic
constructor of a Q/K/V/O claim (with grouped heads, rotary Q/K and key biases); the slices of
heads in linear layers; the detection of rotary position embeddings (:func:`rotary_spec`) and of
QK normalization (:func:`qk_norm_note`), which change the Q/K group or remove it; and small
lookups of modules (their class name, children, configs). A new adapter is written from these
(see the module docstring of :mod:`~geosharp.symmetry.adapters`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from geosharp.symmetry.specs import (
    BlockSpec,
    Claim,
    ParamSlice,
    RotarySpec,
    TranslationSpec,
)

__all__ = [
    "QK_NORM_NOTE",
    "AttentionSlices",
    "attention_claim",
    "qk_norm_note",
    "rotary_note",
    "rotary_spec",
]


def _join(path: str, local: str) -> str:
    return f"{path}.{local}" if path else local


@dataclass(frozen=True)
class AttentionSlices:
    """Where the heads of one attention module's projections are: its parameter slices.

    Attributes:
        q: Slices of the query projection with heads on the sliced axis (weight, then bias).
        k: Slices of the key projection, without its bias (that is ``k_bias``).
        v: Slices of the value projection.
        o: Slices of the output projection with heads on the sliced axis (no bias).
        k_bias: Slices of the key bias.
    """

    q: Sequence[ParamSlice]
    k: Sequence[ParamSlice]
    v: Sequence[ParamSlice]
    o: Sequence[ParamSlice]
    k_bias: Sequence[ParamSlice] = ()


def attention_claim(
    path: str,
    slices: AttentionSlices,
    *,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    rotary: RotarySpec | bool | None = None,
    qk_note: str | None = None,
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
        slices: Where the heads of Q, K, V, O and the key bias are.
        num_heads: Number of query heads.
        head_dim: Head dimension ``h``.
        num_kv_heads: Number of key/value heads (default ``num_heads``).
        rotary: Rotary position embeddings on Q/K: a :class:`RotarySpec` (``True`` means all
            ``h`` features in the ``rotate_half`` layout). The QK block's group is then the
            rotary commutant (SPEC §8).
        qk_note: Any reason why Q/K has no continuous symmetry at all (e.g. a learned QK-norm,
            relative position terms ``q·r``); then only the VO block is returned, with this
            note.
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
    q, k, v, o, k_bias = slices.q, slices.k, slices.v, slices.o, slices.k_bias
    label = path or "<model>"
    claim = Claim()
    qk_name = f"{label}[QK]"
    at = {"module": path, "heads": kv, "head_dim": head_dim}
    if qk_note:
        claim.notes.append(qk_note)
    elif rotary is not None or not key_bias_free or not k_bias:
        h_rows = (*k, *k_bias)
        claim.blocks.append(
            BlockSpec(name=qk_name, kind="QK", **at, g=tuple(q), h=h_rows, rotary=rotary)
        )
        if rotary is not None:
            claim.notes.append(rotary_note(rotary, head_dim))
    else:
        claim.blocks.append(BlockSpec(name=qk_name, kind="QK", **at, g=tuple(q), h=tuple(k)))
        claim.translations.append(
            TranslationSpec(name=f"{label}[b_k]", **at, pieces=tuple(k_bias), fold_into=qk_name)
        )
    claim.blocks.append(BlockSpec(name=f"{label}[VO]", kind="VO", **at, g=tuple(v), h=tuple(o)))
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


def _name(module: nn.Module) -> str:
    return type(module).__name__


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
    *,
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
    slices = AttentionSlices(
        q=_linear_in(path, qn, q),
        k=_linear_weight(path, kn),
        k_bias=_linear_bias(path, kn, k),
        v=_linear_in(path, vn, v),
        o=_linear_out(path, on),
    )
    return attention_claim(
        path,
        slices,
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
def _hf_heads(m: nn.Module, *extra: object) -> int | None:
    cfg = _config(m)
    return _first_int(
        *extra,
        getattr(m, "num_heads", None),
        getattr(m, "num_attention_heads", None),
        getattr(cfg, "num_attention_heads", None),
    )
