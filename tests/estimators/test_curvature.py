"""gs.curvature against dense references, invariance and sharpness at a minimum (SPEC §9)."""

import json
import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import geosharp as gs
from geosharp.estimators.perturbation import Perturbation
from geosharp.models import DiagonalNet, VisionTransformer
from geosharp.symmetry import declare_block, find_symmetries
from geosharp.symmetry.verify import call_model

DT = torch.float64
MSE = nn.functional.mse_loss


# -- small models ---------------------------------------------------------------------------------
class LowRank(nn.Module):
    """``y = x GHᵀ + c`` with ``G = a.weightᵀ`` (n×h), ``H = b.weight`` (m×h): one GL(h) block."""

    def __init__(self, n: int = 4, m: int = 3, h: int = 2) -> None:
        super().__init__()
        self.a = nn.Linear(n, h, bias=False)
        self.b = nn.Linear(h, m)
        self.h = h

    def forward(self, x):
        return self.b(self.a(x))

    def space(self):
        spec = declare_block(self, name="ab", g=[("a.weight", 0)], h=[("b.weight", 1)], head_dim=2)
        return find_symmetries(self, extra_blocks=[spec])


class Attention(nn.Module):
    """One ``nn.MultiheadAttention`` (SDPA kernel: ``need_weights=False``) and a linear readout."""

    def __init__(self, d: int = 4, heads: int = 2, out: int = 2) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, out)

    def forward(self, x):
        return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))


def _lowrank():
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = LowRank().to(DT)
    x, y = torch.randn(20, 4, generator=g, dtype=DT), torch.randn(20, 3, generator=g, dtype=DT)
    return model, [(x, y)], model.space()


def _diagonal():
    g = torch.Generator().manual_seed(2)
    model = DiagonalNet(5).to(DT)
    with torch.no_grad():
        model.u.copy_(torch.randn(5, generator=g, dtype=DT))
        model.v.copy_(torch.randn(5, generator=g, dtype=DT))
    x, y = torch.randn(20, 5, generator=g, dtype=DT), torch.randn(20, generator=g, dtype=DT)
    return model, [(x, y)], find_symmetries(model)


def _attention(dtype=DT):
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    model = Attention().to(DT)
    with torch.no_grad():  # away from the init (zero biases would be frozen adaptive coordinates)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=DT))
    x, y = torch.randn(6, 5, 4, generator=g, dtype=DT), torch.randn(6, 2, generator=g, dtype=DT)
    model = model.to(dtype)
    return model, [(x[:3].to(dtype), y[:3].to(dtype)), (x[3:].to(dtype), y[3:].to(dtype))]


def _attention_case():
    model, batches = _attention()
    return model, batches[:1], find_symmetries(model)


CASES = {"lowrank": _lowrank, "diagonal": _diagonal, "attention": _attention_case}
MEASURES = [("geodesic", "inv"), ("geodesic", "mix"), ("adaptive", "inv"), ("euclidean", "inv")]


# -- the dense reference --------------------------------------------------------------------------
def dense_spectrum(model, batch, space, measure, metric, christoffel=True):
    """Eigenvalues of the Riemannian Hessian on the horizontal space, built densely.

    ``B = ∇²ℓ − ½ ∂²_ξ[∇ℓᵀΓ(ξ, ξ)]`` in the pieces' coordinates (``torch.func.hessian`` of the
    loss in θ; the Christoffel form of every order-2 piece differentiated twice), restricted to
    a metric-orthonormal basis of the range of the horizontal projection.
    """
    theta0 = space.flatten(dict(model.named_parameters())).detach()
    pert = Perturbation(space, theta0, measure=measure, metric=metric, order=2)
    x, y = batch

    def loss(theta):
        return MSE(call_model(model, space.unflatten(theta), x), y)

    with sdpa_kernel(SDPBackend.MATH):
        hess, grad = torch.func.hessian(loss)(theta0), torch.func.grad(loss)(theta0)
    n = theta0.numel()
    whole = (torch.arange(n),)
    order = torch.cat([i.reshape(-1) for p in pert.pieces for i in (p.index or whole)])
    A, e = hess[order][:, order], grad[order]
    template = pert.zeros()
    sizes = [t.numel() for x_ in template for t in x_]
    shapes = [t.shape for x_ in template for t in x_]

    def unflat(v):
        it = iter(c.view(s) for c, s in zip(torch.split(v, sizes), shapes, strict=True))
        return [tuple(next(it) for _ in x_) for x_ in template]

    def gamma_term(v):  # ∇ℓᵀ Γ(v, v) over the pieces followed along order-2 geodesics
        total = v.sum() * 0
        for p, xp, ep in zip(pert.pieces, unflat(v), unflat(e), strict=True):
            if p.order == 2:
                total = total + sum(
                    (a * b).sum() for a, b in zip(ep, p.geometry.christoffel(xp), strict=True)
                )
        return total

    def half_norm_sq(v):
        return 0.5 * sum(
            p.norm_geometry.norm_sq(a).sum() for p, a in zip(pert.pieces, unflat(v), strict=True)
        )

    zero = torch.zeros(n, dtype=DT)
    B = A - 0.5 * torch.autograd.functional.hessian(gamma_term, zero) if christoffel else A
    g = torch.autograd.functional.hessian(half_norm_sq, zero)
    P = torch.stack(
        [torch.cat([t.reshape(-1) for x_ in pert.project(unflat(c)) for t in x_]) for c in
         torch.eye(n, dtype=DT)], 1)  # fmt: skip
    U, S, _ = torch.linalg.svd(P)
    U = U[:, : int((S > 1e-9 * S[0]).sum())]  # a basis of the horizontal space
    lam, V = torch.linalg.eigh(U.mT @ g @ U)
    W = U @ V @ torch.diag(lam.rsqrt()) @ V.mT  # metric-orthonormal
    M = W.mT @ B @ W
    return torch.linalg.eigvalsh(0.5 * (M + M.mT))


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("measure,metric", MEASURES, ids=["-".join(m) for m in MEASURES])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_reference(case, measure, metric):
    model, batches, space = CASES[case]()
    ev = dense_spectrum(model, batches[0], space, measure, metric)
    scale = float(ev.abs().max())
    kw = dict(measure=measure, metric=metric, space=space)
    res = gs.curvature(
        model,
        MSE,
        batches,
        quantities=("lambda_max", "lambda_min", "trace"),
        iters=200,
        tol=1e-12,
        top_k=3,
        trace_method="exact",
        **kw,
    )
    print(f"{case} {measure}-{metric}: dim H = {len(ev)}, lambda_max {ev[-1]:.6g} "
          f"(err {res.lambda_max - ev[-1]:.1e}), trace {ev.sum():.6g} "
          f"(err {res.trace - ev.sum():.1e}), Lanczos {res.lanczos_iters}")  # fmt: skip
    assert abs(res.lambda_max - float(ev[-1])) <= 1e-8 * scale
    assert abs(res.lambda_min - float(ev[0])) <= 1e-8 * scale
    assert res.eigenvalues[0] == pytest.approx(ev.flip(0)[:3].tolist(), abs=1e-8 * scale)
    assert abs(res.trace - float(ev.sum())) <= 1e-8 * scale * len(ev)
    assert res.trace_stderr == 0.0
    if measure == "geodesic":  # the Christoffel term matters here (the loss is not stationary)
        plain = dense_spectrum(model, batches[0], space, measure, metric, christoffel=False)
        assert abs(float(plain[-1] - ev[-1])) > 1e-3 * scale
    hutch = gs.curvature(model, MSE, batches, quantities="trace", probes=200, seed=1, **kw)
    assert abs(hutch.trace - float(ev.sum())) <= 3 * hutch.trace_stderr
    hpp = gs.curvature(
        model, MSE, batches, quantities="trace", probes=90, trace_method="hutch++", **kw
    )
    assert abs(hpp.trace - float(ev.sum())) <= 3 * hpp.trace_stderr + 1e-8 * scale * len(ev)


def test_euclidean_lambda_max_is_the_dense_hessians():
    """On a ViT with LayerNorm, against the dense Hessian by double backward and by differences.

    (``torch.func.hessian`` and ``jacrev(jacrev(·))`` are wrong here in torch 2.13: the vmapped
    second derivative of ``layer_norm`` in its input and weight is off by O(1) and not even
    symmetric, while per-vector ``jvp``/``vjp`` of ``torch.func.grad``, the autograd loop below
    and finite differences agree to 1e-9.)
    """
    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=4, patch_size=2, in_channels=1, num_classes=2, dim=4, depth=1, num_heads=2
    ).to(DT)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 4, 4, generator=g, dtype=DT), torch.randint(0, 2, (8,), generator=g)
    space = find_symmetries(model)
    theta0 = space.flatten(dict(model.named_parameters())).detach()

    def loss(theta):
        return nn.functional.cross_entropy(call_model(model, space.unflatten(theta), x), y)

    dense = torch.autograd.functional.hessian(loss, theta0)
    grad, h = torch.func.grad(loss), 1e-5
    basis = torch.eye(theta0.numel(), dtype=DT)
    diff = torch.stack([(grad(theta0 + h * e) - grad(theta0 - h * e)) / (2 * h) for e in basis])
    assert (diff - dense).abs().max() < 1e-7 * dense.abs().max()
    ev = torch.linalg.eigvalsh(dense)
    res = gs.curvature(
        model,
        nn.functional.cross_entropy,
        [(x, y)],
        measure="euclidean",
        quantities=("lambda_max", "lambda_min", "trace"),
        iters=300,
        tol=1e-11,
        trace_method="exact",
        space=space,
    )
    print(f"ViT ({theta0.numel()} params): lambda_max {ev[-1]:.8g}, Lanczos "
          f"{res.lambda_max:.8g} in {res.lanczos_iters} iterations")  # fmt: skip
    scale = float(ev.abs().max())
    assert abs(res.lambda_max - float(ev[-1])) <= 1e-8 * scale
    assert abs(res.lambda_min - float(ev[0])) <= 1e-8 * scale
    assert abs(res.trace - float(ev.sum())) <= 1e-8 * scale * len(ev)


def test_geodesic_curvature_is_invariant_and_the_others_are_not():
    model, batches = _attention()
    space = find_symmetries(model)
    kw = dict(quantities=("lambda_max", "trace"), iters=100, tol=1e-10, trace_method="exact")
    for metric in ("inv", "mix"):
        ref = gs.curvature(model, MSE, batches, metric=metric, space=space, **kw)
        worst = 0.0
        for a in (1e-2, 1e-1, 1.0, 1e1, 1e2):
            rep = gs.reparametrize(model, generator=torch.Generator().manual_seed(7), scale=a)
            res = gs.curvature(rep, MSE, batches, metric=metric, **kw)
            for q in ("lambda_max", "trace"):
                change = abs(res.values[q] / ref.values[q] - 1)
                worst = max(worst, change)
                assert change < 1e-8, (metric, a, q, change)
        print(f"geodesic-{metric}: lambda_max {ref.lambda_max:.6g}, trace {ref.trace:.6g}, "
              f"largest relative change {worst:.1e}")  # fmt: skip
    kw = dict(quantities="lambda_max", iters=100, tol=1e-8)
    for measure, factor in (("euclidean", 10.0), ("adaptive", 0.05)):
        ref = gs.curvature(model, MSE, batches, measure=measure, **kw).lambda_max
        changes = []
        for a in (1e-2, 1e-1, 1.0, 1e1, 1e2):
            rep = gs.reparametrize(model, generator=torch.Generator().manual_seed(7), scale=a)
            changes.append(gs.curvature(rep, MSE, batches, measure=measure, **kw).lambda_max / ref)
        print(f"{measure}: lambda_max / unreparametrized = {[f'{c:.3g}' for c in changes]}")
        assert max(abs(c - 1) for c in changes) > factor, (measure, changes)


@pytest.fixture(scope="module")
def lowrank_minimum():
    """The low-rank model trained by L-BFGS to a minimum (gradient ~1e-9) of a noisy target."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = LowRank().to(DT)
    x = torch.randn(32, 4, generator=g, dtype=DT)
    y = x @ torch.randn(4, 3, generator=g, dtype=DT) + 0.3 * torch.randn(
        32, 3, generator=g, dtype=DT
    )
    opt = torch.optim.LBFGS(
        model.parameters(),
        lr=1,
        max_iter=500,
        tolerance_grad=1e-14,
        tolerance_change=0,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = MSE(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    model.zero_grad(set_to_none=True)
    return model, [(x, y)], model.space()


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_sharpness_at_a_minimum_is_half_rho_squared_curvature(lowrank_minimum, metric):
    """SPEC §9: worst → ½ρ²λ_max, average → ½ρ²·trace as ρ → 0, at a critical point."""
    model, batches, space = lowrank_minimum
    kw = dict(metric=metric, space=space)
    exact = gs.curvature(
        model, MSE, batches, iters=100, tol=1e-12, trace_method="exact", **kw
    )  # fmt: skip
    hutch = gs.curvature(model, MSE, batches, quantities="trace", probes=400, seed=3, **kw)
    assert exact.grad_norms[0] < 1e-7
    assert abs(hutch.trace - exact.trace) <= 3 * hutch.trace_stderr
    worst, average = {}, {}
    for rho in (1e-1, 1e-2, 1e-3):
        w = gs.sharpness(model, MSE, batches, kind="worst", rho=rho, steps=50, **kw)
        a = gs.sharpness(model, MSE, batches, kind="average", rho=rho, samples=400, seed=3, **kw)
        worst[rho] = w.value / (0.5 * rho**2) / exact.lambda_max - 1
        # Same seed: the noise samples are the probes times ρ, so the two agree to O(ρ).
        average[rho] = a.value / (0.5 * rho**2) / hutch.trace - 1
    print(f"{metric}: lambda_max {exact.lambda_max:.6g}, trace {exact.trace:.6g} "
          f"(Hutchinson {hutch.trace:.6g} ± {hutch.trace_stderr:.2g}); relative error of "
          f"worst/(½ρ²): {worst}; of average/(½ρ²) vs Hutchinson: {average}")  # fmt: skip
    assert abs(worst[1e-3]) < 2e-3 and abs(worst[1e-3]) < 0.05 * abs(worst[1e-1])
    assert abs(average[1e-3]) < 5e-4 and abs(average[1e-3]) < 0.05 * abs(average[1e-1])


def test_result_counts_arguments_and_model_untouched():
    model, batches = _attention()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = gs.curvature(model, MSE, batches, quantities=("lambda_max", "trace"), iters=5, probes=4)
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert res.n_hvp == sum(res.lanczos_iters) + 4 * len(batches)
    assert res.n_forward == res.n_backward == len(batches)
    assert len(res.per_batch["trace"]) == len(res.per_batch_trace_stderr) == len(batches)
    assert res.trace == pytest.approx(sum(res.per_batch["trace"]) / 2)
    se = math.sqrt(sum(s * s for s in res.per_batch_trace_stderr)) / 2
    assert res.trace_stderr == pytest.approx(se)
    assert res.measure == "geodesic-inv curvature" and "lambda_max" in str(res)
    assert res.settings["key_bias"] == "quotient" and res.settings["n_key_biases_fixed"] == 1
    json.dumps(res.to_dict())
    # The same seed gives the same numbers; the probes do not depend on the Lanczos run.
    again = gs.curvature(model, MSE, batches, quantities="trace", probes=4)
    assert again.per_batch["trace"] == res.per_batch["trace"]
    for bad in (
        dict(measure="flat"),
        dict(metric="nope"),
        dict(quantities=("lambda_max", "spectrum")),
        dict(quantities=()),
        dict(trace_method="sketch"),
        dict(trace_method="hutch++", probes=2),
        dict(iters=0),
        dict(top_k=0),
        dict(tol=0.0),
        dict(eps=-1.0),
    ):
        with pytest.raises(ValueError):
            gs.curvature(model, MSE, batches, **bad)
    with pytest.raises(ValueError, match="empty"):
        gs.curvature(model, MSE, [])
    with pytest.raises(TypeError):
        gs.curvature(lambda x: x, MSE, batches)


def test_float32_model_matches_float64():
    model, batches = _attention(DT)
    ref = gs.curvature(model, MSE, batches, iters=100, tol=1e-10, trace_method="exact")
    model, batches = _attention(torch.float32)
    res = gs.curvature(model, MSE, batches, iters=100, tol=1e-6, trace_method="exact")
    assert res.settings["dtype"] == "torch.float32"
    assert res.lambda_max == pytest.approx(ref.lambda_max, rel=1e-4)
    assert res.trace == pytest.approx(ref.trace, rel=1e-4)
