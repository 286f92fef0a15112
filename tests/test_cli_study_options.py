"""geosharp study: --rho and --population only where a study takes them; --curvature."""

import pytest

from geosharp import cli, cli_studies


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a study would be built, trained or measured."""

    def work(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr("geosharp.studies.runner.run_study", work)
    for name in ("vit-mnist", "minilm-text", "vit-orbit"):
        monkeypatch.setitem(cli_studies.STUDIES, name, (cli_studies.STUDIES[name][0], work))


@pytest.mark.parametrize("name", ["vit-mnist", "minilm-text", "vit-orbit"])
@pytest.mark.parametrize(
    ("option", "words"), [(["--rho", "0.1"], "--rho"), (["--population", "sgd-batch"], "--pop")]
)
def test_options_of_the_diagonal_study_are_refused_elsewhere_in_one_line(
    name, option, words, no_work, capsys, tmp_path
):
    code = cli.main(["study", name, *option, "--quick", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"geosharp: error: {words}") and f"not of {name}" in err
    assert "diagonal study only" in err
    assert not (tmp_path / "x").exists()


def test_symmetry_test_has_no_rho_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["symmetry-test", "vit-mnist", "--rho", "0.1"])
    assert "unrecognized arguments: --rho" in capsys.readouterr().err


def test_help_says_which_studies_take_rho(capsys):
    with pytest.raises(SystemExit):
        cli.main(["study", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "diagonal only: its radii" in text
    assert "vit-mnist, minilm-text and vit-orbit fix one ρ grid per measure" in text
    assert "--curvature" in text and "λ_max and trace" in text


def test_every_study_only_option_names_real_studies():
    for studies, _ in cli_studies.STUDY_ONLY_OPTIONS.values():
        assert set(studies) <= set(cli_studies.STUDIES)


@pytest.mark.parametrize("command", ["study", "symmetry-test"])
def test_curvature_flag_turns_on_the_curvature_part(command, monkeypatch, tmp_path):
    seen = {}

    def fake_run(study, out, **kwargs):
        seen["study"] = study
        raise KeyboardInterrupt  # stop here: nothing is trained

    def fake_test(study, out, **kwargs):
        seen["study"] = study
        return [], ""

    monkeypatch.setattr("geosharp.studies.runner.run_study", fake_run)
    monkeypatch.setattr("geosharp.studies.symmetry_test.symmetry_test", fake_test)
    args = [command, "diagonal", "--quick", "--out", str(tmp_path)]
    cli.main([*args, "--curvature"])
    study = seen.pop("study")
    assert study.curvature is not None and "curvature" in study.config()
    assert any(spec.kwargs.get("measure") == "curvature" for spec in study.plan())
    cli.main(args)
    plain = seen.pop("study")
    assert plain.curvature is None and "curvature" not in plain.config()
    assert {spec.name for spec in study.plan()} > {spec.name for spec in plain.plan()}


def test_curvature_flag_on_a_transformer_study(monkeypatch, tmp_path):
    from geosharp.studies.vit_mnist import ViTMNISTConfig, ViTMNISTStudy

    monkeypatch.setitem(
        cli_studies.STUDIES,
        "vit-mnist",
        ("Study 2", lambda args: ViTMNISTStudy(ViTMNISTConfig.quick(seed=args.seed))),
    )
    seen = {}

    def fake_run(study, out, **kwargs):
        seen["study"] = study
        raise KeyboardInterrupt

    monkeypatch.setattr("geosharp.studies.runner.run_study", fake_run)
    cli.main(["study", "vit-mnist", "--quick", "--curvature", "--out", str(tmp_path)])
    names = [spec.name for spec in seen["study"].plan()]
    assert any("curvature" in n for n in names)
