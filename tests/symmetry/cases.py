"""Tiny float64 models for every adapter, with dense references built the slow, obvious way.

Each :class:`Case` knows how to build its model, feed it, which blocks the finder must report,
where a query weight lives (for the "the invariance test can fail" check), and how to build
every block's ``(G, H)`` directly from the module weights by explicit per-head slicing — an
index-free reference for the finder's gather machinery.

HF's eager attention of ViT, CLIP and Llama computes its softmax in float32 even for float64
models, which caps any invariance check at ~1e-8; those cases use the float64 SDPA kernel.

Row-order convention (documented in ``geosharp.symmetry.specs``): the pieces of ``G`` are
stacked in order weight, bias, extra raw rows; within a piece the ``k`` query heads of a
grouped-query group are stacked head-major.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DT = torch.float64
Ref = dict[str, tuple[Tensor, ...]]


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple]
    forward: Callable[[nn.Module, tuple], Tensor]
    #: (kind, heads B, head_dim h, n, m) per GL block, in finder order
    expected: list[tuple[str, int, int, int, int]]
    #: (param, axis, start, stop) of (part of) a query weight, or a function of the model
    q_weight: tuple[str, int, int, int] | Callable[[nn.Module], tuple[str, int, int, int]]
    reference: Callable[[nn.Module], Ref]
    n_pairs: int = 0
    notes: list[str] = field(default_factory=list)
    #: number of key-bias translation blocks
    n_translations: int = 0


# -- per-head slicing references ------------------------------------------------------------------
def in_rows(W: Tensor, b: Tensor | None, heads: int, h: int, group: int = 1, extra=()) -> Tensor:
    """Stacked ``[W[r_i]ᵀ …; b[r_i] …; extra[r_j]]`` for ``y = x Wᵀ + b`` with heads on rows.

    ``heads`` counts the heads in ``W``; ``group`` of them are stacked into one block.
    ``extra`` are raw per-block rows (e.g. ``bias_k``), sliced with the block index.
    """
    blocks = []
    for j in range(heads // group):
        idx = range(j * group, (j + 1) * group)
        rows = [W[i * h : (i + 1) * h, :].T for i in idx]
        if b is not None:
            rows += [b[i * h : (i + 1) * h].reshape(1, h) for i in idx]
        rows += [e[j * h : (j + 1) * h].reshape(1, h) for e in extra]
        blocks.append(torch.cat(rows, dim=0))
    return torch.stack(blocks)


def out_rows(Wo: Tensor, heads: int, h: int, group: int = 1) -> Tensor:
    """Stacked ``W_o[:, r_i]`` (``y = x W_oᵀ``, heads on columns), ``group`` heads per block."""
    return torch.stack(
        [
            torch.cat([Wo[:, i * h : (i + 1) * h] for i in range(j * group, (j + 1) * group)])
            for j in range(heads // group)
        ]
    )


def key_bias_ref(b: Tensor, heads: int, h: int) -> tuple[Tensor]:
    """The key-bias translation block of ``heads`` heads: ``(B, 1, h)``."""
    return (b.reshape(heads, 1, h),)


def linear_attention_ref(
    prefix: str,
    q,
    k,
    v,
    o,
    heads: int,
    h: int,
    kv: int | None = None,
    qk: bool = True,
    key_bias_free: bool = True,
) -> Ref:
    """Per-head blocks of separate q/k/v/o linears; the key bias is its own translation block
    when the softmax ignores it (``key_bias_free``), else the last row of ``H_QK``."""
    kv = kv or heads
    g = heads // kv
    ref = {}
    if qk:
        split = key_bias_free and k.bias is not None
        ref[f"{prefix}[QK]"] = (
            in_rows(q.weight, q.bias, heads, h, g),
            in_rows(k.weight, None if split else k.bias, kv, h),
        )
        if split:
            ref[f"{prefix}[b_k]"] = key_bias_ref(k.bias, kv, h)
    ref[f"{prefix}[VO]"] = (in_rows(v.weight, v.bias, kv, h), out_rows(o.weight, heads, h, g))
    return ref


# -- builders ------------------------------------------------------------------------------------
def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = fn().to(DT).eval()
        # random, not default-initialised, biases and norms: zeros would hide indexing bugs
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return model

    return build


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=DT)


def _ids(g: torch.Generator, *shape: int, vocab: int = 50) -> Tensor:
    return torch.randint(0, vocab, shape, generator=g)


def _mha_ref(prefix: str, m: nn.MultiheadAttention) -> Ref:
    E, B, h = m.embed_dim, m.num_heads, m.head_dim
    if m.in_proj_weight is not None:
        Wq, Wk, Wv = m.in_proj_weight[:E], m.in_proj_weight[E : 2 * E], m.in_proj_weight[2 * E :]
    else:
        Wq, Wk, Wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    if m.in_proj_bias is not None:
        bq, bk, bv = m.in_proj_bias[:E], m.in_proj_bias[E : 2 * E], m.in_proj_bias[2 * E :]
    else:
        bq = bk = bv = None
    ek = [m.bias_k.reshape(E)] if m.bias_k is not None else []
    ev = [m.bias_v.reshape(E)] if m.bias_v is not None else []
    label = prefix or "<model>"
    # b_k is a translation block unless a raw key (bias_k) is appended after the projection
    split = bk is not None and m.bias_k is None and not m.add_zero_attn
    ref = {
        f"{label}[QK]": (in_rows(Wq, bq, B, h), in_rows(Wk, None if split else bk, B, h, extra=ek)),
        f"{label}[VO]": (in_rows(Wv, bv, B, h, extra=ev), out_rows(m.out_proj.weight, B, h)),
    }
    if split:
        ref[f"{label}[b_k]"] = key_bias_ref(bk, B, h)
    return ref


def mha_case(bias: bool, batch_first: bool) -> Case:
    E, B, h = 16, 4, 4
    d = E + bias
    return Case(
        name=f"mha_fused_bias{int(bias)}_bf{int(batch_first)}",
        build=_seeded(lambda: nn.MultiheadAttention(E, B, bias=bias, batch_first=batch_first)),
        inputs=lambda g: (_randn(g, 2, 5, E) if batch_first else _randn(g, 5, 2, E),),
        forward=lambda m, x: m(x[0], x[0], x[0], need_weights=False)[0],
        expected=[("QK", B, h, d, E), ("VO", B, h, d, E)],
        n_translations=int(bias),
        q_weight=("in_proj_weight", 0, 0, E),
        reference=lambda m: _mha_ref("", m),
    )


def mha_separate_case() -> Case:
    E, B, h, kd, vd = 16, 4, 4, 10, 12
    return Case(
        name="mha_separate_kvdim_bias_kv",
        build=_seeded(
            lambda: nn.MultiheadAttention(
                E, B, kdim=kd, vdim=vd, add_bias_kv=True, batch_first=True
            )
        ),
        inputs=lambda g: (_randn(g, 2, 5, E), _randn(g, 2, 6, kd), _randn(g, 2, 6, vd)),
        forward=lambda m, x: m(*x, need_weights=False)[0],
        # H_QK = [W_k; b_k; bias_k], G_VO = [W_v; b_v; bias_v]
        expected=[("QK", B, h, E + 1, kd + 2), ("VO", B, h, vd + 2, E)],
        q_weight=("q_proj_weight", 0, 0, E),
        reference=lambda m: _mha_ref("", m),
    )


def transformer_encoder_case() -> Case:
    E, B, h = 16, 4, 4

    def build():
        layer = nn.TransformerEncoderLayer(E, B, 32, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    return Case(
        name="torch_transformer_encoder",
        build=_seeded(build),
        inputs=lambda g: (_randn(g, 2, 5, E),),
        forward=lambda m, x: m(x[0]),
        expected=[("QK", B, h, E + 1, E), ("VO", B, h, E + 1, E)] * 2,
        n_translations=2,
        q_weight=("layers.0.self_attn.in_proj_weight", 0, 0, E),
        reference=lambda m: {
            k: v
            for i in range(2)
            for k, v in _mha_ref(f"layers.{i}.self_attn", m.layers[i].self_attn).items()
        },
    )


def _geosharp_ref(m: nn.Module) -> Ref:
    ref = {}
    for i, blk in enumerate(m.blocks):
        a = blk.attn
        ref.update(
            linear_attention_ref(
                f"blocks.{i}.attn", a.q, a.k, a.v, a.o, a.num_heads, a.head_dim, a.num_kv_heads
            )
        )
    return ref


def geosharp_vit_case() -> Case:
    from geosharp.models import VisionTransformer

    d, B, h = 16, 4, 4
    return Case(
        name="geosharp_vit",
        build=_seeded(
            lambda: VisionTransformer(
                image_size=8, patch_size=4, num_classes=3, dim=d, depth=2, num_heads=B
            )
        ),
        inputs=lambda g: (_randn(g, 3, 3, 8, 8),),
        forward=lambda m, x: m(x[0]),
        expected=[("QK", B, h, d + 1, d), ("VO", B, h, d + 1, d)] * 2,
        n_translations=2,
        q_weight=("blocks.0.attn.q.weight", 0, 0, d),
        reference=_geosharp_ref,
    )


def geosharp_text_gqa_case() -> Case:
    from geosharp.models import TextTransformer

    d, B, kv, h = 16, 4, 2, 4
    g = B // kv

    def inputs(gen):
        ids = _ids(gen, 3, 7, vocab=30)
        mask = torch.ones(3, 7, dtype=torch.bool)
        mask[1, 5:] = False
        return ids, mask

    return Case(
        name="geosharp_text_gqa_cls",
        build=_seeded(
            lambda: TextTransformer(
                30, 3, max_len=10, dim=d, depth=2, num_heads=B, num_kv_heads=kv, pooling="cls"
            )
        ),
        inputs=inputs,
        forward=lambda m, x: m(x[0], attention_mask=x[1]),
        # G_QK stacks the g query heads of a group: g·(d+1) rows; H_VO stacks g slices of W_o
        expected=[("QK", kv, h, g * (d + 1), d), ("VO", kv, h, d + 1, g * d)] * 2,
        n_translations=2,
        q_weight=("blocks.1.attn.q.weight", 0, 0, d),
        reference=_geosharp_ref,
    )


def bert_case() -> Case:
    from transformers import BertConfig, BertModel

    d, B, h = 32, 4, 8

    def build():
        cfg = BertConfig(
            hidden_size=d,
            num_attention_heads=B,
            num_hidden_layers=2,
            intermediate_size=37,
            vocab_size=50,
            max_position_embeddings=16,
            attn_implementation="eager",
        )
        return BertModel(cfg)

    def forward(m, x):
        out = m(input_ids=x[0], attention_mask=x[1])
        return torch.cat([out.last_hidden_state.flatten(), out.pooler_output.flatten()])

    def inputs(gen):
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[0, 4:] = 0
        return _ids(gen, 2, 6), mask

    def reference(m):
        ref = {}
        for i, layer in enumerate(m.encoder.layer):
            s, o = layer.attention.self, layer.attention.output.dense
            ref.update(
                linear_attention_ref(
                    f"encoder.layer.{i}.attention", s.query, s.key, s.value, o, B, h
                )
            )
        return ref

    return Case(
        name="hf_bert",
        build=_seeded(build),
        inputs=inputs,
        forward=forward,
        expected=[("QK", B, h, d + 1, d), ("VO", B, h, d + 1, d)] * 2,
        n_translations=2,
        q_weight=("encoder.layer.0.attention.self.query.weight", 0, 0, d),
        reference=reference,
    )


def vit_case() -> Case:
    from transformers import ViTConfig, ViTModel

    d, B, h = 32, 4, 8

    def build():
        cfg = ViTConfig(
            hidden_size=d,
            num_hidden_layers=2,
            num_attention_heads=B,
            intermediate_size=37,
            image_size=8,
            patch_size=4,
            attn_implementation="sdpa",
        )
        return ViTModel(cfg)

    def forward(m, x):
        out = m(pixel_values=x[0])
        return torch.cat([out.last_hidden_state.flatten(), out.pooler_output.flatten()])

    def attentions(m):
        # transformers 5.x: ``layers.i.attention`` with q/k/v/o_proj; 4.x:
        # ``encoder.layer.i.attention`` with ``attention.query`` … and ``output.dense``
        return [(n, a) for n, a in m.named_modules() if type(a).__name__ == "ViTAttention"]

    def reference(m):
        ref = {}
        for path, a in attentions(m):
            if hasattr(a, "q_proj"):
                q, k, v, o = a.q_proj, a.k_proj, a.v_proj, a.o_proj
            else:
                s = a.attention
                q, k, v, o = s.query, s.key, s.value, a.output.dense
            ref.update(linear_attention_ref(path, q, k, v, o, B, h))
        return ref

    def q_weight(m):
        path, a = attentions(m)[0]
        local = "q_proj" if hasattr(a, "q_proj") else "attention.query"
        return (f"{path}.{local}.weight", 0, 0, d)

    return Case(
        name="hf_vit",
        build=_seeded(build),
        inputs=lambda g: (_randn(g, 2, 3, 8, 8),),
        forward=forward,
        expected=[("QK", B, h, d + 1, d), ("VO", B, h, d + 1, d)] * 2,
        n_translations=2,
        q_weight=q_weight,
        reference=reference,
    )


class LegacyViTSelfAttention(nn.Module):
    """The transformers-4.x ``ViTSelfAttention`` layout, written out (eager attention)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = d // heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        N, T, d = x.shape
        H, h = self.num_attention_heads, self.attention_head_size
        q, k, v = (
            f(x).view(N, T, H, h).transpose(1, 2) for f in (self.query, self.key, self.value)
        )
        a = torch.softmax(q @ k.transpose(-1, -2) / h**0.5, dim=-1)
        return (a @ v).transpose(1, 2).reshape(N, T, d)


class LegacyViTSelfOutput(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)


class LegacyViTAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attention = LegacyViTSelfAttention(d, heads)
        self.output = LegacyViTSelfOutput(d)

    def forward(self, x: Tensor) -> Tensor:
        return self.output.dense(self.attention(x))


def vit_legacy_case() -> Case:
    d, B, h = 16, 2, 8

    def reference(m):
        out = {}
        for i, a in enumerate(m):
            s = a.attention
            out.update(linear_attention_ref(str(i), s.query, s.key, s.value, a.output.dense, B, h))
        return out

    return Case(
        name="hf_vit_4x_layout",
        build=_seeded(lambda: nn.Sequential(LegacyViTAttention(d, B), LegacyViTAttention(d, B))),
        inputs=lambda g: (_randn(g, 2, 5, d),),
        forward=lambda m, x: m(x[0]),
        expected=[("QK", B, h, d + 1, d), ("VO", B, h, d + 1, d)] * 2,
        n_translations=2,
        q_weight=("0.attention.query.weight", 0, 0, d),
        reference=reference,
    )


def clip_case() -> Case:
    from transformers import CLIPConfig, CLIPModel

    d, B, h = 32, 4, 8
    common = dict(hidden_size=d, intermediate_size=37, num_attention_heads=B, num_hidden_layers=2)

    def build():
        cfg = CLIPConfig(
            text_config=dict(
                common,
                vocab_size=50,
                max_position_embeddings=16,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=2,
            ),
            vision_config=dict(common, image_size=8, patch_size=4),
            projection_dim=16,
            attn_implementation="sdpa",
        )
        return CLIPModel(cfg)

    def forward(m, x):
        out = m(input_ids=x[0], pixel_values=x[1])
        return torch.cat(
            [out.logits_per_image.flatten(), out.text_embeds.flatten(), out.image_embeds.flatten()]
        )

    def inputs(gen):
        # the text tower pools at the EOS token; put it last so that it attends to every token
        # (at position 0 the causal mask leaves one key and Q/K would not matter)
        ids = _ids(gen, 2, 6, vocab=47) + 3
        ids[:, -1] = 1
        return ids, _randn(gen, 2, 3, 8, 8)

    def reference(m):
        ref = {}
        for tower in ("text_model", "vision_model"):
            for i, layer in enumerate(getattr(m, tower).encoder.layers):
                a = layer.self_attn
                ref.update(
                    linear_attention_ref(
                        f"{tower}.encoder.layers.{i}.self_attn",
                        a.q_proj,
                        a.k_proj,
                        a.v_proj,
                        a.out_proj,
                        B,
                        h,
                    )
                )
        return ref

    return Case(
        name="hf_clip_text_and_vision",
        build=_seeded(build),
        inputs=inputs,
        forward=forward,
        expected=[("QK", B, h, d + 1, d), ("VO", B, h, d + 1, d)] * 4,
        n_translations=4,
        q_weight=("vision_model.encoder.layers.1.self_attn.q_proj.weight", 0, 0, d),
        reference=reference,
    )


def gpt2_case(cross: bool) -> Case:
    from transformers import GPT2Config, GPT2Model

    d, B, h = 32, 4, 8

    def build():
        cfg = GPT2Config(
            n_embd=d,
            n_layer=2,
            n_head=B,
            vocab_size=50,
            n_positions=16,
            add_cross_attention=cross,
            attn_implementation="eager",
        )
        return GPT2Model(cfg)

    def inputs(gen):
        return (_ids(gen, 2, 6), _randn(gen, 2, 4, d)) if cross else (_ids(gen, 2, 6),)

    def forward(m, x):
        kw = {"encoder_hidden_states": x[1]} if cross else {}
        return m(input_ids=x[0], use_cache=False, **kw).last_hidden_state

    def conv_ref(prefix, q_w, q_b, kv_w, kv_b, proj):
        # Conv1D: y = x W + b with W (in, out); in nn.Linear convention the weight is Wᵀ
        E = d
        return {
            f"{prefix}[QK]": (in_rows(q_w.T, q_b, B, h), in_rows(kv_w[:, :E].T, None, B, h)),
            f"{prefix}[b_k]": key_bias_ref(kv_b[:E], B, h),
            f"{prefix}[VO]": (
                in_rows(kv_w[:, E : 2 * E].T, kv_b[E : 2 * E], B, h),
                out_rows(proj.weight.T, B, h),
            ),
        }

    def reference(m):
        ref = {}
        for i, blk in enumerate(m.h):
            a = blk.attn
            W, b = a.c_attn.weight, a.c_attn.bias
            ref.update(conv_ref(f"h.{i}.attn", W[:, :d], b[:d], W[:, d:], b[d:], a.c_proj))
            if cross:
                c = blk.crossattention
                ref.update(
                    conv_ref(
                        f"h.{i}.crossattention",
                        c.q_attn.weight,
                        c.q_attn.bias,
                        c.c_attn.weight,
                        c.c_attn.bias,
                        c.c_proj,
                    )
                )
        return ref

    per_layer = [("QK", B, h, d + 1, d), ("VO", B, h, d + 1, d)] * (2 if cross else 1)
    return Case(
        name="hf_gpt2_cross" if cross else "hf_gpt2",
        build=_seeded(build),
        inputs=inputs,
        forward=forward,
        expected=per_layer * 2,
        n_translations=len(per_layer),
        q_weight=("h.0.attn.c_attn.weight", 1, 0, d),
        reference=reference,
    )


def llama_case() -> Case:
    from transformers import LlamaConfig, LlamaModel

    d, B, kv, h = 32, 4, 2, 8

    def build():
        cfg = LlamaConfig(
            hidden_size=d,
            num_attention_heads=B,
            num_key_value_heads=kv,
            num_hidden_layers=2,
            intermediate_size=37,
            vocab_size=50,
            max_position_embeddings=32,
            attention_bias=True,
            attn_implementation="sdpa",
        )
        return LlamaModel(cfg)

    def reference(m):
        ref = {}
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            ref.update(
                linear_attention_ref(
                    f"layers.{i}.self_attn",
                    a.q_proj,
                    a.k_proj,
                    a.v_proj,
                    a.o_proj,
                    B,
                    h,
                    kv,
                    key_bias_free=False,  # RoPE rotates b_k differently for every key
                )
            )
        return ref

    return Case(
        name="hf_llama_gqa_rotary",
        build=_seeded(build),
        inputs=lambda g: (_ids(g, 2, 6),),
        forward=lambda m, x: m(input_ids=x[0], use_cache=False).last_hidden_state,
        # rotary QK: G stacks the 2 query heads [W_q; b_q] of a K/V group, H = [W_k; b_k];
        # G_VO = [W_v; b_v] (d+1 rows), H_VO stacks B/kv slices of W_o
        expected=[("QK", kv, h, (B // kv) * (d + 1), d + 1), ("VO", kv, h, d + 1, (B // kv) * d)]
        * 2,
        q_weight=("layers.0.self_attn.q_proj.weight", 0, 0, d),
        reference=reference,
        notes=["rotary position embeddings (half layout, 8 of 8 features rotated)"],
    )


def diagonal_case() -> Case:
    from geosharp.models import DiagonalNet

    return Case(
        name="geosharp_diagonal_net",
        build=_seeded(lambda: DiagonalNet(7, init_scale=0.5)),
        inputs=lambda g: (_randn(g, 4, 7),),
        forward=lambda m, x: m(x[0]),
        expected=[],
        q_weight=("u", 0, 0, 7),
        reference=lambda m: {},
        n_pairs=1,
    )


CASES: list[Callable[[], Case]] = [
    lambda: mha_case(bias=True, batch_first=True),
    lambda: mha_case(bias=False, batch_first=False),
    mha_separate_case,
    transformer_encoder_case,
    geosharp_vit_case,
    geosharp_text_gqa_case,
    bert_case,
    vit_case,
    vit_legacy_case,
    clip_case,
    lambda: gpt2_case(cross=False),
    lambda: gpt2_case(cross=True),
    llama_case,
    diagonal_case,
]
CASE_IDS = [
    "mha_fused_bias_batch_first",
    "mha_fused_nobias_seq_first",
    "mha_separate_kvdim_bias_kv",
    "torch_transformer_encoder",
    "geosharp_vit",
    "geosharp_text_gqa_cls",
    "hf_bert",
    "hf_vit",
    "hf_vit_4x_layout",
    "hf_clip",
    "hf_gpt2",
    "hf_gpt2_cross",
    "hf_llama_gqa_rotary",
    "geosharp_diagonal_net",
]
