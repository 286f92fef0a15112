"""``geosharp measure --fsdp`` under ``torchrun`` on this machine's GPUs against one process.

    python benchmarks/gpu_cli_check.py OUT [NPROC]

Saves the tiny BERT of ``tests/test_measure.py`` and 8 labelled sentences into ``OUT``, then runs
``torchrun --standalone --nproc-per-node NPROC -m geosharp measure ... --fsdp`` (nccl and one GPU
per rank when CUDA is available, gloo on CPUs) and the same command as one process with
``--device cuda`` (``cpu`` without CUDA), both in float64, and prints every measure's two values
and their relative difference. Exits with 1 when a run fails or a value differs by more than
1e-10 (the tolerance of ``tests/measure/test_fsdp_cli.py``). NPROC defaults to the number of
GPUs (2 processes on a CPU machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.measure.test_fsdp_cli import SENTENCES  # noqa: E402
from tests.test_measure import save_tiny_bert  # noqa: E402

MEASURES = ["adaptive-l2", "geodesic-inv-o2", "geodesic-mix-o2", "geodesic-inv-exact"]
ARGS = [
    "--measures", *MEASURES, "--rho", "0.3", "--steps", "5", "--batch-size", "4",
    "--max-length", "16", "--no-progress", "--dtype", "float64",
]  # fmt: skip


def run(cmd: list[str], out: Path) -> tuple[dict | None, float]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    took = time.perf_counter() - t
    print(f"$ {' '.join(cmd[-8:])}  [{took:.1f} s, rc {proc.returncode}]")
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        return None, took
    print("\n".join(line for line in proc.stdout.splitlines() if "fsdp:" in line))
    return json.loads((out / "results.json").read_text()), took


def main(out: Path, nproc: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model = out / "bert"
    model.mkdir(exist_ok=True)
    save_tiny_bert(model)
    data = out / "train.csv"
    data.write_text("text,label\n" + "".join(f'"{t}",{y}\n' for t, y in SENTENCES))
    cuda = torch.cuda.is_available()
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    common = [str(model), str(data), *ARGS]
    sharded, t_sharded = run(
        [torchrun, "--standalone", "--nproc-per-node", str(nproc), "-m", "geosharp", "measure",
         *common, "--out", str(out / "sharded"), "--fsdp"],
        out / "sharded",
    )  # fmt: skip
    whole, t_whole = run(
        [sys.executable, "-m", "geosharp", "measure", *common, "--device",
         "cuda" if cuda else "cpu", "--out", str(out / "whole")],
        out / "whole",
    )  # fmt: skip
    if sharded is None or whole is None:
        return 1
    fsdp = sharded["settings"]["fsdp"]
    print(f"sharded: world {fsdp['world']}, backend {fsdp['backend']}; {t_sharded:.1f} s")
    print(f"one process on {'cuda' if cuda else 'cpu'}: {t_whole:.1f} s")
    worst = 0.0
    for a, b in zip(sharded["results"], whole["results"], strict=True):
        d = abs(a["value"] - b["value"]) / max(abs(b["value"]), 1e-300)
        worst = max(worst, d)
        print(f"{a['measure']:<32} rho {a['rho']:<5} {a['value']:.12g}  {b['value']:.12g}  {d:.1e}")
    print(f"max relative difference {worst:.2e}")
    return 0 if worst <= 1e-10 else 1


if __name__ == "__main__":
    n = torch.cuda.device_count() if torch.cuda.is_available() else 2
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else n))
