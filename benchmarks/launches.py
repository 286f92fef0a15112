"""Kernel-launching ops per ascent step of ``gs.sharpness``, over a plain pass (issue 43).

On a GPU a step costs what it launches. This counts, deterministically on the CPU, the aten
ops a whole call dispatches that would launch a kernel (``tests/launch_counter.py`` says which:
views, metadata ops and ``empty`` allocations are left out), the elements those ops write and
the dtype casts, under a ``TorchDispatchMode`` that sees the forward, the backward and the
geometry alike. Nothing is timed: the figures are the same from one run to the next.

For every configuration and measure:

- **per step** = ``(C(N₂) − C(N₁)) / (N₂ − N₁)``, ``C(N)`` the count of one whole, fresh
  ``gs.sharpness`` call (base-point cache cleared, symmetry finding included) with ``N`` Auto-PGD
  steps (the average case: ``N`` samples; curvature: ``N`` Lanczos iterations or Hutchinson
  probes, i.e. Hessian-vector products per batch), so that set-up and the clean pass cancel. A
  step covers every batch. ``N₁, N₂`` = 3, 8 (``--steps``; the issue's), 2, 3 for the exact
  geodesic (``--exact-steps``: its 10-step RK4 costs seconds per step here) and for curvature
  (``--products``). Steps are not all alike (the first has no momentum; a checkpoint that
  restarts from an older iterate skips the backward): the figure is the mean over those counted;
- **/plain**: the per-step launches over those of one *plain* forward+backward over the same
  batches (``torch.autograd.grad`` of the loss w.r.t. the trainable weights, eval mode);
- **P/batch-step**: the elements written per step beyond a plain pass, in units of ``P`` (the
  trainable, i.e. perturbed, parameters), per batch;
- **casts**: ``_to_copy`` to another dtype or ``copy_`` across dtypes, per step (all batches);
  **reads**: host reads (``.item()``), per step, also counted as launches; **fwd/bwd**: the
  forward and backward passes per step (``n_forward``, ``n_backward``; curvature: + HVPs);
- **set-up** = ``C(N₁) − N₁ · step``: symmetry finding, the perturbation's construction and the
  clean pass, over a plain pass (biased low where the first steps launch less than the mean:
  below zero for adaptive); **alone**: ``perturbation_of`` counted by itself (what
  ``gs.sharpness`` runs before its clean pass), and ``find_symmetries`` by itself.

The GL geometry runs its per-step products chunk by chunk of heads on a CPU (a chunk of widened
heads stays in cache) and in one batched pass per piece on a GPU. ``--path device`` (the
default) counts the GPU's path on this CPU (:func:`~geosharp.geometry.gl_execution.chunked_on`
with no device): the launches a GPU dispatches; ``--path cpu`` the CPU's own.

Run (``--list`` shows the configurations and measures; every configuration and measure took 31
min on a shared 2-core machine, 21 of them in the exact geodesic; ``--table FILE.json`` prints
the README's table of an earlier run):

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/launches.py \\
        --markdown --json launches.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import regimes  # noqa: E402
from tests.launch_counter import Count, count  # noqa: E402

import geosharp as gs  # noqa: E402
from geosharp.estimators.cache import clear_cache  # noqa: E402
from geosharp.estimators.harness import perturbation_of  # noqa: E402
from geosharp.geometry.gl_execution import chunked_on  # noqa: E402

SCHEMA = "geosharp-launches/1"

#: ``--path`` → the device types on which the GL geometry chunks its per-step products
#: (:func:`~geosharp.geometry.gl_execution.chunked_on`): none, as on a GPU (one batched pass
#: per piece: the launches a GPU dispatches), or the CPU's own chunks of heads (a chunk of
#: widened heads in cache; a few times the geometry's launches, which cost little on a CPU).
PATHS = {"device": (), "cpu": ("cpu",)}

#: measure → (what N counts, the call's keyword arguments without N). ``gs.sharpness`` unless
#: ``"curvature"`` is in the name (``gs.curvature``, geodesic inv). The cost does not depend on
#: the radius (the centres of Study 3's grids, as in ``regimes.py``; ℓ∞ a box of 1 %).
MEASURES: dict[str, tuple[str, dict[str, Any]]] = {
    "adaptive-l2": ("steps", dict(measure="adaptive", kind="worst", rho=0.316)),
    "adaptive-linf": ("steps", dict(measure="adaptive", kind="worst", rho=0.01, norm="linf")),
    "geodesic-inv-o2": ("steps", dict(measure="geodesic", metric="inv", order=2, rho=0.0316)),
    "geodesic-mix-o2": ("steps", dict(measure="geodesic", metric="mix", order=2, rho=0.0316)),
    "geodesic-inv-exact": (
        "steps",
        dict(measure="geodesic", metric="inv", order="exact", rho=0.0316),
    ),
    "geodesic-mix-exact": (
        "steps",
        dict(measure="geodesic", metric="mix", order="exact", rho=0.0316),
    ),
    "geodesic-inv-average": (
        "samples",
        dict(measure="geodesic", metric="inv", order=2, kind="average", rho=0.01),
    ),
    # one Lanczos iteration: a Hessian-vector product and the full reorthogonalization against
    # the basis so far (which grows with the iteration: the figure is the mean over N₁+1..N₂)
    "curvature-lanczos": ("iters", dict(quantities=("lambda_max",), tol=1e-30)),
    # one Hutchinson probe: a draw, a Hessian-vector product and a dot product
    "curvature-hvp": ("probes", dict(quantities=("trace",))),
}


def _llama_case(layers: int) -> Callable[[torch.device], regimes.Case]:
    """``regimes.py``'s Llama-GQA (TinyLlama's 32 heads, 4 key/value heads, MLP 2.75×) at
    hidden 256 (head dim 8), ``layers`` layers, one batch 4 × 32 of random ids."""
    return lambda d: regimes._llama(d, 256, layers, 32, 4, 4, 32)


def _minilm_small_all(device: torch.device) -> regimes.Case:
    case = regimes._minilm_small(device)
    case.model.requires_grad_(True)
    case.key_bias = None  # the library's default, as whole_call.py's minilm-small-all
    case.title = case.title.replace("embeddings frozen", "every weight perturbed")
    return case


#: name → (description, builder): ``regimes.py``'s where they exist.
CONFIGS: dict[str, tuple[str, Callable[[torch.device], regimes.Case]]] = {
    "minilm-small": regimes.CONFIGS["minilm-small"],
    "minilm-small-all": (
        "MiniLM-L6, Study 3's 2 batches of 16 snippets, every weight perturbed (22.7 M; "
        "whole_call.py's minilm-small-all)",
        _minilm_small_all,
    ),
    "minilm-32x64": regimes.CONFIGS["minilm-32x64"],
    "llama-gqa-66": (
        "Llama-GQA, 3 × the 22 layers of regimes.py's llama-1b (66), its heads (32, 4 key/value) "
        "at hidden 256; random weights, one batch 4 × 32",
        _llama_case(66),
    ),
    "llama-gqa-22": (
        "the same Llama-GQA with llama-1b's 22 layers (how the count grows with depth)",
        _llama_case(22),
    ),
}
DEFAULT_CONFIGS = "minilm-small,minilm-32x64,llama-gqa-22,llama-gqa-66"


def build(name: str) -> regimes.Case:
    """The configuration ``name`` on the CPU in float32, in eval mode."""
    case = CONFIGS[name][1](torch.device("cpu"))
    case.model.float().eval()
    return case


def _kwargs(case: regimes.Case, measure: str, n: int) -> dict[str, Any]:
    key, kw = MEASURES[measure]
    kw = dict(kw, **{key: n})
    if case.key_bias is not None:
        kw["key_bias"] = case.key_bias
    return kw


def _call(case: regimes.Case, measure: str, n: int) -> tuple[Count, Any]:
    """The count and result of one fresh call of ``measure`` with ``n`` steps (samples,
    products)."""
    clear_cache()
    fn = gs.curvature if "curvature" in measure else gs.sharpness
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. ExactStepsWarning: the count is what matters
        return count(
            fn, case.model, case.loss_fn, case.batches, progress=False, **_kwargs(case, measure, n)
        )


def _setup(case: regimes.Case, measure: str) -> Count | None:
    """The count of the set-up alone, as ``gs.sharpness`` makes it (``perturbation_of``:
    symmetry finding, the blocks' base point and factorizations, the layout; no clean pass);
    None for curvature, which builds its own."""
    if "curvature" in measure:
        return None
    kw = _kwargs(case, measure, 1)
    clear_cache()
    c, _ = count(
        perturbation_of,
        case.model,
        None,
        measure=kw["measure"],
        metric=kw.get("metric", "inv"),
        order=kw.get("order", 2),
        perturb="all",
        eps=0.0,
        corrected_norm=True,
        exact_steps=10,
        key_bias=kw.get("key_bias", "quotient"),
        low_memory=False,
        cache=False,
    )
    return c


def _counts(measure: str, steps: tuple[int, int], exact: tuple[int, int], products) -> tuple:
    if "curvature" in measure:
        return products
    return exact if "exact" in measure else steps


def _top(c: Count, k: float, n: int) -> list[list[Any]]:
    """The ``n`` ops with the most launches in ``c``, each ``[name, launches / k]``."""
    return [[name, launches / k] for name, launches, _ in c.top(n)]


def measure_config(
    name: str,
    measures: list[str],
    steps: tuple[int, int],
    exact: tuple[int, int],
    products: tuple[int, int],
    top: int,
) -> dict[str, Any]:
    """Every figure of one configuration."""
    case = build(name)
    n_batches = len(case.batches)
    P = sum(p.numel() for p in case.model.parameters() if p.requires_grad)
    for _ in range(2):
        regimes.plain_step(case)  # warm-up (lazy initializations)
    plain, _ = count(regimes.plain_step, case)
    again, _ = count(regimes.plain_step, case)
    if again.ops != plain.ops or again.op_elements != plain.op_elements:
        raise RuntimeError("two plain passes dispatched different ops: the count is not stable")
    find, _ = count(regimes.find_space, case)
    run: dict[str, Any] = {
        "config": name,
        "title": case.title,
        "n_params_total": sum(p.numel() for p in case.model.parameters()),
        "P": P,
        "n_batches": n_batches,
        "batch_shapes": [regimes._batch_shape(x) for x, _ in case.batches],
        "plain": dict(plain.summary(), top=_top(plain, 1, top)),
        "find_symmetries": dict(
            find.summary(), over_plain=find.launches / plain.launches, top=_top(find, 1, top)
        ),
        "measures": {},
    }
    for m in measures:
        n1, n2 = _counts(m, steps, exact, products)
        t0 = time.perf_counter()
        try:
            (low, r1), (high, r2) = _call(case, m, n1), _call(case, m, n2)
            alone = _setup(case, m)
        except Exception as err:  # one measure that fails must not lose the rest
            run["measures"][m] = {"error": f"{type(err).__name__}: {err}"}
            print(f"  {m}: error: {run['measures'][m]['error']}", flush=True)
            continue
        k = n2 - n1
        d = high - low
        step = {key: v / k for key, v in d.summary().items() if key != "views"}
        passes = ("n_forward", "n_backward") + (("n_hvp",) if "curvature" in m else ())
        step.update({p: (getattr(r2, p) - getattr(r1, p)) / k for p in passes})
        setup = {key: v - n1 * step[key] for key, v in low.summary().items() if key in step}
        run["measures"][m] = {
            "counts": [n1, n2],
            "per": MEASURES[m][0],
            "call_low": low.summary(),
            "call_high": high.summary(),
            "step": step,
            "step_over_plain": step["launches"] / plain.launches,
            "step_P_per_batch_beyond_plain": (step["elements"] - plain.elements) / (P * n_batches),
            "setup": setup,
            "setup_over_plain": setup["launches"] / plain.launches,
            "setup_P": setup["elements"] / P,
            "setup_alone": None if alone is None else alone.summary(),
            "setup_alone_over_plain": None if alone is None else alone.launches / plain.launches,
            "top_per_step": _top(d, k, top),
            "wall_s": time.perf_counter() - t0,
        }
        print(f"  {m}: {_row(run['measures'][m])}", flush=True)
    return run


def _passes(s: dict[str, Any]) -> str:
    """Forwards/backwards per step (curvature: + Hessian-vector products)."""
    out = f"{s['n_forward']:g}/{s['n_backward']:g}"
    return out + (f"/{s['n_hvp']:g}" if "n_hvp" in s else "")


def _alone(f: dict[str, Any]) -> str:
    return "—" if f["setup_alone_over_plain"] is None else f"{f['setup_alone_over_plain']:.1f}"


def _row(f: dict[str, Any]) -> str:
    s = f["step"]
    return (
        f"{s['launches']:9.0f} {f['step_over_plain']:7.2f} "
        f"{f['step_P_per_batch_beyond_plain']:8.2f} {s['casts']:6.0f} {s['host_reads']:6.0f} "
        f"{_passes(s):>8} {f['setup_over_plain']:7.1f} {_alone(f):>6}"
    )


HEAD = (
    f"  {'measure':<22}{'launches':>9} {'/plain':>7} {'P/b-step':>8} {'casts':>6} {'reads':>6} "
    f"{'fwd/bwd':>8} {'set-up':>7} {'alone':>6}"
)
LEGEND = (
    "  per step (all batches): launches, over a plain pass, elements written beyond a plain pass"
    " in P per batch,\n  casts, host reads, forwards/backwards(/HVPs); set-up: C(N1) - N1·step"
    " and perturbation_of alone, in plain passes"
)


def print_run(run: dict[str, Any]) -> None:
    p, f = run["plain"], run["find_symmetries"]
    print(
        f"\n{run['config']}: {run['title']}\n  P = {run['P']:,} trainable of "
        f"{run['n_params_total']:,}; {run['n_batches']} batch(es) {run['batch_shapes']}\n"
        f"  plain forward+backward: {p['launches']} launches, {p['elements'] / run['P']:.2f} P "
        f"written, {p['casts']} casts, {p['host_reads']} reads; find_symmetries: "
        f"{f['launches']} launches ({f['over_plain']:.2f} plain), {f['host_reads']} reads"
    )
    print(LEGEND)
    print(HEAD)
    for m, r in run["measures"].items():
        print(f"  {m:<22}{'error: ' + r['error'] if 'error' in r else _row(r)}")
    for m, r in run["measures"].items():
        if "error" not in r:
            per = {"iters": "iteration", "probes": "probe"}.get(r["per"], r["per"][:-1])
            ops = ", ".join(f"{o} {c:.0f}" for o, c in r["top_per_step"])
            print(f"  {m} per {per} ({r['counts'][0]}→{r['counts'][1]}): {ops}")


def markdown(runs: list[dict[str, Any]]) -> str:
    """The README's table: one row per (configuration, measure)."""
    lines = [
        "| configuration | measure | launches / step | / plain | P written / batch-step "
        "| casts / step | reads / step | fwd/bwd(/HVP) per step | set-up / plain "
        "| `perturbation_of` / plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        p, f = run["plain"], run["find_symmetries"]
        written = p["elements"] / (run["P"] * run["n_batches"])
        lines.append(
            f"| {run['config']} | plain pass | {p['launches']} | 1 | ({written:.2f} itself) "
            f"| {p['casts']} | {p['host_reads']} | {run['n_batches']}/{run['n_batches']} "
            f"| `find_symmetries` {f['over_plain']:.2f} | |"
        )
        for m, r in run["measures"].items():
            if "error" in r:
                lines.append(f"| | {m} | error | | | | | | | |")
                continue
            s = r["step"]
            lines.append(
                f"| | {m} | {s['launches']:.0f} | {r['step_over_plain']:.2f} "
                f"| {r['step_P_per_batch_beyond_plain']:.2f} | {s['casts']:.0f} "
                f"| {s['host_reads']:.0f} | {_passes(s)} | {r['setup_over_plain']:.1f} "
                f"| {_alone(r)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"(default {DEFAULT_CONFIGS})")
    ap.add_argument("--measures", default=",".join(MEASURES), help="(default: all)")
    ap.add_argument("--steps", default="3,8", help="N1,N2 steps or samples (3,8)")
    ap.add_argument("--exact-steps", default="2,3", help="N1,N2 steps of the exact geodesic (2,3)")
    ap.add_argument("--products", default="2,3", help="N1,N2 curvature iterations/probes (2,3)")
    ap.add_argument("--top", type=int, default=6, help="ops listed per step (6)")
    ap.add_argument(
        "--path",
        choices=PATHS,
        default="device",
        help="device: the GL geometry's products in one batched pass per piece, as on a GPU "
        "(the launches a GPU pays); cpu: chunk by chunk of heads, as on this CPU (default device)",
    )
    ap.add_argument("--markdown", action="store_true", help="also print the README's table")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--list", action="store_true", help="list configurations and measures")
    ap.add_argument(
        "--table", type=Path, default=None, help="print the README's table of a --json file, only"
    )
    args = ap.parse_args(argv)
    if args.table is not None:
        print(markdown(json.loads(args.table.read_text())["runs"]))
        return 0
    if args.list:
        for k, (text, _) in CONFIGS.items():
            print(f"{k:<18}{text}")
        for k, (per, kw) in MEASURES.items():
            print(f"{k:<22}per {per}: {kw}")
        return 0
    configs, measures = args.configs.split(","), args.measures.split(",")
    for bad, known, what in (
        (set(configs) - set(CONFIGS), CONFIGS, "configuration"),
        (set(measures) - set(MEASURES), MEASURES, "measure"),
    ):
        if bad:
            ap.error(f"unknown {what}(s) {sorted(bad)}; known: {', '.join(known)}")
    steps = tuple(int(s) for s in args.steps.split(","))
    exact = tuple(int(s) for s in args.exact_steps.split(","))
    products = tuple(int(s) for s in args.products.split(","))
    if not all(1 <= a < b for a, b in (steps, exact, products)):
        ap.error("--steps, --exact-steps and --products need 1 <= N1 < N2")
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": regimes.machine(torch.device("cpu")),
        "settings": {
            "configs": configs,
            "measures": measures,
            "steps": list(steps),
            "exact_steps": list(exact),
            "products": list(products),
            "path": args.path,
            "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "runs": [],
    }
    t0 = time.perf_counter()
    for name in configs:
        print(f"{name}: counting ...", flush=True)
        with chunked_on(PATHS[args.path]):
            run = measure_config(name, measures, steps, exact, products, args.top)
        run["path"] = args.path
        run["wall_s"] = time.perf_counter() - t0
        report["runs"].append(run)
        print_run(run)
        if args.json is not None:  # after every configuration: a crash later keeps the rest
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.markdown:
        print("\n" + markdown(report["runs"]))
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
