"""How ``--shard k/n`` splits a study's population, and what a shard folder records of it.

A model belongs to a part by a hash of its name (:func:`shard_of`), so a manifest that grows,
shrinks or is reordered between runs moves no other model to another part; every folder records
its split in its ``study.sqlite`` (:func:`settle_shard`), so a resumed part never silently owns
other models than it measured, and ``geosharp merge`` (:mod:`geosharp.studies.merge`) can name the
models no part measured.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from geosharp.studies.store import Store, StudyMismatchError

__all__ = [
    "PER_SHARD_SETTINGS",
    "POSITION_RULE",
    "SHARDS_META",
    "SHARD_HELP",
    "SHARD_RULE",
    "SHARD_RULES",
    "Shard",
    "merged_report",
    "ran_with",
    "settle_shard",
    "shard_of",
    "shard_record",
]


#: How ``--shard k/n`` splits a population: model ``M`` belongs to part ``shard_of(M, n)``, a
#: hash of its name (its id in the store), so adding, removing or reordering models never moves
#: another model to another part. Recorded in every shard's ``study.sqlite`` (meta ``shards``).
SHARD_RULE = "name-hash"
#: The rule of shard folders written before the rule was recorded: the models at positions
#: ``k−1, k−1+n, …`` of the population (a model added in the middle moves every later one).
POSITION_RULE = "position"
SHARD_RULES = {
    SHARD_RULE: "a hash of the model's name: part 1 + (SHA-256 of the name, first 8 bytes as a "
    "big-endian integer) mod n",
    POSITION_RULE: "position in the manifest: models k, k+n, k+2n, …",
}

#: The ``--shard K/N`` help of every study command (built-in studies and manifests).
SHARD_HELP = (
    "only part k of n of the models: a model belongs to part 1 + (SHA-256 of its name) mod n, "
    "so adding, removing or reordering models moves no other model; OUT records the split and a "
    "resumed OUT keeps it (another n is refused without --force; a folder from before the rule "
    "was recorded keeps taking models by position). geosharp merge joins the parts and names "
    "any model no part measured"
)


def shard_of(model_id: str, n: int) -> int:
    """The part (1 to ``n``) that owns a model under :data:`SHARD_RULE`.

    ``1 + int.from_bytes(sha256(model_id.encode("utf-8")).digest()[:8], "big") % n``: the same
    on every machine, Python and platform, and independent of the other models.

    Example:
        >>> [shard_of(f"diag-{i:03d}", 2) for i in range(4)]
        [1, 2, 1, 2]
        >>> old = Shard(1, 2).take(["a", "b", "c", "d"])
        >>> set(old) <= set(Shard(1, 2).take(["a", "new", "b", "c", "d"]))  # grown: none moves
        True
    """
    digest = hashlib.sha256(model_id.encode("utf-8")).digest()
    return 1 + int.from_bytes(digest[:8], "big") % n


def _model_id(item: Any) -> str:
    return str(item[0] if isinstance(item, tuple | list) else item)


@dataclass
class Shard:
    """Part ``k`` of ``n`` (1-based) of a population.

    Attributes:
        k: The part.
        n: The number of parts.
        rule: :data:`SHARD_RULE` (the models whose :func:`shard_of` is ``k``: stable when the
            population grows, shrinks or is reordered) or :data:`POSITION_RULE` (the models at
            positions ``k−1, k−1+n, …``; what shard folders written before the rule was
            recorded keep, :func:`settle_shard`).
    """

    k: int
    n: int
    rule: str = SHARD_RULE

    @classmethod
    def parse(cls, text: str) -> Shard:
        """Parse ``"k/n"``.

        Raises:
            ValueError: If the text is not ``k/n`` with ``1 ≤ k ≤ n``.
        """
        try:
            k, n = (int(x) for x in text.split("/"))
        except ValueError as err:
            raise ValueError(f"--shard must look like 2/4, got {text!r}") from err
        if not 1 <= k <= n:
            raise ValueError(f"--shard k/n needs 1 <= k <= n, got {text!r}")
        return cls(k, n)

    def owns(self, model_id: str) -> bool:
        """Whether this part holds the model (:data:`SHARD_RULE` only: it needs no position)."""
        if self.rule != SHARD_RULE:
            raise ValueError(f"shard rule {self.rule!r} needs the population's order: use take")
        return shard_of(model_id, self.n) == self.k

    def take(self, items: Sequence[Any], key: Callable[[Any], str] | None = None) -> list[Any]:
        """The items of this shard, in their order.

        Args:
            items: The population: ``(model_id, hyperparameters)`` pairs or model ids.
            key: The model id of an item (default: the item's first element, or the item).
        """
        if self.rule == POSITION_RULE:
            return list(items[self.k - 1 :: self.n])
        if self.rule != SHARD_RULE:
            raise ValueError(f"unknown shard rule {self.rule!r}")
        key = key or _model_id
        return [item for item in items if shard_of(key(item), self.n) == self.k]

    def text(self) -> str:
        """``"part 2/4 (name-hash)"``."""
        return f"part {self.k}/{self.n} ({self.rule})"


#: The ``meta`` key of a folder's shard record: ``{"rule": ..., "n": n or None, "parts": [k]}``.
SHARDS_META = "shards"


def shard_record(meta: dict[str, str]) -> dict[str, Any] | None:
    """The shard record of a store's meta table (``None``: none recorded)."""
    text = meta.get(SHARDS_META)
    if not text:
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def settle_shard(
    store: Store,
    shard: Shard | None,
    *,
    force: bool = False,
    say: Callable[[str], None] = lambda _msg: None,
) -> Shard | None:
    """The part this run measures in the folder of ``store``, checked against its record.

    Every folder records how it was split (meta ``shards``: the rule, ``n`` and the parts
    measured into it), so that a resumed shard never silently owns other models than it did:

    * a new folder, or one recorded with the same ``n``: :data:`SHARD_RULE`, the part added to
      the record (several parts may share one folder);
    * a folder recorded with another ``n``: refused (:class:`StudyMismatchError`), unless
      ``force`` (then it is split anew; its rows are kept);
    * a folder with models but no record (written before the rule was recorded, when shards were
      taken by position): it keeps :data:`POSITION_RULE`, and says so; ``force`` switches it to
      :data:`SHARD_RULE`.

    The record is read and written in one transaction (shards starting together on one folder).

    Raises:
        StudyMismatchError: If the folder was split into another number of parts.
    """
    conn = store.conn
    conn.execute("BEGIN IMMEDIATE")
    try:
        rec = shard_record(dict(conn.execute("SELECT key, value FROM meta").fetchall()))
        has_models = conn.execute("SELECT 1 FROM models LIMIT 1").fetchone() is not None
        if shard is None:
            if rec is None and not has_models:  # a new unsharded folder: the rule, no parts
                rec = {"rule": SHARD_RULE, "n": None, "parts": []}
                _write_shard_record(conn, rec)
            conn.execute("COMMIT")
            return None
        folder = store.path.parent
        rule = SHARD_RULE
        parts: list[int] = []
        if rec is None and has_models:
            if force:
                say(
                    f"{folder} holds models measured before geosharp recorded how shards are "
                    f"split (then by {SHARD_RULES[POSITION_RULE]}); --force: it is now part "
                    f"{shard.k}/{shard.n} by {SHARD_RULES[SHARD_RULE]} (its rows are kept; "
                    "geosharp merge names any model no shard measured)"
                )
            else:
                rule = POSITION_RULE
                say(
                    f"{folder} was started before geosharp recorded how shards are split: it "
                    f"keeps the rule it was measured with, by {SHARD_RULES[POSITION_RULE]}. If "
                    "the manifest grew or was reordered since, that moves models between parts: "
                    "rerun every part, or pass --force to split this folder by the stable rule "
                    f"({SHARD_RULES[SHARD_RULE]})"
                )
        elif rec is not None and rec.get("n") is not None:
            rule = rec.get("rule", SHARD_RULE)
            if rec["n"] != shard.n or rule not in SHARD_RULES:
                was = ", ".join(f"{k}/{rec['n']}" for k in rec.get("parts", []))
                if not force:
                    raise StudyMismatchError(
                        f"{folder} holds part {was} (split by {rule}), but this run asks for "
                        f"part {shard.k}/{shard.n}: parts of another split own other models than "
                        f"their sibling folders; give --shard k/{rec['n']}, another --out, or "
                        "--force to split this folder anew (its rows are kept)"
                    )
                say(f"{folder} held part {was} ({rule}); --force: it is now split anew")
                rule = SHARD_RULE
            else:
                parts = [int(k) for k in rec.get("parts", [])]
                if shard.k not in parts and parts:
                    shown = ", ".join(str(k) for k in sorted({*parts, shard.k}))
                    say(f"{folder} holds parts {shown} of {shard.n} (one folder shared by parts)")
        rec = {"rule": rule, "n": shard.n, "parts": sorted({*parts, shard.k})}
        _write_shard_record(conn, rec)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return Shard(shard.k, shard.n, rule)


def _write_shard_record(conn: Any, rec: dict[str, Any]) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
        (SHARDS_META, json.dumps(rec, sort_keys=True)),
    )


#: Report settings that a folder records of its own models (a manifest study's ``batches``, as
#: cut for the models it measured: a model may accept a shorter length than asked), so parts of
#: one run may differ in them; the merged record keeps each folder's (``per_shard``).
PER_SHARD_SETTINGS = ("batches",)


def _shown(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def ran_with(where: str, key: str, value: Any, was: str, was_value: Any) -> str:
    """``"S2 was run with seed=1 but S1 with seed=0"``: a setting two folders disagree on."""
    return f"{where} was run with {key}={_shown(value)} but {was} with {key}={_shown(was_value)}"


def _names(ids: Sequence[str], shown: int = 5) -> str:
    return ", ".join(ids[:shown]) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def _check_population(records: Sequence[tuple[str, dict[str, Any]]]) -> list[str] | None:
    """The one population of the records (the first's order), or a refusal naming the models."""
    listed = [(w, list(i["population"])) for w, i in records if i.get("population") is not None]
    if not listed:
        return None
    first, pop = listed[0]
    for where, other in listed[1:]:
        extra = [m for m in other if m not in set(pop)]
        lacks = [m for m in pop if m not in set(other)]
        if extra or lacks:
            said = [f"{first} lists {_names(lacks)}, which {where} does not"] if lacks else []
            said += [f"{where} lists {_names(extra)}, which {first} does not"] if extra else []
            raise StudyMismatchError(
                f"the folders were run with different manifests: {'; '.join(said)}. Rerun the "
                "part(s) run with the old manifest with the current one (a resume measures only "
                "the models a part lacks; the name rule moves none), then merge again (into a new "
                "folder if OUT was merged from the old manifest)"
            )
    return pop


def merged_report(records: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The report record (meta ``report``) of study folders merged, checked to be of one run.

    Every folder records what its run was (:func:`geosharp.studies.store.report_info`); ``geosharp
    merge`` puts them into one, deciding by their content alone (never by a machine's clock):

    * the population (the manifest's models) must be the same set in every folder, else the
      merge is refused, naming the models one lists and the other does not;
    * every setting that decides the values (the study's report ``settings``: measures, radii,
      steps, batches asked, seed, data, …) must agree wherever two folders record it, else
      refused naming the folder, the setting and both values; the settings of
      :data:`PER_SHARD_SETTINGS` are kept per folder;
    * what ran each folder (``environments``: versions, threads, CPUs, device, platform, none
      of which changes a value beyond rounding) is kept for every folder, each with the
      folders it ran (``folders``), and the notes of every folder are joined.

    Args:
        records: ``(folder, report record)`` of every folder merged, ``OUT``'s first when it
            already holds a study; empty records (folders of an older geosharp) are skipped.

    Returns:
        The merged record (``{}`` when no folder recorded one).

    Raises:
        StudyMismatchError: If two folders record another population or another setting.

    Example:
        >>> a = {"settings": {"seed": 0, "batches": "8 per batch"}, "population": ["m1", "m2"]}
        >>> b = {"settings": {"seed": 0, "batches": "4 per batch"}, "population": ["m2", "m1"]}
        >>> merged = merged_report([("s1", a), ("s2", b)])
        >>> merged["settings"]["batches"], merged["population"]
        ('8 per batch (s1); 4 per batch (s2)', ['m1', 'm2'])
        >>> merged_report([("s1", a), ("s3", {**b, "settings": {"seed": 1}})])
        Traceback (most recent call last):
        ...
        geosharp.studies.store.StudyMismatchError: s3 was run with seed=1 but s1 with seed=0: not
        parts of one run; merge each into its own folder
    """
    records = [(where, info) for where, info in records if info]
    if not records:
        return {}
    population = _check_population(records)
    base = records[0][1]
    settings: dict[str, Any] = dict(base.get("settings") or {})
    per_shard: dict[str, dict[str, Any]] = {}
    for where, info in records:
        theirs = info.get("settings") or {}
        for key, value in theirs.items():
            if key in PER_SHARD_SETTINGS:
                known = (info.get("per_shard") or {}).get(key) or {where: value}
                per_shard.setdefault(key, {}).update(known)
                continue
            if key not in settings:
                settings[key] = value
            elif settings[key] != value:
                was = next(w for w, i in records if key in (i.get("settings") or {}))
                raise StudyMismatchError(
                    f"{ran_with(where, key, value, was, settings[key])}: not parts of one run; "
                    "merge each into its own folder"
                )
    merged = {k: v for k, v in base.items() if k not in ("recorded", "per_shard")}
    for key, by_folder in per_shard.items():
        groups: dict[str, list[str]] = {}  # each value (as text) → the folders that recorded it
        for where, value in by_folder.items():
            groups.setdefault(str(value), []).append(where)
        if len(groups) > 1:
            settings[key] = "; ".join(f"{v} ({', '.join(ws)})" for v, ws in groups.items())
            merged.setdefault("per_shard", {})[key] = by_folder
        else:
            settings[key] = next(iter(by_folder.values()))
    envs: dict[str, dict[str, Any]] = {}
    for where, info in records:
        for env in info.get("environments") or []:
            bare = {k: v for k, v in env.items() if k != "folders"}
            entry = envs.setdefault(
                json.dumps(bare, sort_keys=True, default=str), {**bare, "folders": []}
            )
            for w in env.get("folders") or [where]:
                if w not in entry["folders"]:
                    entry["folders"].append(w)
    merged["settings"] = settings
    merged["environments"] = list(envs.values())
    merged["notes"] = list(dict.fromkeys(n for _, i in records for n in i.get("notes") or []))
    if population is not None:
        merged["population"] = population
    return merged
