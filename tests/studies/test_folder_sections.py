"""Report sections from study-folder files: the provider registry, export, no runner cycle."""

import subprocess
import sys
from pathlib import Path

import pytest

from geosharp.studies import sections
from geosharp.studies.report import write_report
from geosharp.studies.sections import Section, folder_sections, register_folder_section
from geosharp.studies.symmetry_test import SymmetryTestRow, _append

FAST = {"n_boot": 50, "n_perm": 50}


@pytest.fixture(autouse=True)
def registry():
    """Every test leaves the providers and result files as it found them."""
    providers, files = list(sections.FOLDER_SECTION_PROVIDERS), list(sections.RESULT_FILES)
    yield
    sections.FOLDER_SECTION_PROVIDERS[:] = providers
    sections.RESULT_FILES[:] = files


def _models():
    return [{"model_id": f"m{i}", "gap": 0.1 * i} for i in range(5)]


def _measurements():
    return [
        {"model_id": f"m{i}", "measure": "adaptive worst l2", "rho": 0.1, "value": float(i)}
        for i in range(5)
    ]


def test_runner_does_not_import_the_symmetry_test():
    code = (
        "import sys, geosharp.studies.runner as r;"
        "assert 'geosharp.studies.symmetry_test' not in sys.modules, 'imported';"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    source = Path(sys.modules["geosharp.studies.runner"].__file__ or "").read_text()
    assert "symmetry_test" not in source


def test_symmetry_test_csv_becomes_a_section_through_its_provider(tmp_path):
    for i in range(5):
        row = SymmetryTestRow(f"m{i}", "adaptive worst l2", 0.1, 2.0, 0.1 * i, i, 10 - i, 1e-7)
        _append(tmp_path / "symmetry_test.csv", row)
    found = folder_sections(tmp_path, {})
    assert [s.title for s in found] == ["τ before and after random equivalent re-parametrizations"]
    paths = write_report(
        tmp_path, title="t", models=_models(), measurements=_measurements(), settings={}, **FAST
    )
    assert "τ before and after random equivalent" in paths.html.read_text()
    assert "τ before and after random equivalent" in paths.tau_table.read_text()


def test_an_empty_folder_has_no_sections(tmp_path):
    assert folder_sections(tmp_path, {"m0": 0.1}) == []


def test_a_registered_provider_adds_its_section_in_order(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")

    def notes(folder, gaps):
        path = Path(folder) / "notes.txt"
        if not path.is_file():
            return []
        return [Section("Notes file", ["text", "models"], [[path.read_text(), str(len(gaps))]], "")]

    register_folder_section(notes, files=["notes.txt"])
    register_folder_section(notes)  # twice: listed once
    assert "notes.txt" in sections.RESULT_FILES
    try:
        assert sections.FOLDER_SECTION_PROVIDERS.count(notes) == 1
        (tmp_path / "sections.json").write_text(
            '[{"title": "From JSON", "header": ["a"], "rows": [["1"]], "caption": "c"}]'
        )
        assert [s.title for s in folder_sections(tmp_path, {"m0": 0.1})] == [
            "From JSON",
            "Notes file",
        ]
        paths = write_report(
            tmp_path, title="t", models=_models(), measurements=_measurements(), settings={}, **FAST
        )
        page = paths.html.read_text()
        assert page.index("From JSON") < page.index("Notes file")
        assert "<td>hello</td><td>5</td>" in page
    finally:
        sections.FOLDER_SECTION_PROVIDERS.remove(notes)
    register_folder_section(notes, before=sections.json_sections)
    try:
        assert [s.title for s in folder_sections(tmp_path, {})] == ["Notes file", "From JSON"]
    finally:
        sections.FOLDER_SECTION_PROVIDERS.remove(notes)


def test_a_provider_named_by_module_path_is_imported_when_needed(tmp_path):
    before = list(sections.FOLDER_SECTION_PROVIDERS)
    register_folder_section("geosharp.studies.sections:json_sections")  # already there: no-op
    register_folder_section("geosharp.studies.symmetry_test:folder_sections")  # also
    from geosharp.studies.symmetry_test import folder_sections as symmetry_sections

    register_folder_section(symmetry_sections)  # the callable of a listed name: no-op
    assert sections.FOLDER_SECTION_PROVIDERS == before
    (tmp_path / "sections.json").write_text(
        '[{"title": "Once", "header": ["a"], "rows": [["1"]], "caption": ""}]'
    )
    assert [s.title for s in folder_sections(tmp_path, {})] == ["Once"]
    register_folder_section("geosharp.stats:nosuch")
    try:
        with pytest.raises(AttributeError):
            folder_sections(tmp_path, {})
    finally:
        sections.FOLDER_SECTION_PROVIDERS.remove("geosharp.stats:nosuch")


def test_export_copies_every_result_file_and_keeps_the_sections(tmp_path):
    from geosharp.studies.store import Store
    from geosharp.studies.study_report import export_study, report_from_folder

    src, dst = tmp_path / "study", tmp_path / "shared"
    src.mkdir()
    with Store(src / "study.sqlite", "fake", {"x": 1}) as store:
        for i in range(5):
            store.put_model(f"m{i}", hparams={"i": i}, metrics={}, gap=0.1 * i)
            store.put_measurement(f"m{i}", "adaptive worst l2", 0.1, {}, float(i), [float(i)])
    (src / "diagnostics.csv").write_text(
        "model_id,imbalance\n" + "".join(f"m{i},{0.5 * i}\n" for i in range(5))
    )
    (src / "sections.json").write_text(
        '[{"title": "Preregistered tests", "header": ["H"], "rows": [["H1"]], "caption": ""}]'
    )
    (src / "analysis.md").write_text("# analysis\n")
    (src / "PREREGISTRATION.md").write_text("# plan\n")
    (src / "model.pt").write_bytes(b"checkpoint")  # stays behind
    report_from_folder(src)
    export_study(src, dst)
    for name in ("diagnostics.csv", "sections.json", "analysis.md", "PREREGISTRATION.md"):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert not (dst / "model.pt").exists()
    table = (dst / "tau_table.md").read_text()
    assert "Diagnostics: orbit position" in table and "Preregistered tests" in table
    assert table == (src / "tau_table.md").read_text()
