"""User-facing checkers: they pass on correct blocks and fail on a wrong one."""

import torch

from geosharp.estimators.checks import check_geometry, check_invariance
from geosharp.models import VisionTransformer
from geosharp.symmetry import declare_block, find_symmetries

DT = torch.float64


def small_vit():
    torch.manual_seed(0)
    return VisionTransformer(
        image_size=8, patch_size=4, in_channels=1, num_classes=3, dim=8, depth=1, num_heads=2
    ).to(DT)


def test_invariance_check_passes_on_found_blocks():
    model = small_vit()
    report = check_invariance(model, torch.randn(3, 1, 8, 8, dtype=DT))
    # QK, b_k and VO of one layer: 2 + 2 + 2 heads, as space.summary() counts them
    assert report.passed and report.n_blocks == 3 and report.n_factors == 6
    assert max(report.rel_changes) < 1e-12  # float64 roundoff
    assert min(report.random_changes) > 1e-2  # a non-symmetric move of the same size
    assert "PASSED (3 symmetry blocks, 6 group factors" in str(report)


def test_invariance_check_without_blocks_has_nothing_to_check():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    report = check_invariance(mlp.to(DT), torch.randn(3, 4, dtype=DT))
    assert report.nothing_to_check and not report.passed and report.rel_changes == []
    assert "nothing to check" in str(report) and "PASSED" not in str(report)


class Float32Scores(torch.nn.Module):
    """Attention whose scores are computed in float32 inside a float64 model (as GPT-Neo)."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True, bias=False)

    def forward(self, x):
        a = self.attn
        q, k, v = (x @ w.T for w in a.in_proj_weight.chunk(3))
        split = lambda t: t.view(*t.shape[:2], 2, 4).transpose(1, 2)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        s = (q.float() @ k.float().mT).double() / 2.0
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
        return a.out_proj(y)


def test_invariance_check_knows_a_float32_internal_model_from_a_false_claim():
    torch.manual_seed(0)
    model = Float32Scores().to(DT)
    x = torch.randn(2, 5, 8, dtype=DT)
    report = check_invariance(model, x)
    assert report.passed and max(report.rel_changes) > report.tol  # float32 roundoff ...
    assert "below its parameters' precision" in report.notes[0]  # ... recognised as such
    wrong = declare_block(
        model,
        name="wrong[QV]",
        g=[("attn.in_proj_weight", 0, 0, 4)],
        h=[("attn.in_proj_weight", 0, 16, 20)],
        head_dim=4,
    )
    bad = check_invariance(
        model, x, space=find_symmetries(model, adapters=[], extra_blocks=[wrong])
    )
    assert not bad.passed


def test_invariance_check_never_copies_the_model_and_matches_reparametrize(monkeypatch):
    import copy

    from geosharp.symmetry import reparametrize

    model = small_vit()
    x = torch.randn(3, 1, 8, 8, dtype=DT)
    ref = model(x)
    scales = (3.0, 0.1)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    twins = [reparametrize(model, g, a) for g, a in zip(gens, scales, strict=True)]
    expected = [float((t(x) - ref).norm() / ref.norm()) for t in twins]

    def no_copy(*args, **kwargs):
        raise AssertionError("check_invariance must not deep-copy the model")

    monkeypatch.setattr(copy, "deepcopy", no_copy)
    report = check_invariance(model, x, scales=scales)
    assert report.rel_changes == expected  # the same group elements, the same arithmetic
    assert all(not p.grad_fn for p in model.parameters())


def test_invariance_check_catches_a_wrong_block():
    """A block pairing Q with V is not a symmetry: the check must fail."""
    model = small_vit()
    wrong = declare_block(
        model,
        name="wrong[QV]",
        g=[("blocks.0.attn.q.weight", 0, 0, 4)],
        h=[("blocks.0.attn.v.weight", 0, 0, 4)],
        head_dim=4,
    )
    bad_space = find_symmetries(model, adapters=[], extra_blocks=[wrong])
    report = check_invariance(model, torch.randn(3, 1, 8, 8, dtype=DT), space=bad_space)
    assert not report.passed and min(report.rel_changes) > 1e-3


def test_geometry_check_on_model():
    model = small_vit()
    for metric in ("inv", "mix"):
        report = check_geometry(model, metric=metric)
        assert report.passed and report.idempotence < 1e-12
