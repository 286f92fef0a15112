"""Data-parallel sharpness: two gloo processes under torchrun equal one process (SPEC §6).

The two-process tests launch real ``torchrun --nproc_per_node 2`` jobs on the CPU (gloo). This
file doubles as the worker script of the second launch (``python test_distributed.py OUT``).
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import geosharp as gs
from geosharp.demos.torchrun import demo_problem
from geosharp.estimators.distributed import (
    BatchSplit,
    batch_seed,
    init_distributed,
    is_active,
)

needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)

WORST = dict(measure="geodesic", metric="inv", order=2, rho=0.05, steps=10, seed=0)
AVERAGE = dict(measure="geodesic", metric="mix", kind="average", rho=0.05, samples=3, seed=4)
RESTARTS = dict(measure="adaptive", rho=0.05, steps=4, restarts=2, random_init=True, seed=9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], tmp_path: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _single(n_batches: int, **kw) -> gs.SharpnessResult:
    """The in-process, single-process reference, with torchrun's one thread per process."""
    model, loss_fn, batches = demo_problem(n_batches)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return gs.sharpness(model, loss_fn, batches, progress=False, distributed=False, **kw)
    finally:
        torch.set_num_threads(threads)


def _assert_same(dp: dict, ref: gs.SharpnessResult) -> None:
    # Each batch runs the same float64 operations on the same data with the same generator
    # seed and one thread in both runs, so the numbers are bit-identical (measured max |Δ| = 0);
    # 1e-12 would only allow float64 roundoff of O(1) losses.
    for key in ("per_batch", "clean_losses", "perturbed_losses", "traces"):
        assert dp[key] == getattr(ref, key), key
    assert dp["value"] == ref.value
    assert (dp["n_forward"], dp["n_backward"]) == (ref.n_forward, ref.n_backward)


@needs_gloo
def test_torchrun_two_processes_equal_one_process(tmp_path):
    out = tmp_path / "dp"
    _torchrun(["-m", "geosharp.demos.torchrun", "--out", str(out), "--steps", "10"], out.parent)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    ref = _single(4, **WORST)
    for r in ranks:  # every rank returns the same, complete result
        _assert_same(r["result"], ref)


@needs_gloo
def test_torchrun_average_case_restarts_errors_and_mismatches(tmp_path):
    _torchrun([__file__, str(tmp_path)], tmp_path)
    ranks = [json.loads((tmp_path / f"worker{r}.json").read_text()) for r in (0, 1)]
    for name, kw in (("average", AVERAGE), ("restarts", RESTARTS)):
        ref = _single(5, **kw)  # 5 batches: rank 0 measures 0, 2, 4 and rank 1 measures 1, 3
        for r in ranks:
            _assert_same(r[name], ref)
    # Rank 1 fails on batch 3; rank 0 raises the same error instead of waiting forever.
    for r in ranks:
        assert r["error"][0] == "FloatingPointError" and "batch 3 is bad" in r["error"][1]
        assert r["mismatch"][0] == "ValueError" and "disagree on the batches" in r["mismatch"][1]
        assert r["weights"][0] == "ValueError" and "disagree on the weights" in r["weights"][1]


@needs_gloo
def test_cluster_doc_example_runs_under_torchrun(tmp_path):
    doc = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"
    (code,) = [
        b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S) if "torchrun" in b
    ]
    (tmp_path / "measure.py").write_text(code)
    printed = _torchrun(["measure.py"], tmp_path)
    assert "geodesic-inv-o2 worst l2 (rho=0.05)" in printed and "over 4 batch(es)" in printed


def _worker(out: Path) -> None:
    rank, _ = init_distributed("gloo")
    model, loss_fn, batches = demo_problem(5)
    record = {}
    for name, kw in (("average", AVERAGE), ("restarts", RESTARTS)):
        record[name] = gs.sharpness(model, loss_fn, batches, progress=False, **kw).to_dict()

    def bad_loss(outputs, targets):
        if targets is batches[3][1]:
            raise FloatingPointError("batch 3 is bad")
        return loss_fn(outputs, targets)

    cases = {
        "error": lambda: gs.sharpness(model, bad_loss, batches, steps=2),
        "mismatch": lambda: gs.sharpness(model, loss_fn, batches[::-1] if rank else batches),
        "weights": lambda: gs.sharpness(demo_problem(5, seed=rank)[0], loss_fn, batches),
    }
    for name, call in cases.items():
        try:
            call()
            record[name] = None
        except Exception as err:
            record[name] = [type(err).__name__, str(err)]
    (out / f"worker{rank}.json").write_text(json.dumps(record))
    torch.distributed.destroy_process_group()


# -- one process -----------------------------------------------------------------------------------
def test_batch_randomness_depends_on_seed_and_index_only():
    # A batch measured alone with seed' = batch_seed(seed, b) gets the random start it gets as
    # batch b of a longer list: the property that makes the rank irrelevant.
    model, loss_fn, batches = demo_problem(3)
    kw = dict(measure="adaptive", rho=0.05, steps=3, random_init=True, progress=False)
    full = gs.sharpness(model, loss_fn, batches, seed=5, **kw)
    alone = gs.sharpness(model, loss_fn, batches[2:], seed=batch_seed(5, 2), **kw)
    assert alone.per_batch == full.per_batch[2:]
    assert batch_seed(5, 0) == 5 and batch_seed(-1, 0) == 2**64 - 1


def test_without_a_process_group_nothing_is_split():
    assert not is_active(None) and not is_active(False)
    with pytest.raises(RuntimeError, match=r"not initialized.*init_distributed"):
        is_active(True)
    with pytest.raises(TypeError, match="None, True or False"):
        is_active("yes")
    split = BatchSplit(iter([(1, 2), (3, 4)]), None)
    assert list(split.local()) == [(0, (1, 2)), (1, (3, 4))]
    assert split.gather([1.0], [2.0], [3.0], [], {"forward": 1}) == ([1.0], [2.0], [3.0], [])


def test_unlaunched_world_size_warns(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.warns(RuntimeWarning, match="every rank measures every batch"):
        assert not is_active(None)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
