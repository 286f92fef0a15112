"""The README's Python examples run as written (pymanopt habit: every example runs in CI)."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    torch.manual_seed(0)
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out.strip()
