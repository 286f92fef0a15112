"""Issue 13, more defects of ``geosharp measure``: each test fails on the code before the fix.

1. the ``--eps`` help did not say what ε is (the damping of the GL(h) Gram matrices), when to
   set it, or its default;
2. the HTML report's adaptive block overflowed with a horizontal scrollbar, and its settings
   showed JSON literals (``null``, ``true``, ``["…"]``, ``{"…": …}``);
3. a misspelt ``--measures`` failed only after the model and the data were loaded.
"""

import argparse
import re
import shutil
import subprocess

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.measuring.prepare import adaptive_note
from geosharp.measuring.results import MeasureReport, MeasureRow

# --------------------------------------------------------------------------------------------
# 1. --eps


def eps_option() -> argparse.Action:
    from geosharp.measuring.cli import add_parser

    parser = argparse.ArgumentParser()
    measure = add_parser(parser.add_subparsers())
    (action,) = [a for a in measure._actions if "--eps" in a.option_strings]
    return action


def test_eps_help_says_what_eps_is_when_to_set_it_and_its_default():
    action = eps_option()
    text = " ".join(action.help.split())
    assert "damping" in text and "Gram matrices" in text and "GL(h)" in text  # what
    assert "GᵀG + εI" in text
    assert "Default 0" in text and "exactly invariant" in text  # the default, and why
    assert "singular" in text and "1e-6 times" in text  # when to set it, and to what
    assert action.default == 0.0


# --------------------------------------------------------------------------------------------
# 2. the report page


class Attention(nn.Module):
    """One attention layer with long parameter names, as a real checkpoint has them."""

    def __init__(self):
        super().__init__()
        self.encoder_layer_0_attention_self = nn.MultiheadAttention(16, 2, batch_first=True)
        self.classifier_with_a_rather_long_name = nn.Linear(16, 3)

    def forward(self, x):
        out = self.encoder_layer_0_attention_self(x, x, x)[0]
        return self.classifier_with_a_rather_long_name(out.mean(1))


SETTINGS = {
    "model": "./tiny-bert (BertForSequenceClassification)",
    "weights": None,
    "samples": 4,
    "label_map": {"neg": 0, "pos": 1},
    "measures": ["adaptive worst l2", "geodesic-inv-o2 worst l2"],
    "rhos": [0.01, 0.1],
    "eps": 0.0,
    "check": True,
    "flush": False,
    "curvature": {"iters": 50, "probes": 100, "trace_method": "hutchinson"},
    "model_info": [],
    "n_params": 1139,
}


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    torch.manual_seed(0)
    space = gs.find_symmetries(Attention())
    report = MeasureReport(
        rows=[MeasureRow(measure="adaptive worst l2", rho=0.1, value=1e-3, per_batch=[1e-3])],
        symmetry_summary=space.summary(),
        adaptive_note=adaptive_note(space),
        invariance=None,
        clean_losses=[0.69],
        n_batches=1,
        n_samples=4,
        settings=dict(SETTINGS),
    )
    return report.write_html(tmp_path_factory.mktemp("page") / "report.html")


def section(text: str, title: str) -> str:
    """The HTML from the heading ``title`` to the next ``<h2>`` (or the footer)."""
    start = text.index(f">{title}</h")
    end = min(i for i in (text.find("<h2>", start), text.find("<footer>", start)) if i > 0)
    return text[start:end]


JSON_LITERAL = re.compile(r"\b(null|true|false|None|True|False)\b|[\[\]{}]|&quot;")


def test_settings_and_adaptive_block_have_no_json_literals(page):
    text = page.read_text()
    for title in ("Adaptive geometry", "Settings"):
        block = section(text, title)
        assert not JSON_LITERAL.findall(re.sub(r"<[^>]+>", " ", block)), title
    settings = section(text, "Settings")
    for shown in (
        "<td>none</td>",  # weights: None
        "<td>yes</td>",  # check: True
        "<td>no</td>",  # flush: False
        "<td>neg → 0, pos → 1</td>",
        "<td>0.01, 0.1</td>",
        "<td>adaptive worst l2, geodesic-inv-o2 worst l2</td>",
        "<td>iters 50, probes 100, trace method hutchinson</td>",
        "<td>1,139</td>",
    ):
        assert shown in settings
    assert ">radii ρ</th>" in settings and "title='rhos in results.json'" in settings


def test_adaptive_block_is_a_table_of_parameter_patterns(page):
    block = section(page.read_text(), "Adaptive geometry")
    assert "<pre" not in block  # the note's prose is a paragraph, its patterns a table
    assert "<p>adaptive geometry: " in block
    assert "classifier_with_a_rather_long_name.weight</td><td class='num'>48</td>" in block


def test_nothing_on_the_page_scrolls_sideways(page):
    css = page.read_text().split("</style>")[0]
    assert not re.search(r"overflow(-x)?\s*:\s*(scroll|auto)", css)
    assert re.search(r"pre \{[^}]*white-space: pre-wrap", css)


CHROMIUM = next(
    (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
)
OVERFLOW_PROBE = """<script>
window.addEventListener("load", () => {
  const wide = [...document.querySelectorAll("pre, table, p, li, td, th, figure")]
    .filter((e) => e.scrollWidth > e.clientWidth + 1
      || e.getBoundingClientRect().right > innerWidth)
    .map((e) => e.tagName + ":" + e.textContent.slice(0, 40));
  document.body.setAttribute("data-overflow", JSON.stringify(wide));
});
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary to render the page")
def test_page_fits_1280_px_in_headless_chromium(page, tmp_path):
    """Rendered at 1280 px, no element is wider than its box or than the window."""
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", OVERFLOW_PROBE + "</body>"))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2000"]
    dom = subprocess.run(
        [*cmd, "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    m = re.search(r'data-overflow="([^"]*)"', dom)
    assert m is not None, "the probe did not run"
    assert m.group(1) == "[]", m.group(1)


# --------------------------------------------------------------------------------------------
# 3. a bad measure fails before anything is loaded


def test_bad_measure_fails_before_the_model_is_loaded(tmp_path, run_cli):
    (tmp_path / "d.csv").write_text("text,label\na,0\n")
    code, out, err = run_cli(
        tmp_path / "no-such-model", tmp_path / "d.csv", "--measures", "sharpest"
    )
    assert code == 2 and err.startswith("geosharp: error: unknown measure 'sharpest': a measure is")
    assert out == ""
    code, out, err = run_cli(
        tmp_path / "no-such-model", tmp_path / "d.csv", "--measures", "euclidean-blocks"
    )
    assert code == 2 and "blocks (attention-only" in err and out == ""
