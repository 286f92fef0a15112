"""The further HF adapters (hf_adapters) on tiny float64 models, and the coverage sweep.

Every architecture is built from its config with random, non-trivial weights; the tests check
the blocks found (kind, heads, shapes, rotary planes), compare ``G``, ``H`` with references
built by explicit per-head slicing of the module weights where the layout is unusual (fused,
head-interleaved, multi-query, DeBERTa's stacking), and check that the outputs do not move
under ``reparametrize`` at scales 0.1 and 10.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import geosharp.symmetry as gs
from geosharp.demos import coverage
from geosharp.symmetry import hf_adapters
from geosharp.symmetry.adapters import ADAPTERS
from geosharp.symmetry.specs import RotarySpec

from ..invariance import assert_invariant, rel_change
from .cases import in_rows, key_bias_ref, linear_attention_ref, out_rows

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

DT = torch.float64
# float64 invariance, see test_adapters.INVARIANCE_RTOL; a model computing part of its forward in
# float32 (Falcon's and BLOOM's softmax) is judged against a random move (tests/invariance.py)
RTOL = 1e-10
D, B, H, FFN, V = 32, 4, 8, 37, 64
COVERAGE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"

Ref = dict[str, tuple[Tensor, Tensor]]


@dataclass
class ArchCase:
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple]
    forward: Callable[[nn.Module, tuple], Tensor]
    #: (kind, heads, head_dim, n, m, rotary) per GL block, in finder order
    expected: list[tuple]
    #: number of key-bias translations the adapters claim
    translations: int = 0
    reference: Callable[[nn.Module], Ref] | None = None
    notes: list[str] = field(default_factory=list)


def seeded(config_cls: str, model_cls: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        cfg = getattr(transformers, config_cls)(**kw)
        model = getattr(transformers, model_cls)(cfg).to(DT).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return model

    return build


def ids(g, batch=2, seq=7):
    return torch.randint(3, V, (batch, seq), generator=g)


def text_inputs(g):
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:] = 0
    return ids(g), mask


def encoder_forward(m, x):
    out = m(input_ids=x[0], attention_mask=x[1])
    pooled = getattr(out, "pooler_output", None)
    parts = [out.last_hidden_state] + ([pooled] if pooled is not None else [])
    return torch.cat([p.reshape(-1) for p in parts])


def decoder_forward(m, x):
    return m(input_ids=x[0], use_cache=False).last_hidden_state


def decoder_inputs(g):
    return (ids(g),)


def modules_of(model: nn.Module, cls_name: str) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == cls_name]


# -- encoders -------------------------------------------------------------------------------------
def distilbert_case() -> ArchCase:
    def reference(m):
        ref = {}
        for path, a in modules_of(m, "DistilBertSelfAttention"):
            ref.update(linear_attention_ref(path, a.q_lin, a.k_lin, a.v_lin, a.out_lin, B, H))
        return ref

    return ArchCase(
        build=seeded(
            "DistilBertConfig",
            "DistilBertModel",
            vocab_size=V,
            dim=D,
            n_heads=B,
            n_layers=2,
            hidden_dim=FFN,
            max_position_embeddings=16,
            attn_implementation="eager",
        ),
        inputs=text_inputs,
        forward=encoder_forward,
        expected=[("QK", B, H, D + 1, D, None), ("VO", B, H, D + 1, D, None)] * 2,
        translations=2,
        reference=reference,
    )


def albert_case() -> ArchCase:
    def reference(m):
        (path, a), *rest = modules_of(m, "AlbertAttention")
        assert not rest  # one shared layer
        return linear_attention_ref(path, a.query, a.key, a.value, a.dense, B, H)

    return ArchCase(
        build=seeded(
            "AlbertConfig",
            "AlbertModel",
            vocab_size=V,
            embedding_size=16,
            hidden_size=D,
            num_attention_heads=B,
            num_hidden_layers=3,  # one shared layer applied three times
            intermediate_size=FFN,
            max_position_embeddings=16,
            attn_implementation="eager",
        ),
        inputs=text_inputs,
        forward=encoder_forward,
        expected=[("QK", B, H, D + 1, D, None), ("VO", B, H, D + 1, D, None)],
        translations=1,
        reference=reference,
    )


def deberta_case(pos_att_type, share: bool, relative: bool = True) -> ArchCase:
    c2p = relative and "c2p" in pos_att_type
    p2c = relative and "p2c" in pos_att_type
    pos_q = p2c and not share
    pos_k = c2p and not share
    n_qk = (D + 1) * (1 + pos_q)
    m_qk = D + p2c + D * pos_k  # [W_k; b_k if p2c; W_pk]
    free = (not p2c) or pos_k  # b_k without p2c, b_pk with c2p: one translation block

    def reference(m):
        ref = {}
        for path, a in modules_of(m, "DebertaV2Attention"):
            s = a.self
            G = [in_rows(s.query_proj.weight, s.query_proj.bias, B, H)]
            Hm = [in_rows(s.key_proj.weight, s.key_proj.bias if p2c else None, B, H)]
            if pos_q:
                G.append(in_rows(s.pos_query_proj.weight, s.pos_query_proj.bias, B, H))
            if pos_k:
                Hm.append(in_rows(s.pos_key_proj.weight, None, B, H))
            ref[f"{path}[QK]"] = (torch.cat(G, dim=1), torch.cat(Hm, dim=1))
            free_rows = ([s.key_proj.bias] if not p2c else []) + (
                [s.pos_key_proj.bias] if pos_k else []
            )
            if free_rows:
                ref[f"{path}[b_k]"] = (torch.stack([b.view(B, H) for b in free_rows], dim=1),)
            ref[f"{path}[VO]"] = (
                in_rows(s.value_proj.weight, s.value_proj.bias, B, H),
                out_rows(a.output.dense.weight, B, H),
            )
        return ref

    return ArchCase(
        build=seeded(
            "DebertaV2Config",
            "DebertaV2Model",
            vocab_size=V,
            hidden_size=D,
            num_attention_heads=B,
            num_hidden_layers=2,
            intermediate_size=FFN,
            max_position_embeddings=16,
            relative_attention=relative,
            pos_att_type=list(pos_att_type),
            share_att_key=share,
            position_buckets=4,
            max_relative_positions=8,
            norm_rel_ebd="layer_norm",
        ),
        inputs=text_inputs,
        forward=encoder_forward,
        expected=[("QK", B, H, n_qk, m_qk, None), ("VO", B, H, D + 1, D, None)] * 2,
        translations=2 * free,
        reference=reference,
    )


def mpnet_case() -> ArchCase:
    return ArchCase(
        build=seeded(
            "MPNetConfig",
            "MPNetModel",
            vocab_size=V,
            hidden_size=D,
            num_attention_heads=B,
            num_hidden_layers=2,
            intermediate_size=FFN,
            max_position_embeddings=16,
            pad_token_id=1,
        ),
        inputs=text_inputs,
        forward=encoder_forward,
        expected=[("QK", B, H, D + 1, D, None), ("VO", B, H, D + 1, D, None)] * 2,
        translations=2,
    )


def t5_case() -> ArchCase:
    def inputs(g):
        return (*text_inputs(g), ids(g, seq=5))

    def forward(m, x):
        out = m(input_ids=x[0], attention_mask=x[1], decoder_input_ids=x[2], use_cache=False)
        return torch.cat([out.last_hidden_state.flatten(), out.encoder_last_hidden_state.flatten()])

    def reference(m):
        ref = {}
        for path, a in modules_of(m, "T5Attention"):
            ref.update(linear_attention_ref(path, a.q, a.k, a.v, a.o, B, H))
        return ref

    blocks = [("QK", B, H, D, D, None), ("VO", B, H, D, D, None)]
    return ArchCase(
        build=seeded(
            "T5Config",
            "T5Model",
            vocab_size=V,
            d_model=D,
            d_kv=H,
            num_heads=B,
            num_layers=2,
            d_ff=FFN,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            decoder_start_token_id=0,
            attn_implementation="eager",
        ),
        inputs=inputs,
        forward=forward,
        # encoder: 2 self-attentions; decoder: 2 × (self, cross)
        expected=blocks * 6,
        reference=reference,
    )


# -- fused and rotary decoders --------------------------------------------------------------------
def interleaved(W: Tensor, heads: int, parts: int, h: int, part) -> Tensor:
    """Rows of the per-unit parts ``part`` of a fused weight/bias, unit by unit."""
    sel = slice(part, part + 1) if isinstance(part, int) else slice(*part)
    return W.reshape(heads, parts, h, *W.shape[1:])[:, sel].reshape(-1, *W.shape[1:])


def fused_ref(path, qkv, dense, heads, h, kv, parts, q, k, v, k_in_h: bool) -> Ref:
    W, b = qkv.weight, qkv.bias
    g = heads // kv
    if parts == 1:
        Wq, Wk, Wv = W[slice(*q)], W[slice(*k)], W[slice(*v)]
        bq, bk, bv = (None,) * 3 if b is None else (b[slice(*q)], b[slice(*k)], b[slice(*v)])
    else:
        units = W.shape[0] // (parts * h)
        Wq, Wk, Wv = (interleaved(W, units, parts, h, p) for p in (q, k, v))
        bq, bk, bv = (
            (None,) * 3 if b is None else (interleaved(b, units, parts, h, p) for p in (q, k, v))
        )
    ref = {
        f"{path}[QK]": (in_rows(Wq, bq, heads, h, g), in_rows(Wk, bk if k_in_h else None, kv, h)),
        f"{path}[VO]": (in_rows(Wv, bv, kv, h), out_rows(dense.weight, heads, h, g)),
    }
    if bk is not None and not k_in_h:
        ref[f"{path}[b_k]"] = key_bias_ref(bk, kv, h)
    return ref


def bloom_case() -> ArchCase:
    def reference(m):
        ref = {}
        for path, a in modules_of(m, "BloomAttention"):
            ref.update(
                fused_ref(path, a.query_key_value, a.dense, B, H, B, 3, 0, 1, 2, k_in_h=False)
            )
        return ref

    return ArchCase(
        build=seeded("BloomConfig", "BloomModel", vocab_size=V, hidden_size=D, n_layer=2, n_head=B),
        inputs=decoder_inputs,
        forward=decoder_forward,  # BLOOM's softmax is float32: judged by tests/invariance.py
        expected=[("QK", B, H, D + 1, D, None), ("VO", B, H, D + 1, D, None)] * 2,
        translations=2,
        reference=reference,
    )


def gpt_neox_case() -> ArchCase:
    def reference(m):
        ref = {}
        for path, a in modules_of(m, "GPTNeoXAttention"):
            ref.update(
                fused_ref(path, a.query_key_value, a.dense, B, H, B, 3, 0, 1, 2, k_in_h=True)
            )
        return ref

    rot = RotarySpec(4, "half")
    return ArchCase(
        build=seeded(
            "GPTNeoXConfig",
            "GPTNeoXModel",
            vocab_size=V,
            hidden_size=D,
            num_attention_heads=B,
            num_hidden_layers=2,
            intermediate_size=FFN,
            max_position_embeddings=32,
            rotary_pct=0.5,
            attn_implementation="eager",
        ),
        inputs=decoder_inputs,
        forward=decoder_forward,
        # rotary: the key bias is rotated with the keys, a row of H_QK
        expected=[("QK", B, H, D + 1, D + 1, rot), ("VO", B, H, D + 1, D, None)] * 2,
        reference=reference,
        notes=["rotary position embeddings (half layout, 4 of 8"],
    )


def falcon_case(layout: str, alibi: bool) -> ArchCase:
    kv = {"grouped": 2, "multi_query": 1, "classic": B}[layout]
    g = B // kv
    E = B * H

    def reference(m):
        ref = {}
        for path, a in modules_of(m, "FalconAttention"):
            qkv, dense = a.query_key_value, a.dense
            if layout == "grouped":
                r = fused_ref(path, qkv, dense, B, H, kv, g + 2, (0, g), g, g + 1, not alibi)
            elif layout == "multi_query":
                r = fused_ref(
                    path, qkv, dense, B, H, 1, 1, (0, E), (E, E + H), (E + H, E + 2 * H), not alibi
                )
            else:
                r = fused_ref(path, qkv, dense, B, H, B, 3, 0, 1, 2, not alibi)
            ref.update(r)
        return ref

    rot = None if alibi else RotarySpec(H, "half")
    return ArchCase(
        build=seeded(
            "FalconConfig",
            "FalconModel",
            vocab_size=V,
            hidden_size=D,
            num_attention_heads=B,
            num_hidden_layers=2,
            new_decoder_architecture=layout == "grouped",
            multi_query=layout == "multi_query",
            num_kv_heads=kv if layout == "grouped" else None,
            alibi=alibi,
            bias=True,
            attn_implementation="eager",
        ),
        inputs=decoder_inputs,
        forward=decoder_forward,
        expected=[
            ("QK", kv, H, g * (D + 1), D + (not alibi), rot),
            ("VO", kv, H, D + 1, g * D, None),
        ]
        * 2,
        translations=2 * alibi,
        reference=reference,
    )


def phi_case(qk_layernorm: bool) -> ArchCase:
    kv = 2
    g = B // kv

    def reference(m):
        ref = {}
        for path, a in modules_of(m, "PhiAttention"):
            ref.update(
                linear_attention_ref(
                    path,
                    a.q_proj,
                    a.k_proj,
                    a.v_proj,
                    a.dense,
                    B,
                    H,
                    kv,
                    qk=not qk_layernorm,
                    key_bias_free=False,  # rotary: b_k is rotated with the keys
                )
            )
        return ref

    rot = RotarySpec(4, "half")
    qk = [] if qk_layernorm else [("QK", kv, H, g * (D + 1), D + 1, rot)]
    return ArchCase(
        build=seeded(
            "PhiConfig",
            "PhiModel",
            vocab_size=V,
            hidden_size=D,
            num_attention_heads=B,
            num_key_value_heads=kv,
            num_hidden_layers=2,
            intermediate_size=FFN,
            max_position_embeddings=32,
            partial_rotary_factor=0.5,
            qk_layernorm=qk_layernorm,
            attn_implementation="eager",
        ),
        inputs=decoder_inputs,
        forward=decoder_forward,
        expected=[*qk, ("VO", kv, H, D + 1, g * D, None)] * 2,
        reference=reference,
        notes=["QK-norm"] if qk_layernorm else ["rotary position embeddings (half layout, 4 of 8"],
    )


def phi3_case() -> ArchCase:
    kv = 2
    g = B // kv
    Q, K = B * H, kv * H

    def reference(m):
        ref = {}
        for path, a in modules_of(m, "Phi3Attention"):
            ref.update(
                fused_ref(
                    path, a.qkv_proj, a.o_proj, B, H, kv, 1, (0, Q), (Q, Q + K), (Q + K, Q + 2 * K),
                    k_in_h=True,
                )
            )  # fmt: skip
        return ref

    rot = RotarySpec(4, "half")
    return ArchCase(
        build=seeded(
            "Phi3Config",
            "Phi3Model",
            vocab_size=V,
            hidden_size=D,
            num_attention_heads=B,
            num_key_value_heads=kv,
            num_hidden_layers=2,
            intermediate_size=FFN,
            max_position_embeddings=32,
            partial_rotary_factor=0.5,
            pad_token_id=0,
            attn_implementation="eager",
        ),
        inputs=decoder_inputs,
        forward=decoder_forward,
        expected=[("QK", kv, H, g * D, D, rot), ("VO", kv, H, D, g * D, None)] * 2,
        reference=reference,
    )


def gptj_config() -> dict:
    # the configuration of the reported bug (issue 15): 58 % logit change under a full GL claim
    return dict(
        vocab_size=100,
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        n_positions=64,
        n_inner=64,
        bos_token_id=0,
        eos_token_id=0,
        # GPT-J's eager attention computes Q·Kᵀ in float32; SDPA stays in float64
        attn_implementation="sdpa",
    )


def gptj_case() -> ArchCase:
    def reference(m):
        ref = {}
        for path, a in modules_of(m, "GPTJAttention"):
            ref.update(linear_attention_ref(path, a.q_proj, a.k_proj, a.v_proj, a.out_proj, B, H))
        return ref

    rot = RotarySpec(4, "interleaved")
    return ArchCase(
        build=seeded("GPTJConfig", "GPTJModel", **gptj_config()),
        inputs=lambda g: (torch.randint(0, 100, (2, 7), generator=g),),
        forward=decoder_forward,
        expected=[("QK", B, H, D, D, rot), ("VO", B, H, D, D, None)] * 2,
        reference=reference,
        notes=["rotary position embeddings (interleaved layout, 4 of 8"],
    )


CASES: dict[str, Callable[[], ArchCase]] = {
    "distilbert": distilbert_case,
    "albert_shared": albert_case,
    "deberta_c2p_p2c": lambda: deberta_case(("c2p", "p2c"), share=False),
    "deberta_c2p": lambda: deberta_case(("c2p",), share=False),
    "deberta_p2c": lambda: deberta_case(("p2c",), share=False),
    "deberta_shared_c2p_p2c": lambda: deberta_case(("c2p", "p2c"), share=True),
    "deberta_shared_c2p": lambda: deberta_case(("c2p",), share=True),
    "deberta_no_relative": lambda: deberta_case(("c2p", "p2c"), share=False, relative=False),
    "mpnet": mpnet_case,
    "t5_self_and_cross": t5_case,
    "bloom": bloom_case,
    "gpt_neox_partial_rotary": gpt_neox_case,
    "falcon_grouped_rotary": lambda: falcon_case("grouped", alibi=False),
    "falcon_multi_query_alibi": lambda: falcon_case("multi_query", alibi=True),
    "falcon_multi_query_rotary": lambda: falcon_case("multi_query", alibi=False),
    "falcon_classic_alibi": lambda: falcon_case("classic", alibi=True),
    "phi_gqa_partial_rotary": lambda: phi_case(qk_layernorm=False),
    "phi_qk_layernorm": lambda: phi_case(qk_layernorm=True),
    "phi3_fused_gqa": phi3_case,
    "gptj": gptj_case,
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def setup(request):
    case = CASES[request.param]()
    model = case.build()
    space = gs.find_symmetries(model)
    inputs = case.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = case.forward(model, inputs)
    return case, model, space, inputs, out


def claims(model):
    """Every claim the extra adapters make, with the module path."""
    found = []
    for path, module in model.named_modules():
        for adapter in hf_adapters.EXTRA_ADAPTERS:
            claim = adapter(path, module)
            if claim is not None:
                found.append((path, adapter.__name__, claim))
    return found


def test_blocks_found(setup):
    case, _, space, _, _ = setup
    got = [
        (b.kind, b.heads, b.head_dim, b.n, b.m, getattr(b, "rotary", None)) for b in space.gl_blocks
    ]
    # (the rotary field is the finder's RotaryBlock: full-GL blocks have none)
    assert got == [tuple(e) for e in case.expected]
    for b in space.gl_blocks:
        assert b.g_index.shape == (b.heads, b.n, b.head_dim)
        assert b.h_index.shape == (b.heads, b.m, b.head_dim)
    for note in case.notes:
        assert any(note in n for n in space.notes), space.notes


def test_claims_of_the_extra_adapters(setup):
    # the adapter layer on its own (independent of how the finder resolves rotary blocks and
    # translations): the rotary planes and the free key biases
    case, model, _, _, _ = setup
    found = claims(model)
    assert found, "no extra adapter recognised the model"
    specs = [s for _, _, c in found for s in c.blocks]
    assert [(s.kind, s.heads, s.head_dim) for s in specs] == [e[:3] for e in case.expected]
    assert [s.rotary for s in specs] == [e[5] for e in case.expected]
    assert sum(len(c.translations) for _, _, c in found) == case.translations


def test_per_head_reference(setup):
    case, model, space, _, _ = setup
    if case.reference is None:
        pytest.skip("plain separate projections: covered by the block shapes and invariance")
    theta = space.flatten_module(model).detach()
    ref = case.reference(model)
    assert set(ref) == {b.name for b in space.blocks}
    for b in space.gl_blocks:
        G, Hm = b.gather(theta)
        G_ref, H_ref = ref[b.name]
        assert torch.equal(G, G_ref) and torch.equal(Hm, H_ref), b.name
    for b in space.blocks:
        if b.kind == "b_k":
            (bias,) = b.gather(theta)
            assert torch.equal(bias, ref[b.name][0]), b.name


def test_outputs_ignore_the_free_key_biases(setup):
    # the translation blocks are exact symmetries: a huge change of every free bias is invisible
    case, model, space, inputs, out = setup
    biases = [b for b in space.blocks if b.kind == "b_k"]
    assert len(biases) == case.translations
    if not biases:
        pytest.skip("no key bias the softmax ignores")
    theta = space.flatten_module(model).detach()
    gen = torch.Generator().manual_seed(11)
    for b in biases:
        (bias,) = b.gather(theta)
        theta = b.scatter(theta, bias + 10 * torch.randn(bias.shape, generator=gen, dtype=DT))
    moved = copy.deepcopy(model)
    with torch.no_grad():
        space.write_to(moved, theta)
        change = rel_change(case.forward(moved, inputs), out)
    assert_invariant(
        change,
        rtol=RTOL,
        forward=case.forward,
        model=model,
        space=space,
        moved=theta,
        inputs=inputs,
        out=out,
        what="free key biases",
        everywhere=True,
    )


@pytest.mark.parametrize("scale", [0.1, 10.0])
def test_reparametrization_invariance(setup, scale):
    case, model, space, inputs, out = setup
    twin = gs.reparametrize(model, generator=torch.Generator().manual_seed(7), scale=scale)
    with torch.no_grad():
        out_twin = case.forward(twin, inputs)
    theta, theta_twin = space.flatten_module(model), space.flatten_module(twin)
    assert_invariant(
        rel_change(out_twin, out),
        rtol=RTOL,
        forward=case.forward,
        model=model,
        space=space,
        moved=theta_twin.detach(),
        inputs=inputs,
        out=out,
        what=f"scale {scale}",
    )
    moved = torch.cat([b.g_index.reshape(-1) for b in space.gl_blocks])
    assert rel_change(theta_twin[moved], theta[moved]) > 1e-2


def test_a_full_gl_element_on_a_qk_block_is_seen(setup):
    # G ↦ G A⁻¹, H ↦ H Aᵀ with a generic A: invisible for a full-GL block, visible (order 1)
    # for a rotary block (A does not commute with the rotations); a "half" action is always
    # visible. So the invariance check above can fail, and a rotary claim is not a GL claim.
    case, model, space, inputs, out = setup
    theta = space.flatten_module(model).detach()
    gen = torch.Generator().manual_seed(4)
    for b in space.gl_blocks:
        if b.kind != "QK":
            continue
        G, Hm = b.gather(theta)
        A = torch.randn(b.heads, b.head_dim, b.head_dim, generator=gen, dtype=DT)
        G2 = torch.linalg.solve(A, G, left=False)
        for new, visible in (
            (b.scatter(theta, G2, Hm @ A.mT), getattr(b, "rotary", None) is not None),
            (b.scatter(theta, G2, Hm), True),
        ):
            broken = copy.deepcopy(model)
            with torch.no_grad():
                space.write_to(broken, new)
                change = rel_change(case.forward(broken, inputs), out)
            if visible:
                assert change > 1e-4, (b.name, change)
            else:
                assert_invariant(
                    change,
                    rtol=RTOL,
                    forward=case.forward,
                    model=model,
                    space=space,
                    moved=new,
                    inputs=inputs,
                    out=out,
                    what=b.name,
                )
        break


# -- DeBERTa: which biases are free ---------------------------------------------------------------
@pytest.mark.parametrize(
    "pos_att_type, share",
    [(("c2p", "p2c"), False), (("c2p",), False), (("p2c",), True), (("c2p",), True)],
)
def test_deberta_free_biases(pos_att_type, share):
    case = deberta_case(pos_att_type, share)
    model = case.build()
    x = case.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = case.forward(model, x)
    biases = {"key_proj.bias": "p2c" not in pos_att_type, "query_proj.bias": False}
    if not share and "c2p" in pos_att_type:
        biases["pos_key_proj.bias"] = True
    if not share and "p2c" in pos_att_type:
        biases["pos_query_proj.bias"] = False
    for name, free in biases.items():
        broken = copy.deepcopy(model)
        with torch.no_grad():
            bias = broken.encoder.layer[0].attention.self.get_parameter(name)
            bias.add_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(2)))
            change = rel_change(case.forward(broken, x), out)
        assert (change < RTOL) if free else (change > 1e-4), (name, change)
    # the free ones are exactly the translations claimed
    path = "encoder.layer.0.attention"
    claim = hf_adapters.deberta_v2_attention(path, model.get_submodule(path))
    claimed = {p.param.split("self.")[1] for t in claim.translations for p in t.pieces}
    assert claimed == {n for n, free in biases.items() if free}


def test_deberta_separate_position_projections_must_transform_jointly():
    # transforming only [W_q; b_q] and [W_k; b_k] (not the position projections) is visible
    case = deberta_case(("c2p", "p2c"), share=False)
    model = case.build()
    x = case.inputs(torch.Generator().manual_seed(1))
    a = model.encoder.layer[0].attention.self
    with torch.no_grad():
        out = case.forward(model, x)
        A = torch.randn(B, H, H, generator=torch.Generator().manual_seed(5), dtype=DT)
        for lin, act in ((a.query_proj, "inv"), (a.key_proj, "T")):
            W = lin.weight.view(B, H, D)
            b = lin.bias.view(B, H, 1)
            Gh = torch.cat([W.mT, b.mT], dim=1)  # (B, D+1, H)
            Gh = torch.linalg.solve(A, Gh, left=False) if act == "inv" else Gh @ A.mT
            lin.weight.copy_(Gh[:, :D].mT.reshape(B * H, D))
            lin.bias.copy_(Gh[:, D].reshape(-1))
        assert rel_change(case.forward(model, x), out) > 1e-4


# -- recognition ----------------------------------------------------------------------------------
def test_extra_adapters_are_tried_first():
    assert ADAPTERS[: len(hf_adapters.EXTRA_ADAPTERS)] == hf_adapters.EXTRA_ADAPTERS


@pytest.mark.parametrize(
    "name", ["BERT", "GPT-2", "Llama", "ViT", "CLIP", "BART", "Whisper", "torch Transformer"]
)
def test_extra_adapters_leave_other_layouts_alone(name):
    arch = {a.name: a for a in coverage.ARCHITECTURES}[name]
    assert claims(arch.build()) == []


def test_gptj_is_claimed_by_its_own_adapter():
    model = seeded("GPTJConfig", "GPTJModel", **gptj_config())()
    found = claims(model)
    assert [(p, a) for p, a, _ in found] == [
        ("h.0.attn", "gptj_attention"),
        ("h.1.attn", "gptj_attention"),
    ]
    qk = found[0][2].blocks[0]
    assert qk.rotary == RotarySpec(4, "interleaved")
    assert qk.rotary.planes() == [(0, 1), (2, 3)]


# -- the coverage sweep ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sweep_rows():
    return coverage.sweep()


def test_sweep_has_no_false_claim_and_finds_blocks(sweep_rows):
    assert len(sweep_rows) == len(coverage.ARCHITECTURES) >= 37
    for row in sweep_rows:
        assert row.exact, (row.name, row.change)
        assert row.blocks >= 1, row.name
        assert row.counts.get("VO", 0) >= 1, row.name


def test_the_coverage_page_is_the_generated_table(sweep_rows):
    text = COVERAGE_PAGE.read_text(encoding="utf-8")
    table = coverage.render_table(sweep_rows)
    assert coverage.replace_section(text, table) == text, (
        "the coverage table is stale: run "
        "`python -m geosharp.demos.coverage --write docs/architectures.md`"
    )


def test_a_false_claim_shows():
    # the forward also returns a query weight, which the group moves: a "false claim"
    def forward(m, x):
        return torch.cat([m(*x).flatten(), m.attn.in_proj_weight.flatten()])

    base = {a.name: a for a in coverage.ARCHITECTURES}["torch MultiheadAttention"]
    fake = coverage.Architecture("fake", base.build, base.inputs, forward)
    row = coverage.measure(fake)
    assert not row.exact and row.verdict == "**FALSE CLAIM**"
    assert row.change > 1e-2


def test_bands_and_section_replacement():
    assert coverage.band(3e-16) == "< 1e-12"
    assert coverage.band(5e-11) == "< 1e-5"
    assert coverage.band(6e-8) == "< 1e-5"
    assert coverage.band(0.2) == "≥ 1e-3"
    text = f"a\n{coverage.START_MARKER}\nold\n{coverage.END_MARKER}\nb\n"
    assert coverage.replace_section(text, "new\n") == (
        f"a\n{coverage.START_MARKER}\nnew\n{coverage.END_MARKER}\nb\n"
    )
    with pytest.raises(ValueError, match="no"):
        coverage.replace_section("no markers", "x")


def test_cli_check_and_write(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{coverage.START_MARKER}\n{coverage.END_MARKER}\n", encoding="utf-8")
    args = ["--only", "torch MultiheadAttention"]
    assert coverage.main([*args, "--check", str(readme)]) == 1
    assert coverage.main([*args, "--write", str(readme)]) == 0
    assert coverage.main([*args, "--check", str(readme)]) == 0
    out = capsys.readouterr().out
    assert "| torch MultiheadAttention | 1 QK, 1 VO" in out
    assert "| torch MultiheadAttention |" in readme.read_text(encoding="utf-8")
