"""A manifest's models checked before any is measured: a corrupt ``config.json`` names its row."""

from __future__ import annotations

import json

import pytest

from geosharp.errors import MeasureError
from geosharp.studies.population import PopulationSettings, PopulationStudy, parse_rho


@pytest.fixture
def manifest(tmp_path):
    for name in ("a", "b", "c", "d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "c" / "config.json").write_text('{"model_type": "bert",')  # cut short
    (tmp_path / "m.csv").write_text("model,gap\na,0.1\nb,0.2\nc,0.3\nd,0.4\n")
    return tmp_path / "m.csv"


def _settings(manifest, **kw):
    return PopulationSettings(
        manifest=str(manifest), options={"data": "data.csv"}, rho=parse_rho(["0.1"]), **kw
    )


def test_a_corrupt_config_is_set_aside_under_skip_bad_with_its_row(manifest):
    study = PopulationStudy(_settings(manifest, skip_bad=True), log=lambda _: None)
    assert [r.model_id for r in study.manifest.rows] == ["a", "b", "d"]
    [(line, label, why)] = study.manifest.skipped
    assert (line, label) == (3, "c") and "config.json" in why and "not valid JSON" in why
    assert study.notes() == [f"skipped manifest row 3 (c): {why}"]


def test_a_corrupt_config_without_skip_bad_is_one_line_naming_the_row(manifest):
    with pytest.raises(MeasureError) as err:
        PopulationStudy(_settings(manifest), log=lambda _: None)
    text = str(err.value)
    assert text.startswith("m.csv row 3 (c): ") and "config.json" in text and "\n" not in text
