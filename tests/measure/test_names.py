"""The measure-name grammar (``geosharp.measures``): parsing and canonical names; and the
readings the study reports make of a name (``geosharp.measuring.names``: family, paper family,
the paired geodesic measures).

The report's readings are checked against the regular expressions ``studies/report.py`` used
before it called these functions (copied here verbatim as the reference), on every canonical
name form ``geosharp`` produces and on loose spellings.
"""

import itertools
import re

import pytest

from geosharp.estimators.sharpness_settings import measure_name
from geosharp.measures import Measure, curvature_name, parse_measure
from geosharp.measuring import MeasureError, names
from geosharp.measuring.names import default_paper_match, is_geodesic_main, measure_family

# --------------------------------------------------------------------------------------------
# the reference: studies/report.py's regexes before the grammar module


def ref_measure_family(measure):
    name = re.sub(r"[\s_]+", "-", measure.strip().lower())
    if re.search(r"(^|-)curvature(-|$)", name):
        return "curvature"
    if name == "relative-flatness":
        return "relative flatness"
    return "sharpness"


def ref_default_paper_match(measure):
    name = re.sub(r"[\s_]+", "-", measure.strip().lower())
    if "adaptivenorm" in name or ref_measure_family(measure) == "curvature":
        return None
    if "adaptive" in name:
        return "adaptive"
    if name.startswith("geodesic-inv"):
        return "geodesic inv"
    if name.startswith("geodesic-mix"):
        return "geodesic mix"
    return None


REF_GEODESIC_MAIN = re.compile(r"^geodesic-(inv|mix)-o2 (worst|average) l2$")


def sharpness_names():
    """Every canonical sharpness name :func:`measure_name` can produce."""
    out = []
    for metric, order, kind, corrected, perturb in itertools.product(
        ("inv", "mix"), (1, 2, "exact"), ("worst", "average"), (True, False), ("all", "blocks")
    ):
        out.append(measure_name("geodesic", metric, order, kind, "l2", corrected, perturb))
    for family, kind, norm, perturb in itertools.product(
        ("adaptive", "euclidean"), ("worst", "average"), ("l2", "linf"), ("all", "blocks")
    ):
        if perturb == "blocks" and (family == "euclidean" or norm == "linf"):
            continue
        out.append(measure_name(family, "", 1, kind, norm, perturb=perturb))
    return out


def curvature_names():
    out = [
        curvature_name("geodesic", metric, q)
        for metric in ("inv", "mix")
        for q in ("lambda_max", "lambda_min", "trace")
    ]
    out += [
        curvature_name(of, "", q)
        for of in ("adaptive", "euclidean")
        for q in ("lambda_max", "lambda_min", "trace")
    ]
    return out


CANONICAL = [*sharpness_names(), *curvature_names(), "relative_flatness"]
LOOSE = [
    "relative-flatness",
    "Relative Flatness",
    "rf",
    "geodesic-inv-o2",
    "geo-mix-exact",
    "GEODESIC_MIX_O2 worst l2",
    " geodesic-inv-o2 worst l2 ",
    "geodesic-inv-o2 worst l2\n",
    "adaptive-l2",
    "ada-linf",
    "euclidean",
    "curvature-inv-lmax",
    "curvature_euclidean_trace",
    "adaptive curvature trace",
    "geodesic-inv-o2-adaptivenorm",
    "my-adaptive-thing",
    "geodesicinv",
    "nocurvature here",
    "",
]


# --------------------------------------------------------------------------------------------
# the readings of the study reports


@pytest.mark.parametrize("name", CANONICAL + LOOSE)
def test_report_readings_match_the_report_regexes(name):
    assert measure_family(name) == ref_measure_family(name)
    assert default_paper_match(name) == ref_default_paper_match(name)
    assert is_geodesic_main(name) == bool(REF_GEODESIC_MAIN.match(name))


def test_report_readings_of_every_canonical_form():
    expected = {
        "geodesic-inv-o2 worst l2": ("sharpness", "geodesic inv", True),
        "geodesic-mix-o2 average l2": ("sharpness", "geodesic mix", True),
        "geodesic-inv-o1 worst l2": ("sharpness", "geodesic inv", False),
        "geodesic-mix-oexact worst l2": ("sharpness", "geodesic mix", False),
        "geodesic-inv-o2-blocks worst l2": ("sharpness", "geodesic inv", False),
        "geodesic-mix-o2-blocks average l2": ("sharpness", "geodesic mix", False),
        "geodesic-inv-o2-adaptivenorm worst l2": ("sharpness", None, False),
        "geodesic-mix-o2-adaptivenorm-blocks worst l2": ("sharpness", None, False),
        "adaptive worst l2": ("sharpness", "adaptive", False),
        "adaptive-blocks worst l2": ("sharpness", "adaptive", False),
        "adaptive average linf": ("sharpness", "adaptive", False),
        "euclidean worst l2": ("sharpness", None, False),
        "geodesic-inv curvature lambda_max": ("curvature", None, False),
        "geodesic-mix curvature trace": ("curvature", None, False),
        "adaptive curvature trace": ("curvature", None, False),
        "euclidean curvature lambda_min": ("curvature", None, False),
        "relative_flatness": ("relative flatness", None, False),
        "relative-flatness": ("relative flatness", None, False),
    }
    for name, (family, paper, main) in expected.items():
        got = (measure_family(name), default_paper_match(name), is_geodesic_main(name))
        assert got == (family, paper, main), name
    assert set(names.FAMILY_ORDER) == {measure_family(n) for n in CANONICAL}


def test_is_geodesic_main_never_raises_and_its_parts_come_from_the_parse():
    assert not is_geodesic_main(None) and not is_geodesic_main(3)
    for name in CANONICAL:
        if is_geodesic_main(name):
            m = REF_GEODESIC_MAIN.match(name)
            spec = parse_measure(name)
            assert (spec.metric, spec.kind) == (m.group(1), m.group(2))
    assert sum(map(is_geodesic_main, CANONICAL)) == 4


# --------------------------------------------------------------------------------------------
# parsing


@pytest.mark.parametrize("name", CANONICAL)
def test_every_canonical_name_parses_back_to_itself(name):
    spec = parse_measure(name)
    assert spec.name == name
    assert parse_measure(spec.name) == spec
    assert Measure.parse(name) == spec


def test_blocks_and_adaptivenorm_are_read():
    spec = parse_measure("geodesic-mix-o2-adaptivenorm-blocks")
    assert (spec.measure, spec.metric, spec.perturb, spec.corrected_norm) == (
        "geodesic",
        "mix",
        "blocks",
        False,
    )
    assert parse_measure("adaptive-blocks").name == "adaptive-blocks worst l2"
    assert parse_measure("geodesic-inv").perturb == "all"
    assert parse_measure("geodesic-inv").corrected_norm is True


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("euclidean-blocks", "blocks .* geodesic and adaptive l2"),
        ("adaptive-linf-blocks", "blocks .* geodesic and adaptive l2"),
        ("adaptive-adaptivenorm", "adaptivenorm .* geodesic sharpness only"),
        ("curvature-inv-lmax-blocks", "unknown option 'blocks'"),
        ("geodesic-inv-mix", "gives the metric twice"),
        ("geodesic-linf", "l-infinity box"),
        ("adaptive-inv", "metric and order belong to geodesic"),
        ("curvature-lmax-o2", "no order, kind or norm"),
        ("curvature", "say which curvature quantity"),
        ("curvature-adaptive-inv-trace", "inv|mix belongs to geodesic curvature only"),
        ("sharpest", "unknown measure 'sharpest'"),
    ],
)
def test_bad_measures_say_why(text, match):
    with pytest.raises(MeasureError, match=match):
        parse_measure(text)


def test_the_grammar_is_the_one_of_measure_and_the_callback():
    """``gs.measure`` (its settings) and the callback use ``geosharp.measures``' grammar."""
    from geosharp import measures
    from geosharp.measuring import settings

    assert settings.parse_measure is measures.parse_measure
    pytest.importorskip("transformers")
    from geosharp.integrations import hf_trainer

    assert hf_trainer._parse_measure("geo-mix") == parse_measure("geodesic-mix-o2")
    with pytest.raises(ValueError, match="-blocks"):
        hf_trainer._parse_measure("geodesic-inv-o2-blocks worst l2")
    with pytest.raises(ValueError, match="measures sharpness"):
        hf_trainer._parse_measure("curvature-inv-lmax")


def test_measure_measures_the_blocks_and_adaptivenorm_variants():
    """``gs.measure`` passes ``-blocks`` and ``-adaptivenorm`` on to :func:`geosharp.sharpness`."""
    import torch
    from torch import nn

    import geosharp as gs

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x)[0].mean(1))

    torch.manual_seed(0)
    model = Attention()
    batches = [(torch.randn(4, 5, 8), torch.randint(0, 3, (4,)))]
    kw = {"rhos": [0.1], "steps": 3, "warn": lambda _m: None}
    rep = gs.measure(
        model, batches, measures=["geodesic-inv-o2-adaptivenorm", "adaptive-blocks"], **kw
    )
    assert [r.measure for r in rep.rows] == [
        "geodesic-inv-o2-adaptivenorm worst l2",
        "adaptive-blocks worst l2",
    ]
    ce = nn.functional.cross_entropy
    ref = gs.sharpness(model, ce, batches, rho=0.1, steps=3, corrected_norm=False)
    blocks = gs.sharpness(
        model, ce, batches, measure="adaptive", rho=0.1, steps=3, perturb="blocks"
    )
    assert [r.error for r in rep.rows] == [None, None]
    assert rep.rows[0].value == pytest.approx(ref.value)
    assert rep.rows[1].value == pytest.approx(blocks.value)
