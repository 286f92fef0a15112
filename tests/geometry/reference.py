"""Dense, slow, obviously-correct references for the GL(h) geometry (float64).

Everything here is built from the SPEC's definitions directly — the metric as an explicit
``N × N`` matrix of the flattened point, Christoffel symbols from its derivatives, geodesics by
SciPy's adaptive integrator — and shares no code with ``geosharp.geometry``.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.integrate import solve_ivp
from torch.func import grad, jvp

DT = torch.float64


def random_block(batch, n, m, h, seed):
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(*batch, n, h, generator=g, dtype=DT)
    H = torch.randn(*batch, m, h, generator=g, dtype=DT)
    return G, H, g


def random_gl(batch, h, generator, scale=1.0):
    """A well-conditioned random group element: scale · (orthogonal · diag(0.5..2) · orthogonal)."""
    q1, _ = torch.linalg.qr(torch.randn(*batch, h, h, generator=generator, dtype=DT))
    q2, _ = torch.linalg.qr(torch.randn(*batch, h, h, generator=generator, dtype=DT))
    s = 0.5 + 1.5 * torch.rand(*batch, h, generator=generator, dtype=DT)
    return scale * (q1 * s.unsqueeze(-2)) @ q2


def split(x, n, m, h):
    return x[: n * h].reshape(n, h), x[n * h :].reshape(m, h)


def dense_metric(x, n, m, h, metric, eps):
    """The metric of SPEC §4 as an explicit matrix of the row-major vec of (G, H).

    tr(M⁻¹ ηᵀ ζ) = vec(η)ᵀ (I_n ⊗ M⁻¹) vec(ζ) for row-major vec; similarly for mix.
    """
    G, H = split(x, n, m, h)
    MG = G.T @ G + eps * torch.eye(h, dtype=DT)
    MH = H.T @ H + eps * torch.eye(h, dtype=DT)
    if metric == "inv":
        blocks = (
            torch.kron(torch.eye(n, dtype=DT), torch.linalg.inv(MG).contiguous()),
            torch.kron(torch.eye(m, dtype=DT), torch.linalg.inv(MH).contiguous()),
        )
    else:
        blocks = (
            torch.kron(torch.eye(n, dtype=DT), MH.contiguous()),
            torch.kron(torch.eye(m, dtype=DT), MG.contiguous()),
        )
    return torch.block_diag(*blocks)


def dense_christoffel(x, v, n, m, h, metric, eps):
    """Γ(v, v) = g⁻¹ [ (Dg[v]) v − ½ ∇_x (vᵀ g(x) v) ] — Euler–Lagrange of ½ ẋᵀ g(x) ẋ."""

    def g_of(y):
        return dense_metric(y, n, m, h, metric, eps)

    _, dg_v = jvp(g_of, (x,), (v,))
    quad_grad = grad(lambda y: v @ g_of(y) @ v)(x)
    return torch.linalg.solve(g_of(x), dg_v @ v - 0.5 * quad_grad)


def integrate_geodesic(G, H, xi_G, xi_H, metric, eps, t=1.0):
    """γ(t) by solve_ivp (DOP853, rtol = atol = 1e-13) on the dense geodesic ODE."""
    n, h = G.shape
    m = H.shape[0]
    x0 = torch.cat([G.reshape(-1), H.reshape(-1)])
    v0 = torch.cat([xi_G.reshape(-1), xi_H.reshape(-1)])
    N = x0.numel()

    def rhs(_, y):
        yt = torch.from_numpy(y)
        x, v = yt[:N], yt[N:]
        a = -dense_christoffel(x, v, n, m, h, metric, eps)
        return np.concatenate([v.numpy(), a.numpy()])

    sol = solve_ivp(
        rhs,
        (0.0, t),
        np.concatenate([x0.numpy(), v0.numpy()]),
        method="DOP853",
        rtol=1e-13,
        atol=1e-13,
    )
    assert sol.success, sol.message
    return split(torch.from_numpy(sol.y[:N, -1]), n, m, h)


def vertical_basis(G, H):
    """Columns: vec of (−G E_ab, H E_abᵀ) for the h² matrix units E_ab."""
    h = G.shape[1]
    cols = []
    for a in range(h):
        for b in range(h):
            E = torch.zeros(h, h, dtype=DT)
            E[a, b] = 1.0
            cols.append(torch.cat([(-G @ E).reshape(-1), (H @ E.T).reshape(-1)]))
    return torch.stack(cols, dim=1)


def dense_horizontal_projection(G, H, xi_G, xi_H, metric, eps):
    """Metric-orthogonal projection onto the vertical complement: I − V (VᵀgV)⁻¹ Vᵀg."""
    n, h = G.shape
    m = H.shape[0]
    x = torch.cat([G.reshape(-1), H.reshape(-1)])
    g = dense_metric(x, n, m, h, metric, eps)
    V = vertical_basis(G, H)
    v = torch.cat([xi_G.reshape(-1), xi_H.reshape(-1)])
    coef = torch.linalg.solve(V.T @ g @ V, V.T @ g @ v)
    return split(v - V @ coef, n, m, h)
