"""The finder beyond single adapters: no attention, frozen weights, declared blocks, errors."""

import re

import pytest
import torch
from torch import nn
from torch.func import functional_call

from geosharp.symmetry import (
    ADAPTERS,
    BlockSpec,
    Claim,
    ParamSlice,
    declare_block,
    find_symmetries,
    register_adapter,
    reparametrize,
)

from .cases import DT, bert_case, llama_case

RTOL = 1e-10  # float64 invariance, see test_adapters.INVARIANCE_RTOL


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).to(DT)


def test_model_without_attention_is_all_adaptive():
    model = mlp()
    space = find_symmetries(model)
    assert space.gl_blocks == [] and space.diagonal_pairs == []
    assert torch.equal(space.rest_index, torch.arange(5 * 7 + 7 + 7 * 3 + 3))
    text = space.summary()
    assert "no symmetry blocks found: all 66 parameters use the adaptive geometry" in text
    assert "GL(h) blocks:" not in text.splitlines()[1]
    assert "adaptive=66" in repr(space)


def test_frozen_parameters_are_excluded_and_listed():
    model = bert_case().build()
    model.embeddings.requires_grad_(False)
    space = find_symmetries(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and set(space.excluded) == frozen
    assert all("requires_grad=False" in why for why in space.excluded.values())
    assert not frozen & set(space.param_names)
    assert space.numel() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert len(space.gl_blocks) == 4
    text = space.summary()
    assert "excluded (5 tensors" in text and "embeddings.word_embeddings.weight" in text


def test_block_touching_a_frozen_parameter_is_dropped_with_a_note():
    model = bert_case().build()
    model.encoder.layer[1].attention.self.key.weight.requires_grad_(False)
    space = find_symmetries(model)
    names = [b.name for b in space.gl_blocks]
    assert "encoder.layer.1.attention[QK]" not in names
    assert "encoder.layer.1.attention[VO]" in names and len(names) == 3
    assert any("encoder.layer.1.attention[QK]" in n and "not used" in n for n in space.notes)
    # the trainable coordinates of the dropped block are adaptive
    offsets = dict(zip(space.param_names, space.offsets, strict=True))
    q = offsets["encoder.layer.1.attention.self.query.weight"]
    assert torch.isin(torch.arange(q, q + 32 * 32), space.rest_index).all()


def test_llama_rotary_qk_block_and_note():
    case = llama_case()
    model = case.build()
    space = find_symmetries(model)
    text = space.summary()
    assert "rotary position embeddings (half layout, 8 of 8 features rotated)" in text
    assert "(ℂ*)^4" in text  # the rotary commutant of h = 8: a scaled rotation per plane
    qk = [b for b in space.gl_blocks if b.kind == "QK"]
    assert [type(b).__name__ for b in qk] == ["RotaryBlock", "RotaryBlock"]
    assert qk[0].rotary.planes() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # under RoPE the key bias is rotated with the keys: a row of H, not a translation
    assert not any(b.kind == "b_k" for b in space.blocks)
    params = dict(model.named_parameters())
    offsets = dict(zip(space.param_names, space.offsets, strict=True))
    covered = torch.cat([b.positions() for b in space.blocks])
    for name in offsets:
        if ".q_proj." in name or ".k_proj." in name:
            span = torch.arange(offsets[name], offsets[name] + params[name].numel())
            assert torch.isin(span, covered).all(), name


class Bilinear(nn.Module):
    """Two-head attention scores with plain parameters: no adapter knows this module."""

    def __init__(self):
        super().__init__()
        self.wa = nn.Parameter(torch.randn(8, 5, dtype=DT))  # 2 heads × h=4 on rows
        self.wb = nn.Parameter(torch.randn(5, 8, dtype=DT))  # heads on columns
        self.bb = nn.Parameter(torch.randn(8, dtype=DT))
        self.other = nn.Parameter(torch.randn(3, dtype=DT))

    def forward(self, x):
        a = (x @ self.wa.T).view(-1, 2, 4)
        b = (x @ self.wb + self.bb).view(-1, 2, 4)
        return torch.einsum("nih,mih->inm", a, b).tanh() * self.other.sum()


def test_declared_block_is_invariant_and_matches_reference():
    torch.manual_seed(0)
    model = Bilinear()
    spec = declare_block(
        model,
        name="scores",
        g=[("wa", 0)],
        h=[ParamSlice("wb", axis=1), ("bb", 0, 0, 8)],
        head_dim=4,
    )
    assert spec.heads == 2
    space = find_symmetries(model, extra_blocks=[spec])
    (blk,) = space.gl_blocks
    assert (blk.kind, blk.heads, blk.n, blk.m, blk.head_dim) == ("custom", 2, 5, 6, 4)
    G, H = blk.gather(space.flatten_module(model).detach())
    for i in range(2):
        r = slice(4 * i, 4 * i + 4)
        G_ref = model.wa[r].T
        H_ref = torch.cat([model.wb[:, r], model.bb[r][None]])
        assert torch.equal(G[i], G_ref) and torch.equal(H[i], H_ref)
    assert space.adaptive_numel == 3
    x = torch.randn(6, 5, dtype=DT)
    twin = reparametrize(model, torch.Generator().manual_seed(1), scale=10.0, space=space)
    with torch.no_grad():
        y, y2 = model(x), twin(x)
    assert ((y2 - y).norm() / y.norm()).item() < RTOL
    assert not torch.allclose(twin.wa, model.wa)


def test_overlapping_declared_blocks_raise():
    model = Bilinear()
    a = declare_block(model, name="a", g=[("wa", 0)], h=[("wb", 1)], head_dim=4)
    b = declare_block(model, name="b", g=[("wa", 0, 4, 8)], h=[("bb", 0, 4, 8)], head_dim=4)
    with pytest.raises(
        ValueError, match=r"'a' and 'b' both claim parameter 'wa' at index \(4, 0\)"
    ):
        find_symmetries(model, extra_blocks=[a, b])


def test_block_overlapping_itself_raises():
    model = Bilinear()
    spec = declare_block(model, name="self", g=[("wa", 0)], h=[("wa", 0)], head_dim=4)
    with pytest.raises(ValueError, match="twice"):
        find_symmetries(model, extra_blocks=[spec])


def test_declared_block_overlapping_an_adapter_block_raises():
    model = bert_case().build()
    q = "encoder.layer.0.attention.self.query.weight"
    k = "encoder.layer.0.attention.self.key.weight"
    spec = declare_block(model, name="mine", g=[(q, 0)], h=[(k, 0)], head_dim=8)
    with pytest.raises(ValueError, match=r"'encoder.layer.0.attention\[QK\]' and 'mine'"):
        find_symmetries(model, extra_blocks=[spec])


def test_declare_block_errors():
    model = Bilinear()
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        declare_block(model, name="x", g=["nope"], h=["wa"], head_dim=4)
    with pytest.raises(ValueError, match="multiple of heads·head_dim"):
        declare_block(model, name="x", g=[("wa", 0)], h=[("wb", 1)], head_dim=3)
    with pytest.raises(ValueError, match="out of range"):
        declare_block(model, name="x", g=[("wa", 0, 0, 12)], h=[("wb", 1)], head_dim=4)
    model.wa.requires_grad_(False)
    spec = declare_block(model, name="x", g=[("wa", 0)], h=[("wb", 1)], head_dim=4)
    with pytest.raises(ValueError, match="excluded"):
        find_symmetries(model, extra_blocks=[spec])


def test_duplicate_block_names_raise():
    model = Bilinear()
    a = declare_block(model, name="same", g=[("wa", 0, 0, 4)], h=[("wb", 1, 0, 4)], head_dim=4)
    b = declare_block(model, name="same", g=[("wa", 0, 4, 8)], h=[("wb", 1, 4, 8)], head_dim=4)
    with pytest.raises(ValueError, match="named 'same'"):
        find_symmetries(model, extra_blocks=[a, b])


def test_declared_diagonal_pair_and_shape_mismatch():
    model = nn.ParameterDict({"u": torch.ones(4), "v": torch.ones(4), "w": torch.ones(5)})
    space = find_symmetries(model, diagonal_pairs=[("u", "v")])
    assert len(space.diagonal_pairs) == 1 and space.adaptive_numel == 5
    with pytest.raises(ValueError, match="must match"):
        find_symmetries(model, diagonal_pairs=[("u", "w")])


def test_custom_adapter_and_registry():
    def bilinear_adapter(path, module):
        if not isinstance(module, Bilinear):
            return None
        p = f"{path}." if path else ""
        spec = BlockSpec(
            f"{path}[custom]",
            "custom",
            path,
            2,
            4,
            (ParamSlice(p + "wa", 0),),
            (ParamSlice(p + "wb", 1),),
        )
        return Claim(blocks=[spec], notes=["bilinear scores"])

    model = nn.Sequential(Bilinear(), Bilinear())
    assert find_symmetries(model).gl_blocks == []
    space = find_symmetries(model, adapters=[bilinear_adapter])
    assert [b.name for b in space.gl_blocks] == ["0[custom]", "1[custom]"]
    assert space.notes[0] == "bilinear scores (0, 1)" and "unverified" in space.notes[1]
    try:
        register_adapter(bilinear_adapter)
        assert ADAPTERS[0] is bilinear_adapter
        assert len(find_symmetries(model).gl_blocks) == 2
    finally:
        ADAPTERS.remove(bilinear_adapter)


def test_tied_weights_are_counted_once():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=20, n_positions=8)
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    space = find_symmetries(model)
    assert space.numel() == sum(p.numel() for p in model.parameters())
    assert "lm_head.weight" not in space.param_names
    assert [b.name for b in space.gl_blocks] == [
        "transformer.h.0.attn[QK]",
        "transformer.h.0.attn[VO]",
    ]


def test_flatten_unflatten_are_differentiable():
    model = mlp()
    space = find_symmetries(model)
    theta = space.flatten_module(model).detach().requires_grad_(True)
    x = torch.randn(4, 5, dtype=DT)
    loss = functional_call(model, space.unflatten(theta), (x,)).square().sum()
    (grad,) = torch.autograd.grad(loss, theta)
    model.zero_grad()
    model(x).square().sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_space_validation_errors_and_locate():
    model = mlp()
    space = find_symmetries(model)
    with pytest.raises(ValueError, match="length 66"):
        space.unflatten(torch.zeros(65, dtype=DT))
    with pytest.raises(KeyError, match=r"0\.weight"):
        space.flatten({})
    with pytest.raises(ValueError, match="shape"):
        space.flatten({n: p.unsqueeze(0) for n, p in model.named_parameters()})
    assert space.locate(0) == ("0.weight", (0, 0))
    assert space.locate(5 * 7 + 7 + 8) == ("2.weight", (1, 1))
    with pytest.raises(IndexError):
        space.locate(66)


def test_bert_summary_totals():
    model = bert_case().build()
    text = find_symmetries(model).summary()
    total = sum(p.numel() for p in model.parameters())
    gl = 2 * (4 * (33 + 32) * 8 + 4 * (33 + 32) * 8)  # 2 layers × (QK + VO)
    bk = 2 * 32  # key biases
    assert f"{total:,} coordinates" in text
    assert "6 symmetry blocks (24 group factors" in text
    assert re.search(rf"GL\(h\) blocks\s+{gl:,}\s", text)
    assert re.search(rf"key-bias translations \(held fixed\)\s+{bk}\s", text)
    assert re.search(rf"adaptive \(element-wise\)\s+{total - gl - bk:,}\s", text)
    assert re.search(
        r"QK\s+GL\(8\)\s+encoder\.layer\.0\.attention\s+4\s+G 33×8, H 32×8\s+2,080", text
    )
    assert re.search(
        r"b_k\s+ℝ\^32 \(translations\)\s+encoder\.layer\.0\.attention\s+4\s+b: 32\s+32", text
    )
    assert re.search(
        r"VO\s+GL\(8\)\s+encoder\.layer\.1\.attention\s+4\s+G 33×8, H 32×8\s+2,080", text
    )


def test_key_bias_keep_restores_the_old_layout():
    model = bert_case().build()
    space = find_symmetries(model, key_bias="keep")
    assert not any(b.kind == "b_k" for b in space.blocks)
    assert [(b.kind, b.n, b.m) for b in space.gl_blocks] == [("QK", 33, 33), ("VO", 33, 32)] * 2
    with pytest.raises(ValueError, match="key_bias must be one of"):
        find_symmetries(model, key_bias="drop")


def test_space_to_device_keeps_indices():
    model = bert_case().build()
    space = find_symmetries(model)
    moved = space.to("cpu")
    assert moved is not space and moved.param_names == space.param_names
    for a, b in zip(space.gl_blocks, moved.gl_blocks, strict=True):
        assert torch.equal(a.g_index, b.g_index) and torch.equal(a.h_index, b.h_index)
    assert torch.equal(moved.rest_index, space.rest_index)
