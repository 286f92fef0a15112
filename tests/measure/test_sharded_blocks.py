"""A sharded model's symmetry blocks are laid out when a measure says it uses them.

:func:`geosharp.measuring.sharded.check_sharded` asks each measure
(:attr:`~geosharp.measures.Measure.uses_blocks`) instead of reading its estimator's keyword
arguments: a measure whose kwargs look geodesic but that says it uses no blocks is measured
without the layout, and one that uses blocks under kwargs of its own gets it. The registered
measures say what the kwargs rule said (geodesic sharpness or curvature, ``-blocks``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import geosharp.measuring.sharded as sharded
from geosharp.measures import parse_measure
from geosharp.measures.base import Measure

NAMES = [
    "geodesic-inv-o2", "geodesic-mix-o1", "geodesic-inv-exact", "geodesic-inv-o2-blocks",
    "adaptive-l2", "adaptive-linf", "adaptive-average", "adaptive-blocks", "euclidean",
    "curvature-inv-lmax", "curvature-mix-trace", "curvature-adaptive-trace",
    "curvature-euclidean-lmax", "relative-flatness",
]  # fmt: skip


def _kwargs_rule(spec: Measure) -> bool:
    """What ``check_sharded`` read before: the estimator's keyword arguments."""
    kw = spec.kwargs()
    return "geodesic" in (kw.get("measure"), kw.get("of")) or kw.get("perturb") == "blocks"


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_measure_says_what_the_kwargs_said(name):
    spec = parse_measure(name)
    assert spec.uses_blocks is _kwargs_rule(spec), spec.name


@dataclass(frozen=True)
class _Said(Measure):
    """A measure whose kwargs and whose declaration disagree (never registered)."""

    said: bool = False
    kw: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def claims(cls, text: str, toks: list[str]) -> bool:
        return False

    @classmethod
    def from_tokens(cls, text: str, toks: list[str]) -> _Said:
        raise NotImplementedError

    @classmethod
    def from_estimator_kwargs(cls, kwargs: Mapping[str, Any]) -> _Said:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return "said"

    @property
    def uses_blocks(self) -> bool:
        return self.said

    def kwargs(self) -> dict[str, Any]:
        return dict(self.kw)

    def run(self, model, loss_fn, batches, *, rho=None, **settings):
        raise NotImplementedError


@pytest.mark.parametrize(
    ("spec", "blocks"),
    [
        (_Said(said=False, kw=(("measure", "geodesic"), ("perturb", "blocks"))), False),
        (_Said(said=True, kw=(("measure", "toy"),)), True),
        (parse_measure("adaptive-l2"), False),
        (parse_measure("curvature-inv-lmax"), True),
    ],
)
def test_check_sharded_lays_out_the_blocks_as_the_measure_says(monkeypatch, spec, blocks):
    seen = {}

    def prepare(model, batches, loss_fn, loss_name, say, blocks=False):
        seen["blocks"] = blocks
        return "checked"

    monkeypatch.setattr(sharded, "prepare_sharded", prepare)
    model = nn.Linear(3, 2)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,)))]
    assert sharded.check_sharded(model, batches, None, [spec], lambda _: None) == "checked"
    assert seen == {"blocks": blocks}
