"""The GPU table of issue 43 (deliverable 5): time and memory of each measure at four scales.

For each (configuration, dtype) of the table — a MiniLM-L6 shape at batch 32 × 64, the 335 M
BERT-large shape, the 1.1 B TinyLlama shape (float32 and bfloat16 each) and a Llama-2-7B shape
in bfloat16, all with random weights made on the device — one fresh subprocess measures, with
``benchmarks/regimes.py``'s definitions and timing (``regimes.time_config``, one measure at a
time so that a time-out keeps the measures done):

- ``plain_ms``: one plain forward+backward (``torch.autograd.grad`` w.r.t. every weight), the
  median over all repetitions;
- ``step_ratio``: per measure, one ascent step (average case: one sample) over the plain pass,
  ``(T(N₂) − T(N₁)) / (N₂ − N₁)`` of whole calls, the median over repetitions;
- ``setup_plain_steps``: the first call's set-up (symmetry search, base point and
  factorizations, clean pass; ``T(N₁) − N₁·step`` of the first call of each measure in the
  process, base-point cache cleared before it) in plain passes; the largest over the measures
  (each measure's figure is in ``raw.json``);
- ``peak_buffers_P``: per measure, the peak of an ``N₂`` call above the peak of a plain pass
  (CUDA: ``max_memory_allocated``, same process; CPU twin: resident set, ``VmHWM``), in
  parameter-sized buffers ``P · itemsize`` of the configuration's dtype.

The table's configurations run smallest first, each under its own time limit, all within
``--budget`` seconds; what is left when the budget runs out is recorded as skipped, with the
reason. Before a configuration starts, its memory need (weights, a plain pass's gradients and a
measure's extra buffers, per measure, plus a margin) is compared with the device's memory; a
measure that cannot fit is skipped with that reason (the 7 B shape's geodesic measures on an
80 GB card). ``summary.json`` — ``{"device", "torch", "configs": {NAME: {"params", "dtype",
"batch", "plain_ms", "step_ratio", "setup_plain_steps", "peak_buffers_P"}}}``, with
``"skipped"`` / ``"errors"`` (what → why) where something did not run — ``raw.json`` (every
figure of every child), ``table.md`` and ``log.txt`` are rewritten after every configuration.

GPU (one call; see benchmarks/README.md, "The GPU table of issue 43")::

    PYTHONPATH=src HF_HUB_OFFLINE=1 python3 benchmarks/gpu_table.py --device cuda \\
        --out $OUT/gpu-table --budget 420

CPU twin (tiny shapes of the same models, seconds)::

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpu_table.py \\
        --device cpu --tiny --out /tmp/gpu-table-twin --budget 120
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # the repository's geosharp, also without PYTHONPATH
    sys.path.insert(0, str(ROOT / "src"))

import regimes  # noqa: E402  (benchmarks/ is this script's folder)
import torch  # noqa: E402

SCHEMA = "geosharp-gpu-table/1"
CHILD_TAG = "GPU-TABLE-CHILD "

#: The measures of the table, in the order each child measures them.
MEASURES = ("adaptive-l2", "geodesic-inv-o2", "geodesic-mix-o2", "geodesic-inv-o2-average")

#: Parameter-sized buffers a call holds above a plain pass, for the memory estimate (rounded up
#: from the H200's 335 M BERT float32 figures of 2026-12-04: adaptive 2.72, geodesic inv 4.84,
#: mix 4.83, average 2.02; unknown measures: 5).
EXTRA_BUFFERS = {
    "adaptive-l2": 3.0,
    "geodesic-inv-o2": 5.0,
    "geodesic-mix-o2": 5.0,
    "geodesic-inv-o2-average": 2.5,
}

#: Tiny shapes of the table's models for the CPU twin (random weights, built like the big ones).
TINY_CONFIGS = {
    "tiny-bert": (
        "BERT from a BertConfig (32, 2 layers, 2 heads), batch 2 × 8 (CPU twin)",
        lambda d: regimes._bert(d, 32, 2, 2, 2, 8),
    ),
    "tiny-llama": (
        "Llama-GQA from a LlamaConfig (32, 2 layers, 4 heads, 2 key/value heads), batch 2 × 8 "
        "(CPU twin)",
        lambda d: regimes._llama(d, 32, 2, 4, 2, 2, 8),
    ),
    "tiny-llama-7b-shape": (
        "Llama-2-7B's proportions at width 64 (2 layers, 4 heads, MLP 172), batch 1 × 16 "
        "(CPU twin)",
        lambda d: regimes._llama(d, 64, 2, 4, 4, 1, 16, intermediate=172),
    ),
}
regimes.CONFIGS.update(TINY_CONFIGS)  # so that regimes.build finds them (here and in children)


@dataclass(frozen=True)
class Entry:
    """One row of the table: a regimes.py configuration in one dtype, with its time limit."""

    config: str
    dtype: str
    #: seconds at ``--budget 420`` (scaled with the budget); None: whatever is left
    cap_s: float | None
    #: repetitions per measure (None: ``--repeats``)
    repeats: int | None = None

    @property
    def name(self) -> str:
        return f"{self.config}/{self.dtype}"


#: Smallest first: the 7 B shape (the largest risk) comes last and gets what is left.
GPU_TABLE = (
    Entry("minilm-shape-32x64", "float32", 40),
    Entry("minilm-shape-32x64", "bfloat16", 40),
    Entry("bert-335m", "float32", 70),
    Entry("bert-335m", "bfloat16", 70),
    Entry("llama-1b", "float32", 90, repeats=2),
    Entry("llama-1b", "bfloat16", 90, repeats=2),
    Entry("llama-7b", "bfloat16", None, repeats=2),
)
TINY_TABLE = (  # no caps: interpreter starts alone take seconds on a loaded 2-core machine
    Entry("tiny-bert", "float32", None),
    Entry("tiny-bert", "bfloat16", None),
    Entry("tiny-llama", "float32", None),
    Entry("tiny-llama", "bfloat16", None),
    Entry("tiny-llama-7b-shape", "bfloat16", None),
)
REFERENCE_BUDGET_S = 420.0


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make new floating tensors in ``dtype`` (a bfloat16 7 B model is built as such on the
    device: no float32 copy first)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def batch_text(case: regimes.Case) -> str:
    """``"8 × 64"`` (rows × tokens) for one batch; ``"2 × (16 × 32)"`` for two alike."""
    shapes = [" × ".join(map(str, regimes._batch_shape(x))) for x, _ in case.batches]
    if len(shapes) == 1:
        return shapes[0]
    if len(set(shapes)) == 1:
        return f"{len(shapes)} × ({shapes[0]})"
    return " + ".join(shapes)


def describe(config: str, dtype: str) -> dict[str, Any]:
    """Parameters, batch and title of a configuration, from a model built on the meta device
    (no memory, no device): what the table needs before (or without) running it."""
    with default_dtype(regimes.DTYPES[dtype]):
        case = regimes.CONFIGS[config][1](torch.device("meta"))
    params = sum(p.numel() for p in case.model.parameters())
    trainable = sum(p.numel() for p in case.model.parameters() if p.requires_grad)
    return {
        "params": params,
        "trainable": trainable,
        "batch": batch_text(case),
        "title": case.title,
    }


def memory_need(trainable: int, params: int, itemsize: int, measure: str) -> int:
    """Bytes a call of ``measure`` needs at its peak, estimated: the weights, the gradients of a
    plain pass, the measure's extra parameter-sized buffers, and 1 GiB + 5 % for activations,
    the CUDA context and fragmentation (the activations of the table's batches are small)."""
    unit = trainable * itemsize
    core = params * itemsize + unit + EXTRA_BUFFERS.get(measure, 5.0) * unit
    return int(1.05 * core + 2**30)


# -- the child: one configuration in one process -------------------------------------------------
def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def child(spec: dict[str, Any]) -> None:
    """Measure one configuration; rewrite ``spec["partial"]`` after every stage."""
    t_start = time.perf_counter()
    torch.set_num_threads(spec["threads"])
    device, dtype = torch.device(spec["device"]), regimes.DTYPES[spec["dtype"]]
    partial = Path(spec["partial"])
    out: dict[str, Any] = {"spec": spec, "stage": "start", "measures": {}, "plain_s_samples": []}
    if device.type == "cuda":
        torch.cuda.init()
        out["cuda_init_s"] = time.perf_counter() - t_start
    out["machine"] = regimes.machine(device)
    _write_json(partial, out)

    t0 = time.perf_counter()
    with default_dtype(dtype):
        case = regimes.build(spec["config"], device, dtype)
    regimes._sync(device)
    out["build_s"] = time.perf_counter() - t0
    trainable = [p for p in case.model.parameters() if p.requires_grad]
    out["title"] = case.title
    out["n_params_total"] = sum(p.numel() for p in case.model.parameters())
    out["n_params_trainable"] = sum(p.numel() for p in trainable)
    out["itemsize"] = dtype.itemsize
    out["batch"] = batch_text(case)
    if device.type == "cuda":
        out["allocated_after_build_bytes"] = torch.cuda.memory_allocated(device)
    out["stage"] = "built"
    _write_json(partial, out)
    print(CHILD_TAG + f"built in {out['build_s']:.1f} s: {case.title}", flush=True)

    # One symmetry search for every call (timed twice: a first and a repeated search), as
    # regimes.py --reuse-space; each measure's first-call set-up includes the first one.
    find_s = []
    space = None
    for _ in range(2):
        t0 = time.perf_counter()
        space = regimes.find_space(case)
        find_s.append(time.perf_counter() - t0)
    out["find_symmetries_s"] = find_s
    out["n_params_perturbed"] = space.numel()
    out["stage"] = "space found"
    _write_json(partial, out)
    print(
        CHILD_TAG + f"symmetries found in {find_s[0]:.1f} s, again in {find_s[1]:.1f} s", flush=True
    )

    n1, n2 = spec["steps"]
    cuda_memory = device.type == "cuda" and n2 >= 3
    for m in spec["measures"]:
        t0 = time.perf_counter()
        out["stage"] = f"measuring {m}"
        _write_json(partial, out)
        try:
            plain, figures = regimes.time_config(
                case,
                [m],
                n1,
                n2,
                spec["repeats"],
                spec["eps"],
                device,
                cuda_memory=cuda_memory,
                found_space=(space, find_s),
            )
        except Exception as err:  # one measure's failure must not lose the others
            out["measures"][m] = {"error": f"{type(err).__name__}: {err}"}
        else:
            fig = figures[m]
            if device.type != "cuda" and "error" not in fig:  # the twin: resident set
                try:
                    steps = max(n2, 3)
                    fig["memory"] = regimes.memory_figures(
                        case, m, steps, spec["eps"], device, fresh=False
                    )
                except Exception as err:
                    fig["memory"] = {"error": f"{type(err).__name__}: {err}"}
            out["measures"][m] = fig
            out["plain_s_samples"] += plain["samples_s"]
        out["measures"][m]["wall_s"] = time.perf_counter() - t0
        gc.collect()
        if device.type == "cuda":  # what is left allocated (the model, its batches) and free
            torch.cuda.empty_cache()
            out["allocated_after_measures_bytes"] = torch.cuda.memory_allocated(device)
            out["total_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        out["child_wall_s"] = time.perf_counter() - t_start
        _write_json(partial, out)
        print(CHILD_TAG + f"{m} done in {out['measures'][m]['wall_s']:.1f} s", flush=True)
    out["stage"] = "done"
    out["child_wall_s"] = time.perf_counter() - t_start
    _write_json(partial, out)


# -- the parent: the table ---------------------------------------------------------------------
def device_info(device: torch.device, memory_gib: float | None) -> dict[str, Any]:
    """What ran the table, and the memory the estimates are compared with."""
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["name"] = props.name
        info["total_memory_bytes"] = props.total_memory
        info["cuda"] = torch.version.cuda
        text = f"{props.name}, {props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}"
    else:
        cpu, total = regimes.cpu_and_memory()
        info["name"] = cpu
        info["total_memory_bytes"] = total
        text = f"cpu: {cpu}"
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    if memory_gib is not None:
        info["total_memory_bytes"] = int(memory_gib * 2**30)
        info["memory_overridden"] = True
        text += f" (memory taken as {memory_gib:g} GiB by --device-memory-gib)"
    info["text"] = text
    return info


def summarize(meta: dict[str, Any], dtype: str, res: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's entry for one configuration from its child's figures (None: not run)."""
    entry: dict[str, Any] = {
        "params": int(meta.get("params") or 0),
        "dtype": dtype,
        "batch": str(meta.get("batch", "")),
        "plain_ms": None,
        "step_ratio": {},
        "setup_plain_steps": None,
        "peak_buffers_P": {},
    }
    if res is None:
        return entry
    samples = [s for s in res.get("plain_s_samples", []) if s is not None]
    if samples:
        entry["plain_ms"] = 1e3 * statistics.median(samples)
    setups = []
    errors: dict[str, str] = {}
    for m, fig in res.get("measures", {}).items():
        if "error" in fig:
            errors[m] = fig["error"]
            continue
        ratio = (fig.get("step") or {}).get("ratio")
        if ratio is not None:
            entry["step_ratio"][m] = float(ratio)
        first = (fig.get("setup") or {}).get("first_ratio")
        if first is not None:
            setups.append(float(first))
        mem = fig.get("memory") or {}
        if "error" in mem:
            errors[f"{m} memory"] = mem["error"]
        elif mem.get("extra_param_buffers") is not None:
            entry["peak_buffers_P"][m] = float(mem["extra_param_buffers"])
    if setups:
        entry["setup_plain_steps"] = max(setups)
    if errors:
        entry["errors"] = errors
    return entry


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table_md(summary: dict[str, Any], measures: list[str]) -> str:
    """``summary.json`` as a Markdown table (what a reader of the log sees first)."""
    short = {
        "adaptive-l2": "adaptive",
        "geodesic-inv-o2": "geo inv",
        "geodesic-mix-o2": "geo mix",
        "geodesic-inv-o2-average": "geo inv avg",
    }
    names = [short.get(m, m) for m in measures]
    head = ["config", "params", "batch", "plain ms", "set-up (plain)"]
    head += [f"step {n}" for n in names] + [f"peak P {n}" for n in names] + ["not run"]
    lines = [
        f"{summary['device']}, torch {summary['torch']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, c in summary["configs"].items():
        row = [name, f"{c['params'] / 1e6:.1f} M", c["batch"], _fmt(c["plain_ms"], ".1f")]
        row.append(_fmt(c["setup_plain_steps"], ".0f"))
        row += [_fmt(c["step_ratio"].get(m), ".2f") for m in measures]
        row += [_fmt(c["peak_buffers_P"].get(m), ".2f") for m in measures]
        notes = [f"{k}: {v}" for k, v in {**c.get("skipped", {}), **c.get("errors", {})}.items()]
        row.append("; ".join(notes).replace("|", "/") or "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


class Table:
    """The output folder: summary.json, raw.json, table.md and log.txt, rewritten as it goes."""

    def __init__(self, out: Path, info: dict[str, Any], settings: dict[str, Any]) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.summary: dict[str, Any] = {
            "device": info["text"],
            "torch": info["torch"],
            "configs": {},
        }
        self.raw: dict[str, Any] = {
            "schema": SCHEMA,
            "device": info,
            "settings": settings,
            "configs": {},
        }
        self.measures = settings["measures"]
        self.log = out / "log.txt"
        self.log.write_text("")

    def say(self, text: str) -> None:
        print(text, flush=True)
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")

    def put(self, name: str, entry: dict[str, Any], raw: dict[str, Any]) -> None:
        self.summary["configs"][name] = entry
        self.raw["configs"][name] = raw
        self.flush()

    def flush(self) -> None:
        _write_json(self.out / "summary.json", self.summary)
        _write_json(self.out / "raw.json", self.raw)
        (self.out / "table.md").write_text(table_md(self.summary, self.measures))


def run_child(spec: dict[str, Any], limit: float, workdir: Path) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter under ``limit`` seconds; its figures so far
    (also after a time-out or a crash), with ``rc``, ``timed_out``, ``wall_s`` and its output."""
    log = workdir / (spec["name"].replace("/", "_") + ".log")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            rc = proc.wait()
    wall = time.perf_counter() - t0
    res: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        res = json.loads(Path(spec["partial"]).read_text())
    res.update(rc=rc, timed_out=timed_out, wall_s=wall, limit_s=limit)
    res["output_tail"] = log.read_text(encoding="utf-8", errors="replace")[-4000:]
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda[:N] or cpu (default cuda)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the four files")
    parser.add_argument(
        "--budget", type=float, default=420.0, help="seconds for the whole table (default 420)"
    )
    parser.add_argument("--tiny", action="store_true", help="the CPU twin's tiny shapes")
    parser.add_argument(
        "--configs",
        default=None,
        help="a subset of the table, e.g. bert-335m/float32,llama-7b/bfloat16 (default: all)",
    )
    parser.add_argument("--measures", default=",".join(MEASURES), help="(default: the four)")
    parser.add_argument(
        "--steps", default=None, help="N1,N2 steps of the timed calls (2,6; --tiny: 1,3)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repetitions per measure (3, 2 for the Llamas; --tiny: 1)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument(
        "--min-start", type=float, default=20.0, help="seconds a configuration needs to start (20)"
    )
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="memory the estimates are compared with (default: the device's)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    explicit_repeats = args.repeats is not None
    if args.child is not None:
        child(json.loads(args.child))
        return 0
    if args.out is None:
        parser.error("--out is required")
    t_start = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU (the CPU twin: --device cpu --tiny)")
    table = TINY_TABLE if args.tiny else GPU_TABLE
    if args.configs is not None:
        known = {e.name: e for e in GPU_TABLE + TINY_TABLE}
        wanted = args.configs.split(",")
        bad = [w for w in wanted if w not in known]
        if bad:
            parser.error(f"unknown {bad}; known: {', '.join(known)}")
        table = tuple(known[w] for w in wanted)
    measures = args.measures.split(",")
    if set(measures) - set(regimes.MEASURES):
        parser.error(f"unknown measures {sorted(set(measures) - set(regimes.MEASURES))}")
    if args.steps is None:
        args.steps = "1,3" if args.tiny else "2,6"
    n1, n2 = (int(s) for s in args.steps.split(","))
    if args.repeats is None:
        args.repeats = 1 if args.tiny else 3
    elif args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not 1 <= n1 < n2:
        parser.error("--steps needs 1 <= N1 < N2")
    info = device_info(device, args.device_memory_gib)
    settings = {
        "argv": sys.argv[1:] if argv is None else list(argv),
        "device": str(device),
        "budget_s": args.budget,
        "measures": measures,
        "steps": [n1, n2],
        "repeats": args.repeats,
        "repeats_explicit": explicit_repeats,
        "threads": args.threads,
        "min_start_s": args.min_start,
        "table": [e.name for e in table],
        "extra_buffers_estimate": EXTRA_BUFFERS,
    }
    out = Table(args.out, info, settings)
    out.say(
        f"gpu_table: {info['text']}; torch {info['torch']}; {len(table)} configuration(s), "
        f"budget {args.budget:.0f} s, steps {n1},{n2}, {args.repeats} repetition(s)"
    )
    workdir = Path(tempfile.mkdtemp(prefix="gpu-table-"))
    try:
        run_table(table, args, out, measures, info, workdir, t_start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out.raw["wall_s"] = time.monotonic() - t_start
    out.flush()
    out.say(f"gpu_table: {out.raw['wall_s']:.0f} s; written {args.out}/summary.json")
    return 0


def run_table(
    table: tuple[Entry, ...],
    args: argparse.Namespace,
    out: Table,
    measures: list[str],
    info: dict[str, Any],
    workdir: Path,
    t_start: float,
) -> None:
    """Each configuration in turn: its memory estimate, its time limit, its child, its entry."""
    n1, n2 = out.raw["settings"]["steps"]
    scale = args.budget / REFERENCE_BUDGET_S
    total_mem = info.get("total_memory_bytes")
    explicit_repeats = out.raw["settings"]["repeats_explicit"]
    for i, e in enumerate(table):
        raw: dict[str, Any] = {"config": e.config, "dtype": e.dtype}
        skipped: dict[str, str] = {}
        try:
            meta = describe(e.config, e.dtype)
        except Exception as err:
            meta = {}
            raw["describe_error"] = f"{type(err).__name__}: {err}"
        raw["meta"] = meta
        itemsize = regimes.DTYPES[e.dtype].itemsize
        run_measures = list(measures)
        if meta and total_mem:
            need = {
                m: memory_need(meta["trainable"], meta["params"], itemsize, m) for m in measures
            }
            raw["memory_need_bytes"] = need
            for m in measures:
                if need[m] > total_mem:
                    skipped[m] = (
                        f"does not fit: needs about {need[m] / 2**30:.1f} GiB (weights, "
                        f"gradients, {EXTRA_BUFFERS.get(m, 5.0):g} P for the measure, margin) "
                        f"of {total_mem / 2**30:.1f} GiB"
                    )
            run_measures = [m for m in measures if m not in skipped]
        left = args.budget - (time.monotonic() - t_start)
        res = None
        if not run_measures:
            skipped["config"] = "no measure fits in the device's memory"
        elif left < args.min_start:
            skipped["config"] = (
                f"out of time: {max(left, 0):.0f} s of the {args.budget:.0f} s budget left, "
                f"a configuration needs {args.min_start:.0f} s to start"
            )
        else:
            limit = left if e.cap_s is None else min(e.cap_s * scale, left)
            out.say(
                f"[{i + 1}/{len(table)}] {e.name}: {meta.get('title', '?')}; limit {limit:.0f} s"
            )
            spec = {
                "name": e.name,
                "config": e.config,
                "dtype": e.dtype,
                "device": out.raw["settings"]["device"],
                "measures": run_measures,
                "steps": [n1, n2],
                "repeats": args.repeats if explicit_repeats or e.repeats is None else e.repeats,
                "eps": 1e-6 if e.dtype == "bfloat16" else 0.0,
                "threads": args.threads,
                "partial": str(workdir / (e.name.replace("/", "_") + ".json")),
            }
            res = run_child(spec, limit, workdir)
            with open(out.log, "a", encoding="utf-8") as fh:
                fh.write(f"--- {e.name} (child output) ---\n{res['output_tail']}\n---\n")
            raw["child"] = res
            for m in run_measures:
                if m not in res.get("measures", {}):
                    why = (
                        f"not finished within the configuration's limit of {limit:.0f} s"
                        if res["timed_out"]
                        else f"not reached: the child ended with exit status {res['rc']}"
                    )
                    skipped[m] = f"{why} (its stage then: {res.get('stage', 'start')})"
        if not meta and res is not None and "n_params_total" in res:
            meta = {"params": res["n_params_total"], "batch": res.get("batch", "")}
        entry = summarize(meta, e.dtype, res)
        if res is not None and res["rc"] != 0 and not res["timed_out"]:
            tail = [ln for ln in res["output_tail"].strip().splitlines() if ln.strip()][-2:]
            entry.setdefault("errors", {})["config"] = f"exit {res['rc']}: " + " | ".join(tail)
        if skipped:
            entry["skipped"] = skipped
        if "describe_error" in raw:
            entry.setdefault("errors", {})["describe"] = raw["describe_error"]
        out.put(e.name, entry, raw)
        ratios = ", ".join(f"{m} {v:.2f}" for m, v in entry["step_ratio"].items())
        peaks = ", ".join(f"{m} {v:.2f}" for m, v in entry["peak_buffers_P"].items())
        wall = f" in {res['wall_s']:.1f} s" if res is not None else ""
        out.say(
            f"  {e.name}{wall}: plain {_fmt(entry['plain_ms'], '.1f')} ms; step/plain: "
            f"{ratios or '—'}; first set-up {_fmt(entry['setup_plain_steps'], '.1f')} plain "
            f"steps; peak P: {peaks or '—'}"
        )
        for k, v in {**entry.get("skipped", {}), **entry.get("errors", {})}.items():
            out.say(f"  {e.name}: {k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
