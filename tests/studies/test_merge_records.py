"""What ``geosharp merge`` records of the shards' runs, decided by content, never by a clock.

Settings that decide the values must agree between the shards (else one line names the folder,
the setting and both values, before anything is written); what ran each shard (threads, CPUs,
device, platform) is kept for every shard; a setting a folder records of its own models (a
manifest study's batches as cut) is kept per folder; different manifests are refused naming the
models. The study records its models and measures nothing (an empty plan), so every case runs in
milliseconds on real ``study.sqlite`` folders written by ``run_study``.
"""

import json

import pytest

from geosharp.cli import main
from geosharp.studies import runner
from geosharp.studies.merge import merge_shards
from geosharp.studies.runner import run_study
from geosharp.studies.shards import Shard
from geosharp.studies.store import Store, StudyMismatchError

from .test_shard_rule import V1, Listed


class Recorded(Listed):
    """A study whose report settings hold more than its configuration (as a manifest study's
    do: the data file, the batches as cut for its own models)."""

    def __init__(self, names, settings=None, config=None):
        super().__init__(names)
        self._settings = settings or {}
        self._config = config or {"what": "listed"}

    def config(self):
        return self._config

    def settings(self):
        return {**self._config, **self._settings}


def run(out, k, study, env=None, monkeypatch=None):
    if env is not None:  # another machine: threads, CPUs, platform
        monkeypatch.setattr(runner, "environment", lambda: {**ENV, **env})
    run_study(study, out, shard=Shard(k, 2), report=False, progress=False, log=lambda m: None)


ENV = {"geosharp": "x", "torch": "y", "python": "3", "threads": 1, "cpus": 2,
       "platform": "Linux", "cuda": None}  # fmt: skip


def report_info(out):
    with Store(out / "study.sqlite", None, None) as store:
        return json.loads(store.meta()["report"])


def test_a_setting_that_decides_the_values_must_agree(tmp_path, capsys):
    run(tmp_path / "s1", 1, Recorded(V1, {"data": "a.csv"}))
    run(tmp_path / "s2", 2, Recorded(V1, {"data": "b.csv"}))
    with pytest.raises(StudyMismatchError) as err:
        merge_shards(tmp_path / "m", [tmp_path / "s1", tmp_path / "s2"], log=print)
    msg = str(err.value)
    assert msg == (
        f"{tmp_path / 's2'} was run with data='b.csv' but {tmp_path / 's1'} with data='a.csv': "
        "not parts of one run; merge each into its own folder"
    )
    assert not (tmp_path / "m").exists()  # checked before any work
    assert main(["merge", str(tmp_path / "m"), str(tmp_path / "s1"), str(tmp_path / "s2")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "data='b.csv'" in lines[0] and not (tmp_path / "m").exists()


def test_a_configuration_difference_names_the_nested_setting(tmp_path):
    run(tmp_path / "s1", 1, Recorded(V1, config={"options": {"dtype": "float32", "b": 4}}))
    run(tmp_path / "s2", 2, Recorded(V1, config={"options": {"dtype": "float64", "b": 4}}))
    said = r"s2 was run with options\.dtype='float64' but \S*s1 with options\.dtype='float32': "
    with pytest.raises(StudyMismatchError, match=said + "they are not shards of one run"):
        merge_shards(tmp_path / "m", [tmp_path / "s1", tmp_path / "s2"], report=False)
    assert not (tmp_path / "m").exists()


def test_what_ran_each_shard_is_kept_for_every_shard(tmp_path, monkeypatch):
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    run(s1, 1, Recorded(V1), {"threads": 1, "platform": "Linux-a"}, monkeypatch)
    run(s2, 2, Recorded(V1), {"threads": 8, "cpus": 16, "cuda": "H100"}, monkeypatch)
    merged = tmp_path / "m"
    merge_shards(merged, [s1, s2], log=lambda m: None)
    envs = report_info(merged)["environments"]
    assert [(e["threads"], e["folders"]) for e in envs] == [(1, [str(s1)]), (8, [str(s2)])]
    html = (merged / "report.html").read_text()
    assert f"CPU (2 cores, 1 threads), Linux-a (ran {s1})" in html
    assert f"H100, Linux (ran {s2})" in html
    # Merged again, or with OUT among the shards: the same record, nothing repeated.
    merge_shards(merged, [s1, s2], report=False, log=lambda m: None)
    merge_shards(merged, [merged, s2], report=False, log=lambda m: None)
    assert report_info(merged)["environments"] == envs


def test_batches_cut_per_folder_are_kept_per_folder(tmp_path):
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    run(s1, 1, Recorded(V1, {"batches": "4 per batch, max length 32"}))
    run(s2, 2, Recorded(V1, {"batches": "4 per batch, max length 16"}))
    merged = tmp_path / "m"
    merge_shards(merged, [s1, s2], report=False, log=lambda m: None)
    text = f"4 per batch, max length 32 ({s1}); 4 per batch, max length 16 ({s2})"
    assert report_info(merged)["settings"]["batches"] == text
    merge_shards(merged, [s1, s2], report=False, log=lambda m: None)  # idempotent
    assert report_info(merged)["settings"]["batches"] == text


def test_the_population_is_decided_by_content_not_by_clocks(tmp_path, monkeypatch):
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    run(s1, 1, Recorded(V1))
    monkeypatch.setattr(runner.time, "time", lambda: 0.0)  # a machine whose clock is behind
    run(s2, 2, Recorded(V1[::-1]))  # the same models, listed in another order: one population
    merged = tmp_path / "m"
    summary = merge_shards(merged, [s2, s1], report=False, log=lambda m: None)
    assert summary.population == V1[::-1] and not summary.missing  # the first folder's order
    assert "recorded" not in report_info(merged)
    # The manifest grew, and every part was rerun with it: OUT, merged from the old one, is
    # refused (naming the models) rather than silently keeping or dropping either population.
    grown = [*V1, "new-a"]
    run(s1, 1, Recorded(grown))
    run(s2, 2, Recorded(grown))
    with pytest.raises(StudyMismatchError, match=r"lists new-a, which \S*m does not.*new folder"):
        merge_shards(merged, [s1, s2], report=False, log=lambda m: None)
    assert report_info(merged)["population"] == V1[::-1]  # nothing written
    summary = merge_shards(tmp_path / "m2", [s1, s2], report=False, log=lambda m: None)
    assert summary.population == grown and not summary.missing


def test_the_heads_and_a_manifest_studys_records_are_merged(tmp_path):
    """The ``orbit`` table (the heads the runner records of each model loaded), ``models.json``
    and ``manifest.json`` were left in the shards: the merged report lost its orbit spread and a
    manifest study's model and hyperparameter sections."""
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    run(s1, 1, Recorded(V1))
    run(s2, 2, Recorded(V1))
    record = {"manifest": "m.csv", "rho": "0.05", "hyperparameters": ["lr"]}
    for s in (s1, s2):
        with Store(s / "study.sqlite", None, None) as store:
            for m in store.models():  # as runner._record_orbit stores them
                store.put_orbit(m["model_id"], [{"model_id": m["model_id"], "head": 0}])
            ids = [m["model_id"] for m in store.models()]
        (s / "models.json").write_text(json.dumps({mid: {"kind": "bert"} for mid in ids}))
        (s / "manifest.json").write_text(json.dumps(record))
    merged = tmp_path / "m"
    said = []
    merge_shards(merged, [s1, s2], report=False, log=said.append)
    with Store(merged / "study.sqlite", None, None) as store:
        assert sorted(store.orbit_rows()) == sorted(V1)
    assert sorted(json.loads((merged / "models.json").read_text())) == sorted(V1)
    assert json.loads((merged / "manifest.json").read_text()) == record
    assert not any("manifest.json" in line for line in said)
    # A manifest record that differs is said in one line (the first folder's is kept).
    (s2 / "manifest.json").write_text(json.dumps({**record, "rho": "auto"}))
    summary = merge_shards(tmp_path / "m2", [s1, s2], report=False, log=lambda m: None)
    assert [w for w in summary.warnings if "manifest.json" in w] == [
        f"manifest.json differs between {s1} and {s2} (rho): {tmp_path / 'm2'} keeps {s1}'s"
    ]
