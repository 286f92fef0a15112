"""geosharp's small transformers against dense references."""

import pytest
import torch
from torch import nn

from geosharp.models import Block, MultiHeadAttention, TextTransformer, VisionTransformer

DT = torch.float64


def reference_attention(attn: MultiHeadAttention, x, keep=None):
    """Per-head loop, the slow obvious way."""
    H, KV, h = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.q(x), attn.k(x), attn.v(x)
    heads = []
    for i in range(H):
        j = i // (H // KV)
        qi, kj, vj = (
            q[..., i * h : (i + 1) * h],
            k[..., j * h : (j + 1) * h],
            v[..., j * h : (j + 1) * h],
        )
        s = qi @ kj.transpose(-1, -2) / h**0.5
        if keep is not None:
            s = s.masked_fill(~keep[:, None, :], float("-inf"))
        heads.append(torch.softmax(s, dim=-1) @ vj)
    return attn.o(torch.cat(heads, dim=-1))


def test_attention_matches_torch_multihead_attention():
    torch.manual_seed(0)
    ours = MultiHeadAttention(16, 4).to(DT)
    theirs = nn.MultiheadAttention(16, 4, batch_first=True).to(DT)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.q.weight, ours.k.weight, ours.v.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q.bias, ours.k.bias, ours.v.bias]))
        theirs.out_proj.weight.copy_(ours.o.weight)
        theirs.out_proj.bias.copy_(ours.o.bias)
    x = torch.randn(3, 5, 16, dtype=DT)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1, 3:] = False
    y = ours(x, keep)
    y_ref = theirs(x, x, x, key_padding_mask=~keep, need_weights=False)[0]
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)


def test_grouped_query_attention_matches_per_head_loop():
    torch.manual_seed(1)
    attn = MultiHeadAttention(16, num_heads=4, num_kv_heads=2, head_dim=3).to(DT)
    assert attn.k.weight.shape == (6, 16) and attn.o.weight.shape == (16, 12)
    x = torch.randn(2, 6, 16, dtype=DT)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 4:] = False
    torch.testing.assert_close(
        attn(x, keep), reference_attention(attn, x, keep), rtol=1e-12, atol=1e-12
    )


def test_attention_head_count_errors():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="multiple"):
        MultiHeadAttention(12, 4, num_kv_heads=3)


def test_block_is_pre_norm_residual():
    torch.manual_seed(2)
    blk = Block(8, 2, 16).to(DT)
    x = torch.randn(2, 4, 8, dtype=DT)
    h = x + reference_attention(blk.attn, blk.ln1(x))
    expected = h + blk.mlp.fc2(torch.nn.functional.gelu(blk.mlp.fc1(blk.ln2(h))))
    torch.testing.assert_close(blk(x), expected, rtol=1e-12, atol=1e-12)


def test_vit_shapes_and_patch_error():
    vit = VisionTransformer(image_size=8, patch_size=4, num_classes=5, dim=16, depth=2, num_heads=2)
    assert vit.pos_embed.shape == (1, 1 + 4, 16)
    assert vit(torch.randn(3, 3, 8, 8)).shape == (3, 5)
    with pytest.raises(ValueError, match="does not divide"):
        VisionTransformer(image_size=10, patch_size=4)


def test_vit_uses_the_cls_token():
    torch.manual_seed(3)
    vit = VisionTransformer(image_size=8, patch_size=4, num_classes=2, dim=8, depth=1, num_heads=2)
    x = torch.randn(2, 3, 8, 8)
    y = vit(x)
    with torch.no_grad():  # not a constant shift: the pre-norm LayerNorm would remove that
        vit.cls_token.add_(torch.randn_like(vit.cls_token))
    assert not torch.allclose(vit(x), y)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_text_padding_is_ignored(pooling):
    torch.manual_seed(4)
    net = TextTransformer(20, 3, max_len=12, dim=16, depth=2, num_heads=4, pooling=pooling).to(DT)
    ids = torch.randint(0, 20, (2, 5))
    padded = torch.cat([ids, torch.randint(0, 20, (2, 3))], dim=1)
    mask = torch.cat([torch.ones(2, 5), torch.zeros(2, 3)], dim=1)
    torch.testing.assert_close(net(padded, mask), net(ids), rtol=1e-12, atol=1e-12)
    # without the mask the padding does matter: the check above can fail
    assert not torch.allclose(net(padded), net(ids))


def test_text_pooling_error():
    with pytest.raises(ValueError, match="pooling"):
        TextTransformer(10, 2, pooling="max")


def test_double_backward_matches_finite_differences():
    """Hessian-vector products through the attention (needed by the geodesic ascent)."""
    torch.manual_seed(5)
    net = TextTransformer(20, 3, max_len=8, dim=8, depth=1, num_heads=2, num_kv_heads=1).to(DT)
    ids = torch.randint(0, 20, (4, 6))
    target = torch.tensor([0, 1, 2, 1])
    params = [p for p in net.parameters()]
    vec = [torch.randn_like(p) for p in params]

    def grad(create_graph=False):
        loss = nn.functional.cross_entropy(net(ids), target)
        return torch.autograd.grad(loss, params, create_graph=create_graph)

    g = grad(create_graph=True)
    hvp = torch.autograd.grad(sum((gi * vi).sum() for gi, vi in zip(g, vec, strict=True)), params)
    eps = 1e-5
    with torch.no_grad():
        for p, v in zip(params, vec, strict=True):
            p.add_(eps * v)
    g_plus = grad()
    with torch.no_grad():
        for p, v in zip(params, vec, strict=True):
            p.sub_(2 * eps * v)
    g_minus = grad()
    fd = [(a - b) / (2 * eps) for a, b in zip(g_plus, g_minus, strict=True)]
    # central differences: error O(eps²·‖∇³L‖) ≈ 1e-10, far below the HVP's size (~1e-1)
    for a, b in zip(hvp, fd, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_text_too_long_raises():
    net = TextTransformer(10, 2, max_len=4, dim=8, depth=1, num_heads=2)
    with pytest.raises(ValueError, match="max_len=4"):
        net(torch.zeros(1, 5, dtype=torch.long))
