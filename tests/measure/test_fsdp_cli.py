"""``geosharp measure --fsdp`` under ``torchrun`` equals ``geosharp measure`` (issue 27).

A tiny BERT for sequence classification (built from a config, with a WordPiece tokenizer written
here: nothing is downloaded) and a CSV of 8 sentences in 2 batches of 4 rows are measured by
``torchrun --standalone --nproc-per-node 2 -m geosharp measure ... --fsdp`` (gloo on CPU: two
layers and the root under ``fully_shard``, 2 rows of every batch per rank) and by the unsharded
command in this process. Asserted:

- float32, at ρ = 3 (the base point a copy of the shards): every value within 1e-5 (relative)
  of the unsharded one, and every clean and perturbed loss within 1e-6;
- float32, at ρ = 0.3 (adaptive: θ′ added into the shards in place): the losses within 1e-6 and
  the value within 1e-5 of the clean loss (a value of 3e-3 is a difference of two losses of
  1.1, whose float32 rounding, 1e-7, is a larger part of it; measured: 2e-5 of the value);
- float64, at ρ = 0.3 and 3: every value within 1e-10 (relative), every loss within 1e-12,
  geodesic sharpness (inv and mix, order 2) included: its GL(h) blocks of the attention heads
  on each rank's rows, ``W_q``, ``W_k``, ``W_v`` sharded along dimension 1
  (``geosharp.shard_placement``, which ``--fsdp`` uses); and two curvature measures (no ρ:
  geodesic-inv λ_max by Lanczos, the adaptive trace by Hutchinson with its standard error),
  values within 1e-10 (relative) as well;
- rank 0 alone prints the table and writes the results, which record the sharding and what was
  skipped; and a bad combination is refused in one line, exit status 2, before anything loads.

A PEFT LoRA adapter of a tiny Llama (the base frozen, sharded with it) on a ``.txt`` corpus, the
causal-lm task: the ranks hold unequally many tokens of a batch, and the built-in cross-entropy
weighed by each rank's share of them gives the one-process values within 1e-10 in float64, the
geodesic (mix, order 2) on the adapter's GL(r) blocks included (LoRA's ``A`` sharded along
dimension 1).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from geosharp.cli import main

from ..test_measure import SENTENCES as _SIX
from ..test_measure import save_tiny_bert

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")

SENTENCES = [*_SIX, ("the film was good", 2), ("a bad movie", 0)]  # 8 rows: 2 ranks × 4
MEASURES = ["adaptive-l2", "euclidean-l2", "adaptive-linf"]
#: Measured in float64 only (the blocks' geometry on each rank's rows, SPEC §10.6; the exact
#: geodesic's stages, and the average case's noise drawn by every rank as one process draws it).
GEODESIC = ["geodesic-inv-o2", "geodesic-mix-o2", "geodesic-inv-exact", "adaptive-average"]
#: Measured in float64 only: gs.curvature's sharded Hessian-vector products (4 Lanczos
#: iterations, 2 Hutchinson probes per batch: the same start and probes as one process).
CURVATURE = ["curvature-inv-lmax", "curvature-adaptive-trace", "--iters", "4", "--probes", "2"]
REST = [
    "--rho", "0.3", "3", "--steps", "5", "--batch-size", "4", "--max-length", "16",
    "--no-progress", "--threads", "1",
]  # fmt: skip
COMMON = ["--measures", *MEASURES, *REST]
ARGS = {"float32": COMMON, "float64": ["--measures", *MEASURES, *GEODESIC, *CURVATURE, *REST]}


@pytest.fixture(scope="module")
def bert_and_data(tmp_path_factory):
    """A tiny ``BertForSequenceClassification`` (3 labels, 2 layers) and a CSV of 8 rows."""
    d = tmp_path_factory.mktemp("fsdpbert")
    model = d / "bert"
    model.mkdir()
    save_tiny_bert(model)
    data = d / "train.csv"
    data.write_text("text,label\n" + "".join(f'"{t}",{y}\n' for t, y in SENTENCES))
    return model, data


def _torchrun(model, data, out, dtype, args=COMMON):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        torchrun, "--standalone", "--nproc-per-node", "2", "-m", "geosharp", "measure",
        str(model), str(data), *args, "--dtype", dtype, "--out", str(out), "--fsdp",
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fsdp_under_torchrun_equals_one_process(bert_and_data, tmp_path, capsys, dtype):
    if not dist.is_available():
        pytest.skip("torch without distributed")
    model, data = bert_and_data
    args = ARGS[dtype]
    sharded = _torchrun(model, data, tmp_path / "sharded", dtype, args)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    code = main(["measure", str(model), str(data), *args, "--dtype", dtype, "--out",
                 str(tmp_path / "whole")])  # fmt: skip
    capsys.readouterr()
    assert code == 0
    got = json.loads((tmp_path / "sharded" / "results.json").read_text())
    want = json.loads((tmp_path / "whole" / "results.json").read_text())

    # rank 0 alone prints the table and writes; the result says how it was sharded
    assert sharded.stdout.count("results: ") == 1
    assert sharded.stdout.count("adaptive worst linf") == 4  # 2 progress lines, 2 table rows
    assert "fsdp: 2 layer(s) (BertLayer) and the root sharded over 2 rank(s) (gloo" in (
        sharded.stdout
    )
    # W_q, W_k, W_v of the 2 layers along dimension 1: the heads' rows whole on a rank
    assert "; 6 parameter(s) placed along dimension 1 so that the rows" in sharded.stdout
    st = got["settings"]
    assert st["fsdp"]["world"] == 2 and st["fsdp"]["backend"] == "gloo"
    assert st["fsdp"]["layers"] == 2 and st["fsdp"]["along_dim_1"] == 6
    assert st["sharded"]["shard_dims"] == [0, 1]
    assert st["sharded"]["world"] == 2
    assert set(st["sharded"]["skipped"]) == {"symmetry_search", "self_check", "time_estimate"}
    assert got["invariance_check"] is None and want["invariance_check"]["passed"]
    assert st["n_params"] == want["settings"]["n_params"]
    assert got["n_samples"] == want["n_samples"] == 8
    assert st["largest_batch"] == want["settings"]["largest_batch"] == 4
    for a, b in zip(got["clean_losses"], want["clean_losses"], strict=True):
        assert _rel(a, b) <= (1e-6 if dtype == "float32" else 1e-12)

    assert [(r["measure"], r["rho"]) for r in got["results"]] == [
        (r["measure"], r["rho"]) for r in want["results"]
    ]
    measured = {r["measure"] for r in got["results"]}
    geodesic = {
        "geodesic-inv-o2 worst l2",
        "geodesic-mix-o2 worst l2",
        "geodesic-inv-oexact worst l2",
        "adaptive average l2",
    }
    assert measured & geodesic == (geodesic if dtype == "float64" else set())
    curvature = {"geodesic-inv curvature lambda_max", "adaptive curvature trace"}
    assert measured & curvature == (curvature if dtype == "float64" else set())
    for g, w in zip(got["results"], want["results"], strict=True):
        where = (dtype, g["measure"], g["rho"], g["value"], w["value"])
        assert g["error"] is None and w["error"] is None, where
        # a mean can fall; a Hessian's eigenvalue or trace can be negative
        assert g["value"] > 0 or "average" in g["measure"] or g["rho"] is None, where
        if dtype == "float64":
            assert _rel(g["value"], w["value"]) <= 1e-10, where  # curvature measured: 2.6e-15
            if g["stderr"] is not None:  # the trace's: the same probes as one process draws
                assert _rel(g["stderr"], w["stderr"]) <= 1e-10, where
            for part in ("clean_losses", "perturbed_losses"):
                for a, b in zip(g[part], w[part], strict=True):
                    assert _rel(a, b) <= 1e-12, (*where, part)
            continue
        for part in ("clean_losses", "perturbed_losses"):
            for a, b in zip(g[part], w[part], strict=True):
                assert _rel(a, b) <= 1e-6, (*where, part)
        if g["rho"] == 3 or g["measure"] != "adaptive worst l2":
            assert _rel(g["value"], w["value"]) <= 1e-5, where
        else:  # in place at ρ = 0.3: a value of 3e-3, a difference of two float32 losses of 1.1
            assert abs(g["value"] - w["value"]) <= 1e-5 * w["clean_losses"][0], where


def test_fsdp_causal_lm_lora_weighs_the_ranks_by_their_tokens(
    adapter_dir, corpus_txt, tmp_path, capsys
):
    if not dist.is_available():
        pytest.skip("torch without distributed")
    args = [
        "--measures", "adaptive-l2", "euclidean-l2", "geodesic-mix-o2", "--rho", "0.3",
        "--steps", "3", "--batch-size", "2", "--samples", "6", "--no-progress", "--threads", "1",
    ]  # fmt: skip
    sharded = _torchrun(adapter_dir, corpus_txt, tmp_path / "sharded", "float64", args)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    code = main(["measure", str(adapter_dir), str(corpus_txt), *args, "--dtype", "float64",
                 "--out", str(tmp_path / "whole")])  # fmt: skip
    capsys.readouterr()
    assert code == 0
    got = json.loads((tmp_path / "sharded" / "results.json").read_text())
    want = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert got["settings"]["task"] == "causal-lm"
    assert got["settings"]["fsdp"]["loss_weighing"].startswith("token-weighted")
    assert got["settings"]["loss"] == want["settings"]["loss"] == "auto: cross-entropy"
    assert got["settings"]["n_params"] == want["settings"]["n_params"]  # the adapter's only
    # LoRA's A (r x in) of q_proj, v_proj and down_proj in 2 layers, along dimension 1
    assert got["settings"]["fsdp"]["along_dim_1"] == 6
    assert [r["measure"] for r in got["results"]] == [
        "adaptive worst l2", "euclidean worst l2", "geodesic-mix-o2 worst l2"
    ]  # fmt: skip
    for a, b in zip(got["clean_losses"], want["clean_losses"], strict=True):
        assert _rel(a, b) <= 1e-12
    for g, w in zip(got["results"], want["results"], strict=True):
        assert g["measure"] == w["measure"] and g["error"] is None
        assert _rel(g["value"], w["value"]) <= 1e-10, (g["measure"], g["value"], w["value"])


TORCHRUN_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
}


def _refused(capsys, *args):
    code = main(["measure", "no-such-model-folder", "no-such-data.csv", "--fsdp", *args])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("geosharp: error: "), err
    assert "no-such" not in err  # refused before the model or the data is looked at
    return lines[0]


def test_fsdp_without_torchrun_is_refused_before_loading(capsys, monkeypatch):
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    line = _refused(capsys)
    assert "--fsdp runs one process per rank under torchrun" in line
    assert "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT is not set" in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--measures", "geodesic-mix-o2", "adaptive-blocks", "relative-flatness"],
            "relative_flatness on a sharded (FSDP2) model: relative flatness of a sharded",
        ),
        (
            ["--measures", "curvature-inv-lmax", "curvature-mix-trace", "--trace-method", "exact"],
            "geodesic-mix curvature trace on a sharded (FSDP2) model: the exact trace",
        ),
        (["--measures", "relative-flatness"], "relative flatness of a sharded model"),
        (["--device", "cuda:1"], "use --device auto, cuda or cpu"),
        (["--batch-size", "5"], "--batch-size 5 is not a multiple of the 2 ranks"),
        (["--samples", "9", "--batch-size", "4"], "choose --samples a multiple of 2"),
    ],
)
def test_a_bad_combination_with_fsdp_is_one_line(capsys, monkeypatch, args, says):
    from geosharp.measuring.fsdp import FsdpRun

    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)

    def never(self):  # a combination let through would wait for rank 1 of 2 (for 30 minutes)
        raise RuntimeError("not refused: --fsdp went on to start the process group")

    monkeypatch.setattr(FsdpRun, "start", never)
    line = _refused(capsys, *args)
    assert says in line
    if "--measures" in args:
        assert line.startswith("geosharp: error: --fsdp: ")
        assert "a sharded model is measured with every sharpness measure" in line
        assert "and every curvature measure (lmax, lmin, the trace by hutchinson" in line


def test_the_curvature_measures_shard_but_the_exact_trace():
    import argparse

    from geosharp.errors import MeasureError
    from geosharp.measuring.fsdp import check_args

    def args(*measures, trace_method="hutchinson"):
        return argparse.Namespace(
            measures=list(measures), device="cpu", batch_size=4, samples=8,
            trace_method=trace_method,
        )  # fmt: skip

    every = ["curvature-inv-lmax", "curvature-mix-lmin", "curvature-euclidean-trace"]
    for method in ("hutchinson", "hutch++"):
        assert check_args(args(*every, "adaptive-l2", trace_method=method), TORCHRUN_ENV).world == 2
    # the exact trace is the trace's only: lambda_max takes no trace method
    assert check_args(args("curvature-adaptive-lmax", trace_method="exact"), TORCHRUN_ENV).rank == 0
    with pytest.raises(MeasureError, match=r"^--fsdp: euclidean curvature trace on a sharded"):
        check_args(args(*every, trace_method="exact"), TORCHRUN_ENV)


def test_the_layers_sharded_are_the_transformer_blocks():
    from torch import nn

    from geosharp.measuring.fsdp import transformer_layers

    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=20, d_model=8, d_kv=4, d_ff=16, num_layers=2, num_decoder_layers=1,
            num_heads=2,
        )
    )  # fmt: skip
    assert [type(m).__name__ for m in transformer_layers(t5)] == ["T5Block"] * 3
    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=20, hidden_size=8, num_attention_heads=2, num_hidden_layers=3,
            intermediate_size=16,
        )
    )  # fmt: skip
    assert [type(m).__name__ for m in transformer_layers(bert)] == ["BertLayer"] * 3
    # no Hugging Face hint: the repeated modules of a ModuleList; none: only the root
    mlp = nn.Sequential(
        nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.ModuleList([nn.ReLU()])
    )
    assert transformer_layers(mlp) == list(mlp[0])
    assert transformer_layers(nn.Sequential(nn.Linear(2, 2), nn.Tanh())) == []


def test_the_placement_keeps_the_heads_rows_whole_where_fsdp2_can():
    import torch
    from torch.distributed.tensor import Shard

    from geosharp.measuring.fsdp import FsdpRun

    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=20, hidden_size=8, num_attention_heads=2, num_hidden_layers=2,
            intermediate_size=16,
        )
    )  # fmt: skip
    named = dict(bert.named_parameters())
    qkv = [f"bert.encoder.layer.{i}.attention.self.{p}.weight" for i in range(2)
           for p in ("key", "query", "value")]  # fmt: skip
    said: list[str] = []
    run = FsdpRun(rank=0, world=2, local_rank=0, device=torch.device("cpu"))
    place = run._placement(bert, said.append)
    assert sorted(run.along_dim_1) == sorted(qkv) and not said
    assert [place(named[n]) for n in qkv] == [Shard(1)] * 6
    assert place(named["bert.encoder.layer.0.attention.output.dense.weight"]) is None
    # 3 ranks do not divide the 8 input features, which FSDP2 splits along dimension 1 only
    # evenly: they stay on FSDP's default (dimension 0), so element-wise measures still run
    run = FsdpRun(rank=0, world=3, local_rank=0, device=torch.device("cpu"))
    place = run._placement(bert, said.append)
    assert run.along_dim_1 == [] and [place(named[n]) for n in qkv] == [None] * 6
    assert len(said) == 1 and "6 parameter(s) whose rows the geodesic measures need" in said[0]
    assert "3 ranks do not divide it" in said[0]
