"""``gs.curvature`` against PyHessian: top eigenvalue and trace of the Hessian, values and time.

On the same small model and batch, PyHessian's power iteration (top eigenvalue) and Rademacher
Hutchinson (trace) are compared with ours in the Euclidean metric (Lanczos; Gaussian
Hutchinson and Hutch++), next to a tightly converged Lanczos λ_max and a 600-probe Hutch++
trace as references. Ours in the invariant metrics (geodesic inv and mix, and adaptive) are
printed too, and every measure again on a reparametrized twin of the model
(``gs.reparametrize``, scale 10: the same function): Euclidean numbers move, geodesic ones do
not. Every method is timed on the same batch in this process; "HVPs" counts Hessian-vector
products (PyHessian's counted by wrapping its ``hessian_vector_product``).

PyHessian is not a dependency of geosharp. Install it into a scratch virtualenv, next to the
pinned CPU torch (it would otherwise pull a CUDA build)::

    python3 -m venv /tmp/pyh
    /tmp/pyh/bin/pip install -c constraints.txt torch==2.13.0
    /tmp/pyh/bin/pip install --no-deps pyhessian

and either run this script with the project's environment, pointing it at the scratch
site-packages (appended to ``sys.path``, so the project's torch is the one imported)::

    .venv/bin/python benchmarks/curvature_vs_pyhessian.py \
        --pyhessian-site /tmp/pyh/lib/python3.11/site-packages

or run it inside the scratch environment after adding geosharp's dependencies and geosharp::

    /tmp/pyh/bin/pip install -c constraints.txt numpy scipy matplotlib tqdm
    /tmp/pyh/bin/pip install --no-deps -e .
    /tmp/pyh/bin/python benchmarks/curvature_vs_pyhessian.py

Without PyHessian the script prints our numbers only. Models: ``--models mlp,vit``. PyHessian
draws float32 random vectors, so models are float32 (``--dtype float64`` runs ours only).
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time

import torch
from torch import nn

import geosharp as gs
from geosharp.models import VisionTransformer


def mlp_case(batch: int):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(192, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 10)
    )
    x, y = torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))
    return "MLP 192-48-48-10", model, x, y


def vit_case(batch: int):
    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=8, patch_size=4, in_channels=3, num_classes=10, dim=32, depth=2, num_heads=4
    )
    x, y = torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))
    return "ViT (d=32, 4 heads, 2 layers, 8×8 patches of 4)", model, x, y


CASES = {"mlp": mlp_case, "vit": vit_case}


def train(model: nn.Module, x, y, steps: int) -> float:
    """A few Adam steps on the batch, so that the curvature is not that of the initialization."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def run_pyhessian(pyhessian, model, x, y, power_iters, power_tol, probes, trace_tol):
    """PyHessian's top eigenvalue and trace on a copy of the model; HVPs counted."""
    ph = sys.modules["pyhessian.hessian"]  # the module (``pyhessian.hessian`` is the class)

    count = {"n": 0}
    original = ph.hessian_vector_product

    def counted(*args, **kwargs):
        count["n"] += 1
        return original(*args, **kwargs)

    ph.hessian_vector_product = counted
    try:
        twin = copy.deepcopy(model)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        h = pyhessian.hessian(twin, nn.functional.cross_entropy, data=(x, y), cuda=False)
        t_setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        top, _ = h.eigenvalues(maxIter=power_iters, tol=power_tol)
        t_eig, n_eig = time.perf_counter() - t0 + t_setup, count["n"]
        t0 = time.perf_counter()
        samples = h.trace(maxIter=probes, tol=trace_tol)
        t_tr, n_tr = time.perf_counter() - t0 + t_setup, count["n"] - n_eig
    finally:
        ph.hessian_vector_product = original
    mean = sum(samples) / len(samples)
    var = sum((s - mean) ** 2 for s in samples) / max(len(samples) - 1, 1)
    se = (var / len(samples)) ** 0.5 if len(samples) > 1 else float("nan")
    return dict(lmax=top[0], t_eig=t_eig, n_eig=n_eig, trace=mean, se=se, t_tr=t_tr, n_tr=n_tr)


def row(name, value, se, hvps, seconds, ref=None):
    err = f"{value / ref - 1:+.1e}" if ref else ""
    se_s = f"± {se:.3g}" if se is not None and se == se and se > 0 else ""
    return f"| {name} | {value:.6g} {se_s} | {err} | {hvps} | {seconds:.2f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,vit")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--probes", type=int, default=100, help="trace probes (both libraries)")
    ap.add_argument("--iters", type=int, default=100, help="max Lanczos / power iterations")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--pyhessian-site", default=None, help="site-packages holding pyhessian")
    ap.add_argument("--scale", type=float, default=10.0, help="scale of the reparametrization")
    args = ap.parse_args()
    if args.pyhessian_site:
        sys.path.append(args.pyhessian_site)
    try:
        import pyhessian
    except ImportError:
        pyhessian = None
    dtype = getattr(torch, args.dtype)
    if dtype != torch.float32:
        pyhessian = None
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    print(
        f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
        f"{args.dtype}, batch {args.batch}; PyHessian "
        + ("found" if pyhessian else "not found: our numbers only")
    )
    ce = nn.functional.cross_entropy
    for key in args.models.split(","):
        name, model, x, y = CASES[key](args.batch)
        model, x = model.to(dtype), x.to(dtype)
        loss = train(model, x, y, args.train_steps)
        n = sum(p.numel() for p in model.parameters())
        print(f"\n### {name}: {n} parameters, loss {loss:.4f} after {args.train_steps} steps\n")
        twin = gs.reparametrize(model, generator=torch.Generator().manual_seed(1), scale=args.scale)
        batches = [(x, y)]
        ref_l = gs.curvature(
            model, ce, batches, measure="euclidean", quantities="lambda_max", iters=300, tol=1e-9
        )
        ref_t = gs.curvature(
            model,
            ce,
            batches,
            measure="euclidean",
            quantities="trace",
            probes=600,
            trace_method="hutch++",
            seed=1,
        )
        print(
            f"references: lambda_max {ref_l.lambda_max:.7g} (Lanczos, {ref_l.n_hvp} HVPs), "
            f"trace {ref_t.trace:.6g} ± {ref_t.trace_stderr:.2g} (Hutch++, 600 probes)\n"
        )
        print("| method | value | rel. to reference | HVPs | time (s) |")
        print("|---|---|---|---|---|")
        eig = gs.curvature(
            model, ce, batches, measure="euclidean", quantities="lambda_max", iters=args.iters
        )
        print(
            row(
                "λ_max, ours (Lanczos, tol 1e-5)",
                eig.lambda_max,
                None,
                eig.n_hvp,
                eig.time_s,
                ref_l.lambda_max,
            )
        )
        hut = gs.curvature(
            model, ce, batches, measure="euclidean", quantities="trace", probes=args.probes
        )
        hpp = gs.curvature(
            model,
            ce,
            batches,
            measure="euclidean",
            quantities="trace",
            probes=args.probes,
            trace_method="hutch++",
        )
        if pyhessian is not None:
            ph = run_pyhessian(pyhessian, model, x, y, args.iters, 1e-3, args.probes, 1e-3)
            print(
                row(
                    "λ_max, PyHessian (power, tol 1e-3)",
                    ph["lmax"],
                    None,
                    ph["n_eig"],
                    ph["t_eig"],
                    ref_l.lambda_max,
                )
            )
            ph0 = run_pyhessian(pyhessian, model, x, y, args.iters, 0.0, args.probes, 0.0)
            print(
                row(
                    f"λ_max, PyHessian (power, {args.iters} its)",
                    ph0["lmax"],
                    None,
                    ph0["n_eig"],
                    ph0["t_eig"],
                    ref_l.lambda_max,
                )
            )
        print(
            row(
                f"trace, ours (Hutchinson, {args.probes})",
                hut.trace,
                hut.trace_stderr,
                hut.n_hvp,
                hut.time_s,
                ref_t.trace,
            )
        )
        print(
            row(
                f"trace, ours (Hutch++, {args.probes})",
                hpp.trace,
                hpp.trace_stderr,
                hpp.n_hvp,
                hpp.time_s,
                ref_t.trace,
            )
        )
        if pyhessian is not None:
            print(
                row(
                    "trace, PyHessian (Rademacher, tol 1e-3)",
                    ph["trace"],
                    ph["se"],
                    ph["n_tr"],
                    ph["t_tr"],
                    ref_t.trace,
                )
            )
            print(
                row(
                    f"trace, PyHessian (Rademacher, {args.probes})",
                    ph0["trace"],
                    ph0["se"],
                    ph0["n_tr"],
                    ph0["t_tr"],
                    ref_t.trace,
                )
            )
        print(
            f"\nInvariant and adaptive curvature, and on the reparametrized twin (scale "
            f"{args.scale:g}):\n"
        )
        print("| measure | λ_max | trace (Hutch++) | λ_max twin | trace twin | HVPs | time (s) |")
        print("|---|---|---|---|---|---|---|")
        for label, kw in (
            ("euclidean", dict(measure="euclidean")),
            ("adaptive", dict(measure="adaptive")),
            ("geodesic inv", dict(measure="geodesic", metric="inv")),
            ("geodesic mix", dict(measure="geodesic", metric="mix")),
        ):
            common = dict(iters=args.iters, probes=args.probes, trace_method="hutch++", **kw)
            a = gs.curvature(model, ce, batches, **common)
            b = gs.curvature(twin, ce, batches, **common)
            print(
                f"| {label} | {a.lambda_max:.6g} | {a.trace:.5g} ± {a.trace_stderr:.2g} | "
                f"{b.lambda_max:.6g} | {b.trace:.5g} ± {b.trace_stderr:.2g} | {a.n_hvp} | "
                f"{a.time_s:.2f} |"
            )
        if pyhessian is not None:
            tw = run_pyhessian(pyhessian, twin, x, y, args.iters, 1e-3, args.probes, 1e-3)
            print(f"\nPyHessian on the twin: λ_max {tw['lmax']:.6g}, trace {tw['trace']:.5g}")


if __name__ == "__main__":
    main()
