"""The documentation site: its worked examples run as written, and it builds without a warning.

Every ```python block of the home page and of the example pages is executed, page by page, in
one namespace per page (a page is a script in pieces), so an example that no longer works
fails here. The strict ``mkdocs build`` (the ``docs`` extra; ``make docs``) is skipped, saying
why, where mkdocs-material or mkdocstrings is not installed.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
EXAMPLE_PAGES = sorted((DOCS / "examples").glob("*.md"))
RUN_PAGES = [DOCS / "index.md", *EXAMPLE_PAGES]
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
#: Longest code line of an example: longer ones are cut off in the page's code column.
CODE_WIDTH = 80
DOC_PACKAGES = {
    "mkdocs": "mkdocs",
    "material": "mkdocs-material",
    "mkdocstrings": "mkdocstrings",
    "mkdocstrings_handlers.python": "mkdocstrings-python",
}


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every ```python block of a Markdown page."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, m["code"])
        for m in FENCE.finditer(text)
        if m["lang"] in ("python", "py")
    ]


def test_every_example_page_has_python_and_is_in_the_site():
    nav = MKDOCS_YML.read_text()
    assert EXAMPLE_PAGES, "docs/examples has no page"
    for page in RUN_PAGES:
        rel = page.relative_to(DOCS).as_posix()
        assert python_blocks(page), f"{rel} has no python block"
        assert re.search(rf":\s*{re.escape(rel)}\s*$", nav, re.M), f"{rel} is not in the nav"
        for m in FENCE.finditer(page.read_text()):
            wide = [line for line in m["code"].splitlines() if len(line) > CODE_WIDTH]
            assert not wide, f"{rel}: code lines wider than {CODE_WIDTH} characters: {wide}"


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_examples_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the pages' mkdtemp() go here
    threads = torch.get_num_threads()
    namespace = {"__name__": "__docs_example__"}
    torch.manual_seed(0)
    try:
        for line, code in python_blocks(page):
            where = f"{page.relative_to(ROOT)}:{line}"
            exec(compile(code, where, "exec"), namespace)
    finally:
        torch.set_num_threads(threads)  # a page may run the CLI, which sets the threads
    assert capsys.readouterr().out.strip(), f"{page.name} printed nothing"


def _missing_doc_packages() -> list[str]:
    missing = []
    for module, dist in DOC_PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(dist)
    return missing


def test_mkdocs_build_strict(tmp_path):
    missing = _missing_doc_packages()
    if missing:
        pytest.skip(
            f"the docs packages are not installed ({', '.join(missing)}): "
            "make install (the lock), or pip install -e '.[docs]'"
        )
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(MKDOCS_YML)]
    proc = subprocess.run(
        [*cmd, "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log, log
    for page in [*RUN_PAGES, DOCS / "math.md"]:
        html = site / page.relative_to(DOCS).with_suffix(".html")
        assert html.is_file(), f"{html} was not built"
    api = {p.stem: p.read_text() for p in (site / "api").glob("*.html")}
    assert {"geosharp", "symmetry", "geometry", "estimators", "studies", "integrations"} <= set(api)
    top = api["geosharp"]
    for name in ("sharpness", "curvature", "measure", "find_symmetries", "reparametrize",
                 "check_invariance", "declare_block"):  # fmt: skip
        assert f"gs.{name}" in top, name
    assert "SharpnessCallback" in api["integrations"]
    for name, html in api.items():
        # docstrings are rendered, not shown raw: Sphinx roles became links, doctests code
        assert not re.search(r":(func|class|mod|meth|attr|data):`", html), name
        assert "&gt;&gt;&gt; " not in re.sub(r"<pre.*?</pre>", "", html, flags=re.S), name
    assert not (site / "_ext").exists()
