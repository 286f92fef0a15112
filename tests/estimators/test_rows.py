"""Embedding rows a batch never reaches are left out of the ascent (issue 11), exactly.

An ascent from ξ = 0 never moves a row of an embedding table that the batch does not look up
(its gradient is zero at every point), so cutting the table to the rows reached must give the
same iterates, the same value and the same trace; a table whose gradient reaches other rows
(tied to an output layer, or read directly elsewhere) must stay whole.
"""

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.estimators import rows as R
from geosharp.estimators.diagnostics import ascent_diagnostics
from geosharp.estimators.perturbation import Perturbation
from geosharp.geometry import ElementwiseGeometry

V, D = 300, 16


class Bag(nn.Module):
    """Embedding → mean over tokens → MLP → 3 classes (optionally a tied or direct reuse)."""

    def __init__(self, reuse: str | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.pos = nn.Embedding(32, D)
        self.mlp = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 3))
        self.reuse = reuse
        if reuse == "tied":
            self.out = nn.Linear(D, V, bias=False)
            self.out.weight = self.emb.weight  # one Parameter, two modules

    def forward(self, ids):
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))[None]
        z = self.mlp(h.mean(1))
        if self.reuse == "tied":
            z = z + self.out(h.mean(1))[:, :3]
        elif self.reuse == "direct":  # the table read outside its module: all rows move
            z = z + (h.mean(1) @ self.emb.weight.T)[:, :3]
        return z


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 40, (12, 10), generator=g)
    ids[:, -2:] = 0  # padding
    return [(ids, torch.randint(0, 3, (12,), generator=g))]


def _model(reuse=None, dtype=torch.float64):
    torch.manual_seed(0)
    return Bag(reuse).to(dtype)


def _both(monkeypatch, model, **kw):
    kw = {"steps": 10, "cache": False, **kw}
    cut = gs.sharpness(model, nn.functional.cross_entropy, _data(), **kw)
    monkeypatch.setattr(R, "MAX_ROW_SHARE", -1.0)  # never cut
    whole = gs.sharpness(model, nn.functional.cross_entropy, _data(), **kw)
    monkeypatch.undo()
    return cut, whole


def _spy(monkeypatch):
    made = []
    orig = R.BatchRows.restrict

    def restrict(self, egrad):
        out = orig(self, egrad)
        rows = out[0]._assembly.rows
        made.append(sorted(n for n, c in self.pert.row_tables().items() if c in rows))
        return out

    monkeypatch.setattr(R.BatchRows, "restrict", restrict)
    return made


@pytest.mark.parametrize(
    "kw",
    [
        dict(measure="adaptive", rho=0.3),
        dict(measure="euclidean", rho=0.2),
        dict(measure="adaptive", norm="linf", rho=0.01),
        dict(measure="adaptive", rho=0.3, low_memory=True),
    ],
    ids=["adaptive", "euclidean", "linf", "low_memory"],
)
def test_the_cut_ascent_is_the_whole_ascent(monkeypatch, kw):
    model = _model()
    made = _spy(monkeypatch)
    cut = gs.sharpness(model, nn.functional.cross_entropy, _data(), steps=10, cache=False, **kw)
    assert made == [["emb.weight", "pos.weight"]]
    monkeypatch.setattr(R, "MAX_ROW_SHARE", -1.0)
    whole = gs.sharpness(model, nn.functional.cross_entropy, _data(), steps=10, cache=False, **kw)
    assert made[1] == []
    assert cut.value > 0
    assert cut.value == pytest.approx(whole.value, rel=1e-12, abs=0)
    assert cut.traces[0] == pytest.approx(whole.traces[0], rel=1e-12, abs=0)


def test_geodesic_ascent_on_a_transformer_with_embeddings(monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=500,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    batch = ({"input_ids": torch.randint(0, 60, (6, 9), generator=g)}, torch.tensor([0, 1] * 3))

    def loss(out, y):
        return nn.functional.cross_entropy(out.logits, y)

    made = _spy(monkeypatch)
    kw = dict(measure="geodesic", rho=0.03, steps=8, cache=False)
    cut = gs.sharpness(model, loss, [batch], **kw)
    diag = ascent_diagnostics(model, loss, [batch], measure="geodesic", rho=0.03, steps=8)
    assert diag.value == cut.value  # the diagnostics run the same (cut) ascent
    monkeypatch.setattr(R, "MAX_ROW_SHARE", -1.0)
    whole = gs.sharpness(model, loss, [batch], **kw)
    assert made[0] == made[1] and made[2] == []
    assert "bert.embeddings.word_embeddings.weight" in made[0]
    assert cut.value > 0
    assert cut.value == pytest.approx(whole.value, rel=1e-12, abs=0)


@pytest.mark.parametrize("reuse", ["tied", "direct"])
def test_a_table_read_elsewhere_stays_whole(monkeypatch, reuse):
    model = _model(reuse)
    made = _spy(monkeypatch)
    cut, whole = _both(monkeypatch, model, measure="adaptive", rho=0.3)
    assert made[0] == ["pos.weight"]  # the position table only
    assert cut.value == pytest.approx(whole.value, rel=1e-12, abs=0)
    space = gs.find_symmetries(model, adapters=[])
    pert = Perturbation(space, dict(model.named_parameters()), measure="adaptive")
    names = set(R.table_modules(model, pert))
    assert ("emb.weight" in names) == (reuse == "direct")  # a shared Parameter is not offered


def test_random_starts_and_the_average_case_are_not_cut(monkeypatch):
    model = _model()
    made = _spy(monkeypatch)
    a, b = _both(monkeypatch, model, measure="adaptive", rho=0.3, restarts=2)
    assert made[0] == ["emb.weight", "pos.weight"]  # the first (zero) start only
    assert a.value == pytest.approx(b.value, rel=1e-12, abs=0)
    made = _spy(monkeypatch)
    a, b = _both(monkeypatch, model, measure="adaptive", rho=0.3, random_init=True)
    assert made == [] and a.value == b.value
    made = _spy(monkeypatch)
    a, b = _both(monkeypatch, model, measure="adaptive", rho=0.1, kind="average", samples=3)
    assert made == [] and a.value == b.value


def test_rows_reached_and_the_cut_perturbation():
    model = _model()
    space = gs.find_symmetries(model, adapters=[])
    pert = Perturbation(space, dict(model.named_parameters()), measure="adaptive")
    ((ids, _),) = _data()
    with R.BatchRows(model, pert) as reached:
        model(ids)
    rows = reached.rows()
    assert torch.equal(rows["emb.weight"], torch.unique(ids))
    assert torch.equal(rows["pos.weight"], torch.arange(10))
    cut = pert.on_rows({"emb.weight": rows["emb.weight"]})
    k = 0
    c = list(pert.row_tables()).index("emb.weight")
    assert cut.pieces[k].geometry.point[c].shape == (rows["emb.weight"].numel(), D)
    assert pert.pieces[k].geometry.point[c].shape == (V, D)  # the original is untouched
    # positions of the cut component: the rows' coordinates in θ
    pos = cut.pieces[k].index[c].reshape(-1, D)
    full = pert.pieces[k].index[c].reshape(V, D)
    assert torch.equal(pos, full[rows["emb.weight"]])
    # the perturbed table: w with the rows reached moved, every other row exactly w
    xi = cut.zeros()
    xi[k] = tuple(t + 0.01 if i == c else t for i, t in enumerate(xi[k]))
    table = cut.endpoint_params(xi)["emb.weight"]
    w = model.emb.weight.detach()
    other = torch.ones(V, dtype=torch.bool)
    other[rows["emb.weight"]] = False
    assert torch.equal(table[other], w[other])
    assert torch.equal(table[rows["emb.weight"]], w[rows["emb.weight"]] + 0.01)
    # the norm of a cut ξ is the norm of the whole ξ that is zero on the other rows
    whole = pert.zeros()
    whole[k] = tuple(t.clone() for t in whole[k])
    whole[k][c][rows["emb.weight"]] = xi[k][c]
    for i, t in enumerate(xi[k]):
        if i != c:
            whole[k][i].copy_(t)
    assert float(cut.norm_sq(xi)) == pytest.approx(float(pert.norm_sq(whole)), rel=1e-14)
    with pytest.raises(ValueError, match="not a whole table"):
        pert.on_rows({"mlp.0.bias": torch.tensor([0])})


def test_frozen_coordinates_are_held_compactly():
    """A padding row (exact zeros) is kept as its positions, not a dense 1/w² (issue 11)."""
    w = torch.randn(200, 8, dtype=torch.float64)
    w[0] = 0.0
    w[5, 3] = 1e-300  # 1/w² overflows: frozen too
    g = ElementwiseGeometry(w)
    f = g._frozen[0]
    assert f.dtype == torch.long and f.numel() == 9
    xi = torch.randn(200, 8, dtype=torch.float64)
    moving = (w != 0) & torch.isfinite(w.reciprocal().square())
    ref = float(((xi / w)[moving] ** 2).sum())
    assert float(g.norm_sq((xi,))) == pytest.approx(ref, rel=1e-14)
    assert torch.equal(g.project((xi,))[0] == 0, ~moving | (xi == 0))
    assert torch.equal(g.mask_parts()[0], moving)
    # differentiable with no 0/0 at the frozen coordinates (the curvature's HVPs go through it)
    leaf = xi.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(g.norm_sq((leaf,)), leaf)
    assert bool(torch.isfinite(grad).all()) and bool((grad[~moving] == 0).all())
    assert torch.allclose(grad[moving], (2 * xi / w**2)[moving], rtol=1e-13)
    dense = torch.zeros(40, 3, dtype=torch.float64)  # mostly frozen: a boolean mask
    dense[0] = 1.0
    assert ElementwiseGeometry(dense)._frozen[0].dtype == torch.bool
    assert ElementwiseGeometry(torch.ones(4, 4))._frozen[0] is None


def _copying(monkeypatch):
    """Every cut table perturbed as a copy (``index_put``), as before issue 43's in-place rows."""
    from geosharp.estimators.perturbation import Perturbation as P

    orig = P.endpoint_params

    def copying(self, xi, applied=False):
        saved, self._rows_log = self._rows_log, None
        try:
            return orig(self, xi, applied=applied)
        finally:
            self._rows_log = saved

    monkeypatch.setattr(P, "endpoint_params", copying)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "kw", [dict(measure="adaptive", rho=0.3), dict(measure="adaptive", norm="linf", rho=0.01)]
)
def test_a_cut_table_written_in_place_gives_the_copys_values_and_is_put_back(
    monkeypatch, dtype, kw
):
    """The rows of a cut table written into the table itself for each loss: the same values,
    bit for bit, as the copy with the rows replaced; the model's table unchanged after."""
    model = _model(dtype=dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    made = _spy(monkeypatch)
    args = (model, nn.functional.cross_entropy, _data())
    inplace = gs.sharpness(*args, steps=10, cache=False, **kw)
    assert made == [["emb.weight", "pos.weight"]]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    _copying(monkeypatch)
    copied = gs.sharpness(*args, steps=10, cache=False, **kw)
    assert inplace.value == copied.value and inplace.traces == copied.traces
    assert (inplace.n_forward, inplace.n_backward) == (copied.n_forward, copied.n_backward)


def test_a_cut_table_is_put_back_when_the_loss_fails(monkeypatch):
    """An error in the forward (here the loss at the third evaluation) leaves the table as it
    was: the rows written for it are restored on the way out."""
    model = _model()
    before = model.emb.weight.detach().clone()
    calls = []

    def failing(out, y):
        calls.append(1)
        if len(calls) == 3:
            assert not torch.equal(model.emb.weight.detach(), before)  # rows written in place
            raise RuntimeError("boom")
        return nn.functional.cross_entropy(out, y)

    with pytest.raises(RuntimeError, match="boom"):
        gs.sharpness(model, failing, _data(), measure="adaptive", rho=0.3, steps=5, cache=False)
    assert torch.equal(model.emb.weight.detach(), before)


def test_no_copy_of_a_cut_table_during_the_forward():
    """No op writes a tensor the size of the cut table during the ascent (the copy with the
    rows replaced is gone); the writes into it are its rows."""
    from tests.launch_counter import LaunchCounter

    model = Bag()
    torch.manual_seed(0)
    big = V * D
    seen = []

    class Sizes(LaunchCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == big and "index_put" in str(func):
                seen.append(str(func))
            return out

    with Sizes():
        gs.sharpness(
            model,
            nn.functional.cross_entropy,
            _data(torch.float32),
            measure="adaptive",
            rho=0.3,
            steps=4,
            cache=False,
        )
    assert seen == []
