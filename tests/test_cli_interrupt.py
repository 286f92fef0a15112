"""Ctrl-C and missing extras: one clear line, no traceback."""

import importlib.util

import pytest

from geosharp import cli, cli_studies


def test_ctrl_c_says_what_was_saved_and_how_to_resume(monkeypatch, capsys, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("geosharp.studies.runner.run_study", interrupted)
    monkeypatch.setattr(cli.sys, "argv", ["geosharp", "study", "diagonal", "--out", str(tmp_path)])
    code = cli.main(["study", "diagonal", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 130
    assert f"every finished row is saved in {tmp_path / 'study.sqlite'}" in err
    assert f"Resume with: geosharp study diagonal --out {tmp_path}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_extra_is_named_before_any_work(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name)
    )
    code = cli.main(["study", "minilm-text", "--quick", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "needs transformers (the [hf] extra)" in err
    assert "pip install 'geosharp[hf]'" in err
    assert not (tmp_path / "study.sqlite").exists()


@pytest.mark.parametrize("name", sorted(cli_studies.STUDY_REQUIRES))
def test_requirements_name_real_modules(name):
    modules, extra = cli_studies.STUDY_REQUIRES[name]
    assert extra == "hf" and all(isinstance(m, str) for m in modules)
