"""``--shard k/n`` owns models by a hash of their names: a manifest that grows, shrinks or is
reordered between runs moves no model to another part, every folder records its split (a resumed
folder keeps it, another ``n`` is refused, a folder from before the record keeps the position
rule), and ``geosharp merge`` names the models no shard measured and those two shards measured.

The study here records its models and measures nothing (an empty plan): ownership is what is
tested, in milliseconds; ``test_merge.py`` and ``test_population.py`` measure real shards.
"""

import hashlib
import json
import sqlite3

import pytest

from geosharp.studies.merge import merge_shards
from geosharp.studies.runner import Study, run_study
from geosharp.studies.shards import POSITION_RULE, SHARD_RULE, Shard, shard_of
from geosharp.studies.store import NOT_MEASURED, Store, StudyMismatchError


class Listed(Study):
    """A population of named models, "trained" by recording them."""

    name = "listed"

    def __init__(self, names):
        self.names = list(names)

    def config(self):
        return {"what": "listed"}  # the same study whatever the list: a manifest that grows

    def population(self):
        return [(n, {"i": i}) for i, n in enumerate(self.names)]

    def train(self, todo, out_dir, store, progress):
        for mid, hp in todo:
            store.put_model(mid, hparams=hp, metrics={}, gap=0.1)

    def load(self, row):
        raise AssertionError("nothing is measured")

    def batches(self):
        return []

    def loss_fn(self, outputs, targets):
        raise AssertionError("nothing is measured")

    def plan(self):
        return []


def run(names, out, shard=None, force=False, log=None):
    said = []
    run_study(Listed(names), out, shard=shard, force=force, report=False, progress=False,
              log=log or said.append)  # fmt: skip
    return said


def held(out):
    with Store(out / "study.sqlite", None, None) as store:
        return {m["model_id"] for m in store.models()}


def record(out):
    with Store(out / "study.sqlite", None, None) as store:
        return json.loads(store.meta()["shards"])


V1 = [f"run-{i:02d}" for i in range(12)]
V2 = [*V1[:5], "new-a", "new-b", *V1[5:], "new-c"]  # grown in the middle and at the end
GROWN = [*V1[:5], "new-a", *V1[5:]]  # one model added in the middle


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_every_model_has_one_owner_that_never_moves(n):
    parts = [Shard(k, n) for k in range(1, n + 1)]
    for names in (V1, V2, V2[::-1], V2[3:]):  # grown, reordered, shrunk
        taken = [p.take(names) for p in parts]
        assert sorted(m for t in taken for m in t) == sorted(names)  # exactly one part each
        for p, t in zip(parts, taken, strict=True):
            assert t == [m for m in names if shard_of(m, n) == p.k]  # its order kept
            assert all(p.owns(m) for m in t)
    assert [Shard(2, 3).take([(m, {}) for m in V1])] == [[(m, {}) for m in Shard(2, 3).take(V1)]]


def test_the_rule_is_pinned():
    # 1 + (SHA-256 of the UTF-8 name, its first 8 bytes big-endian) mod n: the same on every
    # machine and Python; a change here would re-split every user's shard folders.
    assert [shard_of(m, 3) for m in V1] == [3, 2, 2, 3, 3, 2, 2, 3, 1, 2, 3, 1]
    digest = hashlib.sha256(b"models/bert-a").digest()
    assert shard_of("models/bert-a", 7) == 1 + int.from_bytes(digest[:8], "big") % 7 == 3


def test_a_manifest_grown_in_the_middle_keeps_every_model_in_one_shard(tmp_path):
    n = 3
    folders = [tmp_path / f"shard{k}" for k in range(1, n + 1)]
    for k, out in enumerate(folders, 1):
        run(V1, out, Shard(k, n))
    before = [held(out) for out in folders]
    for k, out in enumerate(folders, 1):  # the manifest grew between the runs: resume every part
        said = run(V2, out, Shard(k, n))
        assert any(f"shard part {k}/{n} ({SHARD_RULE})" in line for line in said), said
    after = [held(out) for out in folders]
    # Every model in exactly one folder, and no folder lost or gained an old model.
    assert sorted(m for h in after for m in h) == sorted(V2)
    for old, new in zip(before, after, strict=True):
        assert old <= new and not (new - old) - {"new-a", "new-b", "new-c"}
    summary = merge_shards(tmp_path / "merged", folders, report=False, log=lambda m: None)
    assert summary.missing == [] and summary.measured_twice == {}
    assert summary.population == V2 and held(tmp_path / "merged") == set(V2)


def test_merge_names_the_model_no_shard_measured(tmp_path):
    folders = [tmp_path / "shard1", tmp_path / "shard2"]
    for k, out in enumerate(folders, 1):
        run(V1, out, Shard(k, 2))
    owner = shard_of("new-a", 2)
    other = 3 - owner
    run(GROWN, folders[other - 1], Shard(other, 2))  # only the other part
    # The parts read two manifests: refused in one line naming the model, whichever clock ran
    # later, and before anything is written.
    with pytest.raises(StudyMismatchError, match=r"different manifests: .* lists new-a, which "):
        merge_shards(tmp_path / "merged", folders, report=False, log=print)
    assert not (tmp_path / "merged").exists()
    # The owner rerun with the new manifest but not finished (new-a not recorded yet).
    run(GROWN, folders[owner - 1], Shard(owner, 2))
    with sqlite3.connect(folders[owner - 1] / "study.sqlite") as conn:
        conn.execute("DELETE FROM models WHERE model_id = 'new-a'")
    conn.close()
    said = []
    summary = merge_shards(tmp_path / "merged", folders, report=False, log=said.append)
    assert summary.missing == ["new-a"] and summary.population == GROWN
    line = next(w for w in said if "measured by no shard" in w)
    assert line.startswith("warning: 1 of the 13 models of the population were measured by no ")
    assert f"part {owner}/2 owns new-a: rerun it, then merge again" in line
    # results.csv says so rather than ranking fewer models silently.
    with Store(tmp_path / "merged" / "study.sqlite", None, None) as store:
        store.export_csv(tmp_path / "results.csv")
    lines = (tmp_path / "results.csv").read_text().splitlines()
    assert [x for x in lines if x.startswith("new-a,")] == [
        "new-a," + "," * (lines[0].count(",") - 1) + NOT_MEASURED
    ]
    # Rerunning the owner, then merging again, completes the study.
    run(GROWN, folders[owner - 1], Shard(owner, 2))
    again = merge_shards(tmp_path / "merged", folders, report=False, log=lambda m: None)
    assert again.missing == [] and again.new_models == 1


def test_merge_names_models_two_shards_measured(tmp_path):
    run(V1, tmp_path / "all")  # unsharded: every model
    run(V1, tmp_path / "part2", Shard(2, 2))
    said = []
    summary = merge_shards(
        tmp_path / "merged", [tmp_path / "all", tmp_path / "part2"], report=False, log=said.append
    )
    twice = Shard(2, 2).take(V1)
    assert sorted(summary.measured_twice) == sorted(twice)
    line = next(w for w in said if "more than one shard" in w)
    assert line.startswith(f"warning: {len(twice)} model(s) were measured by more than one shard")
    assert "kept once" in line and summary.missing == []
    # The same folder given twice is one shard, not two.
    once = merge_shards(tmp_path / "m2", [tmp_path / "part2"] * 2, report=False, log=print)
    assert once.measured_twice == {}


def test_a_folder_keeps_its_split_and_refuses_another_n(tmp_path):
    out = tmp_path / "s"
    run(V1, out, Shard(1, 2))
    assert record(out) == {"rule": SHARD_RULE, "n": 2, "parts": [1]}
    with pytest.raises(StudyMismatchError, match=r"holds part 1/2 .* asks for part 1/3"):
        run(V1, out, Shard(1, 3))
    assert record(out)["n"] == 2  # nothing changed
    said = run(V1, out, Shard(1, 3), force=True)
    assert any("split anew" in line for line in said)
    assert record(out) == {"rule": SHARD_RULE, "n": 3, "parts": [1]}
    # Parts of one split may share a folder (one database, several processes).
    shared = tmp_path / "shared"
    run(V1, shared, Shard(1, 2))
    said = run(V1, shared, Shard(2, 2))
    assert record(shared)["parts"] == [1, 2] and held(shared) == set(V1)
    assert any("holds parts 1, 2 of 2" in line for line in said)


def test_a_folder_from_before_the_record_keeps_the_position_rule(tmp_path):
    out = tmp_path / "old"
    run(V1, out, Shard(2, 3))
    with sqlite3.connect(out / "study.sqlite") as conn:  # as geosharp wrote it before the rule
        conn.execute("DELETE FROM meta WHERE key = 'shards'")
        conn.execute("DELETE FROM models")
        for mid in V1[1::3]:
            conn.execute(
                "INSERT INTO models VALUES (?, '{}', '{}', 0.1, NULL, NULL, NULL, 0)", (mid,)
            )
    conn.close()
    said = run(V1, out, Shard(2, 3))
    assert any("keeps the rule it was measured with, by position" in line for line in said)
    assert record(out) == {"rule": POSITION_RULE, "n": 3, "parts": [2]}
    assert held(out) == set(V1[1::3])  # nothing else taken
    said = run(V1, out, Shard(2, 3))  # resumed again: still by position, silently
    assert record(out)["rule"] == POSITION_RULE and not any("keeps the rule" in x for x in said)
    assert held(out) == set(V1[1::3])
    # --force switches it to the stable rule (its rows are kept).
    with sqlite3.connect(out / "study.sqlite") as conn:
        conn.execute("DELETE FROM meta WHERE key = 'shards'")
    conn.close()
    said = run(V1, out, Shard(2, 3), force=True)
    assert any("--force: it is now part 2/3" in line for line in said)
    assert record(out)["rule"] == SHARD_RULE
    assert held(out) == set(V1[1::3]) | set(Shard(2, 3).take(V1))
