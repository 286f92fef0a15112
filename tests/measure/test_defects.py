"""Issue 13, the defects of ``geosharp measure``: each test fails on the code before the fix.

1. a flat Auto-PGD trace that rose by one float32 ulp was reported as "still rising";
2. an unwritable ``--out`` failed only after measuring;
3. a missing label column was reported as a missing task head;
4. text labels were mapped to class ids silently, and a shape error did not name its batch.
"""

import json
import os

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.measuring import MeasureError, cells
from geosharp.measuring.results import MeasureRow

#: The trace of the issue: flat from step 3, then up by one float32 ulp at the last step.
FLAT = [0.6871, 0.6893, 0.6899] + [0.689989447593689] * 17 + [0.6899895071983337]
#: Still climbing by 0.01 a step: more steps would find more.
RISING = [0.60 + 0.01 * i for i in range(21)]

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"the a movie film was great bad".split()]
ROWS = [
    ("the movie was great", "pos"),
    ("a bad film", "neg"),
    ("the film was bad", "neg"),
    ("a great movie", "pos"),
]


@pytest.fixture(scope="module")
def bert_base_dir(tmp_path_factory):
    """A tiny ``BertModel`` (no task head) and its WordPiece tokenizer."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tinybertbase")
    (d / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tok = transformers.BertTokenizer.from_pretrained(str(d))
    cfg = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def write_csv(path, rows, header="text,label"):
    path.write_text("\n".join([header] + [f'"{t}",{y}' for t, y in rows]) + "\n")
    return path


def mlp_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g))] * 3
    return model, batches


FAST = ["--measures", "adaptive", "--rho", "0.1", "--steps", "2"]


# --------------------------------------------------------------------------------------------
# 1. "still rising"


def _warnings_for_trace(monkeypatch, trace):
    """The warnings of gs.measure when every Auto-PGD run returns ``trace``."""

    def fake(model, loss_fn, batches, spec, rho, *args, **kwargs):
        return MeasureRow(
            measure=spec.name,
            rho=rho,
            value=max(trace) - trace[0],
            per_batch=[max(trace) - trace[0]],
            clean_losses=[trace[0]],
            perturbed_losses=[max(trace)],
            traces=[list(trace)],
        )

    monkeypatch.setattr(cells, "_measure_one", fake)
    model, batches = mlp_batches()
    said = []
    gs.measure(model, batches[:1], measures=["adaptive"], rhos=[0.1], steps=20, warn=said.append)
    return said


def test_one_ulp_rise_of_a_flat_trace_is_not_still_rising(monkeypatch):
    assert FLAT[-1] - FLAT[-2] == pytest.approx(5.96e-8, rel=1e-2)  # one float32 ulp at 0.69
    assert not [w for w in _warnings_for_trace(monkeypatch, FLAT) if "still rising" in w]


def test_genuinely_rising_trace_warns(monkeypatch):
    said = _warnings_for_trace(monkeypatch, RISING)
    assert [w for w in said if "still rising at the last of 20 Auto-PGD steps" in w]


def test_still_rising_tolerance():
    from geosharp.measuring.checks import still_rising

    eps32 = float(torch.finfo(torch.float32).eps)
    assert not still_rising(FLAT, eps32) and still_rising(RISING, eps32)
    # a slow but steady climb of 100 ulp a step is a trend; so is one big last step
    slow = [1.0 + 100 * eps32 * i for i in range(10)]
    assert still_rising(slow, eps32)
    assert still_rising([*FLAT[:-1], FLAT[-2] + 1e-3], eps32)
    # a last step that rises but stays below the best iterate is not rising
    assert not still_rising([0.5, 0.7, 0.6, 0.65], eps32)
    # the tolerance scales with the dtype: a bfloat16 loss wobbles by 1e-2 relative
    wobble = [0.5, 0.69, 0.69, 0.6925]
    assert still_rising(wobble, eps32)
    assert not still_rising(wobble, float(torch.finfo(torch.bfloat16).eps))
    assert not still_rising([0.1, 0.2])  # too short to tell


# --------------------------------------------------------------------------------------------
# 2. an unwritable --out fails before any work


def test_unwritable_out_fails_before_any_work(bert_base_dir, tmp_path, run_cli):
    data = write_csv(tmp_path / "d.csv", ROWS)
    (tmp_path / "file.txt").write_text("a file, not a folder\n")
    code, out, err = run_cli(bert_base_dir, data, *FAST, "--out", tmp_path / "file.txt" / "sub")
    assert code == 2
    assert err.startswith("geosharp: error: cannot create the output folder ")
    assert "file.txt/sub (--out)" in err and len(err.strip().splitlines()) == 1
    assert "model:" not in out and "finding symmetry blocks" not in out  # nothing was done


def test_read_only_out_fails_before_any_work(bert_base_dir, tmp_path, run_cli):
    data = write_csv(tmp_path / "d.csv", ROWS)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user (root?) may write to a folder of mode 0o555")
        code, out, err = run_cli(bert_base_dir, data, *FAST, "--out", ro / "m")
        assert code == 2 and "cannot create the output folder" in err and "model:" not in out
        code, out, err = run_cli(bert_base_dir, data, *FAST, "--out", ro)
        assert code == 2 and "cannot write to the output folder" in err and "model:" not in out
    finally:
        ro.chmod(0o755)


def test_check_out_dir(tmp_path):
    from geosharp.measuring.cli import check_out_dir

    check_out_dir(tmp_path / "a" / "b")  # created, with its parents
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    (tmp_path / "f").write_text("")
    with pytest.raises(MeasureError, match="cannot create the output folder"):
        check_out_dir(tmp_path / "f")


def test_read_only_file_system_is_found_by_the_write_probe(tmp_path, monkeypatch):
    """The issue's case, ``[Errno 30] Read-only file system``, which root meets too."""
    import errno
    import tempfile

    from geosharp.measuring.cli import check_out_dir

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(MeasureError) as info:
        check_out_dir(tmp_path / "out")
    assert str(info.value) == (
        f"cannot write to the output folder {tmp_path / 'out'} (--out): Read-only file system"
        " — choose another --out"
    )


# --------------------------------------------------------------------------------------------
# 3. a missing label column is named first


def test_missing_label_column_is_named_before_the_missing_head(bert_base_dir, tmp_path, run_cli):
    data = write_csv(tmp_path / "d.csv", ROWS, header="text,y")
    code, _, err = run_cli(bert_base_dir, data, *FAST)
    assert code == 2
    assert "has no label column 'label' (columns: text, y)" in err and "--label-col" in err
    assert "without a task head" not in err
    code, _, err = run_cli(bert_base_dir, data, *FAST, "--label-col", "nosuch")
    assert code == 2 and "has no label column 'nosuch' (columns: text, y)" in err
    assert "without a task head" not in err


# --------------------------------------------------------------------------------------------
# 4. text labels, shape errors


def test_text_label_mapping_is_printed_and_stored(bert_base_dir, tmp_path, run_cli):
    data = write_csv(tmp_path / "d.csv", ROWS)
    code, out, err = run_cli(bert_base_dir, data, *FAST, "--out", tmp_path / "o")
    assert code == 0, err
    assert "labels: text labels mapped to class ids: 'neg' → 0, 'pos' → 1" in out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["settings"]["label_map"] == {"neg": 0, "pos": 1}
    # integer labels: nothing mapped, nothing said
    data = write_csv(tmp_path / "i.csv", [(t, int(y == "pos")) for t, y in ROWS])
    code, out, err = run_cli(bert_base_dir, data, *FAST, "--out", tmp_path / "i")
    assert code == 0, err
    assert "mapped to class ids" not in out
    assert "label_map" not in json.loads((tmp_path / "i" / "results.json").read_text())["settings"]


def test_shape_error_names_its_batch():
    model, batches = mlp_batches()
    x, y = batches[1]
    bad = [batches[0], (x, y[:, None].repeat(1, 2)), batches[2]]
    with pytest.raises(MeasureError, match=r"^batch 1: cross-entropy needs predictions of shape"):
        gs.measure(model, bad, measures=["adaptive"], rhos=[0.1], steps=2)
    regression = [(x, torch.randn(10, 3)), (x, torch.randn(10, 3)), (x, torch.randn(10, 5))]
    with pytest.raises(MeasureError, match=r"^batch 2: the squared error needs"):
        gs.measure(model, regression, "mse", measures=["adaptive"], steps=2)


@pytest.mark.parametrize(
    ("err", "kept"),
    [
        (RuntimeError("out of memory on this rank"), False),  # may be this rank's alone
        (torch.linalg.LinAlgError("singular"), True),  # of matrices summed over the ranks
        (FloatingPointError("the loss became nan"), True),  # the mean over the ranks
        (ValueError("bad rho"), True),
    ],
)
def test_a_sharded_cell_that_may_have_failed_on_one_rank_ends_the_run(monkeypatch, err, kept):
    """Kept as a failed row only where every rank fails alike; else raised (no paired hang)."""

    class Failing:
        name, uses_rho = "adaptive worst l2", True

        def run(self, *args, **kwargs):
            raise err

    model = nn.Linear(2, 2)
    call = {"model": model, "loss_fn": None, "batches": [], "spec": Failing(), "rho": 0.1}
    call["run"] = {"steps": 1}
    assert cells._measure_one(**call).error == str(err)  # one process: always a failed row
    monkeypatch.setattr(cells, "is_sharded", lambda m: True)
    if kept:
        assert cells._measure_one(**call).error == str(err)
    else:
        with pytest.raises(RuntimeError, match="out of memory"):
            cells._measure_one(**call)
