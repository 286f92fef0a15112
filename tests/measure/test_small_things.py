"""Issue 29, item 4 (and the report's part of item 3): the small things of ``geosharp measure``.

1. a truncated or corrupt ``.safetensors`` file is named in one line that says to re-save it,
   instead of ``SafetensorError: … incomplete metadata``;
2. ``results.csv`` (and the warnings) write ρ as the table prints it: ``1``, not ``1.0``;
3. the report's self-check says GL(r) for LoRA blocks, not GL(h);
4. measuring a PEFT adapter says why the frozen base's rotary and V/O symmetries are not in play;
5. the report has a short guide to reading its numbers, naming the documentation page.
"""

import csv
import io
import shutil

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.measuring import MeasureError, MeasureWarning
from geosharp.measuring.checkpoint_files import check_safetensors, load_state_dict
from geosharp.measuring.results import rho_text

FAST = ["--measures", "geodesic-inv-o2", "--rho", "1", "--steps", "1", "--max-length", "16"]


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("geosharp: error: "), err
    return lines[0]


# --------------------------------------------------------------------------------------------
# 1. truncated weights


def test_truncated_safetensors_of_a_model_folder(llama_dir, corpus_txt, tmp_path, run_cli):
    check_safetensors(llama_dir / "model.safetensors")  # a good file passes
    bad = tmp_path / "cut"
    shutil.copytree(llama_dir, bad)
    weights = bad / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as fh:
        fh.truncate(size // 2)
    code, _, err = run_cli(bad, corpus_txt, *FAST)
    line = one_error_line(err)
    assert code == 2
    assert line.startswith(
        f"geosharp: error: the weights file {weights} is corrupt or truncated: re-save it ("
    )
    assert "SafetensorError" not in line
    with weights.open("r+b") as fh:  # a cut inside the header
        fh.truncate(100)
    code, _, err = run_cli(bad, corpus_txt, *FAST)
    assert code == 2 and "is corrupt or truncated: re-save it" in one_error_line(err)


def test_truncated_adapter_and_state_dict(adapter_dir, corpus_txt, tmp_path, run_cli):
    bad = tmp_path / "cut_adapter"
    shutil.copytree(adapter_dir, bad)
    weights = bad / "adapter_model.safetensors"
    with weights.open("r+b") as fh:
        fh.truncate(weights.stat().st_size - 10)
    code, _, err = run_cli(bad, corpus_txt, *FAST)
    assert code == 2 and f"the weights file {weights} is corrupt or truncated" in one_error_line(
        err
    )
    # --weights FILE.safetensors of a module:function model goes through the same check
    from safetensors.torch import save_file

    net = nn.Linear(3, 2)
    path = tmp_path / "w.safetensors"
    save_file(net.state_dict(), str(path))
    load_state_dict(net, path)  # whole: loads
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(MeasureError, match=r"the weights file .* is corrupt or truncated: re-save"):
        load_state_dict(net, path)


# --------------------------------------------------------------------------------------------
# 2. rho as the table prints it


def test_rho_is_written_as_the_table_prints_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    with pytest.warns(MeasureWarning, match=r"at rho=1: "):  # not rho=1.0
        rep = gs.measure(model, batches, measures=["adaptive"], rhos=[1.0, 0.1, 0.05], steps=2)
    table_rhos = [line.split()[3] for line in rep.table().splitlines()[2:]]
    csv_rhos = [r["rho"] for r in csv.DictReader(io.StringIO(rep.to_csv()))]
    assert csv_rhos == table_rhos == ["0.05", "0.1", "1"]  # smallest ball first (nested)
    assert [rho_text(r) for r in (2.0, 1e-05, 0.123456789)] == ["2", "1e-05", "0.123456789"]


# --------------------------------------------------------------------------------------------
# 3-5. a LoRA adapter: the note on the frozen base, the report's GL(r), the reading guide


def test_lora_adapter_note_and_report(adapter_dir, corpus_txt, tmp_path, run_cli):
    code, out, err = run_cli(adapter_dir, corpus_txt, *FAST, "--out", tmp_path / "o", "--report")
    assert code == 0, err
    note = next(x for x in out.splitlines() if x.startswith("note: the frozen base model's"))
    assert "(the rotary commutant of Q/K and GL(h) of V/O, per head) are not in play" in note
    assert "only the adapter's weights are perturbed" in note
    assert "would have to move the frozen base weights W_q, W_k, W_v, W_o too" in note
    assert "GL(r) of each LoRA pair, (B M⁻¹, M A)" in note
    page = (tmp_path / "o" / "report.html").read_text()
    selfcheck = page[page.index("<h2>Self-check</h2>") :]
    selfcheck = selfcheck[: selfcheck.index("</p>")]
    assert "LoRA adapters, GL(r): M = a·N(0, 1)<sup>r×r</sup> acting by (B M⁻¹, M A)" in selfcheck
    assert "GL(h)" not in selfcheck
    assert "<b>Reading these numbers.</b>" in page and "docs/reading-results.md" in page
    assert page.index("Reading these numbers") < page.index("<h2>Self-check</h2>")
