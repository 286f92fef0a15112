"""How many perturbation-sized buffers Auto-PGD holds while the model runs (issue 11).

Peak memory is measured in ``benchmarks/regimes.py``; here the same accounting is checked
deterministically: at every loss evaluation the Python-visible tensors other than the model's
own parameters are counted in units of the perturbation (one tensor per weight matrix per
buffer). What may be alive then (``benchmarks/README.md``): the new iterate ξ_{k+1} and ξ_k
(momentum), the best iterate when it is older, and its direction: four buffers when the
direction is kept always (the default where four fit with what the perturbation holds); with
``low_memory=True`` the direction is kept only while the best iterate is one of those two (or
the zero start, which is never made): three. The base point is the model's tensors
themselves, so no copy of them may appear, and no flat θ or 1/w² buffer either.
"""

import gc
import importlib

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.estimators.harness import Objective
from geosharp.estimators.perturbation import Perturbation

N = 96  # weight matrices N × N: the only tensors of N² elements or more


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N, N), nn.Tanh(), nn.Linear(N, N), nn.Tanh(), nn.Linear(N, 3))


def _units(model):
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.numel() >= N * N:
            ptr = o.untyped_storage().data_ptr()
            if ptr not in own:
                seen.add(ptr)
    return len(seen) / 2  # two N × N weights per perturbation-sized buffer


@pytest.mark.parametrize(("low_memory", "limit"), [(False, 4), (True, 3)])
@pytest.mark.parametrize("measure", ["adaptive", "euclidean"])
def test_buffers_alive_at_each_loss_evaluation(monkeypatch, measure, low_memory, limit):
    model = _model()
    x = torch.randn(32, N, generator=torch.Generator().manual_seed(1))
    y = torch.arange(32) % 3
    counts = []
    orig = Objective.__call__

    def call(self, xi, need_grad, check=True):
        counts.append(_units(model))  # before the forward: what the ascent holds
        return orig(self, xi, need_grad, check)

    monkeypatch.setattr(Objective, "__call__", call)
    res = _ascent(model, x, y, measure, low_memory)
    assert res.value > 0
    assert max(counts) <= limit, counts


def _ascent(model, x, y, measure, low_memory):
    return gs.sharpness(
        model,
        nn.functional.cross_entropy,
        [(x, y)],
        measure=measure,
        rho=0.5,
        steps=12,
        cache=False,
        low_memory=low_memory,
    )


@pytest.mark.parametrize(("low_memory", "limit"), [(False, 4), (True, 3)])
@pytest.mark.parametrize("measure", ["adaptive", "euclidean"])
def test_no_copy_of_the_weights_during_the_forward(measure, low_memory, limit):
    """At the end of every forward (the backward's start) the perturbed weights θ′ live in ξ's
    own tensors: the buffers alive then are the iterates alone, with no θ′ = w + ξ beside them."""
    model = _model()
    x = torch.randn(32, N, generator=torch.Generator().manual_seed(1))
    y = torch.arange(32) % 3
    counts = []
    hook = model[-1].register_forward_hook(lambda *_: counts.append(_units(model)))
    try:
        res = _ascent(model, x, y, measure, low_memory)
    finally:
        hook.remove()
    assert res.value > 0 and len(counts) == res.n_forward
    assert max(counts) <= limit, counts


def test_the_iterate_is_the_displacement_the_forward_applied():
    """``Perturbation.applied``: θ′ in ξ's tensors for one loss, then ξ ← θ′ − w (ξ rounded to
    the point reached: within half an ulp of θ′, and exactly ξ where w + ξ is representable)."""
    model = _model()
    space = gs.find_symmetries(model, adapters=[])
    base = {n: p.detach() for n, p in model.named_parameters()}
    pert = Perturbation(space, base, measure="adaptive")
    g = torch.Generator().manual_seed(3)
    xi = [
        tuple(1e-3 * torch.randn(w.shape, generator=g) * w for w in pert.pieces[0].geometry.point)
    ]
    before = [t.clone() for t in xi[0]]
    with pert.applied(xi) as moved:
        assert moved is xi
        theta = [t.clone() for t in xi[0]]
        params = pert.endpoint_params(moved, applied=True)
        assert all(params[n] is not base[n] for n in base)
    for t, b, th, w in zip(xi[0], before, theta, pert.pieces[0].geometry.point, strict=True):
        assert torch.equal(th, w + b)  # the forward saw exactly w + ξ
        assert torch.equal(t, th - w)  # and ξ is now the displacement it applied
        ulp = torch.finfo(th.dtype).eps * th.abs()
        assert float(((t - b).abs() - 0.5 * ulp).max()) <= 0
    zero = pert.zeros()
    with pert.applied(zero):
        pass
    assert all(torch.equal(t, torch.zeros_like(t)) for t in zero[0])


def _adaptive_problem():
    """The MLP's adaptive perturbation and its loss on a fixed batch, for ``autopgd`` itself."""
    model = _model()
    x = torch.randn(32, N, generator=torch.Generator().manual_seed(1))
    y = torch.arange(32) % 3
    space = gs.find_symmetries(model, adapters=[])
    base = {n: p.detach() for n, p in model.named_parameters()}
    pert = Perturbation(space, base, measure="adaptive")

    def evaluate(params):
        return nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    return pert, evaluate


def test_the_best_direction_kept_or_not_gives_the_same_ascent():
    """Auto-PGD keeping the best iterate's direction always, while free (the default) or never:
    the same iterates bit for bit, the default recomputing no more often than never keeping."""
    from geosharp.estimators.apgd import autopgd

    pert, evaluate = _adaptive_problem()

    passes, out = {}, {}
    for keep in (True, None, False):
        n = [0]

        def loss(xi, need_grad, n=n):
            n[0] += 1
            return pert.loss_and_grad(evaluate, xi, need_grad)

        out[keep] = autopgd(pert, loss, 0.5, 20, None, keep_best_direction=keep)
        passes[keep] = n[0]
    assert out[True].trace == out[None].trace == out[False].trace
    assert out[True].restarts == out[None].restarts and out[True].restarts
    assert passes[True] <= passes[None] <= passes[False]
    for a, b in zip(out[True].best_xi[0], out[None].best_xi[0], strict=True):
        assert torch.equal(a, b)


def test_the_zero_start_is_the_best_iterate_without_a_buffer():
    """An ascent whose every step lowers the loss returns ξ = 0, made only at the end."""
    from geosharp.estimators.apgd import autopgd

    model = _model()
    space = gs.find_symmetries(model, adapters=[])
    pert = Perturbation(space, {n: p.detach() for n, p in model.named_parameters()})
    g = torch.Generator().manual_seed(4)

    def loss(xi, need_grad):  # the loss falls in every direction (1 − ‖ξ‖²), gradients random
        value = 1.0 - float(pert.norm_sq(xi))
        if not need_grad:
            return value, None
        return value, [tuple(torch.randn(t.shape, generator=g) for t in x) for x in xi]

    res = autopgd(pert, loss, 0.1, 6, None)
    assert res.best_loss == 1.0 and res.trace[0] == 1.0 and max(res.trace[1:]) < 1.0
    assert all(torch.equal(t, torch.zeros_like(t)) for x in res.best_xi for t in x)


def test_low_memory_gives_the_same_ascent():
    model = _model()
    x = torch.randn(32, N, generator=torch.Generator().manual_seed(1))
    y = torch.arange(32) % 3
    kw = dict(measure="adaptive", rho=0.5, steps=20, cache=False)
    a = gs.sharpness(model, nn.functional.cross_entropy, [(x, y)], **kw)
    b = gs.sharpness(model, nn.functional.cross_entropy, [(x, y)], low_memory=True, **kw)
    assert a.traces == b.traces and a.value == b.value
    assert b.n_backward >= a.n_backward  # restarts recompute the best iterate's direction
    assert b.settings["low_memory"] and not a.settings["low_memory"]


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_low_memory_block_geometry_in_the_model_dtype(metric):
    """GL tangents in float32 under low_memory: the value moves by float32 roundoff only."""
    model = _encoder()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 10, 32, generator=g), torch.randn(8, 10, 32, generator=g)
    kw = dict(rho=0.05, steps=10, metric=metric, cache=False)
    a = gs.sharpness(model, nn.functional.mse_loss, [(x, y)], **kw)
    b = gs.sharpness(model, nn.functional.mse_loss, [(x, y)], low_memory=True, **kw)
    # 1.2e-5 and 1.1e-5 measured: the projection's float32 roundoff, amplified by cond(M)
    assert abs(a.value - b.value) <= 1e-4 * a.value
    space = gs.find_symmetries(model)
    base = dict(model.named_parameters())
    fast = Perturbation(space, base, metric=metric)
    lean = Perturbation(space, base, metric=metric, work_dtype=torch.float32)
    # tangents are float32 either way; low_memory also runs the products in float32
    kinds = [
        (p.geometry.execution.work_dtype, q.geometry.execution.work_dtype)
        for p, q in zip(fast.pieces, lean.pieces, strict=True)
        if hasattr(p.geometry, "execution")
    ]
    assert (torch.float64, torch.float32) in kinds
    assert all(lo == torch.float32 for _, lo in kinds)
    assert all(p.geometry.tangent_dtype == torch.float32 for p in fast.pieces)


def test_low_memory_is_exact_in_float64():
    model = _encoder().double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 10, 32, generator=g, dtype=torch.float64)
    y = torch.randn(8, 10, 32, generator=g, dtype=torch.float64)
    kw = dict(rho=0.05, steps=10, cache=False)
    a = gs.sharpness(model, nn.functional.mse_loss, [(x, y)], **kw)
    b = gs.sharpness(model, nn.functional.mse_loss, [(x, y)], low_memory=True, **kw)
    assert a.value == b.value and a.traces == b.traces


def test_measure_cli_low_memory_flag():
    """``geosharp measure --low-memory`` reaches gs.sharpness (settings record it)."""
    import argparse

    from geosharp.measuring.cli_parser import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    parser = add_parser(sub)
    assert "--low-memory" in parser.format_help()
    assert parser.parse_args(["model.pt", "data.csv", "--low-memory"]).low_memory is True
    assert parser.parse_args(["model.pt", "data.csv"]).low_memory is False
    model = _model()
    x = torch.randn(16, N, generator=torch.Generator().manual_seed(1))
    y = torch.arange(16) % 3
    rep = gs.measure(
        model, [(x, y)], measures=["adaptive-l2"], rhos=[0.1], steps=3, low_memory=True
    )
    assert rep.settings["low_memory"] is True and rep.rows[0].value is not None


def test_a_restart_from_an_older_best_iterate_skips_the_backward_it_would_discard():
    """The checkpoint's decision depends on the loss alone, so it is taken after the forward:
    the same ascent as one that runs every backward, with one backward fewer per restart from
    an older best iterate (and the best direction kept or recomputed alike)."""
    from geosharp.estimators.apgd import autopgd

    pert, evaluate = _adaptive_problem()

    def run(keep, always):
        n = {"forward": 0, "backward": 0, "at": []}

        def loss(xi, need_grad):
            n["forward"] += 1
            value, grad = pert.loss_and_grad(evaluate, xi, bool(need_grad) if always else need_grad)
            n["backward"] += grad is not None
            n["at"].append(float(value))
            return float(value), grad

        return autopgd(pert, loss, 0.5, 20, None, keep_best_direction=keep), n

    for keep in (True, None):
        (ref, n_ref), (res, n) = run(keep, True), run(keep, False)
        assert res.trace == ref.trace and res.restarts == ref.restarts
        # (the last iteration runs no backward either way)
        older = [i for i in ref.restarts if i < 19 and ref.trace[i + 1] <= max(ref.trace[: i + 1])]
        assert older  # the test ascent has restarts from older best iterates
        assert n["forward"] == n_ref["forward"]
        assert n["backward"] == n_ref["backward"] - len(older)
        for a, b in zip(res.best_xi[0], ref.best_xi[0], strict=True):
            assert torch.equal(a, b)


def _bytes_alive(model, inputs):
    """Bytes of the tensors alive other than the model's and the data (unique storages)."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    own |= {t.untyped_storage().data_ptr() for t in inputs}
    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type != "meta":
            st = o.untyped_storage()
            if st.data_ptr() not in own and st.data_ptr() not in seen and st.nbytes():
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


@pytest.mark.parametrize("measure", ["adaptive", "geodesic"])
def test_the_ascent_holds_what_buffer_bytes_accounts_for(monkeypatch, measure):
    """At every loss evaluation the ascent holds at most its iterates (four ξ when the best
    direction is kept always, three when only while free) and what
    ``Perturbation.buffer_bytes`` says the perturbation holds beside them; the default keeps
    the direction only when that fits in four parameter-sized buffers."""
    from geosharp.estimators.apgd import BUFFER_BUDGET, best_direction_rule

    model = _encoder()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 10, 32, generator=g), torch.randn(8, 10, 32, generator=g)
    seen = []
    orig = Objective.__call__

    def call(self, xi, need_grad, check=True):
        seen.append((self.pert, _bytes_alive(model, (x, y))))
        return orig(self, xi, need_grad, check)

    monkeypatch.setattr(Objective, "__call__", call)
    gc.collect()
    before = _bytes_alive(model, (x, y))  # whatever earlier tests left alive
    res = gs.sharpness(
        model, nn.functional.mse_loss, [(x, y)], measure=measure, rho=0.05, steps=20, cache=False
    )
    assert res.value > 0
    pert = seen[-1][0]
    xi, held = pert.buffer_bytes()
    keep = best_direction_rule(pert)
    assert keep is (True if 4 * xi + held <= (BUFFER_BUDGET + 0.01) * pert.param_bytes else None)
    gathered = sum(
        n * pert._itemsize[j]
        for j, n in zip(pert._assembly.gathered, pert._assembly.gathered_sizes, strict=True)
    )
    bound = (4 if keep else 3) * xi + held - gathered  # θ′ is gathered during the forward
    peak = max(b for _, b in seen) - before
    assert peak <= bound + 4096, (peak, bound)
    if measure == "adaptive":
        assert keep is True and held < 0.01 * pert.param_bytes
    else:  # 4 heads of 8 in width 32: the factorizations outweigh the blocks' weights
        assert keep is None and held > 0.5 * pert.param_bytes


@pytest.mark.parametrize("measure", ["adaptive", "geodesic"])
def test_the_ball_norm_from_the_pairings_is_the_norm_of_the_combination(monkeypatch, measure):
    """Auto-PGD's ``‖α ξ_k + β d + γ ξ_{k−1}‖²`` comes from the Gram matrix of the three
    vectors (``‖ξ_k‖²``, ``‖ξ_{k−1}‖²`` and ``⟨ξ_k, ξ_{k−1}⟩`` carried from step to step, the
    pairings of ``d`` from the gradient): at every step, restarts included, it equals the
    metric norm of the combination formed explicitly (float64), and every iterate lies in the
    ball."""
    A = importlib.import_module("geosharp.estimators.apgd")
    model = (_encoder() if measure == "geodesic" else _model()).double()
    g = torch.Generator().manual_seed(2)
    if measure == "geodesic":
        x = torch.randn(8, 10, 32, generator=g, dtype=torch.float64)
        y, loss_fn = torch.randn(8, 10, 32, generator=g, dtype=torch.float64), "mse"
    else:
        x, y, loss_fn = (
            torch.randn(32, N, generator=g, dtype=torch.float64),
            torch.arange(32) % 3,
            "ce",
        )
    fn = nn.functional.mse_loss if loss_fn == "mse" else nn.functional.cross_entropy
    space = (
        gs.find_symmetries(model)
        if measure == "geodesic"
        else gs.find_symmetries(model, adapters=[])
    )
    pert = Perturbation(
        space, {n: p.detach() for n, p in model.named_parameters()}, measure=measure
    )
    rho = 0.05 if measure == "geodesic" else 0.5
    checked, orig = [], A._l2_step

    def step(xi, d, prev, *, reuse, coef, nsq, rho, into_prev=False):
        al, be, ga = coef
        u = pert.zeros()
        for part, c in ((xi, al), (d, be), (prev, ga)):
            if part is not None:
                u = Perturbation.combine(u, part, 1.0, c)
        exact = float(pert.norm_sq(u))
        checked.append((nsq, exact))
        return orig(xi, d, prev, reuse=reuse, coef=coef, nsq=nsq, rho=rho, into_prev=into_prev)

    monkeypatch.setattr(A, "_l2_step", step)

    def evaluate(params):
        return fn(torch.func.functional_call(model, params, (x,)), y)

    norms = []

    def loss(xi, need_grad):
        norms.append(pert.norm(xi))
        return pert.loss_and_grad(evaluate, xi, need_grad)

    for keep in (True, None):
        res = A.autopgd(pert, loss, rho, 20, None, keep_best_direction=keep)
        assert res.restarts
    assert len(checked) == 40
    for nsq, exact in checked:
        assert abs(nsq - exact) <= 1e-10 * exact, (nsq, exact)
    assert max(norms) <= rho * (1 + 1e-12) and max(norms) > 0.99 * rho


def test_buffer_bytes_counts_a_cut_table_as_its_rows_twice():
    """A table cut to the rows a batch reaches: ξ holds those rows, the perturbation their
    ``w[rows]`` and, for each forward, the rows it overwrites in the table (put back after it;
    no copy of the table, estimators/table_rows.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 3))
    space = gs.find_symmetries(model, adapters=[])
    pert = Perturbation(space, dict(model.named_parameters()), measure="adaptive")
    assert pert.param_bytes == (50 * 16 + 16 * 3 + 3) * 4
    assert pert.buffer_bytes() == (pert.param_bytes, 0)
    cut = pert.on_rows({"0.weight": torch.tensor([1, 2, 7])})
    xi, held = cut.buffer_bytes()
    assert xi == (3 * 16 + 16 * 3 + 3) * 4
    assert held == 3 * 16 * 4 + 3 * 16 * 4  # w[rows], and the rows overwritten (kept)


def test_no_buffer_budget_keeps_the_best_direction_always_with_the_same_ascent():
    """``buffer_budget=None`` keeps the direction even where the default would not (the
    encoder's factorizations outweigh its blocks), with the same iterates and no more passes;
    a bad budget is refused before any work."""
    from geosharp.estimators.apgd import best_direction_rule

    model = _encoder()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 10, 32, generator=g), torch.randn(8, 10, 32, generator=g)
    kw = dict(measure="geodesic", rho=0.05, steps=20, cache=False)
    a = gs.sharpness(model, nn.functional.mse_loss, [(x, y)], **kw)
    b = gs.sharpness(model, nn.functional.mse_loss, [(x, y)], buffer_budget=None, **kw)
    assert a.traces == b.traces and a.value == b.value
    assert b.n_backward <= a.n_backward and b.n_forward <= a.n_forward
    assert a.settings["buffer_budget"] == 4 and b.settings["buffer_budget"] is None
    pert = Perturbation(gs.find_symmetries(model), dict(model.named_parameters()))
    assert best_direction_rule(pert) is None
    assert best_direction_rule(pert, budget=None) is True
    assert best_direction_rule(pert, budget=1e9) is True
    assert best_direction_rule(pert, low_memory=True, budget=None) is None
    with pytest.raises(ValueError, match="buffer_budget must be a finite number > 0"):
        gs.sharpness(model, nn.functional.mse_loss, [(x, y)], buffer_budget=0, **kw)
    with pytest.raises(TypeError, match="buffer_budget must be a number"):
        gs.sharpness(model, nn.functional.mse_loss, [(x, y)], buffer_budget="all", **kw)


def test_measure_cli_buffer_budget_flag(capsys):
    """``geosharp measure --buffer-budget N|none`` reaches gs.sharpness; a bad one is refused."""
    import argparse

    from geosharp.measuring.cli_parser import add_parser

    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["m.pt", "d.csv"]).buffer_budget == 4
    assert parser.parse_args(["m.pt", "d.csv", "--buffer-budget", "none"]).buffer_budget is None
    assert parser.parse_args(["m.pt", "d.csv", "--buffer-budget", "6"]).buffer_budget == 6.0
    for bad in ("0", "-1", "inf", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["m.pt", "d.csv", "--buffer-budget", bad])
        assert f"expected a number > 0 or 'none', got '{bad}'" in capsys.readouterr().err
    model = _model()
    x = torch.randn(16, N, generator=torch.Generator().manual_seed(1))
    y = torch.arange(16) % 3
    kw = dict(measures=["adaptive-l2"], rhos=[0.1], steps=3)
    rep = gs.measure(model, [(x, y)], buffer_budget=None, **kw)
    assert rep.settings["buffer_budget"] is None and rep.rows[0].value is not None
    assert "buffer_budget" not in gs.measure(model, [(x, y)], **kw).settings
