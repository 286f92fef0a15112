"""A measure added in one class answers for itself everywhere it goes (issue 42, deliverable 3).

The toy measure is the clean loss times ρ, named ``toy-adaptive-norm``: its name contains
"adaptive" but it is not the paper's adaptive sharpness, and it says nothing about sharding or
the Trainer callback, so it keeps :class:`Measure`'s defaults: those places refuse it in one
line, and every other place runs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.errors import MeasureError
from geosharp.estimators.sharpness import SharpnessResult
from geosharp.measures import base as measures_base
from geosharp.measures import parse_measure, register, registered
from geosharp.measures.base import Measure
from geosharp.measuring.estimate import estimate_run
from geosharp.measuring.names import default_paper_match, measure_family
from geosharp.measuring.sharded import check_plan
from geosharp.studies.plots import value_label

NAME = "toy-adaptive-norm"


@dataclass(frozen=True)
class ToyAdaptiveNorm(Measure):
    """The clean loss of every batch times ρ (no estimator: one forward pass a batch)."""

    keys: ClassVar[tuple[str, ...]] = ("toy",)
    grammar: ClassVar[str] = "a toy measure is toy-adaptive-norm"
    priority: ClassVar[int] = 5  # before sharpness, whose grammar does not know it anyway

    @classmethod
    def claims(cls, text: str, toks: list[str]) -> bool:
        return "-".join(toks) == NAME

    @classmethod
    def from_tokens(cls, text: str, toks: list[str]) -> ToyAdaptiveNorm:
        return cls()

    @classmethod
    def from_estimator_kwargs(cls, kwargs: Mapping[str, Any]) -> ToyAdaptiveNorm:
        return cls()

    @property
    def name(self) -> str:
        return NAME

    def kwargs(self) -> dict[str, Any]:
        return {"measure": "toy"}

    def run(
        self,
        model: Any,
        loss_fn: Callable,
        batches: Iterable,
        *,
        rho: float | None = None,
        **settings: Any,
    ) -> SharpnessResult:
        t0 = time.perf_counter()
        with torch.no_grad():
            clean = [float(loss_fn(model(x), y)) for x, y in batches]
        per_batch = [c * rho for c in clean]
        return SharpnessResult(
            value=sum(per_batch) / len(per_batch),
            per_batch=per_batch,
            clean_losses=clean,
            perturbed_losses=[c + v for c, v in zip(clean, per_batch, strict=True)],
            measure=NAME,
            settings={},
            time_s=time.perf_counter() - t0,
            n_forward=len(clean),
        )


@pytest.fixture
def toy():
    """The toy measure, registered for one test and unregistered after it."""
    register(ToyAdaptiveNorm)
    try:
        yield parse_measure(NAME)
    finally:
        measures_base._REGISTRY.remove(ToyAdaptiveNorm)
        assert ToyAdaptiveNorm not in registered()


def _model_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    batches = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(2)]
    return model, batches


def test_parse_reads_the_toy_not_a_sharpness(toy):
    assert isinstance(toy, ToyAdaptiveNorm)
    assert toy.name == NAME


def test_gs_measure_gives_its_rows(toy):
    model, batches = _model_and_batches()
    loss = nn.functional.cross_entropy
    report = gs.measure(model, batches, loss, measures=[toy], rhos=[0.1, 0.2], check=False)
    with torch.no_grad():
        clean = [float(loss(model(x), y)) for x, y in batches]
    assert [(r.measure, r.rho) for r in report.rows] == [(NAME, 0.1), (NAME, 0.2)]
    for row in report.rows:  # the definition, to rounding of the mean of two products
        assert row.value == pytest.approx(row.rho * sum(clean) / 2, rel=1e-12)
    assert "curvature" not in report.settings  # it takes no curvature settings


def test_time_estimate_counts_one_pass_a_batch(toy):
    model, batches = _model_and_batches()
    est = estimate_run(model, nn.functional.cross_entropy, batches, [toy], [0.1], steps=20)
    # Measure.step_cost's default: one forward+backward pass per batch, 2 batches, 1 cell
    assert (est.n_cells, est.passes, est.worst_only) == (1, 2.0, False)
    assert est.line().startswith("time estimate:")


def test_trainer_callback_refuses_in_one_line(toy):
    pytest.importorskip("transformers")
    from geosharp.integrations.hf_trainer import SharpnessCallback

    with pytest.raises(ValueError) as err:
        SharpnessCallback([(torch.zeros(1), torch.zeros(1))], measures=[NAME])
    message = str(err.value)
    assert "\n" not in message
    assert "ToyAdaptiveNorm does not say that the callback can measure it" in message


def test_study_report_files_it_under_no_paper_column(toy):
    assert default_paper_match(NAME) is None  # its name says "adaptive"; the class says None
    assert default_paper_match("adaptive worst l2") == "adaptive"
    assert measure_family(NAME) == "sharpness"  # Measure.family's default
    assert value_label(NAME) == "sharpness"  # Measure.axis_label: its family
    # a study takes of the run settings only those Measure.settings names (the seed)
    assert toy.run_settings({"steps": 10, "eps": 0.0, "seed": 3}) == {"seed": 3}


def test_unregistered_name_is_read_as_text():
    # without the class, an old store's name is read as text (names.py's fallback)
    assert default_paper_match(NAME) == "adaptive"


def test_fsdp_plan_refuses_in_one_line(toy):
    with pytest.raises(MeasureError) as err:
        check_plan([toy], None)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        f"{NAME} on a sharded (FSDP2) model: ToyAdaptiveNorm does not say that it runs on a "
        "sharded model;"
    )
    check_plan([parse_measure("adaptive")], None)  # a sharpness measure says it shards
