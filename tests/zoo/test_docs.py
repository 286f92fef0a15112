"""docs/paper_populations.md: its Python examples compile and use names that exist.

The examples point at the real checkpoints and data, which the tests do not have; what they do
is covered by the loader tests on fabricated checkpoints.
"""

import ast
import pathlib
import re

import geosharp.zoo

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "paper_populations.md"


def test_doc_examples_compile_and_import_existing_names():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 4
    imported = set()
    for code in blocks:
        tree = ast.parse(compile(code, str(DOC), "exec", flags=ast.PyCF_ONLY_AST))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "geosharp.zoo":
                imported |= {alias.name for alias in node.names}
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "gs":
                assert hasattr(__import__("geosharp"), node.attr), node.attr
    assert imported and imported <= set(geosharp.zoo.__all__), imported - set(geosharp.zoo.__all__)


def test_doc_names_the_public_releases():
    text = DOC.read_text()
    for needle in ("mlfoundations/model-soups", "v0.0.2", "4110593", "tommccoy1/hans", "estimate"):
        assert needle in text
