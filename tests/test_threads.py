"""``--threads`` on every CLI path, and a smoke run of ``benchmarks/regimes.py``.

Both run in subprocesses: thread pools are process-wide, and the benchmark's memory figures
need fresh processes anyway.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REGIMES = ROOT / "benchmarks" / "regimes.py"

# Runs cli.main on every path with the heavy work stubbed out; each stub records the torch and
# BLAS threads it sees. Before each call both are set to 3, so a path that ignores --threads
# shows 3.
_CLI_SCRIPT = textwrap.dedent(
    """
    import ctypes, importlib, json, sys, types
    import torch

    # By path: the package attribute geosharp.measuring is the function measure().
    cli, measure_cli, merge, runner, study_report, symmetry_test = (
        importlib.import_module(f"geosharp.{name}")
        for name in ("cli", "measuring.cli", "studies.merge", "studies.runner",
                     "studies.study_report", "studies.symmetry_test")
    )

    def blas_threads():
        try:
            from threadpoolctl import threadpool_info
        except ImportError:
            pass
        else:
            found = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
            return found[0] if found else None
        import numpy  # noqa: F401
        with open("/proc/self/maps") as fh:
            paths = {l.split()[-1] for l in fh if "openblas" in l.lower()}
        for path in sorted(paths):
            lib = ctypes.CDLL(path)
            for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                         "openblas_get_num_threads"):
                if hasattr(lib, name):
                    return int(getattr(lib, name)())
        return None

    seen = []

    def record(*args, **kwargs):
        seen.append((torch.get_num_threads(), blas_threads()))

    def fake_run_study(*args, **kwargs):
        record()
        return types.SimpleNamespace(trained=0, measured=0, reused=0, time_s=0.0, report=None)

    def fake_symmetry_test(*args, **kwargs):
        record()
        return None, "table"

    def fake_report(*args, **kwargs):
        record()
        return types.SimpleNamespace(html="report.html")

    def fake_merge(*args, **kwargs):
        record()
        return types.SimpleNamespace(report=types.SimpleNamespace(html="report.html"))

    def fake_measure(args):
        record()
        return 0

    runner.run_study = fake_run_study
    study_report.report_from_folder = fake_report
    study_report.export_study = fake_report
    symmetry_test.symmetry_test = fake_symmetry_test
    merge.merge_shards = fake_merge
    measure_cli.run = fake_measure

    out = sys.argv[1]
    calls = {
        "study diagonal --threads 2": ["study", "diagonal", "--quick", "--threads", "2"],
        "study diagonal (default)": ["study", "diagonal", "--quick"],
        "symmetry-test diagonal --threads 2": [
            "symmetry-test", "diagonal", "--quick", "--threads", "2"],
        "symmetry-test diagonal (default)": ["symmetry-test", "diagonal", "--quick"],
        "report --threads 2": ["report", out, "--threads", "2"],
        "report (default)": ["report", out],
        "report --export --threads 2": ["report", out, "--export", out, "--threads", "2"],
        "merge --threads 2": ["merge", out, out, "--threads", "2"],
        "measure --threads 2": ["measure", "model.pt", "data.npz", "--threads", "2"],
    }
    result = {}
    for label, argv in calls.items():
        if argv[0] in ("study", "symmetry-test"):
            argv = argv + ["--out", out]
        cli.set_threads(3)
        seen.clear()
        code = cli.main(argv)
        result[label] = {"code": code, "seen": seen[:]}
    cli.set_threads(3)
    result["study diagonal --threads 0"] = {
        "code": cli.main(["study", "diagonal", "--quick", "--threads", "0", "--out", out]),
        "seen": [],
    }
    print("RESULT " + json.dumps(result))
    """
)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def test_every_cli_path_honours_threads(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    expected = {
        "study diagonal --threads 2": 2,
        "study diagonal (default)": 1,  # every study defaults to one thread
        "symmetry-test diagonal --threads 2": 2,
        "symmetry-test diagonal (default)": 1,
        "report --threads 2": 2,
        "report (default)": 3,  # report leaves the libraries' own setting
        "report --export --threads 2": 2,
        "merge --threads 2": 2,
        "measure --threads 2": 2,
    }
    for label, threads in expected.items():
        got = result[label]
        assert got["code"] == 0, label
        assert len(got["seen"]) == 1, label
        torch_threads, blas_threads = got["seen"][0]
        assert torch_threads == threads, label
        if blas_threads is not None:  # NumPy's BLAS found (OpenBLAS or threadpoolctl)
            assert blas_threads == threads, label
    assert result["study diagonal --threads 0"]["code"] == 2


def test_threads_help_documents_the_default(capsys):
    from geosharp.cli import DEFAULT_STUDY_THREADS, main

    for argv in (["study", "--help"], ["symmetry-test", "--help"], ["report", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "--threads" in text
        if argv[0] != "report":
            assert f"default {DEFAULT_STUDY_THREADS}" in text
        else:
            assert "default: the libraries' own" in text


def test_set_threads_rejects_zero():
    from geosharp.cli import set_threads

    with pytest.raises(ValueError, match="at least 1"):
        set_threads(0)


# -- benchmarks/regimes.py -----------------------------------------------------------------
RUN_FIELDS = {
    "config",
    "title",
    "dtype",
    "device",
    "threads",
    "eps",
    "n_params_total",
    "n_params_perturbed",
    "n_params_gl",
    "n_params_diagonal",
    "n_params_rest",
    "itemsize",
    "n_batches",
    "batch_shapes",
    "plain",
    "memory_mode",
    "measures",
    "probe_missing",
}
MACHINE_FIELDS = {
    "cpu_model",
    "logical_cpus",
    "usable_cpus",
    "memory_bytes",
    "platform",
    "python",
    "torch",
    "geosharp",
    "git_commit",
    "threads",
    "interop_threads",
    "env_threads",
    "load_average_start",
    "load_average_end",
    "device",
    "cuda_device",
    "cuda_version",
}
SETTINGS_FIELDS = {"configs", "measures", "dtypes", "device", "threads", "repeats", "steps"}
STEP_FIELDS = {"per_step_s", "ratio", "ratio_per_rep", "per_step_s_per_rep", "plain_s_per_rep"}
SETUP_FIELDS = {
    "first_call_s",
    "first_s",
    "first_ratio",
    "repeat_s",
    "repeat_ratio",
    "repeat_ratio_per_rep",
    "first_breakdown",
    "repeat_breakdown",
    "find_symmetries_separate",
}
BREAKDOWN_FIELDS = {
    "total_s",
    "find_symmetries_s",
    "perturbation_s",
    "clean_loss_s",
    "ascent_s",
    "fwd_bwd_s",
    "fwd_s",
    "noise_s",
    "n_fwd_bwd",
    "n_fwd",
    "ascent_geometry_s",
    "other_s",
}
MEMORY_FIELDS = {
    "method",
    "fresh_process",
    "param_buffer_bytes",
    "rss_or_allocated_after_build_bytes",
    "peak_plain_bytes",
    "peak_measure_bytes",
    "extra_bytes",
    "extra_param_buffers",
    "plain_above_model_param_buffers",
    "steps",
    "call_s",
    "call_breakdown",
}
CPU_MEMORY_FIELDS = {
    "maxrss_after_build_bytes",
    "peak_plain_maxrss_bytes",
    "peak_measure_maxrss_bytes",
    "extra_param_buffers_maxrss",
    "build_peak_masks_plain",
    "hwm_reset",
}
MEASURES = {"adaptive-l2", "geodesic-inv-o2", "geodesic-mix-o2", "geodesic-inv-o2-average"}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_regimes_smoke_tiny(tmp_path):
    out = tmp_path / "regimes.json"
    cmd = [sys.executable, str(REGIMES), "--configs", "tiny", "--repeats", "1", "--steps", "1,2"]
    cmd += ["--jobs", "4", "--json", str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "tiny [float32, cpu, 1 thread(s)]" in proc.stdout
    data = json.loads(out.read_text())
    assert data["schema"] == "geosharp-regimes/1"
    assert MACHINE_FIELDS <= set(data["machine"])
    assert data["machine"]["threads"] == 1
    assert SETTINGS_FIELDS <= set(data["settings"])
    (run,) = data["runs"]
    assert RUN_FIELDS <= set(run), RUN_FIELDS - set(run)
    assert run["n_params_perturbed"] == run["n_params_total"] > 0
    assert run["n_params_gl"] > 0 and run["itemsize"] == 4 and run["memory_mode"] == "subprocess"
    assert _finite(run["plain"]["fwd_bwd_s"]) and run["plain"]["fwd_bwd_s"] > 0
    assert set(run["measures"]) == MEASURES
    assert run["probe_missing"] == []  # every stage of gs.sharpness was timed
    for name, m in run["measures"].items():
        assert "error" not in m, (name, m.get("error"))
        assert STEP_FIELDS <= set(m["step"]), name
        assert SETUP_FIELDS <= set(m["setup"]), name
        for key in ("first_breakdown", "repeat_breakdown"):
            assert BREAKDOWN_FIELDS <= set(m["setup"][key]), (name, key)
        assert BREAKDOWN_FIELDS <= set(m["memory"]["call_breakdown"]), name
        fields = MEMORY_FIELDS | CPU_MEMORY_FIELDS
        assert fields <= set(m["memory"]), (name, fields - set(m["memory"]))
        assert m["memory"]["method"] in ("vmhwm_after_clear_refs", "ru_maxrss"), name
        assert m["memory"]["fresh_process"] is True, name
        assert m["memory"]["param_buffer_bytes"] == 4 * run["n_params_perturbed"]
        for value in (m["step"]["ratio"], m["setup"]["first_ratio"], m["setup"]["repeat_ratio"]):
            assert _finite(value), name
        assert _finite(m["step"]["per_step_s"]), name  # its sign is noise at this size
        assert _finite(m["memory"]["extra_param_buffers"]), name
        first, fresh = m["setup"]["first_breakdown"], m["memory"]["call_breakdown"]
        assert first["find_symmetries_s"] > 0 and first["perturbation_s"] > 0, name
        assert first["clean_loss_s"] > 0, name
        if m["settings"]["kind"] == "worst":  # N steps: N − 1 forward+backward, one forward
            assert first["ascent_s"] > 0 and (first["n_fwd_bwd"], first["n_fwd"]) == (0, 2)
            assert (fresh["n_fwd_bwd"], fresh["n_fwd"]) == (2 * (m["memory"]["steps"] - 1), 2)
        else:  # N samples: N forwards
            assert first["ascent_s"] == 0 and first["noise_s"] > 0, name
            assert (first["n_fwd_bwd"], first["n_fwd"]) == (0, 2), name
