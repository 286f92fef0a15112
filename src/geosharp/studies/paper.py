"""A study's τ against the paper's: sign per family and the ordering of the families (SPEC §7).

The paper (and a study's ``paper`` mapping) reports one τ per family of measures: ``"adaptive"``,
``"geodesic inv"``, ``"geodesic mix"``. A measure belongs to the family its name maps to
(``paper_match``, by default :func:`geosharp.measuring.names.default_paper_match`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from geosharp.studies.analysis import Cell
from geosharp.studies.formatting import fmt, rho_key, rho_label

__all__ = ["Family", "compare_with_paper", "family_of", "paper_columns"]


@dataclass
class Family:
    """The cells of one paper family (e.g. every ``adaptive …`` measure) and the paper's τ."""

    label: str
    paper_tau: float
    cells: list[Cell]

    @property
    def defined(self) -> list[Cell]:
        """The cells whose τ is defined."""
        return [c for c in self.cells if c.summary is not None and c.summary.defined]

    def sign_verdict(self) -> str:
        """``"same"``, ``"opposite"`` or ``"mixed"`` sign as the paper's, or ``"undefined"``."""
        cells = self.defined
        if not cells:
            return "undefined"
        same = sum(np.sign(c.summary.tau_a) == np.sign(self.paper_tau) for c in cells)
        if same == len(cells):
            return "same"
        return "opposite" if same == 0 else "mixed"

    def best(self) -> Cell | None:
        """The defined cell with the largest |τ-a| (``None`` if there is none)."""
        cells = self.defined
        return max(cells, key=lambda c: abs(c.summary.tau_a)) if cells else None


def family_of(
    measure: str, paper: Mapping[str, float] | None, paper_match: Callable[[str], str | None]
) -> str | None:
    """The paper family of a measure, if the study has a paper τ for it."""
    if not paper:
        return None
    label = paper_match(measure)
    return label if label is not None and label in paper else None


def compare_with_paper(
    cells: dict[str, dict[float | None, Cell]],
    paper: Mapping[str, float],
    paper_match: Callable[[str], str | None],
    level: float,
) -> dict[str, object]:
    """Sign of τ per paper family and the ordering of the families, with sentences."""
    families: dict[str, Family] = {}
    for measure, by_rho in cells.items():
        label = family_of(measure, paper, paper_match)
        if label is None:
            continue
        fam = families.setdefault(label, Family(label, float(paper[label]), []))
        fam.cells.extend(by_rho[r] for r in sorted(by_rho, key=rho_key))
    sentences: list[str] = []
    fam_json: dict[str, object] = {}
    pct = f"{100 * level:g} %"
    for fam in families.values():
        verdict = fam.sign_verdict()
        defined = fam.defined
        ours = ", ".join(
            f"{fmt(c.summary.tau_a)} ({c.measure}, {rho_label(c.rho)})" for c in defined
        )
        if verdict == "undefined":
            text = (
                f"{fam.label}: the paper reports τ = {fmt(fam.paper_tau)}; our τ is undefined for "
                "every matching measure, so the sign cannot be compared."
            )
        else:
            excl = sum(not (c.summary.ci_low <= 0.0 <= c.summary.ci_high) for c in defined)
            head = {
                "same": "our τ-a has the same sign as the paper's",
                "opposite": "our τ-a has the opposite sign to the paper's",
                "mixed": (
                    f"our τ-a has the paper's sign in "
                    f"{sum(np.sign(c.summary.tau_a) == np.sign(fam.paper_tau) for c in defined)}"
                    f" of {len(defined)} (measure, ρ) cells"
                ),
            }[verdict]
            text = (
                f"{fam.label}: {head} (paper {fmt(fam.paper_tau)}; ours {ours}); the {pct} CI "
                f"excludes 0 in {excl} of {len(defined)} cell(s)."
            )
        sentences.append(text)
        fam_json[fam.label] = {
            "paper_tau": fam.paper_tau,
            "sign_verdict": verdict,
            "cells": [
                {"measure": c.measure, "rho": c.rho, "tau_a": c.summary.tau_a} for c in defined
            ],
        }
    ordering = _ordering(list(families.values()))
    sentences.append(ordering["sentence"])
    unmatched = [k for k in paper if k not in families]
    if unmatched:
        sentences.append(
            "Paper families with no matching measure here: " + ", ".join(unmatched) + "."
        )
    return {
        "families": fam_json,
        "ordering_by": "|τ|",
        "ordering_holds": ordering["holds"],
        "paper_order": ordering["paper_order"],
        "our_order": ordering["our_order"],
        "unmatched_paper_families": unmatched,
        "sentences": sentences,
    }


def _ordering(families: list[Family]) -> dict[str, object]:
    """Check the paper's ordering of the families by |τ| against ours (best cell per family)."""
    usable = [(f, f.best()) for f in families]
    usable = [(f, b) for f, b in usable if b is not None]
    result: dict[str, object] = {"holds": None, "paper_order": [], "our_order": []}
    if len(usable) < 2:
        result["sentence"] = (
            "Ordering of families: fewer than two paper families have a defined τ here, so "
            "there is no ordering to check."
        )
        return result
    paper_order = sorted(usable, key=lambda fb: -abs(fb[0].paper_tau))
    our_order = sorted(usable, key=lambda fb: -abs(fb[1].summary.tau_a))
    violated = [
        (f.label, g.label)
        for f, bf in usable
        for g, bg in usable
        if abs(f.paper_tau) > abs(g.paper_tau) and not abs(bf.summary.tau_a) > abs(bg.summary.tau_a)
    ]
    holds = not violated
    paper_txt = " > ".join(f"{f.label} ({fmt(abs(f.paper_tau))})" for f, _ in paper_order)
    our_txt = " > ".join(f"{f.label} ({fmt(abs(b.summary.tau_a))})" for f, b in our_order)
    verdict = (
        "The paper's ordering holds in our results."
        if holds
        else "The paper's ordering does not hold in our results: "
        + "; ".join(f"{a} is not stronger than {b}" for a, b in violated)
        + "."
    )
    result.update(
        holds=holds,
        paper_order=[f.label for f, _ in paper_order],
        our_order=[f.label for f, _ in our_order],
        sentence=(
            "Ordering of families by |τ| (the strength of the correlation, whatever its sign, "
            "since the paper's sign differs between tasks): the paper has "
            f"{paper_txt}; ours, taking for each family its largest |τ-a| over its measures "
            f"and ρ values (the paper does not state its ρ), is {our_txt}. {verdict}"
        ),
    )
    return result


def paper_columns(
    cells: dict[str, dict[float | None, Cell]],
    paper: Mapping[str, float] | None,
    paper_match: Callable[[str], str | None],
    level: float,
) -> tuple[dict[str, str] | None, dict[str, object] | None]:
    """The "paper τ" column (measure → ``"-0.41 (adaptive)"``) and the comparison with the paper.

    Both are ``None`` when the study has no paper values.
    """
    if not paper:
        return None, None
    column: dict[str, str] = {}
    for measure in cells:
        label = family_of(measure, paper, paper_match)
        if label is not None:
            column[measure] = f"{fmt(float(paper[label]))} ({label})"
    return column, compare_with_paper(cells, paper, paper_match, level)
