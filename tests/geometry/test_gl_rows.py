"""A GL(h) geometry on rows split over ranks equals the one on all rows (SPEC §10.1–§10.2).

The ranks are threads here: each builds the geometry of its rows of ``G`` and ``H`` (uneven
splits, one rank with no rows of ``G``), with a ``row_sum`` that adds the threads' ``h × h``
contractions behind a barrier (what an all-reduce does across processes). Every replicated
quantity (Gram matrices, Λ) must equal the one-process value, every row-wise result
(projection, Riemannian gradient, Christoffel form, order-2 endpoint and its backward, a random
tangent from given normals) the one-process rows, and the local norms must add up to the
one-process norm (float64, 1e-12).
"""

from __future__ import annotations

import threading

import pytest
import torch

from geosharp.geometry import BlockDiagonalAlgebra, GLExecution, GLGeometry, GLSubgroupGeometry
from geosharp.geometry.gl_rows import contract

from .reference import random_block

B, N, M, h = 3, 7, 5, 4
#: rows of G and of H held by each of three ranks (rank 1 holds no row of G)
SPLIT_G = (4, 0, 3)
SPLIT_H = (1, 2, 2)


class ThreadSum:
    """An all-reduce over threads: each deposits its tensor, all read the same sum."""

    def __init__(self, world: int) -> None:
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world)
        self.calls = [0] * world

    def for_rank(self, r: int):
        def row_sum(t: torch.Tensor) -> torch.Tensor:
            assert not t.requires_grad  # the hand-written backward sums plain tensors
            self.calls[r] += 1
            self.slots[r] = t
            self.barrier.wait()
            out = torch.stack(self.slots).sum(0)  # one order on every rank: one result
            self.barrier.wait()
            return out

        return row_sum


def make(kind: str, G, H, metric: str, row_sum=None, chunk: int | None = None):
    ex = GLExecution(row_sum=row_sum)
    if chunk is not None:  # chunks of heads decided by each rank's own rows
        ex = GLExecution(row_sum=row_sum, chunk_elements=chunk)
    if kind == "gl":
        return GLGeometry(G, H, metric, 0.0, execution=ex)
    alg = BlockDiagonalAlgebra(h, planes=((0, 2),), free=(1, 3))
    return GLSubgroupGeometry(G, H, alg, metric=metric, execution=ex)


def on_ranks(fn, ring: ThreadSum, world: int = 3) -> list:
    """``fn(rank)`` on ``world`` threads, their results by rank (the first failure re-raised)."""
    out: list = [None] * world
    errors: list = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # re-raised below
            errors.append(e)
            ring.barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


def rows(t: torch.Tensor, split: tuple[int, ...]) -> list[torch.Tensor]:
    return list(torch.split(t, split, dim=-2))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.shape == b.shape
    if not b.numel():  # a rank with no rows
        return True
    return float((a - b).abs().max()) <= 1e-12 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("kind", ["gl", "rotary"])
@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_split_rows_equal_all_rows(kind, metric, chunk):
    """``chunk=16``: the ranks project 3, 2 and 3 chunks of heads, in one collective each."""
    G, H, g = random_block((B,), N, M, h, seed=4)
    xi = (
        0.1 * torch.randn(G.shape, generator=g, dtype=G.dtype),
        0.1 * torch.randn(H.shape, generator=g, dtype=H.dtype),
    )
    up = (
        torch.randn(G.shape, generator=g, dtype=G.dtype),
        torch.randn(H.shape, generator=g, dtype=H.dtype),
    )
    z = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (G, H, G, H)]  # Z, Ω
    full = make(kind, G, H, metric)
    want = {
        "draw": full.tangent_from_normals(z, 0.7),  # Ωᵀ X summed over the ranks
        "MG": full.factors.MG,
        "lam": full.lam(xi),
        "project": full.project(xi),
        "hgrad": full.horizontal_grad(xi),
        "christoffel": full.christoffel(xi),
        "norm": full.norm_sq(xi),
    }
    leaves = tuple(t.clone().requires_grad_(True) for t in xi)
    end = full.geodesic(leaves, order=2)
    want["end"] = tuple(t.detach() for t in end)
    want["back"] = torch.autograd.grad(end, leaves, up)

    ring = ThreadSum(3)
    parts = [
        rows(t, s) for t, s in ((G, SPLIT_G), (H, SPLIT_H), (xi[0], SPLIT_G), (xi[1], SPLIT_H))
    ]
    ups = [rows(up[0], SPLIT_G), rows(up[1], SPLIT_H)]

    def rank(r: int) -> dict:
        Gr, Hr, xGr, xHr = (p[r] for p in parts)
        geom = make(kind, Gr, Hr, metric, ring.for_rank(r), chunk)
        if chunk is not None:
            assert len(geom._slices) == (3, 2, 3)[r]
        x = (xGr, xHr)
        zr = [rows(t, split)[r] for t, split in zip(z, (SPLIT_G, SPLIT_H) * 2, strict=True)]
        got = {
            "draw": geom.tangent_from_normals(zr, 0.7),
            "MG": geom.factors.MG,
            "lam": geom.lam(x),
            "project": geom.project(x),
            "hgrad": geom.horizontal_grad(x),
            "christoffel": geom.christoffel(x),
            "norm": geom.norm_sq(x),  # this rank's part of the norm
        }
        lv = tuple(t.clone().requires_grad_(True) for t in x)
        e = geom.geodesic(lv, order=2)
        got["end"] = tuple(t.detach() for t in e)
        got["back"] = torch.autograd.grad(e, lv, (ups[0][r], ups[1][r]))
        return got

    ranks = on_ranks(rank, ring)
    for r, got in enumerate(ranks):
        assert close(got["MG"], want["MG"]), r  # replicated: every rank the whole Gram matrix
        assert close(got["lam"], want["lam"]), r
        for key in ("draw", "project", "hgrad", "christoffel", "end", "back"):
            for c, split in enumerate((SPLIT_G, SPLIT_H)):
                assert close(got[key][c], rows(want[key][c], split)[r]), (key, c, r)
    assert close(sum(got["norm"] for got in ranks), want["norm"])
    assert len(set(ring.calls)) == 1  # every rank made the same collectives


# -- the base point's Gram matrices, widened a chunk of heads at a time -----------------------
@pytest.mark.parametrize("kind", ["gl", "rotary"])
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_gram_matrices_in_chunks_equal_the_widened_copy(monkeypatch, kind, metric):
    """A float32 block: ``GᵀG`` widened chunk by chunk (5 elements: one head each, a chunk
    of 4 heads) equals the products of the widened copy bit for bit, and the geometry built on
    them equals the one that holds the copy (``hold_point=True``)."""
    from geosharp.geometry import gl_factors

    G, H, g = random_block((2, 3), N, M, h, seed=7)
    G, H = G.float(), H.float()
    xi = (0.1 * torch.randn(G.shape, generator=g), 0.1 * torch.randn(H.shape, generator=g))
    want = contract((G.double(), G.double()), (H.double(), H.double()))
    for chunk in (5, 4 * N * h, 1 << 22):
        monkeypatch.setattr(gl_factors, "GRAM_CHUNK", chunk)
        got = gl_factors.gram_matrices(G, H, torch.float64)
        assert all(a.dtype == torch.float64 for a in got)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        doubled = gl_factors.gram_matrices(G, H, torch.float64, row_sum=lambda t: 2 * t)
        assert torch.equal(doubled[0], 2 * want[0]) and torch.equal(doubled[1], 2 * want[1])
    lean = make(kind, G, H, metric)
    assert lean._held is None  # a float32 point: nothing widened is held
    alg = BlockDiagonalAlgebra(h, planes=((0, 2),), free=(1, 3))
    ex = GLExecution(hold_point=True, work_dtype=torch.float64)
    held = (
        GLGeometry(G, H, metric, 0.0, execution=ex)
        if kind == "gl"
        else GLSubgroupGeometry(G, H, alg, metric=metric, execution=ex)
    )
    for f in ("MG", "MH", "MG_inv", "MH_inv"):
        assert torch.equal(getattr(lean.factors, f).double(), getattr(held.factors, f)), f
    a, b = lean.project(xi), held.project(tuple(t.double() for t in xi))
    assert all(
        torch.allclose(x.double(), y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b, strict=True)
    )


# -- the base point read a chunk of heads at a time (the sharded endpoint, SPEC §10.7) ---------
@pytest.mark.parametrize("kind", ["gl", "rotary"])
@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_point_read_by_chunks_equals_the_held_point(kind, metric, chunk):
    """A geometry whose point's memory is freed, reading ``G``, ``H`` through a reader a chunk
    of heads at a time, projects bit for bit as the one holding them; the order-2 endpoint's
    factors and its adjoint (in place) by chunks equal the batched ones and the autograd
    gradient of the one-process endpoint, on rows split over three ranks and on all rows; a
    random tangent drawn from the Gram matrices read by chunks equals the held point's."""
    from geosharp.geometry.gl_endpoint import (
        _order2_matrices,
        order2_adjoint_by_chunks,
        order2_factors_by_chunks,
    )

    G, H, g = random_block((B,), N, M, h, seed=11)
    xi = tuple(0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (G, H))
    up = tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (G, H))
    full = make(kind, G, H, metric)
    leaves = tuple(t.clone().requires_grad_(True) for t in xi)
    want_back = torch.autograd.grad(full.geodesic(leaves, order=2), leaves, up)

    def read_by_chunks(Gr, Hr, x, upr, row_sum) -> tuple:
        xGr, xHr = x
        ref = make(kind, Gr, Hr, metric, row_sum, chunk)
        want = (ref.horizontal_grad(x), ref.project(x), ref.ascent_direction(x))
        draw = ref.random_tangent(torch.Generator().manual_seed(5))
        geom = make(kind, Gr.clone(), Hr.clone(), metric, row_sum, chunk)
        reads: list[slice] = []

        def reader(heads: slice, dtype: torch.dtype) -> tuple:
            reads.append(heads)
            return Gr[heads].to(dtype), Hr[heads].to(dtype)

        geom.read_point_from(reader)
        for t in geom.point:  # nothing of the point is read again
            t.untyped_storage().resize_(0)
        got = (geom.horizontal_grad(x), geom.project(x), geom.ascent_direction(x))
        assert all(
            torch.equal(a, b) for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True)
        )
        assert all(torch.equal(a, b) for a, b in zip(got[2][0], want[2][0], strict=True))
        assert torch.equal(got[2][1], want[2][1])
        got_draw = geom.random_tangent(torch.Generator().manual_seed(5))  # Gram matrices read
        assert all(close(a, b) for a, b in zip(got_draw, draw, strict=True))
        if len(geom._slices) > 1:
            assert slice(None) not in reads  # one chunk of heads at a time
        inv, rows_of = geom._endpoint_inv, geom.point_rows
        f = order2_factors_by_chunks(rows_of, geom._slices, xGr, xHr, *inv, metric, row_sum)
        f_want = _order2_matrices(Gr, Hr, xGr, xHr, *inv, metric, row_sum)
        assert all(close(a, b) for a, b in zip(f[:4], f_want[:4], strict=True))
        assert f[4] == f_want[4]
        gr = tuple(t.clone() for t in upr)
        back = order2_adjoint_by_chunks(
            rows_of, geom._slices, (xGr, xHr, *inv), (f[0], f[2], f[4]), metric, gr, row_sum
        )
        assert back[0] is gr[0] and back[1] is gr[1]  # overwritten in place
        return back

    for c, b in enumerate(read_by_chunks(G, H, xi, up, None)):  # all rows: chunk by chunk
        assert close(b, want_back[c]), c
    ring = ThreadSum(3)
    parts = [
        rows(t, s) for t, s in ((G, SPLIT_G), (H, SPLIT_H), (xi[0], SPLIT_G), (xi[1], SPLIT_H))
    ]
    ups = [rows(up[0], SPLIT_G), rows(up[1], SPLIT_H)]

    def rank(r: int) -> tuple:
        x, upr = (parts[2][r], parts[3][r]), (ups[0][r], ups[1][r])
        return read_by_chunks(parts[0][r], parts[1][r], x, upr, ring.for_rank(r))

    for r, back in enumerate(on_ranks(rank, ring)):
        for c, split in enumerate((SPLIT_G, SPLIT_H)):
            assert close(back[c], rows(want_back[c], split)[r]), (c, r)
    assert len(set(ring.calls)) == 1  # every rank made the same collectives
