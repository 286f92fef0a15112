"""Reading and checking a population manifest (geosharp.studies.manifest), before any work."""

from __future__ import annotations

import json

import pytest

from geosharp.errors import MeasureError
from geosharp.studies.manifest import GAP_RULES, read_manifest


def write_csv(path, header, rows):
    path.write_text(
        "\n".join([",".join(header), *(",".join(map(str, r)) for r in rows)]) + "\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture
def folder(tmp_path):
    for name in ("a", "b", "c", "d"):
        (tmp_path / "ckpt" / name).mkdir(parents=True)
    return tmp_path


def test_gap_from_accuracies_hyperparameters_and_relative_paths(folder):
    path = write_csv(
        folder / "m.csv",
        ["model", "train_accuracy", "test_accuracy", "lr", "seed", "optimizer"],
        [
            ["ckpt/a", 0.99, 0.90, 0.1, 1, "sgd"],
            ["ckpt/b", 0.95, 0.91, 0.01, 2, "adam"],
            ["ckpt/c", 1.0, 0.80, 0.1, 3, "sgd"],
        ],
    )
    m = read_manifest(path)
    assert m.gap_rule.key == "accuracy"
    assert [r.gap for r in m.rows] == pytest.approx([0.09, 0.04, 0.20])
    assert m.hparam_names == ["lr", "seed", "optimizer"]
    assert m.rows[1].hparams == {"lr": 0.01, "seed": 2, "optimizer": "adam"}
    assert m.rows[0].model == str(folder / "ckpt" / "a")
    assert [r.model_id for r in m.rows] == ["ckpt/a", "ckpt/b", "ckpt/c"]
    assert "train_accuracy − test_accuracy" in m.gap_line()


@pytest.mark.parametrize(
    "columns, values, key, gap",
    [
        (["gap"], [0.3], "gap", 0.3),
        (["train_error", "test_error"], [0.1, 0.25], "error", 0.15),
        (["train_loss", "test_loss"], [0.2, 0.9], "loss", 0.7),
    ],
)
def test_each_gap_rule(folder, columns, values, key, gap):
    rows = [[f"ckpt/{n}", *values] for n in "abc"]
    m = read_manifest(write_csv(folder / "m.csv", ["model", *columns], rows))
    assert m.gap_rule.key == key and m.rows[0].gap == pytest.approx(gap)
    assert m.hparam_names == []


def test_several_rules_first_wins_and_gap_picks(folder):
    header = ["model", "gap", "train_error", "test_error"]
    rows = [[f"ckpt/{n}", 0.5, 0.1, 0.2] for n in "abc"]
    path = write_csv(folder / "m.csv", header, rows)
    m = read_manifest(path)
    assert m.gap_rule.key == "gap" and "also fit --gap error" in m.gap_line()
    m = read_manifest(path, gap="error")
    assert m.rows[0].gap == pytest.approx(0.1)
    with pytest.raises(MeasureError, match="--gap accuracy needs the column"):
        read_manifest(path, gap="accuracy")
    with pytest.raises(MeasureError, match="--gap must be one of"):
        read_manifest(path, gap="train")
    assert [r.key for r in GAP_RULES] == ["gap", "error", "accuracy", "loss"]


def test_jsonl_and_names(folder):
    path = folder / "m.jsonl"
    rows = [
        {"model": f"ckpt/{n}", "name": f"run-{n}", "gap": i / 10, "wd": 0}
        for i, n in enumerate("abc")
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    m = read_manifest(path)
    assert [r.model_id for r in m.rows] == ["run-a", "run-b", "run-c"]
    assert m.hparam_names == ["wd"]


def test_parquet(folder):
    pa = pytest.importorskip("pyarrow")
    from pyarrow import parquet

    table = pa.table({"model": ["ckpt/a", "ckpt/b", "ckpt/c"], "gap": [0.1, 0.2, 0.3]})
    parquet.write_table(table, folder / "m.parquet")
    assert [r.gap for r in read_manifest(folder / "m.parquet").rows] == [0.1, 0.2, 0.3]


@pytest.mark.parametrize(
    "header, rows, match",
    [
        (["path", "gap"], [["ckpt/a", 1]] * 3, "has no model column"),
        (["model", "lr"], [["ckpt/a", 1]] * 3, "has no generalization gap"),
        (
            ["model", "gap"],
            [["ckpt/a", 0.1], ["ckpt/b", ""], ["ckpt/c", 0.3]],
            "row 2 \\(ckpt/b\\): gap is missing",
        ),
        (
            ["model", "gap"],
            [["ckpt/a", 0.1], ["ckpt/b", "nan"], ["ckpt/c", 0.3]],
            "row 2 \\(ckpt/b\\): gap is nan",
        ),
        (["model", "gap"], [["ckpt/a", 0.1], ["ckpt/b", "high"], ["ckpt/c", 0.3]], "not a number"),
        (
            ["model", "gap"],
            [["ckpt/a", 0.1], ["ckpt/b", 0.2], ["ckpt/a", 0.3]],
            "row 3 \\(ckpt/a\\): the same model as row 1",
        ),
        (
            ["model", "gap"],
            [["ckpt/a", 0.1], ["", 0.2], ["ckpt/c", 0.3]],
            "row 2: the model cell is empty",
        ),
        (["model", "gap"], [["ckpt/a", 0.1], ["ckpt/b", 0.2]], "2 usable model\\(s\\).*at least 3"),
    ],
)
def test_bad_manifests_one_line_naming_the_row(folder, header, rows, match):
    path = write_csv(folder / "m.csv", header, rows)
    with pytest.raises(MeasureError, match=match) as err:
        read_manifest(path)
    assert "\n" not in str(err.value)


def test_a_model_that_does_not_load_and_skip_bad(folder):
    rows = [[f"ckpt/{n}", 0.1 * i] for i, n in enumerate("abcd")] + [["ckpt/zz", 0.9]]
    path = write_csv(folder / "m.csv", ["model", "gap"], rows)

    def check(row):
        if row.model_id in ("ckpt/b", "ckpt/zz"):
            raise MeasureError(f"{row.model}: not a model folder")

    with pytest.raises(MeasureError, match="ckpt/b: not a model folder"):
        read_manifest(path, check_model=check)
    m = read_manifest(path, check_model=check, skip_bad=True)
    assert [r.model_id for r in m.rows] == ["ckpt/a", "ckpt/c", "ckpt/d"]
    assert [(line, label) for line, label, _ in m.skipped] == [(2, "ckpt/b"), (5, "ckpt/zz")]


def test_not_a_manifest(folder):
    with pytest.raises(MeasureError, match=r"must be a \.csv, \.jsonl or \.parquet"):
        read_manifest(folder / "m.txt")
    with pytest.raises(MeasureError, match="does not exist"):
        read_manifest(folder / "missing.csv")


def test_a_manifest_saved_with_a_byte_order_mark(folder):
    """Excel's "CSV UTF-8" starts the file with U+FEFF: the first column is still ``model``."""
    path = folder / "m.csv"
    text = "model,gap,lr\nckpt/a,0.1,1\nckpt/b,0.2,2\nckpt/c,0.3,3\n"
    path.write_bytes("\ufeff".encode() + text.encode())
    m = read_manifest(path)
    assert [r.model_id for r in m.rows] == ["ckpt/a", "ckpt/b", "ckpt/c"]
    assert m.hparam_names == ["lr"]


def test_function_models_that_share_their_builder_are_named_by_their_weights(folder):
    rows = [["digits_model:build", f"w/seed{i}.pt", 0.1 * i] for i in range(3)]
    path = write_csv(folder / "m.csv", ["model", "weights", "gap"], rows)
    m = read_manifest(path)
    assert [r.model_id for r in m.rows] == ["w/seed0.pt", "w/seed1.pt", "w/seed2.pt"]
    assert {r.model for r in m.rows} == {"digits_model:build"}
    assert [r.weights for r in m.rows] == [str(folder / f"w/seed{i}.pt") for i in range(3)]
    # a name column still names them; a true duplicate is still refused in one line
    named = write_csv(folder / "n.csv", ["model", "weights", "gap", "name"],
                      [[*r, f"run{i}"] for i, r in enumerate(rows)])  # fmt: skip
    assert [r.model_id for r in read_manifest(named).rows] == ["run0", "run1", "run2"]
    twice = write_csv(folder / "d.csv", ["model", "weights", "gap"], [*rows, rows[1]])
    same = r"row 4 \(digits_model:build\): the same model as row 2"
    with pytest.raises(MeasureError, match=same):
        read_manifest(twice)
